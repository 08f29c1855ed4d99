"""Exactness of every encoder x synthesizer pair, by exact enumeration and through the
real transport.

- Exact enumeration (``fractions.Fraction``): the committed token's law equals p, with
  s = the law X was really drawn from (the encoding's law, the softmax or the argmax)
  and q' = the row the synthesizer hands the verifier (through the assembler).
- Negative controls: the biased pairs of DESIGN.md section 2 come out biased when the
  guard is bypassed and exact with it on.
- A request SGLang rebootstraps (two lives, same rid and room): the second life's token
  has law p given the first's, exactly, because the draw's key holds its position; the
  key without it (life 1's uniform reused) is the negative control.
- A greedy request (top_k 1) through the real prefill wrapper: its X is q's argmax for
  every uniform, sent X only, and the one-hot it is verified with commits p exactly; its
  argmax X with the shipped law is the negative control.
- Monte Carlo through ZMQ + Mooncake, the receive pipeline, the assembler and the
  reference chain verifier, with the TV bound at alpha = 1e-6.
"""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
import torch

from pd_middleware import OneHotProposal, Payload, PluginContext, Provenance
from pd_middleware.decode.assembler import ProposalAssembler
from pd_middleware.decode.pipeline import Delivery, ReceivePipeline
from pd_middleware.evaluation.verify import exact_verify_law, tv_bound, tv_distance, verify_chain
from pd_middleware.sampling.encodings import dense_law_tensor, sparse_law_tensor
from pd_middleware_full import full
from pd_middleware_plugins import one_hot, sparse
from pd_middleware_plugins.sampling import GreedyEncoder, SoftmaxEncoder

SEED = 20261129
V = 6

ENCODERS = {
    "greedy": lambda c: GreedyEncoder(None, c),
    "softmax": lambda c: SoftmaxEncoder(None, c),
    "full-fp32": lambda c: full.FullEncoder(full.FullEncoderOptions(dtype="fp32"), c),
    "full-bf16": lambda c: full.FullEncoder(full.FullEncoderOptions(dtype="bf16"), c),
    "full-fp16": lambda c: full.FullEncoder(full.FullEncoderOptions(dtype="fp16"), c),
    "sparse-topk": lambda c: sparse.SparseEncoder(sparse.SparseEncoderOptions(mode="topk", k=2), c),
    "sparse-topp": lambda c: sparse.SparseEncoder(sparse.SparseEncoderOptions(mode="topp", epsilon=0.5, k_max=4), c),
    "sparse-floor": lambda c: sparse.SparseEncoder(sparse.SparseEncoderOptions(mode="topk", k=2, floor=True), c),
    "sparse-tv": lambda c: sparse.SparseEncoder(
        sparse.SparseEncoderOptions(mode="tv", epsilon=0.05, k_max=4, floor=True), c
    ),
    # The same pairs with u16 indices (one 65536-token bucket at this vocab).
    "sparse-topp-u16": lambda c: sparse.SparseEncoder(
        sparse.SparseEncoderOptions(mode="topp", epsilon=0.5, k_max=4, index_format="u16"), c
    ),
    "sparse-floor-u16": lambda c: sparse.SparseEncoder(
        sparse.SparseEncoderOptions(mode="topk", k=2, floor=True, index_format="u16"), c
    ),
    "sparse-tv-u16": lambda c: sparse.SparseEncoder(
        sparse.SparseEncoderOptions(mode="tv", epsilon=0.05, k_max=4, floor=True, index_format="u16"), c
    ),
}
SYNTHS = {
    "one_hot": lambda c, unsafe: one_hot.OneHotSynthesizer(None, c),
    "full_distribution": lambda c, unsafe: full.FullDistributionSynthesizer(None, c, unsafe_disable_guard=unsafe),
    "sparse": lambda c, unsafe: sparse.SparseSynthesizer(None, c, unsafe_disable_guard=unsafe),
}

# p and q as exact fractions; q is sent as fp32, so its values must be fp32-exact.
P = [Fraction(n, 64) for n in (20, 13, 11, 9, 7, 4)]
Q_DYADIC = [Fraction(n, 16) for n in (4, 4, 2, 2, 2, 2)]  # every quantisation and top-2 sum are exact
Q_RANDOM = torch.softmax(torch.tensor([1.3, -0.2, 0.9, 0.4, -1.1, 0.05]), dim=0)  # nothing is exact


def ctx(v=V, steps=1, side="decode"):
    return PluginContext(vocab_size=v, num_steps=steps, rejection_sampling=True, side=side)


def fr(t: torch.Tensor) -> list[Fraction]:
    """Exact rationals of a tensor's (float32/float64) values."""
    return [Fraction(float(x)) for x in t.double().tolist()]


def encode(name: str, q: torch.Tensor):
    out = ENCODERS[name](ctx(side="prefill")).encode(
        q.view(1, 1, -1).float(), generator=torch.Generator().manual_seed(SEED)
    )
    return out.proposals[0], out.provenance


def drawn_from(name: str, q: torch.Tensor, enc) -> torch.Tensor:
    """The law the encoder really draws X from, as a float (V,) vector."""
    if name == "greedy":
        return torch.nn.functional.one_hot(q.argmax(), len(q)).float()
    if name == "softmax":
        return q.float()
    return (dense_law_tensor(enc, 1, V) if enc.kind == "dense" else sparse_law_tensor(enc, 1, V))[0]


def committed_law(p, s_vec, synth, enc, prov):
    """Law of the committed token: sum over x of s(x) * law given X = x.

    For each x a payload with draft token x goes through the synthesizer and the
    assembler; the assembled fp32 row is q' for that x. The payload declares q(x) as the
    encoder does: the fp32 value of the law X was drawn from, at x. Returns (law,
    |sum q' - 1| max).
    """
    s = fr(s_vec)
    total = sum(s)
    law = [Fraction(0)] * V
    drift = Fraction(0)
    asm = ProposalAssembler(V, 1, max_batch=1)
    for x in range(V):
        if s[x] == 0:
            continue
        declared = min(1.0, float(s_vec[x].float()))
        payload = Payload(
            request_id=f"x{x}", draft_tokens=(x,), draft_probs=(declared,), vocab_size=V, provenance=prov, proposal=enc
        )
        q_row = fr(asm.build([synth.synthesize(payload)])[0])
        drift = max(drift, abs(sum(q_row) - 1))
        delta = [Fraction(int(y == x)) for y in range(V)]
        law = [a + s[x] / total * b for a, b in zip(law, exact_verify_law(p, q_row, delta))]
    return law, drift


def l1(a, b):
    return sum(abs(x - y) for x, y in zip(a, b))


def hands_over(enc_name: str, synth_name: str) -> bool:
    """Whether the pair ships its law to the verifier (no fallback may happen then)."""
    return (enc_name.startswith("full") and synth_name == "full_distribution") or (
        enc_name.startswith("sparse") and synth_name == "sparse"
    )


# ----------------------------------------------------------------------------- exact enumeration


@pytest.mark.parametrize("synth_name", sorted(SYNTHS))
@pytest.mark.parametrize("enc_name", sorted(ENCODERS))
def test_every_pair_is_exact_on_dyadic_inputs(enc_name, synth_name):
    """q with dyadic values: every encoding's law sums to exactly 1, so law == p exactly."""
    q = torch.tensor([float(v) for v in Q_DYADIC])
    enc, prov = encode(enc_name, q)
    synth = SYNTHS[synth_name](ctx(), False)
    law, drift = committed_law(P, drawn_from(enc_name, q, enc), synth, enc, prov)
    assert drift == 0
    assert law == P, f"{enc_name} -> {synth_name} is biased: {[str(v) for v in law]}"
    if hands_over(enc_name, synth_name):  # exact because the law itself was verified, not a fallback
        assert not synth.guard.counts, dict(synth.guard.counts)


@pytest.mark.parametrize("synth_name", sorted(SYNTHS))
@pytest.mark.parametrize("enc_name", sorted(ENCODERS))
def test_every_pair_is_exact_up_to_fp32_normalisation(enc_name, synth_name):
    """Generic q: q' is X's law up to the fp32 rounding of its normalisation.

    With q' taken as the exact normalisation of the assembled row, law == p exactly;
    with the raw fp32 row the error is at most 2|1/c - 1| (c = sum q', |c - 1| < 1e-6).
    """
    q = Q_RANDOM
    enc, prov = encode(enc_name, q)
    synth = SYNTHS[synth_name](ctx(), False)
    s_vec = drawn_from(enc_name, q, enc)
    law, drift = committed_law(P, s_vec, synth, enc, prov)
    if hands_over(enc_name, synth_name):
        assert not synth.guard.counts, dict(synth.guard.counts)
    assert drift < Fraction(1, 10**6)
    c_low = 1 - drift
    assert l1(law, P) <= 2 * (1 / c_low - 1) + Fraction(1, 10**12)
    # The same enumeration with q' normalised exactly.
    payloads = {}
    for x in range(V):
        declared = min(1.0, float(s_vec[x].float()))
        payloads[x] = synth.synthesize(
            Payload(
                request_id=f"x{x}",
                draft_tokens=(x,),
                draft_probs=(declared,),
                vocab_size=V,
                provenance=prov,
                proposal=enc,
            )
        )
    s = fr(s_vec)
    s = [v / sum(s) for v in s]
    exact = [Fraction(0)] * V
    for x in range(V):
        if s[x]:
            row = fr(payloads[x].to_dense(V)[0])
            row = [v / sum(row) for v in row]
            delta = [Fraction(int(y == x)) for y in range(V)]
            exact = [a + s[x] * b for a, b in zip(exact, exact_verify_law(P, row, delta))]
    assert exact == P


NEGATIVE_CONTROLS = {
    # X ~ fp32 q, bf16 q sent (provenance truthfully says fp32).
    "fp32-drawn-bf16-sent": ("full-fp32", "full-bf16", "full_distribution"),
    # X ~ q (softmax), top-2 q_k sent.
    "softmax-drawn-topk-sent": ("softmax", "sparse-topk", "sparse"),
    "softmax-drawn-u16-floor-sent": ("softmax", "sparse-floor-u16", "sparse"),
    # X = argmax q, full softmax q sent.
    "greedy-drawn-softmax-sent": ("greedy", "full-fp32", "full_distribution"),
}


@pytest.mark.parametrize("control", sorted(NEGATIVE_CONTROLS))
def test_negative_controls_biased_without_guard_exact_with_it(control):
    drawn, sent, synth_name = NEGATIVE_CONTROLS[control]
    q = Q_RANDOM
    s_enc, prov = encode(drawn, q)  # what X is really drawn from, and its provenance
    sent_enc, _ = encode(sent, q)  # what is attached to the payload
    s_vec = drawn_from(drawn, q, s_enc)
    biased, _ = committed_law(P, s_vec, SYNTHS[synth_name](ctx(), True), sent_enc, prov)
    bias = l1(biased, P)
    print(f"{control}: L1 bias without the guard {float(bias):.3g}")
    assert bias > Fraction(1, 10**5), f"{control}: the bypassed guard should let a bias through ({float(bias):.3g})"
    guard_synth = SYNTHS[synth_name](ctx(), False)
    law, drift = committed_law(P, s_vec, guard_synth, sent_enc, prov)
    assert drift == 0 and law == P  # the one-hot fallback is exact for any X
    assert sum(guard_synth.guard.counts.values()) == sum(1 for v in s_vec.tolist() if v > 0)


# ----------------------------------------------------------------------------- Monte Carlo via transport

MC_V = 16
MC_N = 3000
MC_BATCH = 50
MC_ARMS = {
    # arm: (encoder, synthesizer, guard bypassed, expect pass)
    "one_hot+softmax": ("softmax", "one_hot", False, True),
    "full_distribution+full-bf16": ("full-bf16", "full_distribution", False, True),
    "sparse+floor": ("sparse-floor", "sparse", False, True),
    "sparse+topk": ("sparse-topk", "sparse", False, True),
    "full_distribution+greedy(guarded)": ("greedy+full", "full_distribution", False, True),
    "full_distribution+greedy(BYPASSED)": ("greedy+full", "full_distribution", True, False),
}


def _mc_rows():
    g = torch.Generator().manual_seed(SEED)
    p = torch.softmax(torch.randn(MC_V, generator=g), 0)
    q = torch.softmax(torch.log(p) + 0.8 * torch.randn(MC_V, generator=g), 0)
    return p, q


def _mc_encode(arm_encoder: str, q_rows: torch.Tensor, gen: torch.Generator):
    c = ctx(MC_V, side="prefill")
    if arm_encoder == "greedy+full":  # greedy X with the softmax q attached
        g = GreedyEncoder(None, c).encode(q_rows)
        f = full.FullEncoder(full.FullEncoderOptions(dtype="fp32"), c).encode(q_rows, generator=gen)
        return g.tokens, g.token_probs, f.proposals, g.provenance
    enc = {
        "softmax": lambda: SoftmaxEncoder(None, c),
        "full-bf16": lambda: full.FullEncoder(full.FullEncoderOptions(dtype="bf16"), c),
        "sparse-floor": lambda: sparse.SparseEncoder(sparse.SparseEncoderOptions(mode="topk", k=4, floor=True), c),
        "sparse-topk": lambda: sparse.SparseEncoder(sparse.SparseEncoderOptions(mode="topk", k=4), c),
    }[arm_encoder]()
    out = enc.encode(q_rows, generator=gen)
    return out.tokens, out.token_probs, out.proposals, out.provenance


@pytest.mark.slow
def test_monte_carlo_through_the_real_transport(mooncake_pair):
    """N payloads per arm: prefill encoder -> PrefillSender (Mooncake bulk, TCP) ->
    DecodeReceiver -> pipeline (synthesizer) -> assembler -> verify_chain. The committed
    first tokens must lie within TV bound of p (false-positive rate alpha = 1e-6 per arm);
    the guard-bypassed greedy control must exceed it."""
    import zmq

    from pd_middleware.transport import DecodeReceiver, PrefillSender, SlotsConfig, TransportConfig

    decode_engine, prefill_engine = mooncake_pair
    p, q = _mc_rows()
    bound = tv_bound(MC_V, MC_N, 1e-6)
    cfg = TransportConfig(
        inline_threshold_bytes=0,  # every tensor through Mooncake
        heartbeat_s=0.1,
        peer_timeout_s=10.0,
        slots=SlotsConfig(count=MC_BATCH, size_bytes=4096, per_peer=MC_BATCH, wait_s=10.0),
    )
    zctx = zmq.Context()
    results = {}
    try:
        for arm, (enc_name, synth_name, unsafe, expect_pass) in MC_ARMS.items():
            synth = SYNTHS[synth_name](ctx(MC_V), unsafe)
            rx = DecodeReceiver(
                cfg, ReceivePipeline([], {"default": (synth_name, synth)}), engine=decode_engine, context=zctx
            ).start()
            tx = PrefillSender(cfg, engine=prefill_engine, context=zctx, name=f"mc-{arm}").connect(rx.address)
            asm = ProposalAssembler(MC_V, 1, max_batch=MC_BATCH)
            gen_pre = torch.Generator().manual_seed(SEED)
            gen_ver = torch.Generator().manual_seed(SEED + 1)
            counts = torch.zeros(MC_V, dtype=torch.int64)
            fallbacks = 0
            try:
                for start in range(0, MC_N, MC_BATCH):
                    rows = q.expand(MC_BATCH, 1, MC_V).contiguous()
                    tokens, tprobs, props, prov = _mc_encode(enc_name, rows, gen_pre)
                    for i in range(MC_BATCH):
                        tx.send(
                            Payload(
                                request_id=f"{arm}-{start + i}",
                                draft_tokens=tokens[i],
                                draft_probs=tprobs[i],
                                vocab_size=MC_V,
                                hidden=bytes(16),
                                hidden_dtype="bf16",
                                provenance=prov,
                                proposal=props[i],
                            )
                        )
                    got: list[Delivery] = []
                    deadline = time.monotonic() + 20.0
                    while len(got) < MC_BATCH and time.monotonic() < deadline:
                        out = rx.get(timeout=0.2)
                        if out is not None:
                            assert isinstance(out, Delivery), f"{arm}: {out}"
                            got.append(out)
                    assert len(got) == MC_BATCH, f"{arm}: {len(got)} of {MC_BATCH} delivered within 20 s"
                    got.sort(key=lambda d: int(d.request_id.rsplit("-", 1)[1]))
                    draft = asm.build([d.proposal for d in got])
                    toks = torch.tensor([d.payload.draft_tokens[0] for d in got])
                    for d in got:
                        d.release()
                        fallbacks += isinstance(d.proposal, OneHotProposal) and synth_name != "one_hot"
                    target = p.expand(MC_BATCH, 2, MC_V)
                    res = verify_chain(target, draft, toks, gen_ver)
                    counts += torch.bincount(res.committed[:, 0], minlength=MC_V)
                assert tx.flush(10.0)
                snap = rx.metrics.snapshot()
                assert snap["delivered"] == MC_N and snap["failed"] == 0 and snap["bytes_by_plane"]["bulk"] > 0
            finally:
                tx.close()
                rx.stop()
            tv = tv_distance(counts, p)
            results[arm] = (tv, fallbacks)
            if expect_pass:
                assert tv < bound, f"{arm}: TV {tv:.4f} >= bound {bound:.4f} (seed {SEED}, N {MC_N})"
            else:
                assert tv > bound, f"{arm}: negative control TV {tv:.4f} did not exceed {bound:.4f} (seed {SEED})"
    finally:
        zctx.term()
    print({arm: f"TV {tv:.4f} (bound {bound:.4f}), fallbacks {fb}" for arm, (tv, fb) in results.items()})
    assert results["full_distribution+greedy(guarded)"][1] == MC_N  # every greedy payload fell back
    assert results["full_distribution+full-bf16"][1] == results["sparse+floor"][1] == 0


# ----------------------------------------------------------------------------- u16 bit-exact via transport

U16_V = 152064  # three 65536-token buckets
U16_STEPS = 3


@pytest.mark.parametrize("path", ["inline", "mooncake"])
def test_u16_sparse_round_trips_bit_exact_through_the_real_transport(path, mooncake_pair):
    """Real u16 encodings (V = 152064, 3 steps) through PrefillSender -> DecodeReceiver ->
    sparse synthesizer: the bytes arrive unchanged and the law the decode hands over is,
    bit for bit, the law the prefill drew X from."""
    import zmq

    from pd_middleware.transport import DecodeReceiver, PrefillSender, SlotsConfig, TransportConfig

    decode_engine, prefill_engine = mooncake_pair if path == "mooncake" else (None, None)
    cfg = TransportConfig(
        inline_threshold_bytes=0 if path == "mooncake" else 1 << 30,
        heartbeat_s=0.1,
        peer_timeout_s=10.0,
        slots=SlotsConfig(count=8, size_bytes=64 * 1024, per_peer=8, wait_s=10.0),
    )
    g = torch.Generator().manual_seed(SEED)
    q = torch.softmax(3.0 * torch.randn(4, U16_STEPS, U16_V, generator=g), dim=-1)
    enc = sparse.SparseEncoder(
        sparse.SparseEncoderOptions(mode="topp", epsilon=0.01, k_max=3000, floor=True, index_format="u16"),
        ctx(U16_V, U16_STEPS, side="prefill"),
    ).encode(q, generator=torch.Generator().manual_seed(SEED))
    sent = [
        Payload(
            request_id=f"u16-{i}",
            draft_tokens=enc.tokens[i],
            draft_probs=enc.token_probs[i],
            vocab_size=U16_V,
            hidden=bytes(64),
            provenance=enc.provenance,
            proposal=p,
        )
        for i, p in enumerate(enc.proposals)
    ]
    # Every bucket is used and more than one step is sent: the multi-bucket, multi-step case.
    assert all(sum(1 for c in p.proposal.bucket_counts if c) == 3 * U16_STEPS for p in sent), f"seed {SEED}"
    synth = sparse.SparseSynthesizer(None, ctx(U16_V, U16_STEPS))
    zctx = zmq.Context()
    rx = DecodeReceiver(
        cfg, ReceivePipeline([], {"default": ("sparse", synth)}), engine=decode_engine, context=zctx
    ).start()
    tx = PrefillSender(cfg, engine=prefill_engine, context=zctx, name=f"u16-{path}").connect(rx.address)
    try:
        for p in sent:
            tx.send(p)
            out = rx.get(timeout=10.0)
            assert isinstance(out, Delivery), out
            got = out.payload.proposal
            want = p.proposal
            assert (got.index_format, got.bucket_counts, got.lengths, got.tail_mass) == (
                "u16",
                want.bucket_counts,
                want.lengths,
                want.tail_mass,
            )
            assert bytes(got.indices) == bytes(want.indices) and bytes(got.values) == bytes(want.values)
            law = sparse_law_tensor(want, U16_STEPS, U16_V)
            assert torch.equal(out.proposal.to_dense(U16_V), law), f"{path}: decode law differs (seed {SEED})"
            for j, x in enumerate(p.draft_tokens):
                assert law[j, x].item() == p.draft_probs[j] > 0
            out.release()
        assert tx.flush(10.0)
        snap = rx.metrics.snapshot()
        busy = "bulk" if path == "mooncake" else "inline"
        assert snap["delivered"] == len(sent) and snap["failed"] == 0 and snap["bytes_by_plane"][busy] > 0
    finally:
        tx.close()
        rx.stop()
        zctx.term()


# ----------------------------------------------------------------------------- hand-made payloads


def test_fp32_underflowing_floor_never_reaches_the_verifier():
    """Regression (issue 13, finding 9): a tail mass of 1e-46 passes the sum check, but its
    floor is 0.0 in fp32, so an unlisted X would reach the verifier with q'(X) = 0.

    Given that hand-made X = 5, the committed law is p exactly with the guard (one-hot
    fallback, counted) and biased without it, under both kernels' semantics.
    """
    import numpy as np

    from pd_middleware import SparseEncoding

    enc = SparseEncoding(
        lengths=(5,),
        indices=np.arange(5, dtype=np.int32).tobytes(),
        values=np.array([0.25, 0.25, 0.25, 0.125, 0.125], dtype=np.float32).tobytes(),
        value_dtype="fp32",
        tail_mass=(1e-46,),
    )
    from pd_middleware import Provenance

    prov = Provenance(rule="sampled", sampled_from="sparse-fp32")
    payload = Payload(
        request_id="x5", draft_tokens=(5,), draft_probs=(1e-46,), vocab_size=V, provenance=prov, proposal=enc
    )
    delta5 = [Fraction(int(y == 5)) for y in range(V)]
    asm = ProposalAssembler(V, 1, max_batch=1)
    guarded = SYNTHS["sparse"](ctx(), False)
    row = fr(asm.build([guarded.synthesize(payload)])[0])
    assert row == delta5 and dict(guarded.guard.counts) == {"token_outside_proposal": 1}
    for kernel in ("flashinfer", "sglang"):
        assert exact_verify_law(P, row, delta5, kernel) == P
    # Negative control: without the guard the law reaches the assembler, which writes 0.0 at X.
    bypassed = SYNTHS["sparse"](ctx(), True)
    row = fr(asm.build([bypassed.synthesize(payload)])[0])
    assert row[5] == 0 and row[:5] == [Fraction(1, 4)] * 3 + [Fraction(1, 8)] * 2
    for kernel in ("flashinfer", "sglang"):
        assert exact_verify_law(P, row, delta5, kernel) != P, kernel
    # Positive control: a floor that survives fp32 (1e-30 / 1) is a real probability.
    enc_ok = SparseEncoding(
        lengths=enc.lengths, indices=enc.indices, values=enc.values, value_dtype="fp32", tail_mass=(1e-30,)
    )
    q5 = float(np.float32(1e-30))
    ok = SYNTHS["sparse"](ctx(), False).synthesize(
        Payload(request_id="x5", draft_tokens=(5,), draft_probs=(q5,), vocab_size=V, provenance=prov, proposal=enc_ok)
    )
    assert type(ok).__name__ == "SparseProposal" and fr(asm.build([ok])[0])[5] == Fraction(q5)


def test_listed_zero_under_a_floor_is_outside_the_proposal():
    """A listed value of 0 overrides the floor in the assembled row: X there has q'(X) = 0."""
    import numpy as np

    from pd_middleware import Provenance, SparseEncoding

    enc = SparseEncoding(
        lengths=(3,),
        indices=np.array([0, 1, 2], dtype=np.int32).tobytes(),
        values=np.array([0.5, 0.25, 0.0], dtype=np.float32).tobytes(),
        value_dtype="fp32",
        tail_mass=(0.25,),
    )
    prov = Provenance(rule="sampled", sampled_from="sparse-fp32")
    synth = SYNTHS["sparse"](ctx(), False)
    out = synth.synthesize(
        Payload(request_id="x2", draft_tokens=(2,), draft_probs=(0.0,), vocab_size=V, provenance=prov, proposal=enc)
    )
    assert out == OneHotProposal((2,)) and dict(synth.guard.counts) == {"token_outside_proposal": 1}
    # Negative control: an unlisted X gets the floor (0.25 / 3) and is handed over.
    f = float(np.float32(0.25 / 3))
    out = synth.synthesize(
        Payload(request_id="x4", draft_tokens=(4,), draft_probs=(f,), vocab_size=V, provenance=prov, proposal=enc)
    )
    assert type(out).__name__ == "SparseProposal" and out.values_at((4,)) == [f]


# ----------------------------------------------------------------------------- a rebootstrapped request's two lives

#: Grid of the enumerated uniforms: every law below is a multiple of 1/8, so the inverse
#: CDF at u = j/8 (j = 0..7, each with probability 1/8) draws X with exactly its law.
GRID_N = 8
PROMPT = [101, 102, 103]
T0 = 9  # the prefill's first token, committed with life 1's X


class GridOracle:
    """``room_seed`` as a random function on a grid: the k-th distinct key the draws ask for
    gets the uniform ``js[k] / GRID_N`` (through the real ``>> 10`` and 2**-53 of
    ``request_uniforms``). Enumerating every ``js`` with weight 1/GRID_N per key is the
    exact law of draws whose distinct keys get independent uniforms and whose equal keys
    share one, which is what a keyed digest gives."""

    def __init__(self, js):
        self.js, self.keys = js, {}

    def __call__(self, seed, room, salt="", position=None):
        k = self.keys.setdefault((seed, room, salt, position), len(self.keys))
        return (self.js[k] * (2**53 // GRID_N)) << 10


REBOOT_ENCODERS = {
    # configs/sparse_floor.toml's options (topp, fp16 values, u16 indices, floor).
    "sparse_floor": (
        lambda c: sparse.SparseEncoder(
            sparse.SparseEncoderOptions(
                mode="topp", epsilon=0.005, k_max=4000, value_dtype="fp16", index_format="u16", floor=True
            ),
            c,
        ),
        "sparse",
    ),
    "sparse-topk-floor": (
        lambda c: sparse.SparseEncoder(sparse.SparseEncoderOptions(mode="topk", k=2, floor=True), c),
        "sparse",
    ),
    "full-fp32": (lambda c: full.FullEncoder(full.FullEncoderOptions(dtype="fp32"), c), "full_distribution"),
    "full-bf16": (lambda c: full.FullEncoder(full.FullEncoderOptions(dtype="bf16"), c), "full_distribution"),
}
H = Fraction(1, 2)
Q4 = Fraction(1, 4)
REBOOT_CASES = {
    # (V, p of life 1's verify, q of life 1's draft, p and q at life 2's position)
    "V2-flat": (2, [H, H], [H, H], [H, H], [H, H]),
    "V3": (3, [H, Q4, Q4], [Q4, H, Q4], [Q4, Q4, H], [H, Q4, Q4]),
}


def two_lives(enc_name, case):
    """Exact joint law of (Y1, Y2): life 1 draws X1 (the real publisher and encoder, the
    draw keyed by the real code) and the verify commits Y1 from the q' the real
    synthesizer and assembler hand it; SGLang rebootstraps the request (same rid and room,
    the prompt plus the output so far as its new prompt, a fresh metadata row); life 2
    draws X2 with the key the code gives it and the verify commits Y2 from its shipped q'.
    The verify's own coin and residual draw are fresh per life (the decode's)."""
    from types import SimpleNamespace

    from pd_middleware.integrations.sglang.prefill import ProposalPublisher
    from pd_middleware.sampling import draws

    v, p1, q1, p2, q2 = case
    make_enc, synth_name = REBOOT_ENCODERS[enc_name]
    asm = ProposalAssembler(v, 1, max_batch=1)
    synth = SYNTHS[synth_name](ctx(v), False)

    def life(req, p, q):
        staged = []
        pub = ProposalPublisher(
            make_enc(ctx(v, side="prefill")), vocab_size=v, seed=SEED, stage=lambda t, pl: staged.append(pl)
        )
        pub.publish([req.bootstrap_room], torch.tensor([[float(x) for x in q]]), 1.0, targets=[req])
        (payload,) = staged
        x = payload.draft_tokens[0]
        q_row = fr(asm.build([synth.synthesize(payload)])[0])
        return exact_verify_law(p, q_row, [Fraction(int(y == x)) for y in range(v)])

    joint = {}
    for j1 in range(GRID_N):
        for j2 in range(GRID_N):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(draws, "room_seed", GridOracle((j1, j2)))
                first = SimpleNamespace(rid="req-7", bootstrap_room=7, origin_input_ids=list(PROMPT), output_ids=[])
                for y1, a in enumerate(life(first, p1, q1)):
                    if a == 0:
                        continue
                    # The decode's output [T0, Y1, bonus]; the retract pops the boundary (bonus),
                    # the rebootstrap's /generate carries the prompt plus [T0, Y1].
                    second = SimpleNamespace(
                        rid="req-7", bootstrap_room=7, origin_input_ids=[*PROMPT, T0, y1], output_ids=[]
                    )
                    for y2, b in enumerate(life(second, p2, q2)):
                        joint[(y1, y2)] = joint.get((y1, y2), Fraction(0)) + Fraction(1, GRID_N**2) * a * b
    return joint


def conditional_laws(joint, v):
    """{y1: the law of Y2 given Y1 = y1} over the y1 with positive probability."""
    out = {}
    for y1 in range(v):
        m = sum(joint.get((y1, y2), Fraction(0)) for y2 in range(v))
        if m:
            out[y1] = [joint.get((y1, y2), Fraction(0)) / m for y2 in range(v)]
    return out


@pytest.mark.parametrize("case", sorted(REBOOT_CASES))
@pytest.mark.parametrize("enc_name", sorted(REBOOT_ENCODERS))
def test_a_rebootstrapped_request_commits_p_given_its_first_life(enc_name, case, monkeypatch):
    """Issue 40: after SGLang's retract-mode pause rebootstraps a request, the token its
    second life commits has the target's law given everything the first life committed:
    P(Y2 | Y1 = y1) = p2 for every y1, exactly (Fraction enumeration), and Y1 has law p1.

    Negative control: the draw keyed on (seed, room, rid) alone, as before the position
    was in the key, gives life 2 life 1's uniform; at V = 2 with q = p flat the second token
    then copies the first with probability 1 (the target says 1/2)."""
    from pd_middleware.integrations.sglang import prefill

    v, p1, _, p2, _ = REBOOT_CASES[case]
    joint = two_lives(enc_name, REBOOT_CASES[case])
    assert sum(joint.values()) == 1
    marginal = [sum(joint.get((y1, y2), Fraction(0)) for y2 in range(v)) for y1 in range(v)]
    assert marginal == p1, f"{enc_name} {case}: life 1 {[str(x) for x in marginal]}"
    for y1, law in conditional_laws(joint, v).items():
        assert law == p2, f"{enc_name} {case}: Y2 | Y1 = {y1} has law {[str(x) for x in law]}, not p"
    # Negative control: the old key (no position), under the same enumeration.
    monkeypatch.setattr(prefill, "draw_position", lambda req: None)
    stale = conditional_laws(two_lives(enc_name, REBOOT_CASES[case]), v)
    assert any(law != p2 for law in stale.values()), f"{enc_name} {case}: the old key is not caught"
    if case == "V2-flat":
        assert all(law[y1] == 1 for y1, law in stale.items()), "the second token copies the first"


# ----------------------------------------------------------------------------- greedy requests (issue 45)

GREEDY_V = 4
# The draft's q, and two targets: p (not one-hot: exactness must hold for any p) and what
# the verify makes of a top-k 1 request's target (top_k_renorm_prob: one-hot at its argmax,
# here the draft's argmax too, so aggregated serving accepts that row's X every time).
GREEDY_Q = [Fraction(3, 8), Fraction(2, 8), Fraction(2, 8), Fraction(1, 8)]
GREEDY_P = [Fraction(1, 2), Fraction(1, 4), Fraction(1, 8), Fraction(1, 8)]
GREEDY_P_TOP1 = [Fraction(1), Fraction(0), Fraction(0), Fraction(0)]
GREEDY_PAIRS = {"full-fp32": "full_distribution", "sparse-topk": "sparse", "softmax": "one_hot"}


def greedy_batch(enc_name, j, monkeypatch):
    """One prefill batch through the real wrapper (``publish_batch``) with two requests: a
    greedy one (``top_k`` 1, what SGLang makes of temperature 0) and a sampled one (top-k
    all), every draw's uniform ``j / GRID_N`` (:class:`GridOracle`). Returns the payloads
    staged per rid and SGLang's draft input after the wrapper."""
    from types import SimpleNamespace

    from pd_middleware.core.events import Events
    from pd_middleware.integrations.sglang.prefill import ProposalPublisher, publish_batch
    from pd_middleware.sampling import draws

    monkeypatch.setattr(draws, "room_seed", GridOracle((j, j)))
    staged = {}
    pub = ProposalPublisher(
        ENCODERS[enc_name](ctx(GREEDY_V, side="prefill")),
        vocab_size=GREEDY_V,
        seed=SEED,
        stage=lambda req, payload: staged.__setitem__(req.rid, payload),
    )
    reqs = [
        SimpleNamespace(
            rid=rid,
            bootstrap_room=room,
            origin_input_ids=list(PROMPT),
            output_ids=[],
            inflight_middle_chunks=0,
            to_finish=None,
            discard_output_reason=None,
        )
        for rid, room in (("greedy", 7), ("sampled", 8))
    ]
    q = torch.tensor([[float(x) for x in GREEDY_Q]] * 2)
    di = SimpleNamespace(
        topk_index=torch.zeros((2, 1), dtype=torch.int64), topk_p=torch.full((2, 1), 0.5), draft_probs=q
    )
    info = SimpleNamespace(temperatures=torch.ones((2, 1)), top_ks=torch.tensor([1, 1 << 30], dtype=torch.int32))
    batch = SimpleNamespace(reqs=reqs, sampling_info=info)
    publish_batch(pub, batch, SimpleNamespace(copy_done=None, next_draft_input=di), group=None, events=Events("guard"))
    return staged, di, pub


@pytest.mark.parametrize("enc_name", sorted(GREEDY_PAIRS))
def test_a_greedy_request_proposes_its_argmax_and_stays_exact(enc_name, monkeypatch):
    """Issue 45 item 3: SGLang proposes a greedy row's (top_k <= 1) argmax since 0.5.21
    (``sample_draft_proposal``); a shipped strategy drew it from q instead, losing acceptance.
    Enumerated over the draw's uniform: the greedy request's X is q's argmax for every
    uniform, sent X only with a greedy provenance, so the decode verifies the one-hot at X
    (exact for any p: law == p, Fraction); under the top-k 1 target its X is accepted every
    time, as in aggregated serving (drawn from q it was accepted with probability q(argmax)
    = 3/8 under the full law). The sampled request of the same batch is drawn as ever."""
    from pd_middleware.evaluation.verify_exact import exact_accept_probability

    synth = SYNTHS[GREEDY_PAIRS[enc_name]](ctx(GREEDY_V), False)
    asm = ProposalAssembler(GREEDY_V, 1, max_batch=1)
    argmax = max(range(GREEDY_V), key=lambda y: GREEDY_Q[y])
    law = [Fraction(0)] * GREEDY_V
    accept = Fraction(0)
    sampled_tokens = set()
    for j in range(GRID_N):
        staged, di, pub = greedy_batch(enc_name, j, monkeypatch)
        greedy, sampled = staged["greedy"], staged["sampled"]
        (x,) = greedy.draft_tokens
        assert x == argmax, f"{enc_name}, uniform {j}/{GRID_N}: the greedy request proposed {x}, not the argmax"
        assert greedy.provenance.rule == "greedy" and greedy.proposal is None and greedy.draft_probs == (1.0,)
        assert int(di.topk_index[0, 0]) == x and float(di.topk_p[0, 0]) == 1.0  # SGLang's metadata carries it
        assert pub.counts["greedy"] == 1 and pub.counts["staged"] == 2
        # The sampled neighbour: its own draw and its own law, as without a greedy row.
        assert sampled.provenance.rule == "sampled" and int(di.topk_index[1, 0]) == sampled.draft_tokens[0]
        sampled_tokens.add(sampled.draft_tokens[0])
        q_row = fr(asm.build([synth.synthesize(greedy)])[0])
        assert q_row == [Fraction(int(y == x)) for y in range(GREEDY_V)]
        delta = [Fraction(int(y == x)) for y in range(GREEDY_V)]
        law = [a + Fraction(1, GRID_N) * b for a, b in zip(law, exact_verify_law(GREEDY_P, q_row, delta))]
        accept += Fraction(1, GRID_N) * exact_accept_probability(GREEDY_P_TOP1[x], q_row[x])
    assert law == GREEDY_P, f"{enc_name}: the greedy request's token has law {[str(v) for v in law]}"
    assert accept == 1
    assert len(sampled_tokens) > 1  # the sampled request still draws


@pytest.mark.parametrize("enc_name", ["full-fp32", "sparse-topk"])
def test_negative_control_a_greedy_x_with_the_shipped_law_is_biased(enc_name):
    """What the greedy request must never ship: its argmax X with the encoder's law of q
    (the biased pair of DESIGN.md section 2). Through the synthesizer with the guard
    bypassed the committed token's law is not p; with the guard on, the greedy provenance
    falls back to the one-hot, exact, counted ``greedy``."""
    c = ctx(GREEDY_V, side="prefill")
    q = torch.tensor([float(x) for x in GREEDY_Q]).view(1, 1, -1)
    enc = ENCODERS[enc_name](c).encode(q, generator=torch.Generator().manual_seed(SEED)).proposals[0]
    x = 0  # q's argmax
    payload = Payload(
        request_id="greedy",
        draft_tokens=(x,),
        draft_probs=(1.0,),
        vocab_size=GREEDY_V,
        provenance=Provenance(rule="greedy"),
        proposal=enc,
    )
    delta = [Fraction(int(y == x)) for y in range(GREEDY_V)]
    asm = ProposalAssembler(GREEDY_V, 1, max_batch=1)
    bypassed = SYNTHS[GREEDY_PAIRS[enc_name]](ctx(GREEDY_V), True)
    biased = exact_verify_law(GREEDY_P, fr(asm.build([bypassed.synthesize(payload)])[0]), delta)
    assert biased != GREEDY_P, f"{enc_name}: the biased pair is not caught"
    guarded = SYNTHS[GREEDY_PAIRS[enc_name]](ctx(GREEDY_V), False)
    assert exact_verify_law(GREEDY_P, fr(asm.build([guarded.synthesize(payload)])[0]), delta) == GREEDY_P
    assert dict(guarded.guard.counts) == {"greedy": 1}
