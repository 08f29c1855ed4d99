"""The provenance guard: which payloads may hand over a shipped proposal, and the fallbacks."""

from __future__ import annotations

import logging

import pytest

from pd_middleware import DenseEncoding, Metrics, OneHotProposal, Payload, Provenance, SparseEncoding
from pd_middleware.decode.guard import ProvenanceGuard

V = 4
SPARSE = ("sparse-fp16", "sparse-fp32")


def dense(dtype="fp32"):
    import torch

    row = torch.tensor([0.25, 0.25, 0.25, 0.25])
    row = (
        row.to(torch.bfloat16).view(torch.int16)
        if dtype == "bf16"
        else row.to({"fp32": torch.float32, "fp16": torch.float16}[dtype])
    )
    return DenseEncoding(dtype=dtype, data=row.numpy().tobytes())


def sparse(value_dtype="fp16"):
    import numpy as np

    vals = np.array([0.5, 0.5], dtype=np.float16 if value_dtype == "fp16" else np.float32)
    return SparseEncoding(
        lengths=(2,), indices=np.array([1, 3], dtype=np.int32).tobytes(), values=vals.tobytes(), value_dtype=value_dtype
    )


def payload(proposal=None, rule="sampled", sampled_from=None, rid="r0", tokens=(3,), probs=None):
    return Payload(
        request_id=rid,
        draft_tokens=tokens,
        draft_probs=tuple(0.5 for _ in tokens) if probs is None else tuple(probs),
        vocab_size=V,
        provenance=Provenance(rule=rule, temperature=1.0, sampled_from=sampled_from),
        proposal=proposal,
    )


@pytest.mark.parametrize(
    "pl, reason",
    [
        (payload(sparse(), sampled_from="sparse-fp16"), None),
        (payload(sparse("fp32"), sampled_from="sparse-fp32"), None),
        (payload(sparse(), rule="greedy"), "greedy"),
        (payload(None, rule="greedy"), "greedy"),  # greedy is reported first
        (payload(None), "no_proposal"),
        (payload(None, sampled_from="sparse-fp16"), "no_proposal"),
        (payload(dense("bf16"), sampled_from="dense-bf16"), "encoding_mismatch:dense-bf16"),
        (payload(sparse(), sampled_from=None), "not_sampled_from_sent"),  # X ~ softmax, q_k sent
        (payload(sparse(), sampled_from="sparse-fp32"), "not_sampled_from_sent"),  # fp32 law, fp16 sent
        (payload(sparse(), sampled_from="dense-fp32"), "not_sampled_from_sent"),
    ],
)
def test_check_reasons(pl, reason):
    assert ProvenanceGuard("sparse", SPARSE).check(pl) == reason


def test_fallback_is_one_hot_at_the_draft_tokens_counted_and_logged_once(caplog):
    metrics = Metrics()
    g = ProvenanceGuard("full_distribution", ("dense-fp32",), metrics=metrics)
    caplog.set_level(logging.WARNING, logger="pd_middleware.decode.guard")
    outs = [g.screen(payload(dense(), rule="greedy", rid=f"g{i}", tokens=(1, 2))) for i in range(3)]
    outs += [g.screen(payload(None, rid=f"n{i}")) for i in range(2)]
    outs.append(g.screen(payload(dense("fp16"), sampled_from="dense-fp16", rid="m0")))
    assert outs[:3] == [OneHotProposal((1, 2))] * 3
    assert outs[3:] == [OneHotProposal((3,))] * 3
    assert g.screen(payload(dense(), sampled_from="dense-fp32")) is None  # exact: no fallback
    expected = {"greedy": 3, "no_proposal": 2, "encoding_mismatch:dense-fp16": 1}
    assert dict(g.counts) == expected
    assert dict(metrics.fallbacks) == expected
    msgs = [r.getMessage() for r in caplog.records if r.name == "pd_middleware.decode.guard"]
    assert len(msgs) == 3, msgs  # once per reason, not once per payload
    assert "'full_distribution' falls back to one-hot for request 'g0': greedy" in msgs[0]
    assert "drafted greedily" in msgs[0]
    assert "'n0': no_proposal (the prefill sent no proposal distribution)" in msgs[1]
    assert "encoding_mismatch:dense-fp16 (this synthesizer cannot hand over" in msgs[2]


def test_attach_metrics_later():
    g = ProvenanceGuard("sparse", SPARSE)
    g.screen(payload(None))
    m = Metrics()
    g.attach_metrics(m)
    g.screen(payload(None))
    assert g.counts["no_proposal"] == 2 and m.fallbacks["no_proposal"] == 1
    assert m.snapshot()["fallbacks_by_reason"] == {"no_proposal": 1}


def test_unsafe_bypass_skips_only_provenance_checks(caplog):
    caplog.set_level(logging.WARNING, logger="pd_middleware.decode.guard")
    g = ProvenanceGuard("sparse", SPARSE, unsafe_disable_guard=True)
    assert any("DISABLED" in r.getMessage() for r in caplog.records)
    # The biased pairs the guard exists to stop now pass (negative controls use this).
    assert g.check(payload(sparse(), rule="greedy")) is None
    assert g.check(payload(sparse(), sampled_from=None)) is None
    # What the synthesizer physically cannot use still falls back.
    assert g.check(payload(None)) == "no_proposal"
    assert g.check(payload(dense(), sampled_from="dense-fp32")) == "encoding_mismatch:dense-fp32"


def test_token_outside_the_sent_law_falls_back_to_one_hot():
    """X with probability 0 under the law it claims to come from contradicts its provenance."""
    import numpy as np

    from pd_middleware import PluginContext, SparseProposal
    from pd_middleware_full.full import FullDistributionSynthesizer
    from pd_middleware_plugins.sparse import SparseSynthesizer

    ctx = PluginContext(vocab_size=V, num_steps=1, rejection_sampling=True)
    m = Metrics()
    sp = SparseSynthesizer(None, ctx)
    sp.guard.attach_metrics(m)
    # sparse() lists tokens 1 and 3 with no floor: X = 3 is fine, X = 0 cannot have been drawn.
    assert isinstance(sp.synthesize(payload(sparse(), sampled_from="sparse-fp16", tokens=(3,))), SparseProposal)
    out = sp.synthesize(payload(sparse(), sampled_from="sparse-fp16", tokens=(0,)))
    assert out == OneHotProposal((0,))
    assert sp.guard.counts["token_outside_proposal"] == 1 and m.fallbacks["token_outside_proposal"] == 1
    # With a floor every token has positive probability: no fallback.
    floored = SparseEncoding(
        lengths=(2,),
        indices=np.array([1, 3], dtype=np.int32).tobytes(),
        values=np.array([0.45, 0.45], dtype=np.float16).tobytes(),
        value_dtype="fp16",
        tail_mass=(0.1,),
    )
    q0 = float(np.float32(0.1 / 2))  # the fp32 floor: what the assembler writes at X = 0
    assert isinstance(
        sp.synthesize(payload(floored, sampled_from="sparse-fp16", tokens=(0,), probs=(q0,))), SparseProposal
    )
    # Dense: a zero entry at X.
    row = np.array([0.0, 0.5, 0.25, 0.25], dtype=np.float32).tobytes()
    full = FullDistributionSynthesizer(None, ctx)
    assert full.synthesize(
        payload(DenseEncoding("fp32", row), sampled_from="dense-fp32", tokens=(0,))
    ) == OneHotProposal((0,))
    assert full.guard.counts["token_outside_proposal"] == 1
    # The negative-control bypass also skips this check (tests must be able to see the bias).
    unsafe = SparseSynthesizer(None, ctx, unsafe_disable_guard=True)
    assert isinstance(unsafe.synthesize(payload(sparse(), sampled_from="sparse-fp16", tokens=(0,))), SparseProposal)


# ------------------------------------------------------------------ declared q(X)

DV = 64  # vocab of the declared-q(X) tests


def _encode(kind: str, dtype: str):
    """One request encoded by the real prefill encoder: (payload fields, synthesizer)."""
    import torch

    from pd_middleware import PluginContext
    from pd_middleware_full.full import FullDistributionSynthesizer, FullEncoder, FullEncoderOptions
    from pd_middleware_plugins.sparse import SparseEncoder, SparseEncoderOptions, SparseSynthesizer

    pre = PluginContext(vocab_size=DV, num_steps=1, rejection_sampling=True, side="prefill")
    dec = PluginContext(vocab_size=DV, num_steps=1, rejection_sampling=True)
    q = torch.softmax(torch.randn(1, DV, generator=torch.Generator().manual_seed(3)), dim=1)
    gen = torch.Generator().manual_seed(11)
    if kind == "dense":
        out = FullEncoder(FullEncoderOptions(dtype=dtype), pre).encode(q, generator=gen)
        synth = FullDistributionSynthesizer(None, dec)
    else:
        opts = SparseEncoderOptions(mode="topk", k=16, floor=True, value_dtype=dtype)
        out = SparseEncoder(opts, pre).encode(q, generator=gen)
        synth = SparseSynthesizer(None, dec)
    x = int(out.tokens[0, 0])
    return x, float(out.token_probs[0, 0]), float(q[0, x]), out.proposals[0], out.provenance, synth


CASES = [("dense", "fp32"), ("dense", "bf16"), ("dense", "fp16"), ("sparse", "fp16"), ("sparse", "fp32")]


@pytest.mark.parametrize("kind, dtype", CASES)
def test_declared_q_must_match_the_decoded_row(kind, dtype):
    from pd_middleware import OneHotProposal as OneHot

    x, declared, _, enc, prov, synth = _encode(kind, dtype)

    def run(q):
        pl = Payload(request_id="r", draft_tokens=(x,), draft_probs=(q,), vocab_size=DV, provenance=prov, proposal=enc)
        return synth.synthesize(pl)

    # The encoder's own q'(X) is the assembler's fp32 value at X, bit for bit.
    law = run(declared)
    assert not isinstance(law, OneHot) and law.values_at((x,)) == [declared]
    # Within the encoding's precision (one ulp of the wire dtype): still handed over.
    ulp = {"fp32": 2.0**-23, "bf16": 2.0**-8, "fp16": 2.0**-11}[dtype]
    assert not isinstance(run(declared * (1 + ulp)), OneHot)
    # Beyond it: the declared value belongs to another draw; one-hot, counted.
    for off in (declared * (1 + 8 * 2.0**-7), declared * 0.5, 0.0):
        assert run(off) == OneHot((x,)), off
    assert synth.guard.counts == {"declared_q_mismatch": 3}


@pytest.mark.parametrize("kind, dtype", [("dense", "bf16"), ("sparse", "fp16")])
def test_declared_q_before_quantisation_is_within_precision(kind, dtype):
    """A prefill may declare its fp32 q(X) before rounding the row to a 16-bit wire: the
    tolerance (two ulps of the dtype plus the decode's renormalisation) admits it."""
    x, declared, q_fp32, enc, prov, synth = _encode(kind, dtype)
    # Sparse with a floor lists q itself, so only a listed X has q'(X) close to q(X).
    pl = Payload(request_id="r", draft_tokens=(x,), draft_probs=(q_fp32,), vocab_size=DV, provenance=prov, proposal=enc)
    out = synth.synthesize(pl)
    listed = kind == "dense" or x in enc_ids(enc)
    assert (type(out).__name__ != "OneHotProposal") == listed, (declared, q_fp32)


def enc_ids(enc):
    import numpy as np

    return set(np.frombuffer(enc.indices, dtype=np.int32).tolist())


def test_values_at_is_what_the_assembler_writes():
    """values_at reads the assembled buffer's numbers exactly, for every kind of law."""
    import torch

    from pd_middleware.decode.assembler import ProposalAssembler

    for kind, dtype in CASES:
        x, declared, _, enc, prov, synth = _encode(kind, dtype)
        law = synth.synthesize(
            Payload(
                request_id="r", draft_tokens=(x,), draft_probs=(declared,), vocab_size=DV, provenance=prov, proposal=enc
            )
        )
        row = ProposalAssembler(DV, 1, max_batch=1).build([law])[0]
        assert [law.values_at((t,))[0] for t in range(DV)] == row.tolist(), (kind, dtype)
        assert torch.equal(row, law.to_dense(DV)[0]), (kind, dtype)


def test_q_above_one_at_x_falls_back():
    """SGLang's kernel rejects X unless 0 < q'(X) <= 1: a law one ulp above 1 at X is not handed over."""
    import numpy as np
    import torch

    from pd_middleware import SparseProposal

    g = ProvenanceGuard("sparse", SPARSE)
    above = float(np.nextafter(np.float32(1.0), np.float32(2.0)))
    p = payload(sparse(), sampled_from="sparse-fp16", tokens=(3,), probs=(1.0,))

    def law(v: float) -> SparseProposal:
        return SparseProposal(
            lengths=(1,),
            indices=torch.tensor([3], dtype=torch.int64),
            values=torch.tensor([v], dtype=torch.float32),
            floor=(0.0,),
        )

    assert g.check_law(p, law(above)) == "q_above_one"
    assert g.check_law(p, law(1.0)) is None  # control: exactly 1 is the kernel's accepted edge
