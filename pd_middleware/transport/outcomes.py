"""The decode's outcome queue: what the receive loop hands the scheduler, bounded by backpressure.

One producer (the receive loop) and any consumers (:meth:`OutcomeQueue.get` /
:meth:`drain`, normally the scheduler). A deque plus an event set once per receive
batch, not a queue woken per item: waking the scheduler thread for every payload made
the two threads trade the GIL on every message (benchmarks/receive.py).

The loop counts the inline bytes of each outcome it puts (``bytes_in``) and of each
payload released (``bytes_out``: a Delivery's ``release()``, or at once for a failure),
and stops reading the socket while the outcomes queued or the inline bytes not yet
released are at their limit. Counting until release, not until a consumer takes the
outcome, keeps the cap through a consumer that holds what it took (SGLang's
``ProposalStore``). Nothing is ever dropped: libzmq, then TCP, hold the rest.
Once the loop has died (``dead`` set), a consumer that finds the queue empty gets a
:class:`~pd_middleware.TransferError` at once instead of waiting forever.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..core._errors import TransferError


class OutcomeQueue:
    """Outcomes for the scheduler; ``wake_loop`` is called when a take relieves backpressure."""

    def __init__(self, wake_loop: Callable[[], None], where: str = "") -> None:
        self.items: deque[Any] = deque()
        self.bytes_in = 0  # inline bytes of the payloads queued, ever (loop thread)
        self.bytes_out = 0  # inline bytes of the payloads released, ever (loop thread)
        self.backpressure = False  # set by the loop while it is not reading
        self.dead: str | None = None  # why the loop ended on its own
        self.pending_wake = False
        self._ready = threading.Event()
        self._wake_loop = wake_loop
        self.where = where

    # -- loop side ----------------------------------------------------------------------

    def put(self, outcome: Any, nbytes: int = 0) -> None:
        """Queue ``outcome``, whose payload holds ``nbytes`` inline bytes until :meth:`freed`."""
        self.items.append(outcome)
        self.bytes_in += nbytes
        self.pending_wake = True

    def freed(self, nbytes: int) -> None:
        """A payload holding ``nbytes`` inline bytes was released."""
        self.bytes_out += nbytes

    def notify(self) -> None:
        """Wake a waiting consumer once for everything put since the last call."""
        if self.pending_wake:
            self.pending_wake = False
            self._ready.set()

    def full(self, max_items: int, max_bytes: int) -> bool:
        return len(self.items) >= max_items or self.bytes_in - self.bytes_out >= max_bytes

    # -- consumer side ------------------------------------------------------------------

    def _raise_dead(self) -> None:
        raise TransferError(f"the decode receive loop stopped: {self.dead}", op="receive", peer=self.where)

    def _took(self, item: Any) -> Any:
        if self.backpressure:
            self._wake_loop()
        return item

    def get(self, timeout: float | None = None) -> Any:
        """Next outcome, waiting up to ``timeout`` seconds; None if none came; raises once dead."""
        items = self.items
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._took(items.popleft())
            except IndexError:
                pass
            self._ready.clear()
            try:  # re-check after clearing: an append before the clear is not lost
                return self._took(items.popleft())
            except IndexError:
                pass
            if self.dead is not None:
                self._raise_dead()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._ready.wait(left)

    def drain(self, max_items: int = 1 << 30) -> list[Any]:
        """Every outcome ready now, at most ``max_items``; raises once dead and empty."""
        out: list[Any] = []
        pop = self.items.popleft
        try:
            while len(out) < max_items:
                out.append(pop())
        except IndexError:
            pass
        if self.backpressure and out:
            self._wake_loop()
        if not out and self.dead is not None:
            self._raise_dead()
        return out
