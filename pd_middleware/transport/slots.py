"""Decode-side receive slots: one registered region cut into fixed-size slots.

Each slot is *granted* to one prefill peer at hello; the peer writes a payload's bulk
tensors into a slot it owns and names it in the header. From then on the slot is
*held* by the decode until the :class:`~pd_middleware.decode.pipeline.Delivery` that views it
is released (or at once when the payload fails), and only then is it returned to its
owner in a slot-free notice. A held slot is never handed back, so it is never
overwritten while in use. When a peer is lost, its free slots return to the pool at
once and its held slots when they are released.

Each slot has a *generation* (:mod:`.integrity`): a grant sets it to a new grant number
in the high bits, and every payload names a higher one of the same grant. So a header is
good for one use: :meth:`SlotPool.admit` refuses a stale, replayed or foreign generation
and any region whose digest does not match the bytes, and a release carries the
generation it was issued for, so a late or repeated release cannot free a later use.

Single-threaded by design: only the receiver loop touches a pool.
"""

from __future__ import annotations

import mmap
from collections.abc import Hashable

from ..core._errors import IntegrityError, WireError
from . import integrity
from .wire import TensorRef

_FREE = None


class SlotPool:
    """``count`` slots of ``size`` bytes in one page-aligned anonymous mapping.

    ``digest``: the algorithm the decode requires of slot regions; ``key``: the key that
    binds a region's digest to its request, slot, generation and offset (:mod:`.integrity`).
    """

    def __init__(self, count: int, size: int, digest: str = "xxh3_128", key: bytes | None = None) -> None:
        self.count = count
        self.size = size
        # mmap: page-aligned (good for RDMA registration) and lazily zero-filled.
        self.buffer = mmap.mmap(-1, max(count * size, mmap.PAGESIZE))
        self.view = memoryview(self.buffer)
        self.owner: list[Hashable | None] = [_FREE] * count
        self.held = bytearray(count)
        self.digest = digest
        self._key = key  # binds each digest to its use (integrity.key_for)
        # Current generation per slot: grant number << USE_BITS | last use admitted.
        self.gen: list[int] = [0] * count
        self._grants = 0
        self._pool: list[int] = list(range(count - 1, -1, -1))

    @property
    def available(self) -> int:
        """Slots not granted to any peer."""
        return len(self._pool)

    def grant(self, peer: Hashable, n: int) -> list[int]:
        """Give up to ``n`` unowned slots to ``peer``, each at a new grant generation."""
        self._grants += 1
        base = self._grants << integrity.USE_BITS
        out: list[int] = []
        while self._pool and len(out) < n:
            s = self._pool.pop()
            self.owner[s] = peer
            self.gen[s] = base
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

    def admit(self, slot: int, refs: list[tuple[str, TensorRef]], rid: str, key: bytes | None = None) -> int:
        """Check a payload's slot regions against the slot; return the generation it used.

        Call after :meth:`view_of` accepted every region (owner, range, not held).
        ``refs`` are the header's ``(field, ref)`` slot regions (``payload_codec.slot_refs``);
        ``key``: the sending peer's digest key (per-prefill HMAC keys), else the pool's.
        All must name one generation, of this slot's current grant and above its last
        use; it is consumed at once, even if a digest then fails, so no header can be
        used twice. Then each region's digest is checked on the bytes in place. Raises
        :class:`IntegrityError` (``.field`` ``<region>.gen`` or ``<region>.digest``).
        """
        field, first = refs[0]
        g = first.gen
        for f, ref in refs[1:]:
            if ref.gen != g:
                raise IntegrityError(
                    f"generation {ref.gen:#x} differs from {field}'s {g:#x}", field=f"{f}.gen", request_id=rid
                )
        cur = self.gen[slot]
        if g >> integrity.USE_BITS != cur >> integrity.USE_BITS or g <= cur:
            raise IntegrityError(
                f"generation {g:#x} is stale or not of this grant (slot {slot} is at {cur:#x})",
                field=f"{field}.gen",
                request_id=rid,
            )
        self.gen[slot] = g
        base = slot * self.size
        view = self.view
        for f, ref in refs:
            lo = base + ref.offset
            use = (slot, g, ref.offset)
            integrity.verify(
                view[lo : lo + ref.nbytes], ref.digest, self.digest, f"{f}.digest", rid, use, key or self._key
            )
        return g

    def hold(self, slot: int) -> None:
        """Mark ``slot`` in use by a delivery (at its current generation)."""
        self.held[slot] = 1

    def is_held(self, slot: int, gen: int) -> bool:
        """Whether ``slot`` is held by the use of generation ``gen`` (not a later one)."""
        return bool(self.held[slot]) and self.gen[slot] == gen

    def release(self, slot: int, gen: int) -> tuple[bool, Hashable | None]:
        """Un-hold ``slot`` if the use of generation ``gen`` still holds it.

        Returns ``(released, owner)``: ``released`` False for a stale release (the slot
        is free, or held by a later use: nothing changes); ``owner`` is the peer to
        notify, or None when the slot went back to the pool.
        """
        if not self.is_held(slot, gen):
            return False, None
        self.held[slot] = 0
        owner = self.owner[slot]
        if owner is _FREE:
            self._pool.append(slot)
        return True, owner
