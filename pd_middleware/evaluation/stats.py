"""Statistics for exactness and acceptance checks, shared by tests, benchmarks and ``ab``.

- :func:`tv_bound`: a total-variation threshold that a correct sampler exceeds with
  probability at most ``alpha``: E[TV] <= ½·√((K−1)/N) (Cauchy–Schwarz on the per-bin
  standard deviations) plus McDiarmid's √(ln(1/α)/(2N)) (each draw moves the TV by at
  most 1/N). Both steps hold for independent draws from *different* laws too, when the
  reference is the average law, which is what :class:`ExactnessAccumulator` uses.
- :func:`tv_distance`, :func:`chi_square` (its χ² tail through
  ``torch.special.gammaincc``, no scipy), :func:`wilson_interval` for acceptance rates
  and :func:`percentile` (``statistics.quantiles``) for latencies.
- :func:`two_sample_tv_test`: whether two samples of categories come from one law, by
  the permutation test on their total-variation distance: valid at any number of
  categories (where :func:`tv_bound`'s bound grows vacuous: K = 100 at N = 192 is > 1).
- :class:`LogHistogram`: latencies in fixed memory (log-spaced bins), with quantiles
  within a stated relative error of the exact order statistic.
- :class:`ExactnessAccumulator`: an exactness test for committed tokens at a realistic
  vocabulary, where every request has its own target law p.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def tv_bound(num_categories: int, n: int, alpha: float = 1e-6) -> float:
    """½·√((K−1)/N) + √(ln(1/α)/(2N)): P(TV > bound) <= alpha for a correct sampler."""
    if n <= 0 or num_categories < 1 or not 0 < alpha < 1:
        raise ValueError(f"need n > 0, K >= 1, 0 < alpha < 1; got n={n}, K={num_categories}, alpha={alpha}")
    return 0.5 * math.sqrt((num_categories - 1) / n) + math.sqrt(math.log(1 / alpha) / (2 * n))


def _pairs(counts: Any, probs: Any) -> tuple[list[float], list[float]]:
    if isinstance(counts, Mapping) or isinstance(probs, Mapping):
        if not (isinstance(counts, Mapping) and isinstance(probs, Mapping)):
            raise TypeError("counts and probs must both be mappings or both sequences")
        keys = set(counts) | set(probs)
        return [float(counts.get(k, 0)) for k in keys], [float(probs.get(k, 0)) for k in keys]
    c = counts.tolist() if hasattr(counts, "tolist") else list(counts)
    p = probs.tolist() if hasattr(probs, "tolist") else list(probs)
    if len(c) != len(p):
        raise ValueError(f"counts has {len(c)} categories, probs {len(p)}")
    return [float(v) for v in c], [float(v) for v in p]


def tv_distance(counts: Any, probs: Any) -> float:
    """½·Σ|counts/N − p| between empirical counts and a law.

    Both sequences (lists, tensors) of equal length, or both mappings category ->
    value (missing keys count 0). ``probs`` may hold Fractions.
    """
    c, p = _pairs(counts, probs)
    n = sum(c)
    if n <= 0:
        raise ValueError("no observations")
    return 0.5 * sum(abs(ci / n - pi) for ci, pi in zip(c, p))


def _two_sample_tv(codes: Sequence[int], n_a: int) -> float:
    a, b = Counter(codes[:n_a]), Counter(codes[n_a:])
    n_b = len(codes) - n_a
    return 0.5 * sum(abs(a[k] / n_a - b[k] / n_b) for k in a.keys() | b.keys())


def two_sample_tv_test(
    a: Sequence[Hashable], b: Sequence[Hashable], *, rounds: int = 1999, seed: int = 0
) -> tuple[float, float]:
    """(TV between the empirical laws of ``a`` and ``b``, its permutation p-value).

    Under the null (every draw of both samples independent from one law) the pooled labels
    are exchangeable, so p = (1 + #{rounds whose shuffled split has TV >= the observed}) /
    (1 + rounds) satisfies P(p <= alpha) <= alpha for every alpha, at any K. ``rounds``
    bounds the smallest p (1 / (1 + rounds)); ``seed`` fixes the shuffles.
    """
    if not a or not b:
        raise ValueError(f"both samples need draws, got {len(a)} and {len(b)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    index: dict[Hashable, int] = {}
    codes = [index.setdefault(x, len(index)) for x in (*a, *b)]
    observed = _two_sample_tv(codes, len(a))
    rng = random.Random(seed)
    pooled = list(codes)
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        if _two_sample_tv(pooled, len(a)) >= observed - 1e-12:
            hits += 1
    return observed, (1 + hits) / (1 + rounds)


def chi_square(counts: Any, probs: Any) -> tuple[float, int]:
    """Pearson χ² statistic and degrees of freedom (categories with p > 0, minus 1).

    An observation in a category with p = 0 makes the statistic infinite.
    """
    c, p = _pairs(counts, probs)
    n = sum(c)
    stat, cats = 0.0, 0
    for ci, pi in zip(c, p):
        if pi > 0:
            cats += 1
            stat += (ci - n * pi) ** 2 / (n * pi)
        elif ci > 0:
            return math.inf, max(cats - 1, 0)
    return stat, cats - 1


def chi_square_sf(x: float, df: int) -> float:
    """P(χ²_df > x)."""
    if df <= 0:
        raise ValueError(f"df must be positive, got {df}")
    if not math.isfinite(x):
        return 0.0
    if x <= 0:
        return 1.0
    import torch

    # Q(df/2, x/2), the regularised upper incomplete gamma, in float64. It agrees with
    # the series/continued-fraction evaluation this replaced to 1.2e-9 relative over
    # df in [1, 1e5] (measured); a call costs ~8 us against ~3 us, which no caller
    # notices (chi_square_critical's 200-step bisection: ~2 ms).
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64))
    )


def chi_square_critical(df: int, alpha: float = 1e-6) -> float:
    """The x with P(χ²_df > x) = alpha (bisection on :func:`chi_square_sf`)."""
    lo, hi = 0.0, max(10.0, 4.0 * df)
    while chi_square_sf(hi, df) > alpha:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi_square_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for a binomial rate (well-behaved near 0 and 1)."""
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= successes <= n:
        raise ValueError(f"successes {successes} outside [0, {n}]")
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    ph = successes / n
    denom = 1 + z * z / n
    centre = (ph + z * z / (2 * n)) / denom
    half = z * math.sqrt(ph * (1 - ph) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return (lo, hi)


@dataclass(frozen=True, slots=True)
class ExactnessCheck:
    """Result of an exactness test: ``tv`` against ``bound`` at ``alpha`` over ``n`` tokens."""

    tv: float
    bound: float
    alpha: float
    n: int
    num_bins: int

    @property
    def passed(self) -> bool:
        return self.tv <= self.bound


class ExactnessAccumulator:
    """Tests committed tokens against per-request target laws at any vocabulary size.

    A TV over raw token ids is hopeless at V = 152064 and every request has its own p.
    Instead each committed token y is mapped to a bin by its own probability, bin k
    holding ``2^-(k+1) <= p(y) < 2^-k`` (the last bin everything below), plus one extra
    bin for tokens with p(y) = 0 (which an exact verifier never commits). Under exactness, y's bin has the known law
    ``P_i(k) = sum of p_i over the tokens in bin k``; the counts are compared by TV
    with the average of those laws, against :func:`tv_bound` with K+1 categories.
    Biases that matter (collapse onto the argmax, a truncated tail) move mass between
    probability levels, so they show up here.

    Feed one position's rows at a time; a chain position contributes only for requests
    that reached it (each committed token then has law p given its prefix).
    """

    def __init__(self, num_bins: int = 16, alpha: float = 1e-6) -> None:
        import torch

        self.num_bins = num_bins
        self.alpha = alpha
        self.counts = torch.zeros(num_bins + 1, dtype=torch.float64)
        self.expected = torch.zeros(num_bins + 1, dtype=torch.float64)
        self.n = 0

    def _bins(self, probs: torch.Tensor) -> torch.Tensor:
        import torch

        # p = m * 2^e with m in [0.5, 1): -e is the bin; frexp is cheaper than log2.
        level = torch.frexp(probs).exponent.neg_().clamp_(0, self.num_bins - 1).to(torch.int64)
        return torch.where(probs > 0, level, torch.full_like(level, self.num_bins))

    def bin_law(self, target_probs: torch.Tensor) -> torch.Tensor:
        """float64 (n, K+1): each row's law of the bin of a token drawn from it.

        The only V-wide pass; arms verifying the same rows can share it (``update(...,
        bin_law=...)``).
        """
        import torch

        p = target_probs.float()
        law = torch.zeros(p.shape[0], self.num_bins + 1, dtype=torch.float32, device=p.device)
        law.scatter_add_(1, self._bins(p), p)
        # Normalise per row (fp32 rows sum to 1 within ~1e-6, far below any bound).
        law = law.double()
        return law / law.sum(dim=1, keepdim=True)

    def update(self, target_probs: torch.Tensor, tokens: torch.Tensor, bin_law: torch.Tensor | None = None) -> None:
        """Add committed ``tokens`` (int64 (n,)) with their target rows (float (n, V))."""
        import torch

        if tokens.numel() == 0:
            return
        law = bin_law if bin_law is not None else self.bin_law(target_probs)
        self.expected += law.sum(dim=0).cpu()
        idx = tokens.to(device=target_probs.device, dtype=torch.int64).view(-1, 1)
        got = self._bins(target_probs.gather(1, idx).float()).squeeze(1)
        self.counts += torch.bincount(got.cpu(), minlength=self.num_bins + 1).double()
        self.n += int(tokens.numel())

    def result(self) -> ExactnessCheck:
        """TV of the binned counts from the average law, and the bound it must stay under."""
        if self.n == 0:
            raise ValueError("no tokens recorded")
        tv = 0.5 * float((self.counts / self.n - self.expected / self.n).abs().sum())
        return ExactnessCheck(
            tv=tv,
            bound=tv_bound(self.num_bins + 1, self.n, self.alpha),
            alpha=self.alpha,
            n=self.n,
            num_bins=self.num_bins + 1,
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated; NaN if empty.

    ``statistics.quantiles(method="inclusive")``: the 0th percentile is the minimum and
    the 100th the maximum, so p50 <= p99 <= max always holds.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return float("nan")
    if len(values) == 1:  # quantiles() needs two points
        return float(values[0])
    if q == 100:
        return float(max(values))
    if q == 0:
        return float(min(values))
    cuts = statistics.quantiles(values, n=1000, method="inclusive")
    k = q * 10
    i = int(k)
    if i == k:
        return float(cuts[i - 1])
    lo, hi = cuts[i - 1] if i else min(values), cuts[i]
    return float(lo + (hi - lo) * (k - i))


class LogHistogram:
    """Counts of positive values in log-spaced bins: fixed memory whatever the count.

    Bin ``i`` holds ``[lo·g^i, lo·g^(i+1))`` with ``g = (1 + rel_error)^2``, and a
    quantile is reported as its bin's geometric centre ``lo·g^(i+½)``, so it is within a
    factor ``1 + rel_error`` (relative error at most ``rel_error``, 1% by default) of the
    exact nearest-rank order statistic. Values below ``lo`` or at or above ``hi`` are
    counted apart (``under``, ``over``) and reported as ``lo`` and ``hi``: at most
    ``ceil(log(hi/lo)/log(g)) + 2`` counters, 1,044 for the defaults (1 µs to 1000 s, in ms).
    """

    def __init__(self, lo: float = 1e-3, hi: float = 1e6, rel_error: float = 0.01) -> None:
        if not 0 < lo < hi or not 0 < rel_error < 1:
            raise ValueError(f"need 0 < lo < hi and 0 < rel_error < 1; got lo={lo}, hi={hi}, rel_error={rel_error}")
        self.lo, self.hi, self.rel_error = lo, hi, rel_error
        self._log_g = 2 * math.log1p(rel_error)
        self.counts = [0] * math.ceil(math.log(hi / lo) / self._log_g)
        self.under = 0
        self.over = 0
        self.n = 0

    def add(self, value: float) -> None:
        """Count one value (NaN is refused: it has no rank)."""
        if value != value:
            raise ValueError("LogHistogram.add: NaN has no rank")
        self.n += 1
        if value < self.lo:
            self.under += 1
            return
        i = int(math.log(value / self.lo) / self._log_g)
        if i >= len(self.counts):
            self.over += 1
        else:
            self.counts[i] += 1

    def quantile(self, q: float) -> float:
        """The ``q``-th percentile (0..100), nearest rank, within ``rel_error``; NaN if empty."""
        if not 0 <= q <= 100:
            raise ValueError(f"q must be in [0, 100], got {q}")
        if self.n == 0:
            return float("nan")
        rank = max(1, math.ceil(q / 100 * self.n))  # 1-based nearest rank
        seen = self.under
        if rank <= seen:
            return self.lo
        for i, c in enumerate(self.counts):
            seen += c
            if rank <= seen:
                return self.lo * math.exp((i + 0.5) * self._log_g)
        return self.hi


def normal_quantile(confidence: float) -> float:
    """Two-sided z for ``confidence`` (1.959964 at 0.95)."""
    return NormalDist().inv_cdf(0.5 + confidence / 2)


__all__: Sequence[str] = [
    "ExactnessAccumulator",
    "ExactnessCheck",
    "LogHistogram",
    "chi_square",
    "chi_square_critical",
    "chi_square_sf",
    "normal_quantile",
    "percentile",
    "tv_bound",
    "tv_distance",
    "wilson_interval",
]
