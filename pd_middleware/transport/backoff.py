"""The one polling backoff of the transport: fast while work is fresh, then doubling.

A Mooncake write on loopback lands in tens of microseconds, so a waiter polls every
``POLL_MIN_S`` for the first ``POLL_FAST_S``; after that it doubles its sleep up to
``POLL_MAX_S``, so a long wait costs little CPU (the machine is shared with the engine's
own threads).
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: First polling interval, in seconds.
POLL_MIN_S = 20e-6
#: How long to poll at the first interval before backing off, in seconds.
POLL_FAST_S = 2e-3
#: Longest polling interval, in seconds.
POLL_MAX_S = 1e-3


class Backoff:
    """Sleeps for a waiter; :meth:`reset` when new work makes fast polling worth it again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.delay = POLL_MIN_S
        self._since: float | None = None

    def reset(self) -> None:
        self.delay = POLL_MIN_S
        self._since = None

    def sleep(self) -> None:
        """Sleep the current interval; double it once the fast window has passed."""
        now = self._clock()
        if self._since is None:
            self._since = now
        elif now - self._since > POLL_FAST_S:
            self.delay = min(self.delay * 2, POLL_MAX_S)
        time.sleep(self.delay)
