"""Workloads: fixed defaults, shapes, reproducibility, conditioning, strict options."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from pd_middleware import ConfigError
from pd_middleware.evaluation.verify import ExactnessAccumulator, sample_categorical, sum_min, verify_chain
from pd_middleware.workloads import WORKLOAD_NAMES, Workload, WorkloadBatch, make_workload
from pd_middleware.workloads.ngram import read_corpus
from pd_middleware.workloads.synthetic import SyntheticOptions

SMALL_NGRAM = dict(max_bytes=300_000, top_n=2047)


def test_synthetic_defaults_are_fixed() -> None:
    o = SyntheticOptions()
    assert (o.vocab_size, o.num_steps, o.s_min, o.s_max, o.noise_std, o.temperature) == (152064, 1, 1.0, 2.0, 0.5, 1.0)
    w = make_workload("synthetic")
    assert isinstance(w, Workload) and w.vocab_size == 152064 and WORKLOAD_NAMES == ("synthetic", "ngram", "trace")
    b = next(w.batches(2, 2, seed=0))
    assert b.target_probs.shape == (2, 2, 152064) and b.draft_probs.shape == (2, 1, 152064)
    assert b.target_probs.dtype == torch.float32 and b.draft_probs.dtype == torch.float32


@pytest.mark.parametrize("steps", [1, 3])
def test_synthetic_shapes_laws_and_reproducibility(steps: int) -> None:
    w = make_workload("synthetic", vocab_size=3000, num_steps=steps)
    batches = list(w.batches(7, 3, seed=11))
    assert [b.batch_size for b in batches] == [3, 3, 1]
    b = batches[0]
    assert isinstance(b, WorkloadBatch) and b.request_ids == ("synthetic-11-0", "synthetic-11-1", "synthetic-11-2")
    assert b.target_probs.shape == (3, steps + 1, 3000) and b.draft_probs.shape == (3, steps, 3000)
    assert torch.allclose(b.target_probs.sum(-1), torch.ones(3, steps + 1), atol=1e-5)
    assert torch.allclose(b.draft_probs.sum(-1), torch.ones(3, steps), atol=1e-5)
    assert bool((b.prefix == -1).all())
    drafted = torch.zeros(3, steps, dtype=torch.int64)
    assert b.target_given(drafted) is b.target_probs and torch.equal(
        b.draft_given(0, drafted[:, :0]), b.draft_probs[:, 0]
    )
    # Same seed: same rows, whatever the batch size; another seed: different rows.
    again = list(w.batches(7, 4, seed=11))
    assert torch.equal(again[0].target_probs[:3], b.target_probs)
    assert torch.equal(again[1].draft_probs[2:3], batches[2].draft_probs)
    other = next(w.batches(3, 3, seed=12))
    assert not torch.equal(other.target_probs, b.target_probs)


def test_synthetic_rows_follow_the_definition() -> None:
    """Sorted target log-probs are -s log(rank) + c with s in [1, 2]; draft log-ratio noise has sd 0.5."""
    w = make_workload("synthetic", vocab_size=20000)
    b = next(w.batches(8, 8, seed=3))
    p, q = b.target_probs[:, 0].double(), b.draft_probs[:, 0].double()
    logp = p.sort(dim=1, descending=True).values.log()
    s = (logp[:, 0] - logp[:, 1]) / math.log(2)
    assert bool(((s > 1.0) & (s < 2.0)).all()), s
    r = torch.arange(1, 20001, dtype=torch.float64).log()
    assert torch.allclose(logp - logp[:, :1], -s.unsqueeze(1) * r, atol=1e-3)
    diff = q.log() - p.log()
    sd = diff.std(dim=1)
    assert bool(((sd - 0.5).abs() < 0.02).all()), sd
    assert 0.5 < float(sum_min(p, q).mean()) < 0.95


def test_synthetic_temperature_option() -> None:
    cold = next(make_workload("synthetic", vocab_size=500, temperature=0.5).batches(1, 1, 0)).target_probs
    warm = next(make_workload("synthetic", vocab_size=500).batches(1, 1, 0)).target_probs
    assert float(cold.max()) > float(warm.max())


def test_make_workload_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="at ab.workload.name: unknown workload 'zipf'"):
        make_workload("zipf")
    with pytest.raises(ConfigError, match="at ab.workload.options.noise: Object contains unknown field `noise`"):
        make_workload("synthetic", noise=0.3)
    with pytest.raises(
        ConfigError, match=r"at ab.workload.options.s_max: need 0 <= s_min <= s_max <= 100, got 3.0, 2.0"
    ):
        make_workload("synthetic", s_min=3.0)
    with pytest.raises(ConfigError, match="at ab.workload.options.vocab_size: Expected `int`, got `str`"):
        make_workload("synthetic", vocab_size="big")
    with pytest.raises(ConfigError, match="at wl.options.path: Object missing required field `path`"):
        make_workload("trace", config_key="wl")


def test_verify_on_synthetic_is_exact() -> None:
    """X ~ q, full q sent: binned TV of committed tokens under the bound (1024 requests, 17 bins, alpha 1e-6)."""
    seed = 5
    w = make_workload("synthetic", vocab_size=2048)
    acc = ExactnessAccumulator()
    g = torch.Generator().manual_seed(seed)
    for b in w.batches(1024, 512, seed=seed):
        x = sample_categorical(b.draft_probs[:, 0].double(), torch.rand(b.batch_size, dtype=torch.float64, generator=g))
        res = verify_chain(b.target_probs, b.draft_probs, x.unsqueeze(1), g)
        acc.update(b.target_probs[:, 0], res.committed[:, 0])
    r = acc.result()
    assert r.passed, f"seed={seed} tv={r.tv:.4f} bound={r.bound:.4f}"


# ----------------------------------------------------------------- ngram


def test_read_corpus_is_deterministic_and_skips(tmp_path: Path) -> None:
    for rel in ["b.py", "a.py", "sub/c.py", "site-packages/x.py", "test/t.py", "notes.txt"]:
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("x = 1\n")
    assert [r for r, _ in read_corpus(str(tmp_path), 10_000, 100)] == ["a.py", "b.py", "sub/c.py"]
    assert [r for r, _ in read_corpus(str(tmp_path), 10_000, 2)] == ["a.py", "b.py"]
    assert [t for _, t in read_corpus(str(tmp_path), 8, 100)] == ["x = 1\n", "x "]


def test_ngram_needs_a_corpus(tmp_path: Path) -> None:
    (tmp_path / "only.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match=r"options.corpus: found 1 .py files under the corpus directory, need >= 2"):
        make_workload("ngram", corpus=str(tmp_path))


def test_ngram_rows_are_full_support_and_reproducible() -> None:
    w = make_workload("ngram", **SMALL_NGRAM)
    assert w.vocab_size == 2048 and w.num_steps == 1
    facts = w.describe()["corpus"]
    assert facts["vocab_size"] == 2048 and len(facts["corpus_sha256"]) == 64 and facts["heldout_tokens"] > 1000
    b = next(w.batches(64, 64, seed=1))
    assert b.target_probs.shape == (64, 2, 2048) and b.draft_probs.shape == (64, 1, 2048)
    assert bool((b.target_probs > 0).all()) and bool((b.draft_probs > 0).all())
    assert torch.allclose(b.target_probs.sum(-1), torch.ones(64, 2), atol=1e-5)
    again = next(make_workload("ngram", **SMALL_NGRAM).batches(64, 16, seed=1))
    assert torch.equal(again.target_probs, b.target_probs[:16]) and torch.equal(again.prefix, b.prefix[:16])
    acc = float(sum_min(b.target_probs[:, 0], b.draft_probs[:, 0]).mean())
    assert 0.3 < acc < 0.95, acc


def test_ngram_chain_conditions_on_the_drafted_prefix() -> None:
    w = make_workload("ngram", num_steps=3, **SMALL_NGRAM)
    b = next(w.batches(8, 8, seed=2))
    m = w.model
    ctx = b.conditional.context
    # Contexts are consecutive held-out tokens.
    held = m.heldout.tolist()
    pairs = set(itertools.pairwise(held))
    assert all((a, c) in pairs for a, c in ctx.tolist())
    assert torch.equal(b.target_given(b.prefix), b.target_probs)
    for k in range(3):
        assert torch.equal(b.draft_given(k, b.prefix[:, :k]), b.draft_probs[:, k])
    hist = torch.cat([ctx, b.prefix], dim=1)
    assert torch.allclose(b.target_probs[:, 2], m.target_rows(hist[:, 2], hist[:, 3]).float())
    assert torch.allclose(b.draft_probs[:, 1], m.draft_rows(hist[:, 2]).float())
    other = (b.prefix + 1) % w.vocab_size
    assert not torch.equal(b.target_given(other)[:, 1:], b.target_probs[:, 1:])
    assert torch.equal(b.target_given(other)[:, 0], b.target_probs[:, 0])


def test_ngram_witten_bell_row_by_hand(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("a b c a b d a b c\n")
    (tmp_path / "b.py").write_text("a b c\n")
    w = make_workload("ngram", corpus=str(tmp_path), heldout_every=2, top_n=10)
    m = w.model
    ids = {t: i for i, t in enumerate(m.tokens)}
    a, b, c, d = (torch.tensor([ids[t]]) for t in "abcd")
    # Train: a b c a b d a b c  (N = 9, V = 5 with <unk>); P1(x) = (C(x) + 1) / 14.
    p1 = torch.tensor([1, 4, 4, 3, 2], dtype=torch.float64)[[ids[t] for t in ["<unk>", "a", "b", "c", "d"]]] / 14
    assert torch.allclose(m.p1, p1.double())
    # Bigram after b: C(b c) = 2, C(b d) = 1, T = 2: q(c|b) = (2 + 2 P1(c)) / 5.
    q = m.draft_rows(b)[0]
    assert float(q[ids["c"]]) == pytest.approx((2 + 2 * 3 / 14) / 5)
    # Trigram after (a b): same counts as the bigram here, backing off to q.
    p = m.target_rows(a, b)[0]
    assert float(p[ids["d"]]) == pytest.approx((1 + 2 * float(q[ids["d"]])) / 5)
    # Unseen context (d, c) backs off entirely to the bigram after c.
    assert torch.allclose(m.target_rows(d, c), m.draft_rows(c))
