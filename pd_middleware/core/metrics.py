"""Counters and histograms of the decode side, and their Prometheus names.

Plain Python integers on the hot path (one attribute increment per event); the
Prometheus export (optional extra ``prometheus``) reads them at scrape time through a
custom collector, so scraping costs nothing per payload. Histograms are pre-bucketed:
an observation is one ``bisect`` over a tuple of bounds and two in-place increments,
with no object built per observation.

Exported names (``docs/metrics.md`` documents each, with PromQL):

=============================================== ========= ======================================
name                                            type      labels
=============================================== ========= ======================================
``pd_middleware_payloads_received_total``       counter
``pd_middleware_payloads_delivered_total``      counter   ``arm``
``pd_middleware_payloads_failed_total``         counter   ``reason``
``pd_middleware_payloads_failed_by_arm_total``  counter   ``arm``
``pd_middleware_fallbacks_total``               counter   ``reason``
``pd_middleware_received_bytes_total``          counter   ``plane``
``pd_middleware_receive_to_delivery_seconds``   histogram
``pd_middleware_batch_assembly_seconds``        histogram
``pd_middleware_first_verify_accepted_tokens``  histogram ``arm`` (``_count``: first verifies,
                                                          ``_sum``: drafts accepted at them)
``pd_middleware_first_verify_unattributed_total`` counter
=============================================== ========= ======================================

Invariant the tests check: ``received == delivered + failed_total + in_flight`` where
``in_flight`` is what the receiver holds between arrival and outcome.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

PLANES: tuple[str, ...] = ("control", "inline", "bulk")

#: Most distinct failure reasons kept; later new reasons count as ``<stage>:other``.
MAX_REASONS = 256
#: Longest failure reason kept as its own key, in characters.
MAX_REASON_CHARS = 128
#: Most A/B arms whose first verifies are kept apart; later arms count as unattributed.
MAX_ARMS = 64
#: Largest accepted-draft count kept as its own bucket (the config's num_steps cap).
MAX_ACCEPTED = 16

PREFIX = "pd_middleware"

#: Receive-to-delivery buckets, in seconds: the pipeline's work is microseconds per
#: payload, a payload that waited behind a slow hook is milliseconds.
RECEIVE_BUCKETS: tuple[float, ...] = (
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    0.1,
    1.0,
)
#: Batch assembly buckets, in seconds: a sparse scatter is ~10 µs, a dense (B, V) copy ~ms.
ASSEMBLY_BUCKETS: tuple[float, ...] = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    1.0,
)


class Histogram:
    """A pre-bucketed histogram: ``counts[i]`` observations in ``(bounds[i-1], bounds[i]]``.

    ``counts`` has one more entry than ``bounds``: the last one is ``+Inf``. The
    bucket rule is Prometheus's ``le`` (a value equal to a bound lands in that bound's
    bucket). Updated by one thread; readers copy through :meth:`snapshot`.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        b = tuple(float(x) for x in bounds)
        if not b or list(b) != sorted(set(b)):
            raise ValueError(f"bounds must be non-empty, strictly increasing: {bounds!r}")
        self.bounds = b
        self.counts = [0] * (len(b) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (seconds, tokens: the unit of the bounds)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> dict[str, Any]:
        """``{"bounds": [...], "counts": [...] (per bucket, +Inf last), "sum": s}``."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class Metrics:
    """Decode-side counters. Updated by one thread; read from any (snapshots copy)."""

    def __init__(self) -> None:
        self.received = 0
        self.delivered = 0
        self.failed: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        # Plain dicts, bumped for every payload: Counter's item assignment is ~2x slower
        # (it defines __delitem__ in Python, which slows every store; benchmarks/hooks.py).
        self.bytes: dict[str, int] = dict.fromkeys(PLANES, 0)
        self.arm_delivered: dict[str, int] = {}
        self.arm_failed: Counter[str] = Counter()
        # From ReceiveContext.received_at (stamped by the receiver) to the Delivery.
        self.receive_to_delivery = Histogram(RECEIVE_BUCKETS)
        # One observation per batch whose draft_probs the middleware built.
        self.batch_assembly = Histogram(ASSEMBLY_BUCKETS)
        # Live A/B: per arm, counts[k] = first verifies that accepted k draft tokens.
        self.first_verify: dict[str, list[int]] = {}
        # First verifies whose request carried no arm (or past MAX_ARMS arms).
        self.first_verify_unattributed = 0
        # 1 while the transport's receive loop runs, 0 once it ended (set by the receiver).
        self.receiver_alive = 0
        # Times a receive loop ended on its own (never, by design): a counter, so it sums
        # across processes where a 0/1 gauge would not (metrics_export's mirror).
        self.receiver_deaths = 0
        self._lock = threading.Lock()

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())

    def record_failure(self, reason: str, arm: str | None = None) -> None:
        """Count one failed payload under ``reason`` (e.g. ``wire:draft_probs``).

        Reasons can carry sender-chosen text (an unknown field's name), so their
        number and length are capped: past :data:`MAX_REASONS` distinct keys, or for a
        key longer than :data:`MAX_REASON_CHARS`, the failure is counted under
        ``<stage>:other``. Without the cap a hostile prefill grows this Counter (and
        the Prometheus label set) by one entry per message.
        """
        failed = self.failed
        if reason not in failed and (len(failed) >= MAX_REASONS or len(reason) > MAX_REASON_CHARS):
            reason = f"{reason.split(':', 1)[0][:32]}:other"
        failed[reason] += 1
        if arm is not None:
            self.arm_failed[arm] += 1

    def record_first_verify(self, arm: str | None, accepted: int) -> None:
        """Count one request's first verify: ``accepted`` draft tokens (bonus excluded).

        ``arm`` is the A/B arm the request's proposal came from (None: unknown, counted
        apart). ``accepted`` above :data:`MAX_ACCEPTED` is clamped into the last bucket;
        a negative value is a caller bug (ValueError).
        """
        if accepted < 0:
            raise ValueError(f"accepted draft tokens must be >= 0, got {accepted}")
        per_arm = self.first_verify
        counts = per_arm.get(arm) if arm is not None else None
        if counts is None:
            if arm is None or len(per_arm) >= MAX_ARMS:
                self.first_verify_unattributed += 1
                return
            counts = per_arm[arm] = [0] * (MAX_ACCEPTED + 1)
        counts[min(accepted, MAX_ACCEPTED)] += 1

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of every counter as plain dicts, lists and numbers (JSON-ready)."""
        with self._lock:
            return {
                "received": self.received,
                "delivered": self.delivered,
                "failed": self.failed_total,
                "failed_by_reason": dict(self.failed),
                "fallbacks_by_reason": dict(self.fallbacks),
                "bytes_by_plane": dict(self.bytes),
                "delivered_by_arm": dict(self.arm_delivered),
                "failed_by_arm": dict(self.arm_failed),
                "receive_to_delivery_seconds": self.receive_to_delivery.snapshot(),
                "batch_assembly_seconds": self.batch_assembly.snapshot(),
                "first_verify_accepted_by_arm": {a: list(c) for a, c in self.first_verify.items()},
                "first_verify_unattributed": self.first_verify_unattributed,
                "receiver_alive": self.receiver_alive,
                "receiver_deaths": self.receiver_deaths,
            }

    def format(self) -> str:
        """Human-readable multi-line summary."""
        s = self.snapshot()
        lines = [
            f"received  {s['received']}",
            f"delivered {s['delivered']}",
            f"failed    {s['failed']}",
        ]
        for reason, n in sorted(s["failed_by_reason"].items()):
            lines.append(f"  failed[{reason}] {n}")
        for reason, n in sorted(s["fallbacks_by_reason"].items()):
            lines.append(f"  fallback[{reason}] {n}")
        for plane, n in s["bytes_by_plane"].items():
            lines.append(f"bytes[{plane}] {n}")
        for arm, n in sorted(s["delivered_by_arm"].items()):
            lines.append(f"arm[{arm}] delivered {n} failed {s['failed_by_arm'].get(arm, 0)}")
        for arm, counts in sorted(s["first_verify_accepted_by_arm"].items()):
            n = sum(counts)
            acc = sum(k * c for k, c in enumerate(counts))
            lines.append(f"arm[{arm}] first verifies {n} accepted drafts {acc}")
        return "\n".join(lines)

    def families(self, prefix: str = PREFIX) -> Iterator[Any]:
        """The Prometheus metric families of one snapshot (needs ``prometheus_client``)."""
        return _families(self.snapshot(), prefix)

    def register_prometheus(self, registry: Any = None, prefix: str = PREFIX) -> Any:
        """Expose these counters through ``prometheus_client`` (optional extra).

        Returns the collector; ``prometheus_client.generate_latest(registry)`` then
        renders the Prometheus text format.
        """
        from prometheus_client import REGISTRY

        metrics = self

        class _Collector:
            def collect(self) -> Iterator[Any]:
                return metrics.families(prefix)

        collector = _Collector()
        (registry if registry is not None else REGISTRY).register(collector)
        return collector


def _cumulative(counts: Sequence[int], bounds: Sequence[float]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    acc = 0
    for bound, n in zip([*map(_le, bounds), "+Inf"], counts):
        acc += n
        out.append((bound, float(acc)))
    return out


def _le(bound: float) -> str:
    # Prometheus's own rendering of a bound: integers as "1.0", others as repr.
    from prometheus_client.utils import floatToGoString

    text: str = floatToGoString(bound)  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
    return text


def _families(s: dict[str, Any], prefix: str) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    c = CounterMetricFamily(f"{prefix}_payloads_received", "Payloads that reached the decode receive path")
    c.add_metric([], s["received"])
    yield c
    c = CounterMetricFamily(
        f"{prefix}_payloads_delivered", "Payloads delivered to the scheduler, by A/B arm", labels=["arm"]
    )
    for arm, n in sorted(s["delivered_by_arm"].items()):
        c.add_metric([arm], n)
    yield c
    c = CounterMetricFamily(f"{prefix}_payloads_failed", "Payloads that failed, by stage:field", labels=["reason"])
    for reason, n in sorted(s["failed_by_reason"].items()):
        c.add_metric([reason], n)
    yield c
    c = CounterMetricFamily(f"{prefix}_payloads_failed_by_arm", "Payloads that failed, by A/B arm", labels=["arm"])
    for arm, n in sorted(s["failed_by_arm"].items()):
        c.add_metric([arm], n)
    yield c
    c = CounterMetricFamily(f"{prefix}_fallbacks", "Exact one-hot fallbacks, by reason", labels=["reason"])
    for reason, n in sorted(s["fallbacks_by_reason"].items()):
        c.add_metric([reason], n)
    yield c
    c = CounterMetricFamily(f"{prefix}_received_bytes", "Bytes received, by plane", labels=["plane"])
    for plane, n in sorted(s["bytes_by_plane"].items()):
        c.add_metric([plane], n)
    yield c
    for name, doc in (
        ("receive_to_delivery_seconds", "From a payload's arrival to its delivery (hooks and synthesis)"),
        ("batch_assembly_seconds", "Building one batch's draft_probs"),
    ):
        h = s[name]
        fam = HistogramMetricFamily(f"{prefix}_{name}", doc)
        fam.add_metric([], _cumulative(h["counts"], h["bounds"]), h["sum"])
        yield fam
    fam = HistogramMetricFamily(
        f"{prefix}_first_verify_accepted_tokens",
        "Draft tokens accepted at each request's first verify, by A/B arm (_count: first verifies)",
        labels=["arm"],
    )
    bounds = list(range(MAX_ACCEPTED))  # le="0" .. le="15", then +Inf holds 16
    for arm, counts in sorted(s["first_verify_accepted_by_arm"].items()):
        total = sum(k * n for k, n in enumerate(counts))
        fam.add_metric([arm], _cumulative(counts, bounds), float(total))
    yield fam
    c = CounterMetricFamily(f"{prefix}_first_verify_unattributed", "First verifies of requests that carried no A/B arm")
    c.add_metric([], s["first_verify_unattributed"])
    yield c
    c = CounterMetricFamily(
        f"{prefix}_receive_loop_deaths", "Decode receive loops that ended on their own (alert on any)"
    )
    c.add_metric([], s["receiver_deaths"])
    yield c
