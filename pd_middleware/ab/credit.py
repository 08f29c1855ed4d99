"""The decode's credit: how the A/B job's prefill process is paced, batch by batch.

The decode grants one batch of credit each time it has verified a batch; the prefill
takes one before it generates each batch. So at most ``window`` batches of every arm
are in flight (generated, encoded, on the wire, filed, assembled or waiting for the
verifier) whatever the number of requests, and neither process grows a buffer when
the other is slower: the faster one waits.

One case needs more than a count: a payload that never reaches the decode (a send that
failed) leaves its batch incomplete, so it is never verified and no credit comes back.
A prefill that has waited ``stall_s`` flushes its sender (every payload it sent has
been acknowledged) and publishes that batches ``0 .. k-1`` are complete on the wire
(:attr:`Credit.acknowledged`); the decode then fails whatever of those batches is
still missing ("never arrived at the decode") and the run goes on. Nothing is dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..core._errors import PDMiddlewareError

#: Batches of every arm in flight between the two processes. Two keep both busy (the
#: prefill encodes batch k + 1 while the decode verifies batch k); each costs the decode
#: about (2S + 1 + arms·S)·B·V·4 bytes, 136 MB for the main job.
IN_FLIGHT_BATCHES = 2


class Credit:
    """Shared between the decode and its prefill child (picklable for ``spawn``)."""

    def __init__(self, ctx: Any, window: int = IN_FLIGHT_BATCHES) -> None:
        """``ctx``: the multiprocessing context the prefill is spawned from."""
        if window < 1:
            raise ValueError(f"credit window must be >= 1, got {window}")
        self.window = window
        self._sem = ctx.Semaphore(window)
        self._acked = ctx.Value("q", 0)

    # -- decode side --------------------------------------------------------------------

    def grant(self) -> None:
        """One batch verified: the prefill may start one more."""
        self._sem.release()

    @property
    def acknowledged(self) -> int:
        """Batches ``0 .. n-1`` were sent and every payload of them acknowledged (published on a stall)."""
        return int(self._acked.value)

    # -- prefill side -------------------------------------------------------------------

    def take(self, k: int, flush: Callable[[float], bool], timeout_s: float, stall_s: float = 1.0) -> float:
        """Wait for the credit to start batch ``k``; return the seconds waited.

        ``flush(timeout)``: the sender's flush (True once every sent payload has a status).
        Raises PDMiddlewareError after ``timeout_s`` without credit.
        """
        t0 = time.monotonic()
        published = self.acknowledged >= k
        while not self._sem.acquire(timeout=stall_s):
            if not published and flush(stall_s):
                self._acked.value = k
                published = True
            if time.monotonic() - t0 > timeout_s:
                raise PDMiddlewareError(f"ab prefill: no credit from the decode for batch {k} in {timeout_s:.0f}s")
        return time.monotonic() - t0
