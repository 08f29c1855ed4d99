"""Progress of the A/B job on stderr: a ``rich`` bar on a terminal, a line per 10% otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """``update(done)`` with a running total; ``close()`` ends the bar."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.t0 = time.monotonic()
        self._last_decile = -1
        self.done = 0
        self._bar: Any = None
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            # Fits the terminal's width; transient, so the table printed next starts clean.
            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("payloads"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self._task = self._bar.add_task(label, total=self.total)
            self._bar.start()

    def update(self, done: int) -> None:
        self.done = done
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
            return
        frac = min(1.0, done / self.total)
        decile = int(frac * 10)
        if decile > self._last_decile:
            self._last_decile = decile
            self.stream.write(
                f"{self.label}: {done}/{self.total} payloads ({frac:.0%}) after {time.monotonic() - self.t0:.1f}s\n"
            )
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
