"""The reference chain verifier: exact enumeration, Monte Carlo against it, edge cases.

Exact tests use :class:`fractions.Fraction` and prove laws with no randomness. Monte
Carlo tests use fixed seeds and the TV bound at alpha = 1e-6: a correct verifier fails
one with probability at most 1e-6 (for a fixed seed the outcome is deterministic anyway).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from pd_middleware import ValidationError
from pd_middleware.evaluation.verify import (
    acceptance_probability,
    complete_law,
    exact_accept_probability,
    exact_chain_law,
    exact_residual,
    exact_verify_law,
    expected_accepted_length,
    sample_categorical,
    sanitize_q,
    sum_min,
    target_sequence_law,
    tv_bound,
    tv_distance,
    verify_chain,
)

ALPHA = 1e-6
SEEDS = [0, 1, 2, 3, 4]


def rand_law(rng: random.Random, v: int, zeros: int = 0) -> list[Fraction]:
    """A random law with small denominators; ``zeros`` entries forced to 0."""
    w = [rng.randint(1, 9) for _ in range(v)]
    for i in rng.sample(range(v), zeros):
        w[i] = 0
    total = sum(w)
    return [Fraction(x, total) for x in w]


def one_hot(v: int, x: int) -> list[Fraction]:
    return [Fraction(int(i == x)) for i in range(v)]


def top_k(q: list[Fraction], k: int) -> list[Fraction]:
    keep = sorted(range(len(q)), key=lambda i: (-q[i], i))[:k]
    mass = sum(q[i] for i in keep)
    return [q[i] / mass if i in keep else Fraction(0) for i in range(len(q))]


def bf16(q: list[Fraction]) -> list[Fraction]:
    return [Fraction(float(torch.tensor(float(x), dtype=torch.float32).to(torch.bfloat16).float())) for x in q]


def argmax(q: list[Fraction]) -> int:
    return max(range(len(q)), key=lambda i: (q[i], -i))


# ----------------------------------------------------------------- exact, one position


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("v", [2, 5, 8])
def test_one_hot_is_exact_for_any_drafting_rule(seed: int, v: int) -> None:
    rng = random.Random(seed)
    p = rand_law(rng, v, zeros=1 if v > 2 else 0)
    q = rand_law(rng, v)
    adversarial = min(range(v), key=lambda i: p[i])  # a token with p = 0 when v > 2
    for name, s in [
        ("sampled", q),
        ("greedy", one_hot(v, argmax(q))),
        ("fixed adversarial", one_hot(v, adversarial)),
    ]:
        law = exact_verify_law(p, lambda x: one_hot(v, x), s)
        assert law == p, f"seed={seed} v={v} drafting={name}"


@pytest.mark.parametrize("seed", SEEDS)
def test_full_distribution_is_exact_when_x_is_drawn_from_it(seed: int) -> None:
    rng = random.Random(seed)
    p, q = rand_law(rng, 8, zeros=2), rand_law(rng, 8, zeros=1)
    assert exact_verify_law(p, q, q) == p, f"seed={seed}"
    qk = top_k(q, 3)
    assert exact_verify_law(p, qk, qk) == p, f"seed={seed}: truncate first, then sample, is exact"


@pytest.mark.parametrize("seed", SEEDS)
def test_negative_controls_are_biased(seed: int) -> None:
    rng = random.Random(seed)
    p, q = rand_law(rng, 6), rand_law(rng, 6)
    greedy = exact_verify_law(p, q, one_hot(6, argmax(q)))
    assert greedy != p, f"seed={seed}: greedy X with softmax q must be biased"
    assert sum(greedy) == 1
    assert exact_verify_law(p, top_k(q, 2), q) != p, f"seed={seed}: X ~ q with q_k sent must be biased"
    q7 = [Fraction(x, 7 * 9) for x in [1, 2, 4, 8, 16, 32]]
    q7.append(1 - sum(q7))
    p7 = rand_law(rng, 7)
    assert bf16(q7) != q7
    assert exact_verify_law(p7, bf16(q7), q7) != p7, f"seed={seed}: X ~ fp32 q with bf16 q sent must be biased"


def test_acceptance_matches_the_formulas() -> None:
    rng = random.Random(7)
    p, q = rand_law(rng, 8), rand_law(rng, 8)
    chain = exact_chain_law(lambda pre: p, lambda pre, x: q, lambda pre: q, 1)
    assert chain.expected_accepted == sum(min(a, b) for a, b in zip(p, q))
    onehot = exact_chain_law(lambda pre: p, lambda pre, x: one_hot(8, x), lambda pre: q, 1)
    assert onehot.expected_accepted == sum(a * b for a, b in zip(p, q))


# The kernels' reading of q'(X), one row per case of the table in docs/strategies.md:
# (q'(X), p(X), P(accept) under FlashInfer's chain kernel, under SGLang's Triton kernel).
NAN, INF = math.nan, math.inf
ACCEPT_TABLE = [
    (0.25, Fraction(1, 8), Fraction(1, 2), Fraction(1, 2)),  # valid: min(1, p/q')
    (1.0, Fraction(1, 8), Fraction(1, 8), Fraction(1, 8)),  # one-hot: p(X)
    (0.0, Fraction(1, 8), Fraction(1), Fraction(0)),  # q' = 0: u*0 < p always / not a probability
    (0.0, Fraction(0), Fraction(0), Fraction(0)),  # 0 < 0 is false
    (-0.5, Fraction(1, 8), Fraction(1), Fraction(0)),  # u*q' < 0 <= p
    (-0.5, Fraction(0), Fraction(1), Fraction(0)),  # ... even where p(X) = 0
    (1.5, Fraction(1, 8), Fraction(1, 12), Fraction(0)),  # q' > 1: p/q'
    (1.5, Fraction(1), Fraction(2, 3), Fraction(0)),
    (NAN, Fraction(1, 8), Fraction(0), Fraction(0)),  # NaN comparison is false
    (INF, Fraction(1, 8), Fraction(0), Fraction(0)),  # inf < p is false
    (-INF, Fraction(1, 8), Fraction(1), Fraction(0)),  # -inf < p is true
]


@pytest.mark.parametrize("q, p, fi, sg", ACCEPT_TABLE)
def test_accept_table_exact_and_analytic(q, p, fi, sg) -> None:
    assert exact_accept_probability(p, q, "flashinfer") == fi
    assert exact_accept_probability(p, q, "sglang") == sg
    target = torch.tensor([[[float(p), 1.0 - float(p)], [0.5, 0.5]]], dtype=torch.float64)
    draft = torch.tensor([[[q, 0.0]]], dtype=torch.float64)
    x = torch.tensor([[0]])
    for kernel, want in (("flashinfer", fi), ("sglang", sg)):
        got = float(acceptance_probability(target, draft, x, kernel)[0, 0])
        assert got == pytest.approx(float(want), abs=1e-15), (kernel, q, p)


@pytest.mark.parametrize("q, p, fi, sg", ACCEPT_TABLE)
def test_accept_table_torch_on_a_uniform_grid(q, p, fi, sg) -> None:
    """verify_chain's literal comparison on 1000 evenly spaced coins: the accepted share is
    the exact probability within 1/1000 (no randomness)."""
    n = 1000
    u_acc = ((torch.arange(n, dtype=torch.float64) + 0.5) / n).view(n, 1)
    u_draw = torch.full((n, 2), 0.5, dtype=torch.float64)
    target = torch.tensor([[float(p), 1.0 - float(p)], [0.5, 0.5]], dtype=torch.float64).expand(n, 2, 2)
    draft = torch.tensor([[q, 0.0]], dtype=torch.float64).expand(n, 1, 2)
    x = torch.zeros(n, 1, dtype=torch.int64)
    for kernel, want in (("flashinfer", fi), ("sglang", sg)):
        res = verify_chain(target, draft, x, uniforms=(u_acc, u_draw), kernel=kernel)
        share = float(res.accepted_lengths.double().mean())
        assert abs(share - float(want)) <= 1 / n, (kernel, q, p, share)


RESIDUAL_ROW = [NAN, INF, -0.5, 1.5, 0.25, 0.25, 0.25, 0.25]


def test_residual_table_exact() -> None:
    p = [Fraction(1, 8)] * 8
    # FlashInfer: fmaxf(p - q', 0): NaN -> 0, +inf -> 0, negative q' raises the entry.
    assert exact_residual(p, RESIDUAL_ROW, "flashinfer") == [0, 0, 1, 0, 0, 0, 0, 0]
    # SGLang: q' outside [0, 1] read as 0, so those tokens keep their p.
    assert exact_residual(p, RESIDUAL_ROW, "sglang") == [Fraction(1, 4)] * 4 + [0] * 4
    # q' = -inf: the sum is inf and FlashInfer emits the last token with positive residual.
    assert exact_residual(p, [0.0, -INF, 0.0, 0.5, 0.5, 0, 0, 0], "flashinfer") == [0, 0, 0, 0, 0, 0, 0, 1]
    # No residual mass (p == q'): both kernels are undefined there; the reference draws from p.
    assert exact_residual(p, [0.125] * 8, "flashinfer") == p and exact_residual(p, [0.125] * 8, "sglang") == p
    with pytest.raises(ValidationError, match="must be one of flashinfer, sglang, got 'vllm'"):
        exact_residual(p, [0.125] * 8, "vllm")  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel", ["flashinfer", "sglang"])
@pytest.mark.parametrize(
    "row", [RESIDUAL_ROW, [0.0, -INF, 0.0, 0.5, 0.5, 0, 0, 0], [0.125] * 8, [0.5, 0.5, 0, 0, 0, 0, 0, 0]]
)
def test_residual_torch_matches_exact_on_a_grid(kernel, row) -> None:
    """A rejected X (p(X) = 0, so every kernel rejects it at u = 1), then the residual drawn
    on 800 evenly spaced coins: each token's share is the exact residual within 1/800."""
    n, v = 800, 8
    target = torch.full((n, 2, v), 1 / 8, dtype=torch.float64)
    draft = torch.tensor(row, dtype=torch.float64).expand(n, 1, v)
    u_draw = torch.stack([(torch.arange(n, dtype=torch.float64) + 0.5) / n, torch.zeros(n, dtype=torch.float64)], 1)
    target = target.clone()
    target[:, 0, 7] = 0.0
    target[:, 0, :7] = 1 / 7
    p7 = [Fraction(1, 7)] * 7 + [Fraction(0)]
    exact = exact_residual(p7, row, kernel)
    x = torch.full((n, 1), 7, dtype=torch.int64)
    res = verify_chain(target, draft, x, uniforms=(torch.ones(n, 1, dtype=torch.float64), u_draw), kernel=kernel)
    assert bool((res.accepted_lengths == 0).all())
    counts = torch.bincount(res.committed[:, 0], minlength=v).double() / n
    for y in range(v):
        assert abs(float(counts[y]) - float(exact[y])) <= 1 / n + 1e-12, (kernel, row, y, counts.tolist(), exact)


def test_invalid_q_makes_one_hot_style_pairs_biased_under_both_kernels() -> None:
    """Why the guard keeps q'(X) > 0: X drawn where q' says 0 is accepted outright by
    FlashInfer and always rejected by SGLang; both commit a law other than p."""
    p = [Fraction(1, 8)] * 8
    s = [Fraction(1, 4)] * 4 + [Fraction(0)] * 4
    zeroed = [0, 0, 0, 0, 0.25, 0.25, 0.25, 0.25]
    fi = exact_verify_law(p, zeroed, s, "flashinfer")
    assert fi[:4] == s[:4] and fi[4:] == [0, 0, 0, 0]  # accepted outright: the law is s
    assert exact_verify_law(p, zeroed, s, "sglang") != p
    # Negative control: q' = s (X drawn from what was sent) is exact under both kernels.
    assert exact_verify_law(p, s, s, "flashinfer") == p and exact_verify_law(p, s, s, "sglang") == p


def test_exact_mode_rejects_bad_laws() -> None:
    with pytest.raises(ValidationError, match="must be non-negative and sum to exactly 1, got sum 1/2"):
        exact_verify_law([Fraction(1, 2), 0], [1, 0], [1, 0])
    with pytest.raises(ValidationError, match="lengths differ: p 2, q 3, s 2"):
        exact_verify_law([1, 0], [1, 0, 0], [1, 0])


# ----------------------------------------------------------------- exact, chains


def chain_tables(seed: int, v: int, steps: int) -> tuple[dict, dict]:
    """Prefix-dependent p (up to the bonus) and q tables."""
    rng = random.Random(seed)
    p_tab, q_tab = {}, {}

    def prefixes(n: int) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = [()]
        for _ in range(n):
            out = [(*pre, x) for pre in out for x in range(v)]
        return out

    for n in range(steps + 1):
        for pre in prefixes(n):
            p_tab[pre] = rand_law(rng, v, zeros=rng.randint(0, 1))
            q_tab[pre] = rand_law(rng, v, zeros=rng.randint(0, 1))
    return p_tab, q_tab


@pytest.mark.parametrize("steps,v", [(2, 4), (3, 3)])
def test_chain_is_exact_for_full_and_one_hot_proposals(steps: int, v: int) -> None:
    p_tab, q_tab = chain_tables(11 + steps, v, steps)
    target = target_sequence_law(p_tab.__getitem__, steps + 1)
    full = exact_chain_law(p_tab.__getitem__, lambda pre, x: q_tab[pre], q_tab.__getitem__, steps)
    assert sum(full.law.values()) == 1
    assert complete_law(full.law, p_tab.__getitem__, steps + 1) == target
    greedy = lambda pre: one_hot(v, argmax(q_tab[pre]))  # noqa: E731  # a one-line law
    hot = exact_chain_law(p_tab.__getitem__, lambda pre, x: one_hot(v, x), greedy, steps)
    assert complete_law(hot.law, p_tab.__getitem__, steps + 1) == target
    biased = exact_chain_law(p_tab.__getitem__, lambda pre, x: q_tab[pre], greedy, steps)
    assert complete_law(biased.law, p_tab.__getitem__, steps + 1) != target
    assert sum(full.accepted.values()) == 1 and set(full.accepted) <= set(range(steps + 1))


def test_chain_expected_length_for_independent_positions() -> None:
    rng = random.Random(3)
    ps = [rand_law(rng, 5) for _ in range(3)]
    qs = [rand_law(rng, 5) for _ in range(2)]
    law = exact_chain_law(lambda pre: ps[len(pre)], lambda pre, x: qs[len(pre)], lambda pre: qs[len(pre)], 2)
    a1, a2 = (sum(min(a, b) for a, b in zip(ps[k], qs[k])) for k in range(2))
    assert law.expected_accepted == a1 + a1 * a2
    assert law.accepted == {0: 1 - a1, 1: a1 * (1 - a2), 2: a1 * a2}


# ----------------------------------------------------------------- torch vs exact


def as_tensor(rows: list[list[Fraction]]) -> torch.Tensor:
    return torch.tensor([[float(x) for x in r] for r in rows], dtype=torch.float32)


def test_torch_single_step_matches_exact_law() -> None:
    """N = 200k; two-token committed sequences (V + V^2 = 42 categories); false-positive rate <= 1e-6."""
    seed, v, n = 20240601, 6, 200_000
    rng = random.Random(seed)
    p, bonus, q = rand_law(rng, v, zeros=1), rand_law(rng, v), rand_law(rng, v, zeros=1)
    exact = exact_chain_law(lambda pre: p if not pre else bonus, lambda pre, x: q, lambda pre: q, 1)
    g = torch.Generator().manual_seed(seed)
    pt, bt, qt = as_tensor([p]), as_tensor([bonus]), as_tensor([q])
    x = sample_categorical(qt.double().expand(n, -1), torch.rand(n, dtype=torch.float64, generator=g))
    res = verify_chain(torch.cat([pt, bt]).expand(n, 2, v), qt.expand(n, v), x, g)
    seqs = [tuple(t for t in row if t >= 0) for row in res.committed.tolist()]
    counts: dict[tuple[int, ...], int] = {}
    for s in seqs:
        counts[s] = counts.get(s, 0) + 1
    tv = tv_distance(counts, exact.law)
    bound = tv_bound(v + v * v, n, ALPHA)
    assert tv < bound, f"seed={seed} tv={tv:.5f} bound={bound:.5f}"
    rate = float(res.first_accepted.double().mean())
    assert abs(rate - float(exact.expected_accepted)) < 5 * math.sqrt(0.25 / n), f"seed={seed}"
    # Negative control: the same machinery flags greedy X with softmax q sent.
    xg = torch.full((n,), argmax(q), dtype=torch.int64)
    bad = verify_chain(torch.cat([pt, bt]).expand(n, 2, v), qt.expand(n, v), xg, g)
    first = torch.bincount(bad.committed[:, 0], minlength=v)
    tv_bad = tv_distance(first, [float(a) for a in p])
    assert tv_bad > tv_bound(v, n, ALPHA), f"seed={seed} negative control tv={tv_bad:.5f} not flagged"


def test_torch_chain_matches_exact_law() -> None:
    """S = 3, V = 3, prefix-dependent p and q; 3+9+27+81 = 120 categories, N = 120k; false-positive rate <= 1e-6."""
    seed, v, steps, n = 77, 3, 3, 120_000
    p_tab, q_tab = chain_tables(seed, v, steps)
    exact = exact_chain_law(p_tab.__getitem__, lambda pre, x: q_tab[pre], q_tab.__getitem__, steps)
    g = torch.Generator().manual_seed(seed)
    # Draft each chain from q given its drafted prefix, then gather p rows along it.
    codes = torch.zeros(n, dtype=torch.int64)
    drafts = torch.empty(n, steps, dtype=torch.int64)
    q_rows = torch.empty(n, steps, v)
    p_rows = torch.empty(n, steps + 1, v)
    for k in range(steps + 1):
        prefixes = [pre for pre in p_tab if len(pre) == k]
        index = {pre: i for i, pre in enumerate(prefixes)}
        pk = as_tensor([p_tab[pre] for pre in prefixes])
        cur = torch.tensor([index[tuple(r)] for r in drafts[:, :k].tolist()]) if k else codes
        p_rows[:, k] = pk[cur]
        if k < steps:
            qk = as_tensor([q_tab[pre] for pre in prefixes])[cur]
            q_rows[:, k] = qk
            drafts[:, k] = sample_categorical(qk.double(), torch.rand(n, dtype=torch.float64, generator=g))
    res = verify_chain(p_rows, q_rows, drafts, g)
    counts: dict[tuple[int, ...], int] = {}
    for row in res.committed.tolist():
        s = tuple(t for t in row if t >= 0)
        counts[s] = counts.get(s, 0) + 1
    cats = sum(v**k for k in range(1, steps + 2))
    tv, bound = tv_distance(counts, exact.law), tv_bound(cats, n, ALPHA)
    assert tv < bound, f"seed={seed} tv={tv:.5f} bound={bound:.5f}"
    mean_len = float(res.accepted_lengths.double().mean())
    assert abs(mean_len - float(exact.expected_accepted)) < 5 * steps / math.sqrt(n), f"seed={seed}"
    # The analytic per-chain expectation agrees on average too (lower variance).
    analytic = expected_accepted_length(acceptance_probability(p_rows, q_rows, drafts)).mean()
    assert abs(float(analytic) - float(exact.expected_accepted)) < 3 * steps / math.sqrt(n), f"seed={seed}"


def test_invalid_q_torch_matches_exact_law_for_both_kernels() -> None:
    """Monte Carlo of a whole verify on the residual table's row (30k draws, 8+64
    categories, alpha 1e-6): the committed law matches exact mode under each kernel."""
    seed, v, n = 5, 8, 30_000
    p = [Fraction(1, 8)] * 8
    s = [Fraction(1, 4)] * 4 + [Fraction(0)] * 4
    invalid = torch.tensor(RESIDUAL_ROW)
    assert sanitize_q(invalid).tolist() == [0, 0, 0, 0, 0.25, 0.25, 0.25, 0.25]
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (n,), generator=g)
    target = torch.full((n, 2, v), 1 / 8)
    for kernel in ("flashinfer", "sglang"):
        a = verify_chain(target, invalid.expand(n, v), x, torch.Generator().manual_seed(seed), kernel=kernel)
        exact = exact_chain_law(lambda pre: p, lambda pre, x: RESIDUAL_ROW, lambda pre: s, 1, kernel)
        counts: dict[tuple[int, ...], int] = {}
        for row in a.committed.tolist():
            key = tuple(t for t in row if t >= 0)  # drop the -1 padding after a rejection
            counts[key] = counts.get(key, 0) + 1
        assert tv_distance(counts, exact.law) < tv_bound(v + v * v, n, ALPHA), f"seed={seed} kernel={kernel}"
    # FlashInfer accepts X on NaN/+inf? No: NaN and +inf reject, -0.5 accepts, 1.5 accepts w.p. 1/12.
    fi = verify_chain(target, invalid.expand(n, v), x, torch.Generator().manual_seed(seed))
    first = fi.first_accepted
    assert not bool(first[x == 0].any()) and not bool(first[x == 1].any()) and bool(first[x == 2].all())
    assert abs(float(first[x == 3].double().mean()) - 1 / 12) < 0.02
    with pytest.raises(ValidationError, match="kernel"):
        verify_chain(target[:2], invalid.expand(2, v), x[:2], kernel="vllm")  # type: ignore[arg-type]


# ----------------------------------------------------------------- edge cases


def test_u_zero_never_draws_a_zero_mass_token() -> None:
    p = torch.tensor([[[0.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.0, 1.0]]])
    q = torch.tensor([[[0.5, 0.0, 0.5, 0.0]]])
    zeros = (torch.zeros(1, 1, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64))
    # X = 0 has p = 0: rejected even at u = 0; the residual (0, 0, 0, 0.5) puts all mass on 3.
    res = verify_chain(p, q, torch.tensor([[0]]), uniforms=zeros)
    assert res.committed.tolist() == [[3, -1]] and res.accepted_lengths.tolist() == [0]
    # X = 2 is accepted at u = 0; the bonus at u = 0 skips the zero-mass tokens 0..2.
    res = verify_chain(p, q, torch.tensor([[2]]), uniforms=zeros)
    assert res.committed.tolist() == [[2, 3]] and res.num_committed.tolist() == [2]


def test_u_next_to_one_never_runs_past_the_last_token_with_mass() -> None:
    w = torch.tensor([[0.1, 0.2, 0.7, 0.0, 0.0]], dtype=torch.float64)
    u = torch.tensor([1 - 2**-53], dtype=torch.float64)
    assert sample_categorical(w, u).tolist() == [2]
    assert sample_categorical(w, torch.zeros(1, dtype=torch.float64)).tolist() == [0]


def test_single_layer_shapes_and_reproducibility() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(16, 2, 50, generator=g), dim=-1)
    q = torch.softmax(torch.randn(16, 50, generator=g), dim=-1)
    x = torch.multinomial(q, 1, generator=g).squeeze(1)
    r1 = verify_chain(p, q, x, torch.Generator().manual_seed(9))
    r2 = verify_chain(p, q.unsqueeze(1), x.unsqueeze(1), torch.Generator().manual_seed(9))
    assert torch.equal(r1.committed, r2.committed)
    assert r1.committed.shape == (16, 2) and r1.accepted_lengths.dtype == torch.int64
    acc = r1.accepted_lengths
    assert torch.equal(r1.committed[acc == 1, 0], x[acc == 1])
    assert bool((r1.committed[acc == 0, 1] == -1).all())
    assert torch.allclose(sum_min(p[:, 0], q), torch.minimum(p[:, 0], q).sum(-1).double())


def test_shape_errors_name_the_field() -> None:
    p = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValidationError, match=r"field 'draft_probs': expected \(2, 2, 4\)"):
        verify_chain(p, torch.full((2, 1, 4), 0.25), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValidationError, match=r"field 'draft_tokens': token ids must lie in \[0, 4\)"):
        verify_chain(p, torch.full((2, 2, 4), 0.25), torch.full((2, 2), 4, dtype=torch.int64))
    with pytest.raises(ValidationError, match=r"field 'draft_tokens': expected integer \(2, 2\)"):
        verify_chain(p, torch.full((2, 2, 4), 0.25), torch.zeros(2, 2))
    with pytest.raises(ValidationError, match=r"field 'target_probs': expected \(B, S\+1, V\)"):
        verify_chain(p[0], p[0], torch.zeros(3, dtype=torch.int64))
