"""A dependency-free progress bar on stderr (a line per 10% when stderr is not a TTY)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update(done)`` with a running total; ``close()`` ends the line."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.t0 = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1
        self.done = 0

    def update(self, done: int) -> None:
        self.done = done
        if not self.enabled:
            return
        now = time.monotonic()
        frac = min(1.0, done / self.total)
        if self.tty:
            if now - self._last_draw < 0.1 and done < self.total:
                return
            self._last_draw = now
            width = 30
            fill = int(frac * width)
            rate = done / max(1e-9, now - self.t0)
            eta = (self.total - done) / rate if rate > 0 else float("inf")
            self.stream.write(
                f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} "
                f"{rate:7.1f}/s eta {eta:5.0f}s"
            )
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile > self._last_decile:
                self._last_decile = decile
                self.stream.write(f"{self.label}: {done}/{self.total} ({frac:.0%}) after {now - self.t0:.1f}s\n")
                self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.update(self.done)
            self.stream.write("\n")
            self.stream.flush()
