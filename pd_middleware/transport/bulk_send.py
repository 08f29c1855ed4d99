"""The prefill's bulk send path: slot writes through Mooncake and the writes in flight.

:meth:`BulkPath.send` takes a free slot of the grant (waiting up to ``slots.wait_s`` for
the decode to free one: :meth:`BulkPath._acquire_slot`), stamps the header (generation
and digests, :mod:`.bulk`), submits one merged write and sends the header at once
(``max_inflight_writes = 1``) or once the write landed. :meth:`BulkPath.poll` and
:meth:`BulkPath.settle` complete writes in flight; a failed write fails its request
with ``transfer:write`` and loses the decode until ``reconnect()``.

A part of :class:`~.sender.PrefillSender`, an object it holds when it has an engine: it
owns the :class:`~.bulk.BulkWriter` (staging, registered sources, writes in flight) and
the decode's Mooncake peer name; it takes slots from the grant, sends headers through
the control channel and settles failed writes in the ledger. Every method runs under
the sender's lock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..core._errors import NoSlotError, TransferAbandoned, TransferError
from ..core.payload import Payload
from .backoff import POLL_MAX_S, Backoff
from .bulk import BulkWriter, InFlight
from .control import Control, GrantedSlots, Ledger
from .sockets import poll_ms


class BulkPath:
    """Bulk writes into granted slots, slot waits and writes in flight."""

    def __init__(
        self,
        writer: BulkWriter,
        control: Control,
        slots: GrantedSlots,
        ledger: Ledger,
        max_inflight: int,
        wait_s: float,
        clock: Callable[[], float],
        while_waiting: Callable[[float], None] = lambda now: None,
    ) -> None:
        self.writer = writer
        self._control = control
        self._slots = slots
        self._ledger = ledger
        self._max_inflight = max_inflight
        self._wait_s = wait_s
        self._clock = clock
        # Called with the time on each turn of a slot wait (the sender's heartbeat duties): the
        # wait holds the sender's lock, so the background thread cannot beat meanwhile.
        self._while_waiting = while_waiting
        self.decode_mc: str | None = None  # the decode's Mooncake peer name, from its grant
        self.polled_at = 0.0  # time.monotonic() when writes in flight were last polled (by any thread)

    @property
    def inflight(self) -> deque[InFlight]:
        """The writes in flight (submitted, header not sent yet)."""
        return self.writer.inflight

    def granted(self, mooncake: str | None, slot_size: int, slots: tuple[int, ...], gens: tuple[int, ...]) -> None:
        """A new grant: the decode's engine, and staging regions and generations for its slots."""
        self.decode_mc = mooncake
        if mooncake is not None and slots:
            self.writer.prepare(slot_size, slots, gens)
            self.writer.engine.probe(mooncake, force=True)

    def send(self, payload: Payload, seq: int, size: int) -> None:
        """Write the tensors into a slot; send the header now (synchronous) or once landed."""
        bulk, mc = self.writer, self.decode_mc
        assert mc is not None
        engine = bulk.engine
        slot = self._acquire_slot()
        region = -1
        try:
            header, parts = bulk.header(payload, seq, slot)  # stamps generation and digests
            ranges, region = bulk.ranges(self._slots.addr[slot], parts)
            bids = engine.start_write(mc, ranges)
            if self._max_inflight > 1:
                bulk.inflight.append(InFlight(seq, slot, header, bids, region, self._clock()))
                # Counted when submitted, like inline bytes when queued: a caller that diffs
                # statuses() around its sends (per-arm accounting) sees its own bytes.
                self._ledger.bytes["bulk"] += size
                return
            engine.finish_write(mc, bids)
            self._control.send_msg(header)
        except BaseException as exc:
            bulk.free_region(region)  # only read by the write: safe to reuse
            if isinstance(exc, TransferAbandoned):
                # Given up on, not failed: the write may still land in the slot. Retire the
                # slot and lose the decode, so nothing is written there before a reconnect.
                self._control.lose(exc)
            else:
                self._slots.untake(slot)  # the decode never heard of it: still ours
            raise
        bulk.free_region(region)
        self._ledger.bytes["bulk"] += size

    def _acquire_slot(self) -> int:
        slots = self._slots
        if slots.free:
            return slots.take()
        control = self._control
        wait = self._wait_s
        deadline = self._clock() + wait
        sock = control.sock
        assert sock is not None
        while not slots.free:
            if self.inflight:
                # Writes of ours may hold slots: their headers must go out for the decode
                # to consume and free them (the background thread waits for this lock).
                self.poll()
                control.check_alive("send")  # a write that failed just now loses the decode
                if slots.free:
                    break
            now = self._clock()
            # The wait holds the sender's lock (up to slots.wait_s, which may exceed the
            # decode's peer_timeout_s): the background thread cannot send heartbeats
            # meanwhile, so the waiter does (check_alive already notices a silent decode).
            self._while_waiting(now)
            control.check_alive("send")
            if slots.free:  # its drain may have read the decode's frees
                break
            left = deadline - now
            if left <= 0:
                raise NoSlotError(
                    f"all {len(slots.addr)} slots stayed in use for {wait:g} s", op="send", peer=control.address
                )
            if sock.poll(poll_ms(min(left, POLL_MAX_S if self.inflight else 0.05))):
                control.drain()
            control.check_alive("send")
        return slots.take()

    def poll(self) -> None:
        """One non-blocking pass: send the header of each write that landed, fail the failed."""
        assert self.decode_mc is not None
        self.writer.poll(self.decode_mc, self._end_write)
        self.polled_at = time.monotonic()

    def _end_write(self, w: InFlight, retire_slot: bool) -> None:
        """A write ended: send its header, or fail its request (and lose the decode)."""
        self.writer.free_region(w.region)
        if w.error is None:
            try:
                self._control.send_msg(w.header)
                return
            except TransferError as exc:
                w.error = exc
        if not retire_slot:
            self._slots.untake(w.slot)  # the decode never heard of it
        key = "transfer:write" if w.error.op != "send" else "transfer:control_full"
        self._ledger.fail(w.seq, key, str(w.error))
        if key == "transfer:write":
            self._control.lose(w.error)

    def settle(self, limit: int) -> None:
        """Poll writes in flight until at most ``limit`` remain (each one is bounded by write_timeout_s)."""
        backoff = Backoff(self._clock)
        while len(self.inflight) > limit:
            self.poll()
            if len(self.inflight) <= limit:
                return
            backoff.sleep()

    def drop(self) -> None:
        """On reset: wait for running writes to end (bulk.py), no header goes out."""
        if self.writer.inflight:
            self.writer.drop(self.decode_mc)

    def register_source(self, buf: Any) -> None:
        self.writer.register_source(buf)
