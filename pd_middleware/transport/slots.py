"""Decode-side receive slots: one registered region cut into fixed-size slots.

Each slot is *granted* to one prefill peer at hello; the peer writes a payload's bulk
tensors into a slot it owns and names it in the header. From then on the slot is
*held* by the decode until the :class:`~pd_middleware.pipeline.Delivery` that views it
is released (or at once when the payload fails), and only then is it returned to its
owner in a slot-free notice. A held slot is never handed back, so it is never
overwritten while in use. When a peer is lost, its free slots return to the pool at
once and its held slots when they are released.

Single-threaded by design: only the receiver loop touches a pool.
"""

from __future__ import annotations

import mmap
from typing import Hashable

from .._errors import WireError

_FREE = None


class SlotPool:
    """``count`` slots of ``size`` bytes in one page-aligned anonymous mapping."""

    def __init__(self, count: int, size: int) -> None:
        self.count = count
        self.size = size
        # mmap: page-aligned (good for RDMA registration) and lazily zero-filled.
        self.buffer = mmap.mmap(-1, max(count * size, mmap.PAGESIZE))
        self.view = memoryview(self.buffer)
        self.owner: list[Hashable | None] = [_FREE] * count
        self.held = bytearray(count)
        self._pool: list[int] = list(range(count - 1, -1, -1))

    @property
    def available(self) -> int:
        """Slots not granted to any peer."""
        return len(self._pool)

    def grant(self, peer: Hashable, n: int) -> list[int]:
        """Give up to ``n`` unowned slots to ``peer``."""
        out = []
        while self._pool and len(out) < n:
            s = self._pool.pop()
            self.owner[s] = peer
            out.append(s)
        return out

    def reclaim(self, peer: Hashable) -> list[int]:
        """Take back every slot of ``peer``; held ones become orphans until released."""
        back = []
        for s, o in enumerate(self.owner):
            if o == peer:
                self.owner[s] = _FREE
                if not self.held[s]:
                    self._pool.append(s)
                    back.append(s)
        return back

    def view_of(self, peer: Hashable, slot: int, offset: int, nbytes: int, field: str, rid: str) -> memoryview:
        """Zero-copy view of ``nbytes`` at ``offset`` of ``slot``, checked against ``peer``'s grant."""
        if not 0 <= slot < self.count or self.owner[slot] != peer:
            raise WireError(f"slot {slot} is not granted to this peer", field=f"{field}.slot", request_id=rid)
        if self.held[slot]:
            raise WireError(f"slot {slot} is still in use by an earlier payload", field=f"{field}.slot", request_id=rid)
        if offset + nbytes > self.size:
            raise WireError(
                f"range [{offset}, {offset + nbytes}) exceeds the {self.size}-byte slot",
                field=f"{field}.offset",
                request_id=rid,
            )
        base = slot * self.size + offset
        return self.view[base : base + nbytes]

    def hold(self, slot: int) -> None:
        self.held[slot] = 1

    def release(self, slot: int) -> Hashable | None:
        """Un-hold ``slot``; returns its owner to notify, or None if it went back to the pool."""
        self.held[slot] = 0
        owner = self.owner[slot]
        if owner is _FREE:
            self._pool.append(slot)
        return owner
