"""The ``recompute`` synthesizer: exact enumeration, the negative control, the guard,
the sampler's law, the temperature (q' = softmax(logits / T) up to fp32, X' drawn from
it) and the capability check.

A stand-in head stands for the engine's draft head (the real SGLang head is tested in
``tests/test_sglang_recompute.py``): a fixed fp32 matrix over a tiny vocabulary.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from pd_middleware import ConfigError, OneHotProposal, Payload, PluginContext, Provenance
from pd_middleware.core._errors import ExactnessError, ValidationError
from pd_middleware.core.metrics import Metrics
from pd_middleware.core.proposal import RecomputedProposal
from pd_middleware.decode import recompute as R
from pd_middleware.decode.assembler import ProposalAssembler
from pd_middleware.decode.recompute import (
    SEEDED_DRAW,
    SYNTHESIZER,
    Recomputed,
    RecomputeSynthesizer,
    draw_proposal,
    inverse_cdf,
    proposal_probs,
    seed_from_room,
)
from pd_middleware.evaluation.verify import exact_verify_law, tv_bound, tv_distance
from pd_middleware.registry import default_registry

SEED = 20261201
V, H = 6, 4
P = [Fraction(n, 32) for n in (9, 7, 6, 5, 3, 2)]  # the target law, exact


class MatrixHead:
    """Stand-in draft head: logits = h @ W.T in fp32 (V x H), on CPU."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.float()
        self.vocab_size, self.hidden_size = (int(n) for n in weight.shape)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float() @ self.weight.T


def _weight(seed: int = SEED) -> torch.Tensor:
    return torch.randn(V, H, generator=torch.Generator().manual_seed(seed))


HIDDEN = torch.randn(1, H, generator=torch.Generator().manual_seed(SEED + 1)).to(torch.bfloat16)


def ctx(head=None, *, steps=1, rs=True, v=V):
    caps = {} if head is None else {"draft_head": head}
    return PluginContext(vocab_size=v, num_steps=steps, rejection_sampling=rs, capabilities=caps)


def fr(t: torch.Tensor) -> list[Fraction]:
    return [Fraction(float(x)) for x in t.double().tolist()]


def payload(rid="7", hidden=HIDDEN, tokens=(0,), rule="sampled", steps=1, temperature=1.0) -> Payload:
    raw = hidden.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if hidden is not None else b""
    return Payload(
        request_id=rid,
        draft_tokens=tokens * steps if len(tokens) == 1 else tokens,
        draft_probs=(0.5,) * steps,
        vocab_size=V,
        hidden=raw,
        hidden_dtype="bf16",
        provenance=Provenance(rule=rule, temperature=temperature),
    )


def assembled_row(prop) -> torch.Tensor:
    """The fp32 row the verifier reads, through the real assembler."""
    return ProposalAssembler(V, 1, max_batch=1).build([prop])[0].clone()


# ----------------------------------------------------------------------------- exact enumeration


def test_committed_law_is_p_for_the_recompute_path():
    """X' ~ q' (the law the sampler draws from: q' up to its fp32 normalisation), q'
    handed over: the committed law is p exactly with q' normalised exactly, and within
    the fp32-normalisation bound with the raw fp32 row the assembler writes."""
    head = MatrixHead(_weight())
    synth = RecomputeSynthesizer(None, ctx(head))
    prop = synth.synthesize(payload())
    assert isinstance(prop, RecomputedProposal) and not synth.counts
    row = assembled_row(prop)
    q = fr(row)
    c = sum(q)
    s = [v / c for v in q]  # what the exponential race draws from: proportional to q'
    law = exact_verify_law(P, [v / c for v in q], s)
    assert law == P
    raw = exact_verify_law(P, q, s)
    assert sum(abs(a - b) for a, b in zip(raw, P)) <= 2 * abs(1 / c - 1) + Fraction(1, 10**12)
    # q' is the head's softmax, the prefill's semantics.
    ref = proposal_probs(head.logits(HIDDEN.float()), torch.ones(1))[0]
    assert torch.equal(row, ref)


def test_negative_control_prefill_x_with_a_perturbed_head_is_biased():
    """Keep the prefill's X ~ q and hand the verifier q' from a perturbed head (another
    precision): biased, far beyond the fp32 bound. Redrawing X' from that same q' (the
    recompute path) is exact again."""
    w = _weight()
    q_prefill = proposal_probs(MatrixHead(w).logits(HIDDEN.float()), torch.ones(1))[0].double()
    s = [v / sum(fr(q_prefill)) for v in fr(q_prefill)]
    perturbed = MatrixHead(w.to(torch.bfloat16).float() + 0.05 * _weight(SEED + 7))
    q_dec = fr(proposal_probs(perturbed.logits(HIDDEN.float()), torch.ones(1))[0])
    c = sum(q_dec)
    q_dec = [v / c for v in q_dec]
    biased = exact_verify_law(P, q_dec, s)
    gap = sum(abs(a - b) for a, b in zip(biased, P))
    assert gap > Fraction(1, 1000), float(gap)
    assert exact_verify_law(P, q_dec, q_dec) == P


# ----------------------------------------------------------------------------- the guard


def test_guard_no_recomputed_without_its_draw():
    probs = torch.full((1, V), 1.0 / V)
    with pytest.raises(ExactnessError, match="only by draw_proposal"):
        Recomputed(object(), probs, torch.zeros(1, dtype=torch.int64), probs[:, 0], torch.ones(1, dtype=torch.bool))
    with pytest.raises(ExactnessError, match="X' was not drawn from q'"):
        RecomputedProposal(torch.tensor([[0.0, 1.0, 0, 0, 0, 0]]), torch.ones(1), tokens=(0,))


def test_guard_token_probs_are_read_back_from_the_kept_q():
    """A sampler that lies (returns another token's probability, or a token outside q')
    cannot make a pair that disagrees with q': q'(X') is re-gathered from q', and a
    token with q'(X') = 0 is an invalid row, never handed over."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0]])

    def liar(p, seeds, positions):
        return torch.full((2, 1), 0.9), torch.tensor([[3], [1]])

    r = draw_proposal(
        probs, seeds=torch.zeros(2, dtype=torch.int64), positions=torch.zeros(2, dtype=torch.int64), draw=liar
    )
    assert r.tokens.tolist() == [3, 1]
    assert r.token_probs.tolist() == [0.0, 0.25]
    assert r.valid.tolist() == [False, True]
    # Greedy rows propose their argmax, read from the same q'.
    g = draw_proposal(
        probs,
        seeds=torch.zeros(2, dtype=torch.int64),
        positions=torch.zeros(2, dtype=torch.int64),
        greedy=torch.tensor([True, False]),
        draw=liar,
    )
    assert g.tokens.tolist() == [0, 1] and g.token_probs.tolist() == [0.5, 0.25]


def test_guard_every_handed_over_pair_comes_from_one_draw():
    """Over many requests and heads: X' is in q''s support, the proposal row is the q'
    it was drawn from, and the X the verifier gets is X', not the prefill's."""
    synth = RecomputeSynthesizer(None, ctx(MatrixHead(_weight())))
    seen = set()
    for i in range(200):
        prop = synth.synthesize(payload(rid=str(1000 + i), tokens=(5,)))
        assert isinstance(prop, RecomputedProposal)
        (x,) = prop.tokens
        row = assembled_row(prop)
        assert 0 < float(row[x]) <= 1
        assert prop.values_at(prop.tokens) == [float(row[x])]
        seen.add(x)
    assert len(seen) > 2  # redrawn, not the prefill's X = 5 every time


# ----------------------------------------------------------------------------- the sampler


def test_seeded_draws_follow_q_tv_bound():
    draw = inverse_cdf
    """N seeded draws (one per room) against q': TV <= 1/2 sqrt((V-1)/N) + sqrt(ln(1/a)/2N), a = 1e-6."""
    q = proposal_probs(MatrixHead(_weight()).logits(HIDDEN.float()), torch.ones(1))
    n = 20000
    probs = q.expand(n, V).contiguous()
    _, x = draw(probs, seed_from_room(range(n)), torch.full((n,), 17, dtype=torch.int64))
    freq = torch.bincount(x.view(-1), minlength=V).double() / n
    assert tv_distance(freq, q[0].double()) <= tv_bound(V, n, 1e-6)


def test_draw_is_deterministic_per_seed_and_position():
    draw = inverse_cdf
    """Two ranks with the same batch draw the same X' (seed from the room when SGLang has none)."""
    probs = torch.full((4, V), 1.0 / V)
    seeds = seed_from_room([11, 12, 13, 14])
    pos = torch.tensor([5, 5, 6, 6])
    a = draw(probs, seeds, pos)[1]
    b = draw(probs.clone(), seeds.clone(), pos.clone())[1]
    assert torch.equal(a, b)
    assert seed_from_room([11]).tolist() == seed_from_room([11]).tolist()
    assert int(seed_from_room([2**64 - 1])[0]) >= 0


# ----------------------------------------------------------------------------- temperature

TEMPERATURES = (0.5, 2.0)
EPS32 = torch.finfo(torch.float32).eps


def fp32_tolerance(logits64: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Relative error an fp32 softmax(logits / T) may carry against float64, per row: the
    fp32 logits (a few ulps of their size) amplified by exp through max|logit| / T, 8 ulps
    per unit, plus V ulps for the normaliser. Far below any change of T (checked)."""
    return EPS32 * (8 * (1 + logits64.abs().amax(dim=1, keepdim=True) / t.view(-1, 1)) + V)


def fits(probs: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> torch.Tensor:
    """bool (B,): every entry of the row within ``tol`` relative of ``want``."""
    return ((probs.double() - want).abs() <= tol * want).all(dim=1)


@pytest.mark.parametrize("t", TEMPERATURES)
def test_q_prime_is_softmax_of_logits_over_t_up_to_fp32(t):
    """The core synthesizer's q' at T != 1, rows of T and of T = 1 mixed in one batch (each
    row its own T), against float64 softmax(logits / T) from float64 logits; and the
    payload path (the A/B job) at provenance temperature T. Negative control: the T = 1
    law fails the same check on every row drawn at T."""
    head = MatrixHead(_weight())
    synth = RecomputeSynthesizer(None, ctx(head))
    hidden = torch.randn(64, H, generator=torch.Generator().manual_seed(SEED + 3))
    temps = torch.tensor([t, 1.0] * 32)
    rec = synth.recompute(
        hidden,
        temperatures=temps.view(-1, 1),
        seeds=seed_from_room(range(64)),
        positions=torch.zeros(64, dtype=torch.int64),
    )
    logits64 = hidden.double() @ head.weight.double().T
    t64 = temps.double()
    tol = fp32_tolerance(logits64, t64)
    assert bool(fits(rec.probs, torch.softmax(logits64 / t64.view(-1, 1), dim=1), tol).all()), f"T={t}"
    at_t = temps == t
    assert not bool(fits(rec.probs, torch.softmax(logits64, dim=1), tol)[at_t].any()), "control: the T=1 law"
    # X' and q'(X') are read from that q'.
    assert torch.equal(rec.token_probs, rec.probs.gather(1, rec.tokens.view(-1, 1)).view(-1))

    prop = synth.synthesize(payload(temperature=t))
    assert isinstance(prop, RecomputedProposal)
    row = assembled_row(prop).view(1, V)
    one64 = HIDDEN.double() @ head.weight.double().T
    tol1 = fp32_tolerance(one64, torch.tensor([t], dtype=torch.float64))
    assert bool(fits(row, torch.softmax(one64 / t, dim=1), tol1).all())
    assert not bool(fits(row, torch.softmax(one64, dim=1), tol1).any())


@pytest.mark.parametrize("t", TEMPERATURES)
def test_x_prime_follows_softmax_over_t_tv_bound(t):
    """20,000 seeded draws (one per room) at temperature T against float64 softmax(logits / T):
    TV <= 1/2 sqrt((V-1)/N) + sqrt(ln(1/a)/2N), false-positive bound a = 1e-6. Negative
    control: the same draws against the T = 1 law exceed the bound."""
    head = MatrixHead(_weight())
    synth = RecomputeSynthesizer(None, ctx(head))
    n = 20_000
    rec = synth.recompute(
        HIDDEN.float().expand(n, H).contiguous(),
        temperatures=torch.full((n, 1), t),
        seeds=seed_from_room(range(n)),
        positions=torch.full((n,), 17, dtype=torch.int64),
    )
    assert bool(rec.valid.all())
    freq = torch.bincount(rec.tokens, minlength=V).double() / n
    logits64 = (HIDDEN.double() @ head.weight.double().T)[0]
    bound = tv_bound(V, n, 1e-6)
    assert tv_distance(freq, torch.softmax(logits64 / t, dim=0)) <= bound, f"seed {SEED}, T={t}"
    assert tv_distance(freq, torch.softmax(logits64, dim=0)) > bound, "control: the T=1 law must fail"


def test_x_prime_drawn_at_t_is_exact_only_with_the_q_prime_of_t_exact_enumeration():
    """With Fractions: X' ~ q'_T handed with q'_T commits p exactly; handed with the T = 1 law
    instead (a synthesizer that ignored T when building q', but drew at T) it is biased."""
    head = MatrixHead(_weight())
    logits = head.logits(HIDDEN.float())

    def law(t):
        q = fr(proposal_probs(logits, torch.tensor([t]))[0])
        return [v / sum(q) for v in q]

    for t in TEMPERATURES:
        assert exact_verify_law(P, law(t), law(t)) == P
        biased = exact_verify_law(P, law(1.0), law(t))
        assert sum(abs(a - b) for a, b in zip(biased, P)) > Fraction(1, 1000), t


# ----------------------------------------------------------------------------- fallbacks and refusal


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (RecomputeSynthesizer(None, ctx(MatrixHead(_weight()))), payload(hidden=None)), "no_hidden"),
        (lambda: (RecomputeSynthesizer(None, ctx(object())), payload()), "unknown_head"),
        (lambda: (RecomputeSynthesizer(None, ctx(MatrixHead(torch.randn(V, H + 2)))), payload()), "shape"),
        (
            lambda: (RecomputeSynthesizer(None, ctx(MatrixHead(_weight()), steps=2)), payload(tokens=(1, 2), steps=2)),
            "multi_layer",
        ),
    ],
)
def test_fallbacks_are_one_hot_at_x_and_counted(make, reason):
    synth, p = make()
    m = Metrics()
    synth.guard.attach_metrics(m)
    out = synth.synthesize(p)
    assert out == OneHotProposal(p.draft_tokens)
    assert synth.counts == {reason: 1}
    assert m.fallbacks[f"recompute:{reason}"] == 1


def test_rejection_sampling_off_attaches_nothing_and_counts():
    synth = RecomputeSynthesizer(None, ctx(MatrixHead(_weight()), rs=False))
    assert synth.synthesize(payload()) is None
    assert synth.counts == {"rejection_off": 1}


def test_refused_at_startup_without_the_engine_capability():
    reg = default_registry()
    spec = reg.get("synthesizer", "recompute")
    assert spec is SYNTHESIZER or spec.needs == ("draft_head",)
    with pytest.raises(ConfigError, match=r"at arms\[2\]\.synthesizer: .*needs the engine capability 'draft_head'"):
        reg.build(spec, None, ctx(None), "arms[2].synthesizer")
    assert isinstance(reg.build(spec, None, ctx(MatrixHead(_weight())), "synthesizer"), RecomputeSynthesizer)


def test_the_engines_seeded_draw_is_the_synthesizers_draw():
    """An engine that offers its own seeded sampler (SEEDED_DRAW: SGLang's fast_sample) gets
    it used for X'; without one the synthesizer draws with inverse_cdf. Negative control:
    the draw records its calls, so a synthesizer that ignored the offer would leave it empty."""
    calls = []

    def engine_draw(probs, seeds, positions):
        calls.append(seeds.tolist())
        x = probs.argmin(dim=1, keepdim=True)  # a recognisable choice: the least likely token
        return probs.gather(1, x), x

    c = ctx(MatrixHead(_weight()))
    c = PluginContext(
        vocab_size=c.vocab_size,
        num_steps=c.num_steps,
        rejection_sampling=c.rejection_sampling,
        capabilities={**c.capabilities, SEEDED_DRAW: engine_draw},
    )
    synth = RecomputeSynthesizer(None, c)
    out = synth.recompute(
        HIDDEN.float().view(1, -1),
        temperatures=torch.ones(1),
        seeds=seed_from_room([5]),
        positions=torch.zeros(1, dtype=torch.int64),
    )
    assert calls == [seed_from_room([5]).tolist()]
    assert int(out.tokens[0]) == int(out.probs.argmin())
    assert RecomputeSynthesizer(None, ctx(MatrixHead(_weight()))).draw is inverse_cdf


def test_inverse_cdf_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]]).expand(4000, V).contiguous()
    _, x = inverse_cdf(probs, seed_from_room(range(4000)), torch.zeros(4000, dtype=torch.int64))
    assert set(x.view(-1).tolist()) == {1, 3}


# ----------------------------------------------------------------------------- chunks and memory

VC, HC = 257, 8  # a wider vocabulary than the enumeration's, so a chunk's rows are not one vector


class CountingHead(MatrixHead):
    """A MatrixHead computed one row at a time (a BLAS matmul's rounding may depend on how
    many rows it multiplies: a row's logits here do not), that records the rows of every
    call, raises on the calls in ``fail_on`` and cuts call k's width to ``width[k]``."""

    def __init__(self, weight: torch.Tensor, fail_on: tuple[int, ...] = (), width: dict[int, int] | None = None):
        super().__init__(weight)
        self.calls: list[int] = []
        self.fail_on, self.width = fail_on, width or {}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        k = len(self.calls)
        self.calls.append(int(hidden.shape[0]))
        if k in self.fail_on:
            raise RuntimeError(f"injected: head call {k} fails")
        out = self.rows(hidden)
        return out[:, : self.width[k]] if k in self.width else out

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([super(CountingHead, self).logits(hidden[i : i + 1]) for i in range(hidden.shape[0])])


def _chunk_case(b: int, seed: int = SEED + 11):
    g = torch.Generator().manual_seed(seed)
    head = CountingHead(torch.randn(VC, HC, generator=g))
    hidden = torch.randn(b, HC, generator=g)
    temps = torch.tensor([0.5, 1.0, 2.0])[torch.arange(b) % 3]
    return head, hidden, temps, seed_from_room(range(b)), torch.arange(b, dtype=torch.int64) + 3


@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_chunked_recompute_is_the_one_shot_law_bit_for_bit(rows, monkeypatch):
    """37 rows (a ragged last chunk), each its own T, every fourth greedy, in chunks of
    ``rows``: q', X', q'(X') and valid equal the one-shot computation (the same logits,
    one softmax and one draw over the whole batch) bit for bit, with one head call a
    chunk. Negative control: the draw with its seeds one row off (what a misaligned chunk
    would hand it) differs."""
    monkeypatch.setattr(R, "CHUNK_ROWS", rows)
    b = 37
    head, hidden, temps, seeds, pos = _chunk_case(b)
    greedy = torch.arange(b) % 4 == 0
    rec = RecomputeSynthesizer(None, ctx(head, v=VC)).recompute(
        hidden, temperatures=temps, seeds=seeds, positions=pos, greedy=greedy
    )
    assert head.calls == [min(rows, b - a) for a in range(0, b, rows)], f"seed {SEED + 11}"
    q = proposal_probs(head.rows(hidden), temps)
    x = torch.where(greedy, q.argmax(dim=1), inverse_cdf(q, seeds, pos)[1].view(-1))
    assert torch.equal(rec.probs, q) and torch.equal(rec.tokens, x)
    assert torch.equal(rec.token_probs, q.gather(1, x.view(-1, 1)).view(-1)) and bool(rec.valid.all())
    off = inverse_cdf(q, seeds.roll(1), pos)[1].view(-1)
    assert not torch.equal(torch.where(greedy, x, off), x), "control: the seeds must matter"


@pytest.mark.parametrize(
    ("fail_on", "width", "message"),
    [
        ((1,), {}, "injected: head call 1 fails"),
        ((1, 3), {}, "injected: head call 1 fails"),
        ((), {2: VC - 1}, r"field 'logits': the draft head's logits for rows 6:9 are \(3, 256\), q' is \(10, 257\)"),
    ],
)
def test_a_failing_chunk_still_runs_every_chunks_head_call_then_raises(fail_on, width, message, monkeypatch):
    """A head with a collective (SGLang's gather under TP > 1) must be entered by every rank
    the same number of times: a chunk that fails on this rank (its head call, or a width
    its q' cannot take) is remembered, every later chunk's head call still runs, and the
    first failure is raised after the last. Negative control: the same batch on a head that
    does not fail makes the same calls and raises nothing."""
    monkeypatch.setattr(R, "CHUNK_ROWS", 3)
    head, hidden, temps, seeds, pos = _chunk_case(10)
    head.fail_on, head.width = fail_on, width
    synth = RecomputeSynthesizer(None, ctx(head, v=VC))
    with pytest.raises((RuntimeError, ValidationError), match=message):
        synth.recompute(hidden, temperatures=temps, seeds=seeds, positions=pos)
    assert head.calls == [3, 3, 3, 1]
    head.calls, head.fail_on, head.width = [], (), {}
    synth.recompute(hidden, temperatures=temps, seeds=seeds, positions=pos)
    assert head.calls == [3, 3, 3, 1]


def test_the_recompute_holds_q_prime_and_one_chunk_never_the_batchs_temporaries(monkeypatch):
    """The extra peak memory of a batch's recompute (torch's CPU allocator records,
    tests/_alloc_peak.py) is q' (B x V fp32) and one chunk's temporaries (the head's logits
    and logits / T, or the draw's float64 running sum: two fp32 chunks; bounded here by
    three), whatever B is. Controls: the measure sees q' itself (the peak is at least B x V x 4), and the
    one-shot computation (the landed code: logits, logits / T and q' of the whole batch)
    exceeds the bound."""
    from _alloc_peak import allocation_peak

    monkeypatch.setattr(R, "CHUNK_ROWS", 8)
    b, v = 64, 4096
    g = torch.Generator().manual_seed(SEED + 13)
    head = MatrixHead(torch.randn(v, HC, generator=g))
    hidden, temps = torch.randn(b, HC, generator=g), torch.full((b,), 0.7)
    seeds, pos = seed_from_room(range(b)), torch.zeros(b, dtype=torch.int64)
    synth = RecomputeSynthesizer(None, ctx(head, v=v))
    bound = b * v * 4 + 3 * (8 * v * 4) + 65536  # q', three chunks, the (B,)-sized rest
    peak, _ = allocation_peak(lambda: synth.recompute(hidden, temperatures=temps, seeds=seeds, positions=pos))
    assert b * v * 4 <= peak <= bound, (peak, bound)
    one_shot, _ = allocation_peak(lambda: proposal_probs(head.logits(hidden), temps))
    assert one_shot > bound, (one_shot, bound)
