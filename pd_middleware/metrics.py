"""Counters for the receive path: received, delivered, failed by reason, bytes by plane.

Plain Python integers on the hot path (one attribute increment per event); the
Prometheus export (optional extra ``prometheus``) reads them at scrape time through a
custom collector, so scraping costs nothing per payload.

Invariant the tests check: ``received == delivered + failed_total + in_flight`` where
``in_flight`` is what the receiver holds between arrival and outcome.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

PLANES: tuple[str, ...] = ("control", "inline", "bulk")

#: Most distinct failure reasons kept; later new reasons count as ``<stage>:other``.
MAX_REASONS = 256
#: Longest failure reason kept as its own key, in characters.
MAX_REASON_CHARS = 128


class Metrics:
    """Receive-path counters. Updated by one thread; read from any (snapshots copy)."""

    def __init__(self) -> None:
        self.received = 0
        self.delivered = 0
        self.failed: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        # Plain dicts, bumped for every payload: Counter's item assignment is ~2x slower
        # (it defines __delitem__ in Python, which slows every store; benchmarks/hooks.py).
        self.bytes: dict[str, int] = {p: 0 for p in PLANES}
        self.arm_delivered: dict[str, int] = {}
        self.arm_failed: Counter[str] = Counter()
        # 1 while the receive loop runs, 0 once it ended (set by the transport receiver).
        self.receiver_alive = 0
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

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of every counter as plain dicts and ints."""
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
                "receiver_alive": self.receiver_alive,
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
        return "\n".join(lines)

    def register_prometheus(self, registry: Any = None, prefix: str = "pd_middleware") -> Any:
        """Expose these counters through ``prometheus_client`` (optional extra).

        Returns the collector; ``prometheus_client.generate_latest(registry)`` then
        renders the Prometheus text format.
        """
        from prometheus_client import REGISTRY
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        metrics = self

        class _Collector:
            def collect(self):  # noqa: ANN202 - prometheus_client protocol
                s = metrics.snapshot()
                c = CounterMetricFamily(f"{prefix}_received", "Payloads received")
                c.add_metric([], s["received"])
                yield c
                c = CounterMetricFamily(f"{prefix}_delivered", "Payloads delivered", labels=["arm"])
                for arm, n in sorted(s["delivered_by_arm"].items()):
                    c.add_metric([arm], n)
                yield c
                c = CounterMetricFamily(f"{prefix}_failed", "Payloads failed, by reason", labels=["reason"])
                for reason, n in sorted(s["failed_by_reason"].items()):
                    c.add_metric([reason], n)
                yield c
                c = CounterMetricFamily(
                    f"{prefix}_fallbacks", "One-hot fallbacks by the provenance guard", labels=["reason"]
                )
                for reason, n in sorted(s["fallbacks_by_reason"].items()):
                    c.add_metric([reason], n)
                yield c
                c = CounterMetricFamily(f"{prefix}_bytes", "Bytes received, by plane", labels=["plane"])
                for plane, n in sorted(s["bytes_by_plane"].items()):
                    c.add_metric([plane], n)
                yield c
                g = GaugeMetricFamily(f"{prefix}_receiver_alive", "1 while the decode receive loop runs")
                g.add_metric([], s["receiver_alive"])
                yield g

        collector = _Collector()
        (registry if registry is not None else REGISTRY).register(collector)
        return collector
