"""The one-hot synthesizer: the five behaviours of the upstream fix, against our API.

1. a one-hot FP32 proposal at each request's drafted token;
2. width equal to the target vocab;
3. no proposal without rejection sampling, single-layer and multi-layer;
4. multi-layer gets the (B, num_steps, vocab) one-hot chain;
5. exactness by exact enumeration with fractions.Fraction.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch

from pd_middleware import Payload, Provenance
from pd_middleware.config import parse_config
from pd_middleware.decode.pipeline import Delivery, Failure
from pd_middleware.evaluation.verify import exact_verify_law
from pd_middleware.middleware import DecodeMiddleware

SEED = 20261129


def middleware(vocab=50, steps=1, rs=True, max_batch=8):
    cfg = parse_config(
        {
            "model": {"vocab_size": vocab, "num_steps": steps, "hidden_size": 4},
            "decode": {"rejection_sampling": rs, "max_batch": max_batch},
            "synthesizer": {"name": "one_hot"},
        }
    )
    return DecodeMiddleware.from_config(cfg)


def payload(rid, tokens, vocab=50, rule="sampled"):
    return Payload(
        request_id=rid,
        draft_tokens=tuple(tokens),
        draft_probs=tuple(0.5 for _ in tokens),
        vocab_size=vocab,
        provenance=Provenance(rule=rule, temperature=0.0 if rule == "greedy" else 1.0),
    )


def test_one_hot_fp32_at_drafted_tokens_with_vocab_width():
    mw = middleware()
    toks = [3, 49, 0, 17]
    ds = [mw.receive(payload(f"r{i}", [t])) for i, t in enumerate(toks)]
    assert all(isinstance(d, Delivery) for d in ds)
    probs = mw.assemble(ds)
    assert probs.dtype == torch.float32  # (1)
    assert probs.shape == (4, 50)  # (2) width equals the target vocab
    assert probs.argmax(-1).tolist() == toks  # (1) at each drafted token
    assert probs.sum(-1).tolist() == [1.0] * 4
    assert int((probs != 0).sum()) == 4


@pytest.mark.parametrize("steps", [1, 3])
def test_no_proposal_without_rejection_sampling(steps):
    mw = middleware(steps=steps, rs=False)
    ds = [mw.receive(payload(f"r{i}", list(range(i, i + steps)))) for i in range(3)]
    assert all(isinstance(d, Delivery) and d.proposal is None for d in ds)  # (3)
    assert mw.assemble(ds) is None


def test_multi_layer_chain():
    mw = middleware(steps=3)
    chains = [[1, 2, 3], [49, 48, 47], [7, 7, 7]]
    ds = [mw.receive(payload(f"r{i}", c)) for i, c in enumerate(chains)]
    probs = mw.assemble(ds)
    assert probs.shape == (3, 3, 50) and probs.dtype == torch.float32  # (4)
    assert probs.argmax(-1).tolist() == chains
    assert probs.sum(-1).eq(1.0).all()


def test_mismatched_payloads_fail_only_themselves():
    mw = middleware(steps=1)
    good = mw.receive(payload("ok", [1]))
    wrong_vocab = mw.receive(payload("v", [1], vocab=51))
    wrong_steps = mw.receive(payload("s", [1, 2]))
    assert isinstance(good, Delivery)
    assert isinstance(wrong_vocab, Failure) and wrong_vocab.field == "vocab_size"
    assert "payload vocab 51 != target vocab 50" in wrong_vocab.reason
    assert isinstance(wrong_steps, Failure) and wrong_steps.field == "draft_tokens"
    snap = mw.metrics.snapshot()
    assert snap["received"] == 3 and snap["delivered"] == 1 and snap["failed"] == 2


def _random_law(rng: random.Random, v: int) -> list[Fraction]:
    w = [rng.randint(0, 6) for _ in range(v)]
    if sum(w) == 0:
        w[rng.randrange(v)] = 1
    return [Fraction(x, sum(w)) for x in w]


def _one_hot_committed_law(mw, p, draft_law, vocab):
    """Sum over X of P(X = x) * law(committed | X = x, q' = what the synthesizer built)."""
    out = [Fraction(0)] * vocab
    for x, sx in enumerate(draft_law):
        if sx == 0:
            continue
        d = mw.receive(payload(f"x{x}", [x], vocab=vocab))
        q_row = mw.assemble([d])[0].tolist()  # exactly what the verifier would read
        delta = [Fraction(int(i == x)) for i in range(vocab)]
        law = exact_verify_law(p, q_row, delta)
        out = [o + sx * w for o, w in zip(out, law)]
    return out


@pytest.mark.parametrize("vocab", [2, 5, 8])
def test_exactness_by_enumeration(vocab):
    """(5) For random p and three drafting laws the committed law equals p exactly."""
    rng = random.Random(SEED + vocab)
    mw = middleware(vocab=vocab)
    for trial in range(10):
        p = _random_law(rng, vocab)
        q = _random_law(rng, vocab)
        argmax = max(range(vocab), key=lambda i: q[i])
        adversarial = min(range(vocab), key=lambda i: p[i])  # the token p likes least
        laws = {
            "sampled from q": q,
            "greedy argmax q": [Fraction(int(i == argmax)) for i in range(vocab)],
            "fixed adversarial": [Fraction(int(i == adversarial)) for i in range(vocab)],
        }
        for name, s in laws.items():
            got = _one_hot_committed_law(mw, p, s, vocab)
            assert got == p, f"seed={SEED + vocab} trial={trial} drafting={name}: {got} != {p}"


def test_negative_control_greedy_with_softmax_q_is_biased():
    """Greedy X verified against the softmax q it was not drawn from must be biased."""
    p = [Fraction(1, 2), Fraction(1, 4), Fraction(1, 4)]
    q = [Fraction(1, 2), Fraction(3, 8), Fraction(1, 8)]
    greedy = [Fraction(1), Fraction(0), Fraction(0)]
    law = exact_verify_law(p, q, greedy)
    assert law != p
    # X = 0 is always accepted (q(0) = p(0)) so the output collapses onto the argmax.
    assert law[0] == 1
