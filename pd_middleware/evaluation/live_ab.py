"""``pd-middleware live-ab``: a live A/B's per-arm first-verify acceptance, with 95% CIs.

Reads the per-arm first-verify counts a decode exports
(``pd_middleware_first_verify_accepted_tokens{arm}``, see ``docs/metrics.md``) from:

- a running decode's metrics endpoint (``--url http://host:port/metrics``: the
  ``[metrics] port`` endpoint, or SGLang's own ``/metrics`` under ``--enable-metrics``);
- a file (``--from FILE``): a saved scrape (Prometheus text), a ``Metrics.snapshot()``
  JSON dump, or the JSON-lines log of ``[metrics] first_verify_log`` (one line per first
  verify: ``{"request_id", "arm", "accepted"}``).

Per arm it prints, over the first verifies (only they depend on the strategy):

- ``mean accepted``: draft tokens accepted per first verify, bonus excluded, with a
  normal 95% CI from the sample variance (the counts are exact per accepted length);
- ``acceptance``: the share of first verifies whose first draft position was accepted
  (the position the shipped proposal decides), with a Wilson 95% CI;
- ``ratio``: mean accepted against the baseline arm, with a delta-method CI on the log
  ratio (arms are disjoint sets of requests, so independent).
"""

from __future__ import annotations

import argparse
import json
import math
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core._errors import ConfigError
from ..core.metrics import MAX_ACCEPTED, PREFIX
from .stats import normal_quantile, wilson_interval

FAMILY = "first_verify_accepted_tokens"
#: Below this many first verifies an arm's normal (mean, ratio) intervals are flagged as rough.
SMALL_N = 30


@dataclass(frozen=True, slots=True)
class ArmAcceptance:
    """One arm's first verifies: ``counts[k]`` accepted exactly k draft tokens."""

    arm: str
    counts: tuple[int, ...]

    @property
    def n(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        return sum(k * c for k, c in enumerate(self.counts)) / self.n if self.n else math.nan

    @property
    def variance(self) -> float:
        """Sample variance of the accepted length (n − 1 in the denominator)."""
        n = self.n
        if n < 2:
            return math.nan
        m = self.mean
        return sum(c * (k - m) ** 2 for k, c in enumerate(self.counts)) / (n - 1)

    def mean_interval(self, confidence: float = 0.95) -> tuple[float, float]:
        if self.n < 2:
            return (math.nan, math.nan)
        half = normal_quantile(confidence) * math.sqrt(self.variance / self.n)
        return (self.mean - half, self.mean + half)

    @property
    def first_accepted(self) -> int:
        """First verifies that accepted at least the first draft position."""
        return self.n - (self.counts[0] if self.counts else 0)

    def rate_interval(self, confidence: float = 0.95) -> tuple[float, float]:
        return wilson_interval(self.first_accepted, self.n, confidence)


def ratio_interval(a: ArmAcceptance, base: ArmAcceptance, confidence: float = 0.95) -> tuple[float, float, float]:
    """``mean(a) / mean(base)`` and its CI (delta method on the log; NaN when undefined)."""
    if a.n < 2 or base.n < 2 or a.mean <= 0 or base.mean <= 0:
        return (math.nan, math.nan, math.nan)
    r = a.mean / base.mean
    se = math.sqrt(a.variance / (a.n * a.mean**2) + base.variance / (base.n * base.mean**2))
    z = normal_quantile(confidence)
    return (r, r * math.exp(-z * se), r * math.exp(z * se))


def _arms(by_arm: Mapping[str, list[int]]) -> dict[str, ArmAcceptance]:
    return {a: ArmAcceptance(a, tuple(int(x) for x in c)) for a, c in sorted(by_arm.items()) if sum(c) > 0}


def parse_prometheus(text: str, prefix: str = PREFIX) -> dict[str, ArmAcceptance]:
    """Per-arm counts from a Prometheus text exposition (buckets ``le="0"`` .. ``+Inf``).

    Label sets that differ only in labels other than ``arm`` (an engine's ``pid`` or
    rank) are added up. Raises ConfigError when the text holds no such family.
    """
    from prometheus_client.parser import text_string_to_metric_families

    name = f"{prefix}_{FAMILY}"
    cumulative: dict[str, dict[float, float]] = {}
    found = False
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ConfigError(f"not a Prometheus text exposition: {exc}", path="source") from None
    for fam in families:
        if fam.name != name:
            continue
        found = True
        for s in fam.samples:
            if s.name != f"{name}_bucket" or "arm" not in s.labels:
                continue
            le = float(s.labels["le"])
            per = cumulative.setdefault(s.labels["arm"], {})
            per[le] = per.get(le, 0.0) + s.value
    if not found:
        raise ConfigError(f"no {name} in the metrics (is the live A/B hook installed on this decode?)", path="source")
    by_arm: dict[str, list[int]] = {}
    for arm, per in cumulative.items():
        counts = [0] * (MAX_ACCEPTED + 1)
        prev = 0.0
        for le in sorted(per):
            k = MAX_ACCEPTED if math.isinf(le) else int(le)
            counts[min(k, MAX_ACCEPTED)] += round(per[le] - prev)
            prev = per[le]
        by_arm[arm] = counts
    return _arms(by_arm)


def parse_json(text: str) -> dict[str, ArmAcceptance]:
    """Per-arm counts from a ``Metrics.snapshot()`` dump or a first-verify JSON-lines log."""
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            doc = None  # several objects: a JSON-lines log
        if isinstance(doc, dict) and "first_verify_accepted_by_arm" in doc:
            return _arms(doc["first_verify_accepted_by_arm"])
    by_arm: dict[str, list[int]] = {}
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            arm, k = rec["arm"], int(rec["accepted"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"line {i}: not a first-verify record ({exc})", path="source") from None
        if arm is None or k < 0:
            continue  # unattributed first verify
        by_arm.setdefault(str(arm), [0] * (MAX_ACCEPTED + 1))[min(k, MAX_ACCEPTED)] += 1
    return _arms(by_arm)


def load(source: str, prefix: str = PREFIX, timeout_s: float = 5.0) -> dict[str, ArmAcceptance]:
    """Per-arm counts from a URL or a file (format detected from the content)."""
    if source.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(source, timeout=timeout_s) as resp:
                text = resp.read().decode("utf-8")
        except (urllib.error.URLError, OSError) as exc:
            raise ConfigError(f"cannot read {source}: {exc}", path="url") from None
        return parse_prometheus(text, prefix)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {source}: {exc}", path="from") from None
    if text.lstrip().startswith(("{", "[")):
        return parse_json(text)
    return parse_prometheus(text, prefix)


def subtract(now: Mapping[str, ArmAcceptance], before: Mapping[str, ArmAcceptance]) -> dict[str, ArmAcceptance]:
    """The first verifies between two reads of the same decode's counters (``now`` minus ``before``).

    ConfigError when a count went down: the decode restarted in between, or ``before``
    came from another decode.
    """
    out: dict[str, list[int]] = {}
    for arm, a in now.items():
        b = before.get(arm)
        diff = [x - (b.counts[k] if b is not None and k < len(b.counts) else 0) for k, x in enumerate(a.counts)]
        if min(diff, default=0) < 0:
            raise ConfigError(f"arm {arm!r}: counts went down since the earlier read (decode restarted?)", path="since")
        out[arm] = diff
    return _arms(out)


def summarize(arms: Mapping[str, ArmAcceptance], baseline: str | None, confidence: float = 0.95) -> dict[str, Any]:
    """The report as plain data: per arm n, mean, acceptance, their CIs, ratio vs baseline."""
    if not arms:
        raise ConfigError("no first verifies recorded yet for any arm", path="source")
    base = baseline if baseline is not None else ("one_hot" if "one_hot" in arms else next(iter(arms)))
    if base not in arms:
        raise ConfigError(f"baseline arm {base!r} has no first verifies; arms: {sorted(arms)}", path="baseline")
    rows = []
    for a in arms.values():
        lo, hi = a.mean_interval(confidence)
        rlo, rhi = a.rate_interval(confidence)
        # The baseline against itself is 1 by definition: no interval.
        r, r_lo, r_hi = (1.0, math.nan, math.nan) if a.arm == base else ratio_interval(a, arms[base], confidence)
        rows.append(
            {
                "arm": a.arm,
                "first_verifies": a.n,
                "mean_accepted": a.mean,
                "mean_accepted_ci": [lo, hi],
                "acceptance": a.first_accepted / a.n,
                "acceptance_ci": [rlo, rhi],
                "ratio_vs_baseline": r,
                "ratio_ci": [r_lo, r_hi],
            }
        )
    return {"baseline": base, "confidence": confidence, "arms": rows}


def _fmt(x: float, nd: int = 3) -> str:
    return "-" if math.isnan(x) else f"{x:.{nd}f}"


def format_table(report: Mapping[str, Any]) -> str:
    pct = round(report["confidence"] * 100)
    head = (
        f"{'arm':<16} {'first verifies':>14}  {'mean accepted [' + str(pct) + '% CI]':<28}"
        f"{'acceptance [' + str(pct) + '% CI]':<28}{'ratio vs ' + report['baseline'] + ' [CI]'}"
    )
    lines = [head]
    for r in report["arms"]:
        m = f"{_fmt(r['mean_accepted'])} [{_fmt(r['mean_accepted_ci'][0])}, {_fmt(r['mean_accepted_ci'][1])}]"
        a = f"{_fmt(r['acceptance'])} [{_fmt(r['acceptance_ci'][0])}, {_fmt(r['acceptance_ci'][1])}]"
        q = f"{_fmt(r['ratio_vs_baseline'])} [{_fmt(r['ratio_ci'][0])}, {_fmt(r['ratio_ci'][1])}]"
        lines.append(f"{r['arm']:<16} {r['first_verifies']:>14}  {m:<28}{a:<28}{q}")
    lines.append(
        "mean accepted: draft tokens accepted at each request's first verify (bonus excluded); "
        "acceptance: share whose first draft position was accepted."
    )
    few = [r["arm"] for r in report["arms"] if r["first_verifies"] < SMALL_N]
    if few:
        lines.append(
            f"note: fewer than {SMALL_N} first verifies in {', '.join(few)}: the normal intervals are rough there."
        )
    return "\n".join(lines)


def _no_nan(x: Any) -> Any:
    # JSON has no NaN: an undefined figure (too few verifies, a zero mean) is null.
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return x


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``live-ab`` on the CLI's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "live-ab",
        help="per-arm first-verify acceptance of a live A/B, from a decode's metrics",
        description="Print each arm's first-verify acceptance (mean accepted draft tokens and the "
        "share whose first position was accepted, with CIs) and its ratio against a baseline arm, "
        "from a running decode's /metrics or a saved scrape, snapshot or first-verify log.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a decode's metrics URL, e.g. http://127.0.0.1:9400/metrics")
    src.add_argument("--from", dest="source", metavar="FILE", help="saved scrape, snapshot JSON or first-verify log")
    p.add_argument(
        "--since",
        metavar="FILE",
        default=None,
        help="an earlier saved scrape or snapshot: report only what came after it",
    )
    p.add_argument(
        "--baseline", default=None, metavar="ARM", help="arm to compare against (default: one_hot, else the first)"
    )
    p.add_argument("--confidence", type=float, default=0.95, help="CI level (default 0.95)")
    p.add_argument("--prefix", default=PREFIX, help=f"metric name prefix (default {PREFIX})")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """The ``live-ab`` command: 0 on a report, ConfigError (exit 2) when there is nothing to report."""
    if not 0 < args.confidence < 1:
        raise ConfigError(f"--confidence must be in (0, 1), got {args.confidence}", path="confidence")
    arms = load(args.url or args.source, args.prefix)
    if args.since is not None:
        arms = subtract(arms, load(args.since, args.prefix))
    report = summarize(arms, args.baseline, args.confidence)
    if args.json:
        print(json.dumps(_no_nan(report), indent=2))
    else:
        print(format_table(report))
    return 0
