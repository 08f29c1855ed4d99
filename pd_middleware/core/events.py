"""One part's event counters: count, log the first of each key once, mirror fallbacks.

Every component that degrades on purpose (a synthesizer falling back to one-hot, a
wrapper whose batch fails, the in-band row that overflows, a prefill that cannot publish)
reports through one :class:`Events` object, so the three things an operator needs happen
the same way everywhere:

- **count**: ``counts[key] += n``, under a lock (the SGLang scheduler counts while the
  metrics copy reads);
- **log once**: the first event of each key is logged (at the level the caller gives),
  later ones are only counted, so a failure on every batch cannot flood the log;
- **mirror**: an event marked ``fallback`` (a request verified with the exact one-hot
  proposal instead of what was configured) is also added to ``Metrics.fallbacks``, the
  ``pd_middleware_fallbacks_total{reason}`` counter.

**The key scheme.** A key is ``<family>:<detail>`` (``fallback:no_hidden``,
``inband:overflow``, ``guard:propose:ValueError``, ``agreement:x_differs``) or a bare
family for a plain tally (``staged``, ``batches``). The mirror key of a fallback is
``<source>:<key>`` with a leading ``fallback:`` family dropped: ``source = "sglang"``
turns ``fallback:missing`` into ``sglang:missing`` and ``guard:propose:ValueError``
into ``sglang:guard:propose:ValueError``; an empty source mirrors the key itself (the
provenance guard's ``greedy``, ``not_sampled_from_sent``). ``docs/metrics.md`` lists
every source.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["FALLBACK_FAMILY", "Events"]

#: The family whose events are dropped from the mirror key (``fallback:<reason>``).
FALLBACK_FAMILY = "fallback:"


class Events:
    """Counters of one part of the middleware, logged once per key, fallbacks mirrored.

    ``part``: what the counts describe (``decode``, ``prefill``, ``inband``, ``guard``,
    ``recompute``: the ``part`` label of SGLang's integration events); ``source``: the
    prefix of mirrored fallbacks (see the module docstring; ``""`` for none);
    ``metrics``: anything with a ``fallbacks`` Counter (a :class:`~pd_middleware.Metrics`),
    attachable later; ``logger``: where the first event of each key is logged.
    """

    def __init__(
        self,
        part: str,
        *,
        source: str = "",
        metrics: Any = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.part = part
        self.source = source
        self.metrics = metrics
        self.logger = logger if logger is not None else logging.getLogger("pd_middleware")
        self.counts: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def attach_metrics(self, metrics: Any) -> None:
        """Mirror fallbacks into ``metrics.fallbacks`` from now on."""
        self.metrics = metrics

    def mirror_key(self, key: str) -> str:
        """The ``Metrics.fallbacks`` key of fallback ``key`` (the module's key scheme)."""
        reason = key[len(FALLBACK_FAMILY) :] if key.startswith(FALLBACK_FAMILY) else key
        return f"{self.source}:{reason}" if self.source else reason

    def count(
        self,
        key: str,
        n: int = 1,
        *,
        fallback: bool = False,
        log: str | Callable[[], str] | None = None,
        level: int = logging.WARNING,
    ) -> bool:
        """Count ``n`` events of ``key``; returns whether this was the key's first event.

        ``fallback``: also add ``n`` to the mirror (``Metrics.fallbacks``); ``log``: the
        message logged (at ``level``) for the key's first event only: a string, or a
        callable that builds it (nothing is formatted for the events after the first).
        The log line ends with "(logged once; counted as <key>)".
        """
        if n <= 0:
            return False
        with self._lock:
            self.counts[key] += n
            first = key not in self._logged
            self._logged.add(key)
        if fallback and self.metrics is not None:
            self.metrics.fallbacks[self.mirror_key(key)] += n
        if first and log is not None:
            text = log() if callable(log) else log
            self.logger.log(level, "%s (logged once; counted as %s)", text, key)
        return first

    def failed(self, where: str, exc: BaseException | str, instead: str) -> None:
        """A guarded step of ours failed: count ``guard:<where>:<error>`` as a fallback and
        log it once at ERROR, saying what is used instead (``instead``)."""
        why = exc if isinstance(exc, str) else type(exc).__name__
        self.count(
            f"guard:{where}:{why}",
            fallback=True,
            log=lambda: f"pd-middleware {where} failed ({exc}); {instead} is used for this batch",
            level=logging.ERROR,
        )

    def snapshot(self) -> dict[str, int]:
        """A copy of the counts (safe while another thread counts)."""
        with self._lock:
            return dict(self.counts)
