"""Prefill-side encoders: what they send, what they draw X from, and their options."""

from __future__ import annotations

import pytest
import torch

from pd_middleware import ConfigError, PluginContext, ValidationError
from pd_middleware.config import convert_options
from pd_middleware.core.payload import ITEMSIZE
from pd_middleware.evaluation.stats import chi_square, chi_square_critical
from pd_middleware.sampling.encodings import dense_law_tensor, sparse_law_tensor
from pd_middleware_full.full import ENCODER as FULL
from pd_middleware_full.full import FullEncoder, FullEncoderOptions
from pd_middleware_plugins.sampling import GreedyEncoder, SoftmaxEncoder
from pd_middleware_plugins.sparse import ENCODER as SPARSE
from pd_middleware_plugins.sparse import SparseEncoder, SparseEncoderOptions

SEED = 20261129
V = 16


def ctx(v=V, steps=1):
    return PluginContext(vocab_size=v, num_steps=steps, rejection_sampling=True, side="prefill")


def rows(b, s, v=V, seed=SEED, sharp=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(b, s, v, generator=g), dim=-1)


def gen(seed=SEED):
    return torch.Generator().manual_seed(seed)


def law_of(enc, steps, v=V):
    """The canonical law of one sent encoding (the decode's own function)."""
    return dense_law_tensor(enc, steps, v) if enc.kind == "dense" else sparse_law_tensor(enc, steps, v)


ENCODERS = {
    "full-fp32": lambda c: FullEncoder(FullEncoderOptions(dtype="fp32"), c),
    "full-bf16": lambda c: FullEncoder(FullEncoderOptions(dtype="bf16"), c),
    "full-fp16": lambda c: FullEncoder(FullEncoderOptions(dtype="fp16"), c),
    "sparse-topk": lambda c: SparseEncoder(SparseEncoderOptions(mode="topk", k=5), c),
    "sparse-topk-fp32": lambda c: SparseEncoder(SparseEncoderOptions(mode="topk", k=5, value_dtype="fp32"), c),
    "sparse-topp": lambda c: SparseEncoder(SparseEncoderOptions(mode="topp", epsilon=0.1, k_max=12), c),
    "sparse-floor": lambda c: SparseEncoder(SparseEncoderOptions(mode="topk", k=5, floor=True), c),
    "sparse-tv": lambda c: SparseEncoder(SparseEncoderOptions(mode="tv", epsilon=0.05, k_max=12, floor=True), c),
    "sparse-topk-u16": lambda c: SparseEncoder(SparseEncoderOptions(mode="topk", k=5, index_format="u16"), c),
    "sparse-floor-u16": lambda c: SparseEncoder(
        SparseEncoderOptions(mode="topk", k=5, floor=True, index_format="u16"), c
    ),
    "sparse-tv-u16": lambda c: SparseEncoder(
        SparseEncoderOptions(mode="tv", epsilon=0.05, k_max=12, floor=True, index_format="u16"), c
    ),
}


# ----------------------------------------------------------------------------- basics


def test_greedy_is_argmax_with_point_mass_probability():
    q = rows(4, 3)
    out = GreedyEncoder(None, ctx(steps=3)).encode(q, temperature=0.0)
    assert out.tokens.tolist() == q.argmax(-1).tolist()
    assert out.tokens.dtype == torch.int64 and out.token_probs.tolist() == [[1.0] * 3] * 4
    assert out.proposals == [None] * 4
    assert (out.provenance.rule, out.provenance.temperature, out.provenance.sampled_from) == ("greedy", 0.0, None)


def test_softmax_samples_without_sending():
    q = rows(6, 1)[:, 0]  # (B, V) single-layer input
    a = SoftmaxEncoder(None, ctx()).encode(q, temperature=0.7, generator=gen())
    b = SoftmaxEncoder(None, ctx()).encode(q, temperature=0.7, generator=gen())
    assert a.tokens.shape == (6, 1) and torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.token_probs[:, 0], q.gather(1, a.tokens).squeeze(1))
    assert a.proposals == [None] * 6
    assert (a.provenance.rule, a.provenance.temperature, a.provenance.sampled_from) == ("sampled", 0.7, None)


@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_sends_one_proposal_per_request_with_a_step_each_and_draws_from_it(name):
    b, s = 5, 3
    q = rows(b, s)
    enc = ENCODERS[name](ctx(steps=s))
    out = enc.encode(q, generator=gen())
    again = ENCODERS[name](ctx(steps=s)).encode(q, generator=gen())
    other = ENCODERS[name](ctx(steps=s)).encode(q, generator=gen(SEED + 1))
    assert torch.equal(out.tokens, again.tokens), f"not reproducible with seed {SEED}"
    assert not torch.equal(out.tokens, other.tokens)
    assert out.tokens.shape == (b, s) and out.token_probs.shape == (b, s)
    assert out.token_probs.dtype == torch.float32 and len(out.proposals) == b
    for i, p in enumerate(out.proposals):
        assert p.encoding_id == out.provenance.sampled_from == enc.encoding_id
        law = law_of(p, s)
        assert law.shape == (s, V)
        for j in range(s):
            x = int(out.tokens[i, j])
            # q(X) reported is X's mass in exactly the row the decode will rebuild.
            assert out.token_probs[i, j].item() == law[j, x].item() > 0
        if p.kind == "sparse":
            assert len(p.lengths) == s


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_full_wire_size_and_quantised_law(dtype):
    q = rows(2, 1, v=1000)
    out = FullEncoder(FullEncoderOptions(dtype=dtype), ctx(v=1000)).encode(q, generator=gen())
    for i, p in enumerate(out.proposals):
        assert p.dtype == dtype and p.nbytes == 1000 * ITEMSIZE[dtype]
        law = law_of(p, 1, 1000)
        err = (law[0] - q[i, 0]).abs().max().item()
        if dtype == "fp32":
            assert err < 1e-6
        else:  # a different vector than q: sampling from q would be biased, hence the guard
            assert 0 < err < 1e-2 * q.max().item()


def test_sparse_topk_lists_the_k_largest_renormalised():
    q = rows(3, 2)
    out = SparseEncoder(SparseEncoderOptions(mode="topk", k=4), ctx(steps=2)).encode(q, generator=gen())
    for i, p in enumerate(out.proposals):
        assert p.lengths == (4, 4) and p.tail_mass == () and p.nbytes == 8 * (4 + 2)
        law = law_of(p, 2)
        for j in range(2):
            top = q[i, j].topk(4)
            assert set(law[j].nonzero().squeeze(1).tolist()) == set(top.indices.tolist())
            expect = top.values / top.values.sum()
            assert torch.allclose(law[j, top.indices], expect, atol=2e-3)


def test_sparse_topp_is_the_smallest_prefix_and_respects_k_max():
    q = rows(8, 1, sharp=2.5)
    eps = 0.1
    out = SparseEncoder(SparseEncoderOptions(mode="topp", epsilon=eps, k_max=V), ctx()).encode(q, generator=gen())
    for i, p in enumerate(out.proposals):
        (n,) = p.lengths
        srt = q[i, 0].double().sort(descending=True).values.cumsum(0)
        assert srt[n - 1] >= 1 - eps - 1e-9 and (n == 1 or srt[n - 2] < 1 - eps)
    capped = SparseEncoder(SparseEncoderOptions(mode="topp", epsilon=0.0, k_max=3), ctx()).encode(q, generator=gen())
    assert {p.lengths for p in capped.proposals} == {(3,)}


def test_sparse_floor_spends_the_dropped_mass_uniformly():
    q = rows(3, 1)
    out = SparseEncoder(SparseEncoderOptions(mode="topk", k=6, floor=True), ctx()).encode(q, generator=gen())
    for i, p in enumerate(out.proposals):
        top = q[i, 0].double().topk(6)
        assert p.tail_mass == pytest.approx((1 - float(top.values.sum()),), abs=1e-6)
        law = law_of(p, 1)[0]
        unlisted = torch.ones(V, dtype=torch.bool)
        unlisted[top.indices] = False
        floor = law[unlisted]
        assert torch.all(floor == floor[0]) and floor[0].item() == pytest.approx(p.tail_mass[0] / (V - 6), rel=1e-6)
        assert torch.allclose(law[top.indices].double(), top.values, atol=1e-3)
    whole = SparseEncoder(SparseEncoderOptions(mode="topk", k=10**6, floor=True), ctx()).encode(q, generator=gen())
    assert {(p.lengths, p.tail_mass) for p in whole.proposals} == {((V,), (0.0,))}  # k clamped to V


def _floored_tv(row, n):
    """Brute force: TV between q and the law listing its n largest plus a uniform floor."""
    q = row.double() / row.double().sum()
    srt = q.sort(descending=True).values
    if n == len(q):
        return 0.0
    f = (1 - srt[:n].sum()) / (len(q) - n)
    return float(0.5 * (srt[n:] - f).abs().sum())


def test_sparse_tv_mode_is_the_smallest_prefix_within_budget():
    q = rows(10, 1, v=64, sharp=2.0)
    eps = 0.05
    out = SparseEncoder(SparseEncoderOptions(mode="tv", epsilon=eps, k_max=64, floor=True), ctx(v=64)).encode(
        q, generator=gen()
    )
    for i, p in enumerate(out.proposals):
        (n,) = p.lengths
        assert _floored_tv(q[i, 0], n) <= eps + 1e-9
        assert n == 1 or _floored_tv(q[i, 0], n - 1) > eps
    capped = SparseEncoder(SparseEncoderOptions(mode="tv", epsilon=0.0, k_max=7, floor=True), ctx(v=64)).encode(
        q, generator=gen()
    )
    assert {p.lengths for p in capped.proposals} == {(7,)}


@pytest.mark.parametrize("mode", ["topk", "topp", "tv"])
def test_sparse_u16_sends_sorted_low_bits_with_bucket_counts_and_the_int32_law(mode):
    """V = 152064 (3 buckets), 3 steps: same entries and law as int32, at 4 B per entry."""
    v, b, s = 152064, 3, 3
    q = rows(b, s, v=v, sharp=4.0)
    opts = dict(mode=mode, k=700, epsilon=0.01, k_max=700, floor=mode == "tv")
    c = ctx(v=v, steps=s)
    a = SparseEncoder(SparseEncoderOptions(**opts, index_format="int32"), c).encode(q, generator=gen())
    u = SparseEncoder(SparseEncoderOptions(**opts, index_format="u16"), c).encode(q, generator=gen())
    assert u.provenance == a.provenance  # the encoding id does not depend on the index format
    for pa, pu in zip(a.proposals, u.proposals):
        assert pu.index_format == "u16" and pa.index_format == "int32" and pa.bucket_counts == ()
        assert pu.lengths == pa.lengths and pu.tail_mass == pytest.approx(pa.tail_mass, abs=1e-12)
        total = sum(pu.lengths)
        assert pu.nbytes == 4 * total and pa.nbytes == 6 * total
        ids_a = torch.frombuffer(bytearray(pa.indices), dtype=torch.int32).long()
        low = torch.frombuffer(bytearray(pu.indices), dtype=torch.uint16).long()
        start = 0
        for j, n in enumerate(pu.lengths):
            want = ids_a[start : start + n].sort().values
            counts = pu.bucket_counts[3 * j : 3 * j + 3]
            assert counts == tuple(int(((want >> 16) == k).sum()) for k in range(3))
            assert torch.equal(low[start : start + n], want & 0xFFFF), f"seed {SEED} step {j}"
            start += n
        la, lu = law_of(pa, s, v), law_of(pu, s, v)
        # Same entries and values; only the fp32 sum order of the normalisation may differ.
        assert torch.equal(la > 0, lu > 0) and torch.allclose(la, lu, rtol=1e-6, atol=0)
    for i in range(b):
        for j in range(s):
            assert u.token_probs[i, j].item() == law_of(u.proposals[i], s, v)[j, int(u.tokens[i, j])].item()


# ----------------------------------------------------------------------------- inputs and options


@pytest.mark.parametrize("name", ["full-fp32", "sparse-topk"])
def test_input_validation(name):
    enc = ENCODERS[name](ctx())
    with pytest.raises(ValidationError, match=r"width 8 != vocab 16") as e:
        enc.encode(torch.full((2, 8), 1 / 8))
    assert e.value.field == "probs"
    bad = rows(2, 1)
    bad[1, 0, 3] = float("nan")
    with pytest.raises(ValidationError, match=r"contains NaN, inf or values outside \[0, 1\]"):
        enc.encode(bad)
    with pytest.raises(ValidationError, match=r"row \(0, 0\) sums to 2, not 1 within 0.001"):
        enc.encode(torch.full((1, V), 2 / V))
    with pytest.raises(ValidationError, match=r"expected shape \(B, V\) or \(B, S, V\), got \(16,\)"):
        enc.encode(torch.full((V,), 1 / V))


@pytest.mark.parametrize(
    "spec, raw, path, message",
    [
        (SPARSE, {"mode": "tv"}, "encoder.options.mode", "'tv' needs floor = true"),
        (SPARSE, {"k": 0}, "encoder.options.k", "must be in [1, 16777216], got 0"),
        (SPARSE, {"k_max": -1}, "encoder.options.k_max", "must be in [1, 16777216], got -1"),
        (SPARSE, {"epsilon": 1.0}, "encoder.options.epsilon", "must be in [0, 1), got 1.0"),
        (SPARSE, {"mode": "top_k"}, "encoder.options.mode", "Invalid enum value 'top_k'"),
        (SPARSE, {"value_dtype": "bf16"}, "encoder.options.value_dtype", "Invalid enum value 'bf16'"),
        (SPARSE, {"index_format": "u8"}, "encoder.options.index_format", "Invalid enum value 'u8'"),
        (SPARSE, {"kk": 3}, "encoder.options.kk", "unknown field `kk`; did you mean `k`?"),
        (FULL, {"dtype": "int8"}, "encoder.options.dtype", "Invalid enum value 'int8'"),
    ],
)
def test_option_errors_name_the_key(spec, raw, path, message):
    with pytest.raises(ConfigError) as e:
        convert_options(spec, raw, "encoder.options")
    assert e.value.path == path
    assert message in str(e.value)


def test_options_round_trip():
    o = convert_options(SPARSE, {"mode": "topp", "epsilon": 0.01, "k_max": 4000, "floor": True}, "encoder.options")
    assert o == SparseEncoderOptions(mode="topp", epsilon=0.01, k_max=4000, floor=True) and o.index_format == "int32"
    o = convert_options(SPARSE, {"mode": "tv", "floor": True, "index_format": "u16"}, "encoder.options")
    assert o == SparseEncoderOptions(mode="tv", floor=True, index_format="u16")
    assert convert_options(FULL, {"dtype": "bf16"}, "encoder.options") == FullEncoderOptions(dtype="bf16")


# ----------------------------------------------------------------------------- sampling law


N_B, N_S = 2500, 8  # 20,000 draws per encoder, one per (request, step)
CRIT = chi_square_critical(V - 1, 1e-6)  # a correct sampler exceeds this with prob <= 1e-6


def _draws(encoder, q_row):
    q = q_row.expand(N_B, N_S, V).contiguous()
    out = encoder.encode(q, generator=gen())
    counts = torch.bincount(out.tokens.flatten(), minlength=V)
    return counts, out


@pytest.mark.parametrize(
    "name, index_format",
    [("full-bf16", None)] + [(n, f) for n in ("sparse-floor", "sparse-topk") for f in ("int32", "u16")],
)
def test_encoders_sample_from_the_law_they_send(name, index_format):
    """Pearson chi-square of X against the sent law, false-positive bound 1e-6 each."""
    q_row = rows(1, 1, sharp=1.0)[0, 0]
    enc = ENCODERS[name + ("-u16" if index_format == "u16" else "")](ctx(steps=N_S))
    if index_format is not None:
        assert enc.options.index_format == index_format
    counts, out = _draws(enc, q_row)
    law = law_of(out.proposals[0], N_S)[0].double()
    assert all(torch.equal(law_of(p, N_S)[0].double(), law) for p in out.proposals[:5])
    stat, df = chi_square(counts, (law / law.sum()).tolist())
    assert stat < chi_square_critical(df, 1e-6), f"seed {SEED}: chi2 {stat:.1f} df {df}"


def test_sampling_test_detects_drawing_from_q_instead_of_the_sent_law():
    """Negative control: X ~ q (softmax) tested against the floored top-5 law must fail."""
    q_row = rows(1, 1, sharp=1.0)[0, 0]
    sent = ENCODERS["sparse-floor"](ctx(steps=N_S)).encode(q_row.expand(1, N_S, V).contiguous(), generator=gen())
    law = law_of(sent.proposals[0], N_S)[0].double()
    counts, _ = _draws(SoftmaxEncoder(None, ctx(steps=N_S)), q_row)
    stat, df = chi_square(counts, (law / law.sum()).tolist())
    assert df == V - 1 and stat > 10 * CRIT, f"seed {SEED}: chi2 {stat:.1f} (control must fail)"
