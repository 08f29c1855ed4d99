"""Decode-side synthesizers: one contract suite over every registered synthesizer, then
the validation errors of each malformed proposal, with their messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pd_middleware import (
    DenseEncoding,
    DenseProposal,
    OneHotProposal,
    Payload,
    PluginContext,
    Provenance,
    SparseEncoding,
    SparseProposal,
    ValidationError,
)
from pd_middleware.decode.assembler import ProposalAssembler
from pd_middleware.decode.pipeline import Failure, ReceivePipeline
from pd_middleware.registry import default_registry
from pd_middleware.sampling.encodings import dense_law_tensor, sparse_law_tensor
from pd_middleware_full import full
from pd_middleware_plugins import sparse
from pd_middleware_plugins.sampling import GreedyEncoder, SoftmaxEncoder

SEED = 20261129
V = 12


# Every installed synthesizer, found the way the core finds them: through entry points.
REG = default_registry()
SYNTHS = sorted(i.name for i in REG.plugins() if i.kind == "synthesizer")
ENCODERS = {
    "greedy": lambda c: GreedyEncoder(None, c),
    "softmax": lambda c: SoftmaxEncoder(None, c),
    "full-fp32": lambda c: full.FullEncoder(full.FullEncoderOptions(dtype="fp32"), c),
    "full-bf16": lambda c: full.FullEncoder(full.FullEncoderOptions(dtype="bf16"), c),
    "sparse-topk": lambda c: sparse.SparseEncoder(sparse.SparseEncoderOptions(mode="topk", k=4), c),
    "sparse-floor": lambda c: sparse.SparseEncoder(
        sparse.SparseEncoderOptions(mode="topp", epsilon=0.2, k_max=6, floor=True), c
    ),
}


class _Head:
    """Stand-in draft head (the engine capability ``recompute`` needs); these payloads
    carry no hidden state, so ``recompute`` answers one-hot here (tests/test_recompute.py
    covers its own path)."""

    vocab_size, hidden_size = V, 8

    def logits(self, hidden):
        return torch.zeros(hidden.shape[0], V)


def build(name, v=V, steps=1, rs=True):
    spec = REG.get("synthesizer", name)
    ctx = PluginContext(vocab_size=v, num_steps=steps, rejection_sampling=rs, capabilities={"draft_head": _Head()})
    return REG.build(spec, REG.options(spec, {}, "synthesizer.options"), ctx, "synthesizer")


def rows(b, s, v=V, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(1.5 * torch.randn(b, s, v, generator=g), dim=-1)


def payloads(encoder_name, b=4, steps=1, v=V):
    ctx = PluginContext(vocab_size=v, num_steps=steps, rejection_sampling=True, side="prefill")
    q = rows(b, steps, v)
    out = ENCODERS[encoder_name](ctx).encode(q, generator=torch.Generator().manual_seed(SEED))
    return (
        q,
        out,
        [
            Payload(
                request_id=f"r{i}",
                draft_tokens=out.tokens[i],
                draft_probs=out.token_probs[i],
                vocab_size=v,
                provenance=out.provenance,
                proposal=out.proposals[i],
            )
            for i in range(b)
        ],
    )


# ----------------------------------------------------------------------------- contract suite


@pytest.mark.parametrize("name", SYNTHS)
@pytest.mark.parametrize("steps", [1, 3])
def test_contract_no_proposal_without_rejection_sampling(name, steps):
    s = build(name, steps=steps, rs=False)
    for p in payloads("full-fp32", steps=steps)[2]:
        assert s.synthesize(p) is None


@pytest.mark.parametrize("name", SYNTHS)
def test_contract_refuses_wrong_vocab_and_step_count(name):
    p = payloads("softmax", b=1, steps=1, v=V + 1)[2][0]
    with pytest.raises(ValidationError, match=rf"payload vocab {V + 1} != target vocab {V}") as e:
        build(name).synthesize(p)
    assert (e.value.field, e.value.request_id) == ("vocab_size", "r0")
    p = payloads("softmax", b=1, steps=2)[2][0]
    with pytest.raises(ValidationError, match=r"2 draft tokens, deployment drafts 3 steps") as e:
        build(name, steps=3).synthesize(p)
    assert e.value.field == "draft_tokens"


@pytest.mark.parametrize("name", SYNTHS)
@pytest.mark.parametrize("encoder", sorted(ENCODERS))
@pytest.mark.parametrize("steps", [1, 3])
def test_contract_hands_over_the_law_x_was_drawn_from_or_one_hot(name, encoder, steps):
    """The exactness contract for every (encoder, synthesizer) pair: q' is either the
    exact law X was drawn from (bit for bit) or the one-hot row at X."""
    _q, _out, ps = payloads(encoder, steps=steps)
    synth = build(name, steps=steps)
    props = [synth.synthesize(p) for p in ps]
    built = ProposalAssembler(V, steps, max_batch=8).build(props).clone().view(len(ps), steps, V)
    for i, (p, prop) in enumerate(zip(ps, props)):
        if isinstance(prop, OneHotProposal):
            assert prop.tokens == p.draft_tokens
            continue
        enc = p.proposal
        law = dense_law_tensor(enc, steps, V) if enc.kind == "dense" else sparse_law_tensor(enc, steps, V)
        assert p.provenance.sampled_from == enc.encoding_id
        assert torch.equal(built[i], law), f"{name} handed over a different vector than {encoder} drew from"
    exact_pair = (name, encoder.split("-")[0]) in {("full_distribution", "full"), ("sparse", "sparse")}
    assert all(isinstance(x, OneHotProposal) for x in props) == (not exact_pair)


@pytest.mark.parametrize("name", SYNTHS)
def test_contract_greedy_payloads_get_one_hot_even_with_a_distribution_attached(name):
    for enc_name in ("full-fp32", "sparse-topk"):
        _, _out, ps = payloads(enc_name)
        for p in ps:
            forged = Payload(
                request_id=p.request_id,
                draft_tokens=p.draft_tokens,
                draft_probs=p.draft_probs,
                vocab_size=V,
                provenance=Provenance(rule="greedy", temperature=0.0),
                proposal=p.proposal,
            )
            assert build(name).synthesize(forged) == OneHotProposal(p.draft_tokens)


# ----------------------------------------------------------------------------- fallback counting


def test_fallbacks_are_counted_into_the_pipeline_metrics():
    from pd_middleware.core.metrics import Metrics

    m = Metrics()
    s = build("sparse")
    s.guard.attach_metrics(m)
    pipe = ReceivePipeline([], {"default": ("sparse", s)}, m)
    for enc in ("softmax", "greedy", "full-bf16", "sparse-topk"):
        for p in payloads(enc, b=2)[2]:
            pipe.process(p)
    assert dict(m.fallbacks) == {"no_proposal": 2, "greedy": 2, "encoding_mismatch:dense-bf16": 2}
    assert m.delivered == 8 and m.failed_total == 0


# ----------------------------------------------------------------------------- validation errors


def _payload(proposal, rid="bad", sampled_from=None, steps=1, probs=None):
    sf = sampled_from if sampled_from is not None else proposal.encoding_id
    return Payload(
        request_id=rid,
        draft_tokens=(0,) * steps,
        draft_probs=(0.5,) * steps if probs is None else probs,
        vocab_size=V,
        provenance=Provenance(rule="sampled", sampled_from=sf),
        proposal=proposal,
    )


def _dense(values, dtype="fp32"):
    t = torch.tensor(values, dtype=torch.float32)
    if dtype == "bf16":
        return DenseEncoding(dtype="bf16", data=t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return DenseEncoding(
        dtype=dtype, data=t.to({"fp32": torch.float32, "fp16": torch.float16}[dtype]).numpy().tobytes()
    )


def _sparse(idx, vals, lengths=None, dtype="fp16", tail=()):
    return SparseEncoding(
        lengths=tuple(lengths) if lengths is not None else (len(idx),),
        indices=np.asarray(idx, dtype=np.int32).tobytes(),
        values=np.asarray(vals, dtype=np.float16 if dtype == "fp16" else np.float32).tobytes(),
        value_dtype=dtype,
        tail_mass=tuple(tail),
    )


U = [1 / V] * V

DENSE_BAD = [
    (
        _dense(U[:-1]),
        "proposal.data",
        f"holds {4 * (V - 1)} bytes, expected {4 * V} (1 x {V} fp32); width {V - 1} != vocab {V}",
    ),
    (_dense([*U, 0.0]), "proposal.data", f"width {V + 1} != vocab {V}"),
    (_dense([float("nan"), *U[1:]]), "proposal.data", "contains NaN or inf"),
    (_dense([float("inf"), *U[1:]], "bf16"), "proposal.data", "contains NaN or inf"),
    (_dense([-0.25, 0.25 + 1 / V, *U[2:]]), "proposal.data", "contains negative values"),
    (_dense([2 / V] * V), "proposal.data", "step 0 sums to 2, not 1 within 0.001"),
    (_dense([0.9 / V] * V, "fp16"), "proposal.data", "step 0 sums to 0.9"),
]

SPARSE_BAD = [
    (_sparse([1, 1], [0.5, 0.5]), "proposal.indices", "repeats an index within a step"),
    (_sparse([1, V], [0.5, 0.5]), "proposal.indices", f"index {V} is outside [0, {V})"),
    (_sparse([-1, 2], [0.5, 0.5]), "proposal.indices", f"index -1 is outside [0, {V})"),
    (_sparse([1, 2], [float("nan"), 1.0]), "proposal.values", "contains NaN or inf"),
    (_sparse([1, 2], [-0.5, 1.5], dtype="fp32"), "proposal.values", "contains negative values"),
    (
        _sparse([1, 2], [0.5, 0.6], dtype="fp32"),
        "proposal.values",
        "step 0: listed mass 1.1 + tail 0 is not 1 within 0.001",
    ),
    (
        _sparse([1, 2], [0.2, 0.2], tail=(0.3,)),
        "proposal.values",
        "listed mass 0.399902 + tail 0.3 is not 1 within 0.01",
    ),
    (_sparse([1, 2], [0.0, 0.0], tail=(0.99,)), "proposal.values", "step 0 has no probability mass"),
    (_sparse([1, 2], [0.5, 0.5], lengths=(1, 1)), "proposal.lengths", "has 2 steps, expected 1"),
    (_sparse([], [], lengths=(0,)), "proposal.lengths", f"entry count 0 is not an int in [1, {V}]"),
    (_sparse([1, 2], [0.5, 0.5], lengths=(3,)), "proposal.indices", "holds 8 bytes, expected 3 int32 indices"),
    (
        SparseEncoding(lengths=(2,), indices=np.array([1, 2], np.int32).tobytes(), values=b"\0" * 2),
        "proposal.values",
        "holds 2 bytes, expected 2 fp16 values",
    ),
    (_sparse([1, 2], [0.5, 0.5], tail=(0.1, 0.1)), "proposal.tail_mass", "has 2 entries, expected 1"),
    (_sparse([1, 2], [0.5, 0.5], tail=(1.0,)), "proposal.tail_mass", "step 0: 1.0 is not a probability in [0, 1)"),
    (
        _sparse(list(range(V)), U, tail=(0.1,)),
        "proposal.tail_mass",
        "step 0 lists the whole vocab but spreads 0.1 over no token",
    ),
]


@pytest.mark.parametrize("enc, field, message", DENSE_BAD)
def test_full_distribution_validation_errors(enc, field, message):
    with pytest.raises(ValidationError) as e:
        build("full_distribution").synthesize(_payload(enc))
    assert (e.value.field, e.value.request_id) == (field, "bad")
    assert message in str(e.value)


@pytest.mark.parametrize("enc, field, message", SPARSE_BAD)
def test_sparse_validation_errors(enc, field, message):
    with pytest.raises(ValidationError) as e:
        build("sparse").synthesize(_payload(enc))
    assert (e.value.field, e.value.request_id) == (field, "bad")
    assert message in str(e.value)


def test_malformed_proposal_fails_only_its_request():
    synth = build("sparse")
    pipe = ReceivePipeline([], {"default": ("sparse", synth)})
    good = payloads("sparse-topk", b=2)[2]
    outs = [pipe.process(good[0]), pipe.process(_payload(SPARSE_BAD[0][0])), pipe.process(good[1])]
    assert [type(o).__name__ for o in outs] == ["Delivery", "Failure", "Delivery"]
    f = outs[1]
    assert isinstance(f, Failure) and f.stage == "synthesizer:sparse" and f.field == "proposal.indices"
    assert "repeats an index within a step" in f.reason
    assert pipe.metrics.failed == {"synthesizer:sparse:proposal.indices": 1}


def test_valid_proposals_come_back_as_laws():
    d = build("full_distribution").synthesize(_payload(_dense([0.5, 0.25, 0.25] + [0.0] * (V - 3), "bf16")))
    assert isinstance(d, DenseProposal) and d.to_dense(V)[0, :3].tolist() == [0.5, 0.25, 0.25]
    floor32 = float(np.float32(0.5 / (V - 2)))  # the law's floor is the fp32 number the assembler writes
    s = build("sparse").synthesize(_payload(_sparse([7, 2], [0.25, 0.25], tail=(0.5,)), probs=(floor32,)))
    assert isinstance(s, SparseProposal) and s.floor == (floor32,)
    assert s.indices.tolist() == [7, 2] and s.values.tolist() == [0.25, 0.25]
