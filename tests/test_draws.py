"""The prefill's per-request draws: counter-based uniforms, one encoder call per batch, no V-wide host copy.

``ProposalPublisher.encode`` and the multi-layer chain (:mod:`pd_middleware.integrations.
sglang.chain`) run the encoder once per batch where the draft rows live, each row drawn at
its uniform of (seed, room, rid, position). These tests check, on CPU tensors (no GPU here; the
host-copy check counts the transfer *calls*, which are the same code on any device):

- the uniforms are uniform (DKW bound) and a request's X does not depend on its batch;
- the uniforms of one request's chain steps are pairwise independent (a grid chi-square
  of the pairs and (u_j - u_i) mod 1, family-wise false-positive bound 1e-6), and they are
  what the multi-layer chain hands its encoder;
- the position (the prefill's seq_len) is in the key: a request that SGLang rebootstraps
  draws its next life, every step, from uniforms independent of its first life's;
- X is drawn from the very law that is sent (chi-square, false-positive bound 1e-6);
- nothing V-wide is read back to the host unless the encoder ships V-wide rows.
Each has a negative control that makes it fail.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pd_middleware import EncodedBatch, PluginContext, Provenance
from pd_middleware.evaluation.stats import chi_square, chi_square_critical
from pd_middleware.integrations.sglang import chain as sglang_chain
from pd_middleware.integrations.sglang.prefill import ProposalPublisher
from pd_middleware.sampling.draws import request_uniforms, room_seed, takes_uniforms
from pd_middleware.sampling.encodings import dense_law_tensor, encoder_input, sparse_law_tensor
from pd_middleware_full.full import FullEncoder, FullEncoderOptions
from pd_middleware_plugins.sampling import GreedyEncoder, SoftmaxEncoder
from pd_middleware_plugins.sparse import SparseEncoder, SparseEncoderOptions

SEED = 20261202
V = 4096


def ctx(v=V, steps=1):
    return PluginContext(vocab_size=v, num_steps=steps, rejection_sampling=True, side="prefill")


ENCODERS = {
    "greedy": lambda c: GreedyEncoder(None, c),
    "softmax": lambda c: SoftmaxEncoder(None, c),
    "sparse-topk": lambda c: SparseEncoder(SparseEncoderOptions(mode="topk", k=8), c),
    "sparse-topp": lambda c: SparseEncoder(SparseEncoderOptions(mode="topp", epsilon=0.1, k_max=64), c),
    "sparse-tv": lambda c: SparseEncoder(SparseEncoderOptions(mode="tv", epsilon=0.05, k_max=64, floor=True), c),
    "sparse-floor-u16": lambda c: SparseEncoder(
        SparseEncoderOptions(mode="topk", k=8, floor=True, index_format="u16"), c
    ),
    "full-bf16": lambda c: FullEncoder(FullEncoderOptions(dtype="bf16"), c),
}


def publisher(name, v=V, seed=SEED):
    return ProposalPublisher(ENCODERS[name](ctx(v)), vocab_size=v, seed=seed, stage=lambda target, payload: None)


def draft(b, v=V, seed=SEED, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(b, v, generator=g), dim=-1)


def law_of(enc, steps, v):
    return dense_law_tensor(enc, steps, v) if enc.kind == "dense" else sparse_law_tensor(enc, steps, v)


# ----------------------------------------------------------------------------- the uniforms


def dkw_eps(n, alpha=1e-6):
    """Dvoretzky-Kiefer-Wolfowitz: P(sup |F_n - F| > eps) <= 2 exp(-2 n eps^2) = alpha."""
    return math.sqrt(math.log(2 / alpha) / (2 * n))


def ks_distance(u):
    s = torch.sort(u.double()).values
    n = s.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - s, s - (i - 1) / n).max())


def test_uniforms_are_53_bit_values_in_the_unit_interval_and_reproducible():
    u = request_uniforms(SEED, [1, 2, 3], ["a", "b", "c"], steps=4)
    assert u.shape == (3, 4) and u.dtype == torch.float64
    assert bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u, (u * 2.0**53).round() / 2.0**53), "every value is a multiple of 2**-53"
    assert torch.equal(u, request_uniforms(SEED, [1, 2, 3], ["a", "b", "c"], steps=4))
    # Row i is request i's alone: the same request in another batch, at another row, draws the same.
    assert torch.equal(request_uniforms(SEED, [3], ["c"], steps=4)[0], u[2])
    # One step is the request's seed (the legacy generator's) in its top 53 bits.
    assert float(request_uniforms(SEED, [7], ["r"])[0, 0]) == (room_seed(SEED, 7, "r") >> 10) * 2.0**-53
    with pytest.raises(ValueError, match="2 salts for 3 rooms"):
        request_uniforms(SEED, [1, 2, 3], ["a", "b"])


def test_uniforms_pass_a_dkw_test_per_step_and_jointly():
    """Per column, and for the pair (step 0, step 1) through u0 + u1 mod 1, within the
    DKW band at false-positive bound 1e-6; the same room reused with new rids too."""
    n = 20_000
    rooms = [1000 + i for i in range(n)]
    u = request_uniforms(SEED, rooms, [f"rid-{i}" for i in range(n)], steps=2)
    eps = dkw_eps(n)
    for col in (u[:, 0], u[:, 1], torch.remainder(u[:, 0] + u[:, 1], 1.0)):
        assert ks_distance(col) < eps, f"seed {SEED}: KS {ks_distance(col):.4f} >= {eps:.4f}"
    reused = request_uniforms(SEED, [5] * n, [f"rid-{i}" for i in range(n)])[:, 0]
    assert ks_distance(reused) < eps


def test_dkw_check_detects_biased_uniforms():
    """Negative control: u**1.1 (a mild bias) and one room without a salt fail the same check."""
    n = 20_000
    u = request_uniforms(SEED, list(range(n)), [str(i) for i in range(n)])[:, 0]
    assert ks_distance(u**1.1) > dkw_eps(n)
    assert ks_distance(request_uniforms(SEED, [5] * n)[:, 0]) > dkw_eps(n), "no salt: one value n times"


# ----------------------------------------------------------------------------- a chain's steps are independent

N_PAIRS, GRID = 40_000, 8


def grid_chi_square(a, b, k=GRID):
    """Pearson chi-square of the pairs (a_i, b_i) on the k x k grid of [0, 1)^2 against the
    uniform law (what two independent uniforms give): (statistic, df = k^2 - 1)."""
    cell = (a * k).long().clamp(max=k - 1) * k + (b * k).long().clamp(max=k - 1)
    return chi_square(torch.bincount(cell, minlength=k * k), [1.0 / (k * k)] * (k * k))


def independence_failures(u, alpha=1e-6):
    """Every pair of steps (i, j) of ``u`` (n, S), two checks each: the k x k grid chi-square
    of (u_i, u_j), and the DKW band of (u_j - u_i) mod 1 (uniform when u_j is independent of
    u_i). Bonferroni over the 2 * C(S, 2) checks: a correct generator fails any with
    probability at most ``alpha``. Returns the failed checks (empty: all passed)."""
    n, s = u.shape
    pairs = [(i, j) for i in range(s) for j in range(i + 1, s)]
    each = alpha / (2 * len(pairs))
    crit, eps = chi_square_critical(GRID * GRID - 1, each), dkw_eps(n, each)
    out = []
    for i, j in pairs:
        stat, df = grid_chi_square(u[:, i], u[:, j])
        if not stat < crit:
            out.append(f"grid chi2 of steps ({i}, {j}): {stat:.1f} >= {crit:.1f} (df {df})")
        ks = ks_distance(torch.remainder(u[:, j] - u[:, i], 1.0))
        if not ks < eps:
            out.append(f"KS of (u{j} - u{i}) mod 1: {ks:.4f} >= {eps:.4f}")
    return out


def chain_uniforms(n=N_PAIRS, steps=4, seed=SEED):
    return request_uniforms(seed, [1000 + i for i in range(n)], [f"rid-{i}" for i in range(n)], steps=steps)


def test_the_uniforms_of_a_requests_chain_steps_are_independent():
    """Steps 0..3 of 40,000 requests, every pair: the 8 x 8 grid chi-square and (u_j - u_i)
    mod 1 against uniform, family-wise false-positive bound 1e-6 (seed shown on failure).
    Unlike (u0 + u1) mod 1, these see two equal steps (the negative controls below)."""
    u = chain_uniforms()
    assert independence_failures(u) == [], f"seed {SEED}"


def test_the_chain_draws_step_k_at_column_k_of_the_request_uniforms():
    """What the multi-layer chain hands its encoder at step k (salt ``rid:k``, one step at a
    time) is column k of ``request_uniforms(steps=S)``: the columns tested above."""
    seen = []

    class Recording(TrustingArgmax):
        def encode(self, probs, *, temperature=1.0, generator=None, uniforms=None):
            seen.append(uniforms.clone())
            return super().encode(probs, temperature=temperature)

    _, chain, b = _chain(Recording(None, ctx()), steps=3)
    topk_p, topk_index = torch.zeros(b, 1), torch.zeros(b, 1, dtype=torch.int64)
    with sglang_chain.CHAIN.enter(chain):
        for k in range(3):
            assert sglang_chain.draw_step(k, draft(b, seed=SEED + k), topk_p, topk_index) is not None
    rooms, rids = [100 + i for i in range(b)], [f"r{i}" for i in range(b)]
    want = request_uniforms(SEED, rooms, rids, steps=3, positions=[4] * b)  # _chain's Reqs: 4 prompt tokens
    assert torch.equal(torch.cat([s.reshape(b, 1) for s in seen], 1), want)


def test_the_position_is_in_the_key_of_every_step_and_of_the_chain():
    """Issue 40: the draw's position (the prefill's seq_len) is in the key, so a request's
    next life (same seed, room and rid, a longer prefix) draws from other uniforms, at
    every step; the key keeps its properties: reproducible, per row whatever the batch,
    distinct across steps. The chain hands its encoder the same columns, with each Req's
    ``len(origin_input_ids) + len(output_ids)`` as its position."""
    rooms, rids = [1, 2, 3], ["a", "b", "c"]
    u = request_uniforms(SEED, rooms, rids, steps=3, positions=[10, 10, 12])
    assert torch.equal(u, request_uniforms(SEED, rooms, rids, steps=3, positions=[10, 10, 12]))
    assert torch.equal(request_uniforms(SEED, [3], ["c"], steps=3, positions=[12])[0], u[2])
    later = request_uniforms(SEED, rooms, rids, steps=3, positions=[11, 13, 13])
    assert bool((later != u).all()), "another position: every step of every row draws again"
    assert bool((u != request_uniforms(SEED, rooms, rids, steps=3)).all()), "a position is not the old key"
    assert all(len(set(row)) == 3 for row in u.tolist()), "steps stay distinct"
    assert float(u[0, 0]) == (room_seed(SEED, 1, "a:0", 10) >> 10) * 2.0**-53
    with pytest.raises(ValueError, match="2 positions for 3 rooms"):
        request_uniforms(SEED, rooms, rids, positions=[1, 2])
    # The chain, on Reqs whose prompt and output give positions 5 + i.
    seen = []

    class Recording(TrustingArgmax):
        def encode(self, probs, *, temperature=1.0, generator=None, uniforms=None):
            seen.append(uniforms.clone())
            return super().encode(probs, temperature=temperature)

    b = 4
    pub = ProposalPublisher(Recording(None, ctx()), vocab_size=V, seed=SEED, stage=lambda t, p: None)
    reqs = [
        SimpleNamespace(bootstrap_room=100 + i, rid=f"r{i}", origin_input_ids=[7] * (4 + i), output_ids=[8])
        for i in range(b)
    ]
    chain = sglang_chain.chain_for(pub, SimpleNamespace(reqs=reqs, sampling_info=None))
    topk_p, topk_index = torch.zeros(b, 1), torch.zeros(b, 1, dtype=torch.int64)
    with sglang_chain.CHAIN.enter(chain):
        for k in range(3):
            assert sglang_chain.draw_step(k, draft(b, seed=SEED + k), topk_p, topk_index) is not None
    want = request_uniforms(
        SEED, [100 + i for i in range(b)], [f"r{i}" for i in range(b)], steps=3, positions=[5 + i for i in range(b)]
    )
    assert torch.equal(torch.cat([s.reshape(b, 1) for s in seen], 1), want)


def test_a_rebootstrapped_requests_uniforms_are_independent_of_its_first_lifes():
    """40,000 requests, each drawn at its prompt's length and again after a rebootstrap
    (same seed, room and rid; a prefix longer by 1 to 3 tokens), steps 0 and 1: every pair
    of (life, step) columns passes the grid chi-square and the (u_j - u_i) mod 1 DKW band,
    family-wise false-positive bound 1e-6 (seed shown on failure). Negative control: the
    key without the position fails both checks of every cross-life pair of one step."""
    n = N_PAIRS
    rooms, rids = [1000 + i for i in range(n)], [f"rid-{i}" for i in range(n)]
    first = [17 + i % 50 for i in range(n)]
    second = [f + 1 + i % 3 for i, f in enumerate(first)]
    u = torch.cat(
        [
            request_uniforms(SEED, rooms, rids, steps=2, positions=first),
            request_uniforms(SEED, rooms, rids, steps=2, positions=second),
        ],
        1,
    )
    assert independence_failures(u) == [], f"seed {SEED}"
    old = torch.cat([request_uniforms(SEED, rooms, rids, steps=2)] * 2, 1)
    assert len(independence_failures(old)) == 4, "steps (0, 0) and (1, 1) across lives: 2 checks each"


def test_independence_check_detects_a_step_that_reuses_or_shifts_step_0():
    """Negative controls: step 1 reusing step 0's uniform (as a salt without the step would),
    step 1 = step 0 + 0.01 mod 1, and the real request_uniforms with its step salt dropped,
    all fail the check; the sum mod 1 alone passes the reused step (why it is not the test)."""
    u = chain_uniforms(steps=2)
    reused = torch.stack([u[:, 0], u[:, 0]], 1)
    shifted = torch.stack([u[:, 0], torch.remainder(u[:, 0] + 0.01, 1.0)], 1)
    for name, bad in (("reused", reused), ("shifted", shifted)):
        failed = independence_failures(bad)
        assert len(failed) == 2, f"{name}: {failed}"
    assert ks_distance(torch.remainder(reused[:, 0] + reused[:, 1], 1.0)) < dkw_eps(N_PAIRS), "the sum is blind to it"
    from pd_middleware.sampling import draws

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(draws, "step_salt", lambda salt, step, steps: salt)
        unsalted = chain_uniforms(steps=2)
    assert torch.equal(unsalted[:, 0], unsalted[:, 1]) and len(independence_failures(unsalted)) == 2


# ----------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("name", ["softmax", "sparse-topp", "sparse-floor-u16", "full-bf16"])
def test_a_requests_x_depends_on_the_request_alone(name):
    """Two ranks (two publishers, one seed) agree; alone, reordered, or among others with
    another temperature, a request draws the same X and sends the same law."""
    q = draft(6)
    rooms, rids = [11, 12, 13, 14, 15, 16], [f"r{i}" for i in range(6)]
    whole, pw = publisher(name).encode(rooms, q, 1.0, rids)
    other, _ = publisher(name).encode(rooms, q, 1.0, rids)
    assert torch.equal(whole.tokens, other.tokens)
    perm = [3, 0, 5, 1, 4, 2]
    moved, _ = publisher(name).encode([rooms[i] for i in perm], q[perm], 1.0, [rids[i] for i in perm])
    assert torch.equal(moved.tokens, whole.tokens[perm])
    alone, pa = publisher(name).encode([rooms[4]], q[4:5], 1.0, [rids[4]])
    assert torch.equal(alone.tokens[0], whole.tokens[4])
    if pw[4].proposal is not None:
        assert torch.equal(law_of(pa[0].proposal, 1, V), law_of(pw[4].proposal, 1, V))
    # Mixed temperatures: one encoder call per temperature, each row back in its place.
    mixed, pmix = publisher(name).encode(rooms, q, [1.0, 0.5, 1.0, 0.5, 0.5, 1.0], rids)
    assert torch.equal(mixed.tokens, whole.tokens)
    assert [p.provenance.temperature for p in pmix] == [1.0, 0.5, 1.0, 0.5, 0.5, 1.0]
    assert [p.draft_tokens for p in pmix] == [p.draft_tokens for p in pw]


def test_batch_invariance_check_detects_a_shared_generator():
    """Negative control: one generator for the batch (the design the uniforms replace)
    gives a request a different X when its batch changes."""
    enc = ENCODERS["softmax"](ctx())
    q = draft(64, sharp=0.5)
    whole = enc.encode(q, generator=torch.Generator().manual_seed(SEED)).tokens[:, 0]
    tail = enc.encode(q[32:], generator=torch.Generator().manual_seed(SEED)).tokens[:, 0]
    assert not torch.equal(whole[32:], tail)
    u = request_uniforms(SEED, list(range(64)), None)
    assert torch.equal(enc.encode(q, uniforms=u).tokens[32:, 0], enc.encode(q[32:], uniforms=u[32:]).tokens[:, 0])


def test_a_different_seed_or_rid_changes_the_draws():
    q = draft(64, sharp=0.5)
    rooms = list(range(64))
    base, _ = publisher("softmax").encode(rooms, q, 1.0, [f"a{i}" for i in rooms])
    reseeded, _ = publisher("softmax", seed=SEED + 1).encode(rooms, q, 1.0, [f"a{i}" for i in rooms])
    resalted, _ = publisher("softmax").encode(rooms, q, 1.0, [f"b{i}" for i in rooms])
    assert (base.tokens != reseeded.tokens).sum() > 32 and (base.tokens != resalted.tokens).sum() > 32


# ----------------------------------------------------------------------------- the law drawn from

N_DRAWS, V_SMALL = 20_000, 16


def _counts(name, q_row):
    pub = publisher(name, v=V_SMALL)
    rooms = list(range(N_DRAWS))
    enc, payloads = pub.encode(rooms, q_row.expand(N_DRAWS, V_SMALL).contiguous(), 1.0, [f"r{i}" for i in rooms])
    return torch.bincount(enc.tokens[:, 0], minlength=V_SMALL), payloads


@pytest.mark.parametrize("name", ["softmax", "sparse-topk", "sparse-floor-u16", "full-bf16"])
def test_batched_draws_follow_the_law_that_is_sent(name):
    """Pearson chi-square of 20,000 batched draws (one per request) against the sent law
    (the decode's own function on the sent bytes; q itself for softmax, which sends none);
    false-positive bound 1e-6 each."""
    q_row = draft(1, v=V_SMALL, sharp=1.0)[0]
    counts, payloads = _counts(name, q_row)
    if payloads[0].proposal is None:
        law = q_row.double()
    else:
        law = law_of(payloads[0].proposal, 1, V_SMALL)[0].double()
        assert all(torch.equal(law_of(p.proposal, 1, V_SMALL)[0].double(), law) for p in payloads[:5])
    stat, df = chi_square(counts, (law / law.sum()).tolist())
    assert stat < chi_square_critical(df, 1e-6), f"seed {SEED}: chi2 {stat:.1f} df {df}"


def test_law_check_detects_draws_from_q_instead_of_the_sent_law():
    """Negative control: softmax's draws (X ~ q) against the floored top-8 law sent fail."""
    q_row = draft(1, v=V_SMALL, sharp=1.0)[0]
    _, sent = _counts("sparse-floor-u16", q_row)
    law = law_of(sent[0].proposal, 1, V_SMALL)[0].double()
    counts, _ = _counts("softmax", q_row)
    stat, df = chi_square(counts, (law / law.sum()).tolist())
    assert df == V_SMALL - 1 and stat > 10 * chi_square_critical(df, 1e-6), f"seed {SEED}: chi2 {stat:.1f}"


# ----------------------------------------------------------------------------- host copies


class HostReads(TorchFunctionMode):
    """Records every call that reads a tensor back to the host: ``cpu``, ``to("cpu")``,
    ``tolist``, ``numpy``, ``item`` and the scalar conversions, with the tensor's element
    count. On a GPU each is a device-to-host copy; here the calls are the same."""

    READS: ClassVar[set[str]] = {"cpu", "tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is not None and (name in self.READS or (name == "to" and _to_host(args[1:], kwargs))):
            self.calls.append((name, t.numel()))
        return func(*args, **kwargs)

    def wide(self, v=V):
        return [c for c in self.calls if c[1] >= v]


def _to_host(args, kwargs):
    # ``to("cpu")`` names the host; ``to(t.device)`` follows another tensor (on a server,
    # the device it lives on), so only the string counts as a host copy.
    dev = kwargs.get("device", args[0] if args else None)
    return isinstance(dev, str) and torch.device(dev).type == "cpu"


@pytest.mark.parametrize("name", ["greedy", "softmax", "sparse-topk", "sparse-topp", "sparse-tv", "sparse-floor-u16"])
def test_the_prefill_reads_nothing_v_wide_back_unless_the_encoder_ships_it(name):
    pub = publisher(name)
    q = draft(8)
    with HostReads() as reads:
        pub.encode(list(range(8)), q, 1.0, [str(i) for i in range(8)])
    assert reads.calls, "the watcher sees the (narrow) reads of X and the listed entries"
    assert reads.wide() == [], reads.wide()


def test_host_read_check_detects_v_wide_copies():
    """Negative controls: ``full`` ships the whole row (the copy is its payload), and an
    encoder from before ``uniforms`` gets the legacy per-request host copy."""
    with HostReads() as reads:
        publisher("full-bf16").encode(list(range(4)), draft(4), 1.0, None)
    assert reads.wide(), "full's row copy must be seen"

    class Legacy(SoftmaxEncoder):
        def encode(self, probs, *, temperature=1.0, generator=None):
            return super().encode(probs, temperature=temperature, generator=generator)

    legacy = ProposalPublisher(Legacy(None, ctx()), vocab_size=V, seed=SEED, stage=lambda t, p: None)
    assert not takes_uniforms(legacy.encoder) and takes_uniforms(ENCODERS["softmax"](ctx()))
    with HostReads() as reads:
        enc, _ = legacy.encode(list(range(4)), draft(4), 1.0, None)
    assert reads.wide() and enc.tokens.shape == (4, 1)


class TrustingArgmax:
    """A device-resident test encoder with no checks of its own (so no scalar syncs):
    what the chain's own code reads back is all that the watcher sees."""

    def __init__(self, options, context):
        self.vocab_size = context.vocab_size

    def encode(self, probs, *, temperature=1.0, generator=None, uniforms=None):
        rows = probs.unsqueeze(1) if probs.dim() == 2 else probs
        tokens = rows.argmax(dim=-1)
        return EncodedBatch(
            tokens,
            rows.gather(2, tokens.unsqueeze(-1)).squeeze(-1).float(),
            [None] * rows.shape[0],
            Provenance(rule="greedy", temperature=temperature),
        )


def _chain(encoder, steps=3, b=4):
    pub = ProposalPublisher(encoder, vocab_size=V, seed=SEED, stage=lambda t, p: None)
    reqs = [
        SimpleNamespace(bootstrap_room=100 + i, rid=f"r{i}", origin_input_ids=[7] * 4, output_ids=[]) for i in range(b)
    ]
    batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(temperatures=torch.ones(b, 1)))
    return pub, sglang_chain.chain_for(pub, batch), b


def test_the_chain_reads_nothing_back_between_steps_and_once_after():
    _, chain, b = _chain(TrustingArgmax(None, ctx()))
    out = SimpleNamespace()
    topk_p, topk_index = torch.zeros(b, 1), torch.zeros(b, 1, dtype=torch.int64)
    with HostReads() as reads, sglang_chain.CHAIN.enter(chain):
        xs = []
        for k in range(3):
            q = draft(b, seed=SEED + k)
            got = sglang_chain.draw_step(k, q, topk_p, topk_index)
            assert got is not None
            xs.append(got[2])
        during = list(reads.calls)
        sglang_chain.finish(chain, out)
    assert during == [], f"the draft loop must not wait on the device: {during}"
    payloads = getattr(out, sglang_chain.PAYLOADS_ATTR)
    assert [p.draft_tokens for p in payloads] == [tuple(int(x[i, 0]) for x in xs) for i in range(b)]
    assert sum(1 for name, _ in reads.calls if name == "cpu") == 1, reads.calls


@pytest.mark.parametrize("name", ["softmax", "sparse-floor-u16"])
def test_the_chain_reads_nothing_v_wide_back(name):
    _, chain, b = _chain(ENCODERS[name](ctx()))
    out = SimpleNamespace()
    topk_p, topk_index = torch.zeros(b, 1), torch.zeros(b, 1, dtype=torch.int64)
    with HostReads() as reads, sglang_chain.CHAIN.enter(chain):
        for k in range(3):
            assert sglang_chain.draw_step(k, draft(b, seed=SEED + k), topk_p, topk_index) is not None
        sglang_chain.finish(chain, out)
    assert reads.wide() == [], reads.wide()
    assert all(p is not None and len(p.draft_tokens) == 3 for p in getattr(out, sglang_chain.PAYLOADS_ATTR))


def test_chain_read_check_detects_a_per_step_read():
    """Negative control: an encoder that checks its input (a scalar read per step, as
    ``encoder_input`` does) is seen between the steps."""

    class Checking(TrustingArgmax):
        def encode(self, probs, **kw):
            return super().encode(encoder_input(probs), **kw)

    _, chain, b = _chain(Checking(None, ctx()))
    with HostReads() as reads, sglang_chain.CHAIN.enter(chain):
        for k in range(3):
            sglang_chain.draw_step(k, draft(b, seed=SEED + k), torch.zeros(b, 1), torch.zeros(b, 1, dtype=torch.int64))
    sglang_chain.finish(chain, SimpleNamespace())
    assert len(reads.calls) >= 3


def test_the_cpu_draw_in_row_chunks_equals_the_whole_batch_draw(monkeypatch):
    """``sample_categorical`` sums a few rows at a time on the CPU (cache); the draws are
    the same as one whole-batch sum, including u next to 1 and zero-mass tokens."""
    from pd_middleware.sampling import draws

    w = draft(37, v=257, sharp=3.0)
    w[:, ::5] = 0.0
    u = torch.cat([request_uniforms(SEED, list(range(35)))[:, 0], torch.tensor([0.0, 1.0 - 2.0**-53])])
    monkeypatch.setattr(draws, "_CPU_CDF_BYTES", 1 << 40)
    whole = draws.sample_categorical(w, u)
    for rows in (1, 3, 8):
        monkeypatch.setattr(draws, "_CPU_CDF_BYTES", rows * 8 * 257)
        assert torch.equal(draws.sample_categorical(w, u), whole), rows
    assert bool((w.gather(1, whole.view(-1, 1)) > 0).all()), "a zero-mass token was drawn"
