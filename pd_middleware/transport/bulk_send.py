"""The prefill's bulk send path: slot writes through Mooncake and the writes in flight.

:meth:`BulkPath._send_bulk` takes a free slot (waiting up to ``slots.wait_s`` for the
decode to free one: :meth:`BulkPath._acquire_slot`), stamps the header (generation and
digests, :mod:`.bulk`), submits one merged write and sends the header at once
(``max_inflight_writes = 1``) or once the write landed. :meth:`BulkPath._poll_inflight`
and :meth:`BulkPath._settle` complete writes in flight; a failed write fails its request
with ``transfer:write`` and loses the decode until ``reconnect()``.

A mixin of :class:`~.sender.PrefillSender`: it owns the state declared below; every
method runs under the sender's lock.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from .._errors import NoSlotError, TransferAbandoned, TransferError
from ..payload import Payload
from .backoff import POLL_MAX_S, Backoff
from .bulk import BulkWriter, InFlight
from .control import Control
from .sockets import poll_ms


class BulkPath(Control):
    """Bulk writes into granted slots, slot waits and writes in flight."""

    # Set by PrefillSender.__init__/connect (see there).
    _bulk: BulkWriter | None
    _decode_mc: str | None
    _max_inflight: int
    _polled_at: float  # time.monotonic() when writes in flight were last polled (by any thread)

    def _send_bulk(self, payload: Payload, seq: int, size: int) -> None:
        """Write the tensors into a slot; send the header now (synchronous) or once landed."""
        bulk, mc = self._bulk, self._decode_mc
        assert bulk is not None and mc is not None
        engine = bulk.engine
        slot = self._acquire_slot()
        region = -1
        try:
            header, parts = bulk.header(payload, seq, slot)  # stamps generation and digests
            ranges, region = bulk.ranges(self._slot_addr[slot], parts)
            bids = engine.start_write(mc, ranges)
            if self._max_inflight > 1:
                bulk.inflight.append(InFlight(seq, slot, header, bids, region, self._clock()))
                # Counted when submitted, like inline bytes when queued: a caller that diffs
                # statuses() around its sends (per-arm accounting) sees its own bytes.
                self.bytes["bulk"] += size
                return
            engine.finish_write(mc, bids)
            self._send_msg(header)
        except BaseException as exc:
            bulk.free_region(region)  # only read by the write: safe to reuse
            if isinstance(exc, TransferAbandoned):
                # Given up on, not failed: the write may still land in the slot. Retire the
                # slot and lose the decode, so nothing is written there before a reconnect.
                self._lose(exc)
            else:
                self._free.appendleft(slot)  # the decode never heard of it: still ours
            raise
        bulk.free_region(region)
        self.bytes["bulk"] += size

    def _acquire_slot(self) -> int:
        if self._free:
            return self._free.popleft()
        wait = self.config.slots.wait_s
        deadline = self._clock() + wait
        sock = self._sock
        assert sock is not None
        while not self._free:
            if self._inflight:
                # Writes of ours may hold slots: their headers must go out for the decode
                # to consume and free them (the background thread waits for this lock).
                self._poll_inflight()
                self._check_alive("send")  # a write that failed just now loses the decode
                if self._free:
                    break
            left = deadline - self._clock()
            if left <= 0:
                raise NoSlotError(
                    f"all {len(self._slot_addr)} slots stayed in use for {wait:g} s", op="send", peer=self._address
                )
            if sock.poll(poll_ms(min(left, POLL_MAX_S if self._inflight else 0.05))):
                self._drain()
            self._check_alive("send")
        return self._free.popleft()

    def _poll_inflight(self) -> None:
        """One non-blocking pass: send the header of each write that landed, fail the failed."""
        assert self._bulk is not None and self._decode_mc is not None
        self._bulk.poll(self._decode_mc, self._end_write)
        self._polled_at = time.monotonic()

    def _end_write(self, w: InFlight, retire_slot: bool) -> None:
        """A write ended: send its header, or fail its request (and lose the decode)."""
        assert self._bulk is not None
        self._bulk.free_region(w.region)
        if w.error is None:
            try:
                self._send_msg(w.header)
                return
            except TransferError as exc:
                w.error = exc
        if not retire_slot:
            self._free.appendleft(w.slot)  # the decode never heard of it
        rid = self._outstanding.pop(w.seq, None)
        key = "transfer:write" if w.error.op != "send" else "transfer:control_full"
        if rid is not None:
            self.failed[key] += 1
            self._failures.append((rid, key, str(w.error)))
        if key == "transfer:write":
            self._lose(w.error)

    def _lose(self, err: TransferError) -> None:
        """A write failed or was given up on: the decode is lost until reconnect()."""
        if self._lost is None:
            self._lost = f"a Mooncake write to the decode failed ({err})"
            self._lost_error = err

    def _settle(self, limit: int) -> None:
        """Poll writes in flight until at most ``limit`` remain (each one is bounded by write_timeout_s)."""
        backoff = Backoff(self._clock)
        while len(self._inflight) > limit:
            self._poll_inflight()
            if len(self._inflight) <= limit:
                return
            backoff.sleep()

    def _drop_inflight(self) -> None:
        """On reset: wait for running writes to end (bulk.py), no header goes out."""
        if self._bulk is not None and self._bulk.inflight:
            self._bulk.drop(self._decode_mc)

    @property
    def _inflight(self) -> deque[InFlight] | tuple[()]:
        """The writes in flight (an empty tuple without an engine)."""
        return self._bulk.inflight if self._bulk is not None else ()

    @property
    def writes_in_flight(self) -> int:
        """Bulk writes submitted whose header has not gone out yet."""
        return len(self._inflight)

    def register_source(self, buf: Any) -> None:
        """Register a prefill-side output buffer (writable, e.g. an mmap or bytearray).

        Payload tensors that are views into it are then written straight from it, with no
        staging copy, like SGLang's pre-registered metadata buffers. The caller must not
        modify the viewed bytes until their write has landed: until :meth:`send` returned
        when ``mooncake.max_inflight_writes`` is 1, else until :attr:`writes_in_flight`
        is 0 (for example after :meth:`flush`). Tensors outside registered buffers are
        copied before :meth:`send` returns and may be reused at once.
        """
        if self._bulk is None:
            raise TransferError("no Mooncake engine: nothing to register with", op="register_memory")
        self._bulk.register_source(buf)
