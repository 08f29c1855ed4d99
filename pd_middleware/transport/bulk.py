"""A prefill's bulk writes: where their bytes come from, and the writes still in flight.

Used by :class:`~pd_middleware.transport.sender.PrefillSender`, under its lock; nothing
here is thread-safe on its own.

- *Sources.* Buffers registered with :meth:`BulkWriter.register_source` are written
  from directly (zero copy); any other tensor is copied into a *staging region*. There
  is one region per write that may be in flight (``mooncake.max_inflight_writes``), each
  the size of a decode slot, in one registered mapping.
- *Writes in flight.* A write is submitted with :meth:`MooncakeEngine.start_write` and
  then polled, never waited for with a spinning call. :meth:`BulkWriter.poll` makes one
  non-blocking pass and hands every write that ended (landed, failed or given up on) to
  the sender, which sends its header or fails its request.
"""

from __future__ import annotations

import ctypes
import mmap
from collections import deque
from collections.abc import Callable
from typing import Any

from ..core._errors import TransferAbandoned, TransferError
from ..core.payload import Payload
from . import integrity, payload_codec, wire
from .backoff import Backoff
from .mooncake import MooncakeEngine, Range


def _flat(buf: Any) -> memoryview:
    """``buf`` as a flat byte view, read in place (TypeError for a non-contiguous view)."""
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


class InFlight:
    """A bulk write submitted but not yet seen complete; its header waits for it."""

    __slots__ = ("bids", "error", "header", "region", "seq", "slot", "started")

    def __init__(self, seq: int, slot: int, header: Any, bids: list[int], region: int, started: float) -> None:
        self.seq = seq
        self.slot = slot
        self.header = header
        self.bids = bids
        self.region = region  # staging region used, or -1
        self.started = started
        self.error: TransferError | None = None


class BulkWriter:
    """Staging memory, registered sources and the writes in flight of one sender.

    ``engine``: the sender's open engine; ``max_inflight``: writes that may run at once
    (one staging region each); ``clock``: the sender's clock; ``digest``: the algorithm
    that stamps each region in its header and ``key`` its binding key (:mod:`.integrity`).
    """

    def __init__(
        self,
        engine: MooncakeEngine,
        max_inflight: int,
        clock: Callable[[], float],
        digest: str = "xxh3_128",
        key: bytes | None = None,
    ) -> None:
        self.engine = engine
        self.max_inflight = max_inflight
        self._clock = clock
        bind = integrity.Binder(digest, key)
        self._digest: Callable[[str, int, int, int, Any], bytes] = lambda rid, slot, gen, off, buf: bind(
            rid, slot, gen, off, _flat(buf)
        )
        self._gens: dict[int, int] = {}
        self._staging: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._addr = 0
        self._region_size = 0
        self._regions_free: list[int] = []
        self._sources: list[tuple[int, int]] = []
        self.inflight: deque[InFlight] = deque()

    # -- memory -----------------------------------------------------------------

    def prepare(self, slot_size: int, slots: tuple[int, ...] = (), gens: tuple[int, ...] = ()) -> None:
        """At a grant: size the staging area for slots of ``slot_size`` bytes (every region
        free) and note each granted slot's generation (``gens``, in ``slots`` order)."""
        self._gens = dict(zip(slots, gens))
        need = slot_size * self.max_inflight
        if self._staging is None or len(self._staging) < need:
            if self._staging is not None:
                self.engine.unregister(self._addr)
            self._staging = mmap.mmap(-1, need)
            self._view = memoryview(self._staging)
            self._addr = self.engine.register(self._staging)
        self._region_size = slot_size
        self._regions_free = list(range(self.max_inflight))

    def register_source(self, buf: Any) -> None:
        """Register a writable buffer whose views are then written from directly."""
        addr = self.engine.register(buf)
        self._sources.append((addr, addr + memoryview(buf).nbytes))

    def close(self) -> None:
        """Unregister the staging area and the sources (the engine stays open)."""
        if self.engine.closed:
            return
        if self._staging is not None:
            self.engine.unregister(self._addr)
            self._staging = None
            self._view = None
        for lo, _ in self._sources:
            self.engine.unregister(lo)
        self._sources.clear()

    def _source_addr(self, mv: memoryview) -> int:
        """Address of ``mv`` if it lies inside a registered source buffer, else 0."""
        if not self._sources or mv.readonly or not mv.nbytes:
            return 0
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mv))
        except (TypeError, ValueError):
            return 0
        for lo, hi in self._sources:
            if lo <= addr and addr + mv.nbytes <= hi:
                return addr
        return 0

    def ranges(self, dst: int, parts: list[tuple[Any, int]]) -> tuple[list[Range], int]:
        """The (source, destination, length) ranges that put ``parts`` at their offsets from ``dst``.

        Tensors inside a registered source go as they are; others are copied into a free
        staging region at their slot offsets, padded so that they merge into one range.
        Returns the ranges and the region taken (-1 for none; give it back with
        :meth:`free_region` once its write has ended). On an exception the region is
        given back before it propagates.
        """
        view = self._view
        assert view is not None
        region = -1
        base = 0
        out: list[Range] = []
        try:
            for i, (buf, off) in enumerate(parts):
                mv = _flat(buf)
                n = mv.nbytes
                src = self._source_addr(mv)
                if src:
                    out.append((src, dst + off, n))
                    continue
                if region < 0:
                    region = self._regions_free.pop()  # one is free: at most max - 1 writes run between sends
                    base = region * self._region_size
                view[base + off : base + off + n] = mv
                # Cover the alignment padding up to the next tensor so staged ranges merge into one.
                span = parts[i + 1][1] - off if i + 1 < len(parts) else n
                out.append((self._addr + base + off, dst + off, span))
        except BaseException:
            self.free_region(region)
            raise
        return out, region

    def header(self, payload: Payload, seq: int, slot: int) -> tuple[wire.PayloadHeader, list[tuple[Any, int]]]:
        """The header and parts of ``payload`` written into ``slot``, at the slot's next generation.

        Each region's digest is taken here, from the bytes about to be staged or written
        in place (they must not change until the write landed, as for any source). The
        generation is used up even if the write then fails: the decode only asks that
        each header name a higher one than the last it admitted.
        """
        gen = self._gens.get(slot, 0) + 1
        self._gens[slot] = gen
        return payload_codec.build_header(payload, seq, slot, gen=gen, digest=self._digest)

    def free_region(self, region: int) -> None:
        if region >= 0:
            self._regions_free.append(region)

    # -- writes in flight -------------------------------------------------------

    def poll(self, peer: str, on_end: Callable[[InFlight, bool], None]) -> None:
        """One non-blocking pass over the writes in flight, oldest first.

        Each write that ended goes to ``on_end(write, retire_slot)``, with ``write.error``
        set if it failed; ``retire_slot`` is True when the write was given up on (past
        ``write_timeout_s``, or timed out in the engine), since it may still land. The
        pass stops at the first write still running: writes to one decode land in the
        order they were submitted (the engine's connection to a peer is a stream), so
        polling the ones behind it would only cost status calls (benchmarks/bulk.py),
        and a header is never held back for long behind an earlier one.
        """
        engine = self.engine
        inflight = self.inflight
        now = self._clock()
        while inflight:
            w = inflight[0]
            try:
                pending, err = engine.poll_write(peer, w.bids)
            except TransferError as exc:  # the engine was closed under us
                pending, err = [], exc
            w.error = w.error or err
            if pending and now - w.started <= engine.write_timeout_s:
                w.bids = pending
                return
            inflight.popleft()
            if pending:
                engine.abandon(pending)
                w.error = TransferAbandoned(
                    f"write not done within write_timeout_s={engine.write_timeout_s:g}",
                    op="transfer_check_status",
                    peer=peer,
                )
                on_end(w, True)
            else:
                on_end(w, isinstance(w.error, TransferAbandoned))  # timed out in the engine: may still land

    def drop(self, peer: str | None) -> None:
        """On reset: wait for running writes to end, then give up on the rest; no header goes out.

        A reconnect gets the same slot addresses back, so a write still running could land
        in a slot the new session has filled: each write is waited for up to its
        ``write_timeout_s`` (writes to a dead peer fail within milliseconds). Only one
        that outlives that is abandoned.
        """
        engine = self.engine
        backoff = Backoff(self._clock)
        while self.inflight and not engine.closed and peer is not None:
            still: deque[InFlight] = deque()
            now = self._clock()
            for w in self.inflight:
                try:
                    pending, _ = engine.poll_write(peer, w.bids)
                except TransferError:  # the engine was closed under us: nothing left to poll
                    pending = []
                if pending and now - w.started <= engine.write_timeout_s:
                    w.bids = pending
                    still.append(w)
                elif pending:
                    engine.abandon(pending)
            self.inflight = still
            if not still:
                break
            backoff.sleep()
        for w in self.inflight:
            engine.abandon(w.bids)
        self.inflight.clear()
