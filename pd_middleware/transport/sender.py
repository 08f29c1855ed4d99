"""Prefill side of the transport: a ZMQ DEALER plus, optionally, Mooncake writes.

:meth:`PrefillSender.connect` says hello and receives the decode's slot grant (its
Mooncake peer name and the addresses of the slots this prefill may write). Per
request, :meth:`PrefillSender.send` either

- writes the bulk tensors into a free slot it owns with one (merged) Mooncake write,
  then sends the header naming the slot (*bulk*, above ``inline_threshold_bytes``), or
- sends the header followed by the tensors as raw ZMQ frames (*inline*).

Bulk writes are pipelined: ``send`` submits the write and returns, and the header goes
out once the bytes have landed (checked by the next ``send``, by ``flush``, or within
tens of microseconds by the sender's background thread). At most
``mooncake.max_inflight_writes`` writes run at once; with 1, ``send`` waits for its own
write, as a plain synchronous sender would. A write that fails after ``send`` returned
fails its request with ``transfer:write`` (the reason names op, code and peer), and the
next ``send`` raises that error: the sender must ``reconnect()``.

The sender holds its parts as objects (:mod:`.control`: the connection, the ledger of
requests, the slot grant; :mod:`.bulk_send`: the bulk path, with an engine). The decode
answers with batched acks (applied by the connection): per-request status (delivered, or failed with a reason) and
slot-free notices. A slot is reused only after the decode freed it; with no free slot,
``send`` waits up to ``slots.wait_s`` and then raises :class:`~pd_middleware.NoSlotError`.

Counters reconcile: ``sent == delivered + failed + outstanding``; requests in flight
when the decode is lost are moved to ``failed['transfer:decode_lost']`` by
:meth:`reconnect`/:meth:`close`.

Threading: ``send``/``flush`` may be called from any thread (one lock serialises them);
a small background thread, started by ``connect``, completes writes in flight, keeps the
connection alive when idle and notices a silent or restarted decode. ``flush`` does the
last two itself while it waits, as it holds the lock the thread would need.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq

from ..core._errors import TransferError
from ..core.payload import Payload
from . import integrity, payload_codec, wire
from .auth import Signer
from .backoff import Backoff
from .bulk import BulkWriter, InFlight
from .bulk_send import BulkPath
from .config import TransportConfig
from .control import Control, GrantedSlots, Ledger
from .mooncake import MooncakeEngine
from .sockets import poll_ms

# The background thread leaves writes in flight to a thread that polled them this
# recently (a send() in a loop completes its own): about half a 608 KB write on loopback.
_QUIET_S = 100e-6


class PrefillSender:
    """Sends payloads to one decode receiver.

    ``engine``: an open :class:`MooncakeEngine` for the bulk path (None: inline only);
    ``context``: the ``zmq.Context`` (default: the process one); ``name``: this
    prefill's identity in the decode's logs, contexts and ``expect(peer=...)``.
    """

    def __init__(
        self,
        config: TransportConfig,
        engine: MooncakeEngine | None = None,
        context: zmq.Context[Any] | None = None,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.engine = engine
        self.name = name or f"prefill-{id(self):x}"
        self._ctx = context
        self._clock = clock
        self._thread_error: str | None = None  # why the background thread died, if it did
        self._lock = threading.RLock()
        self._ledger = Ledger()
        self._slots = GrantedSlots()
        self._control = Control(config, clock, self._ledger, self._slots)
        self._max_inflight = config.mooncake.max_inflight_writes
        # The bulk path (staging, registered sources, writes in flight); None without an engine.
        self._bulk_path: BulkPath | None = None
        if engine is not None:
            digest, key = integrity.algorithm_for(config), integrity.key_for(config)
            writer = BulkWriter(engine, self._max_inflight, clock, digest, key)
            self._bulk_path = BulkPath(
                writer,
                self._control,
                self._slots,
                self._ledger,
                self._max_inflight,
                config.slots.wait_s,
                clock,
                while_waiting=self._heartbeat_duties,
            )
        self._work = threading.Event()  # wakes the background thread for new writes in flight
        self._seq = 0
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._owns_engine = False  # set by open_sender, which opened the engine: close() closes it

    # -- counters (the ledger's) --------------------------------------------------

    @property
    def sent(self) -> int:
        return self._ledger.sent

    @property
    def delivered(self) -> int:
        return self._ledger.delivered

    @property
    def failed(self) -> Counter[str]:
        return self._ledger.failed

    @property
    def rejected(self) -> Counter[str]:
        """Replies from the decode refused here, and error replies received, by reason."""
        return self._control.rejected

    @property
    def bytes(self) -> Counter[str]:
        return self._ledger.bytes

    # -- the parts' state, for tests and tools that poke at the wire ----------------

    @property
    def _sock(self) -> zmq.Socket[Any] | None:
        return self._control.sock

    @property
    def _signer(self) -> Signer | None:
        return self._control.signer

    @property
    def _nonce(self) -> builtins.bytes:
        return self._control.nonce

    @property
    def _tx_seq(self) -> int:
        return self._control.tx_seq

    @_tx_seq.setter
    def _tx_seq(self, value: int) -> None:
        self._control.tx_seq = value

    @property
    def _outstanding(self) -> dict[int, str]:
        return self._ledger.outstanding

    @property
    def _free(self) -> deque[int]:
        return self._slots.free

    @property
    def _bulk(self) -> BulkWriter | None:
        return self._bulk_path.writer if self._bulk_path is not None else None

    @property
    def _inflight(self) -> deque[InFlight] | tuple[()]:
        """The writes in flight (an empty tuple without an engine)."""
        return self._bulk_path.inflight if self._bulk_path is not None else ()

    def _send_msg(self, msg: wire.Message, extra: list[Any] | None = None) -> None:
        self._control.send_msg(msg, extra)

    # -- connection -------------------------------------------------------------

    def connect(self, address: str, timeout: float | None = None) -> PrefillSender:
        """Connect to ``address`` (``tcp://host:port``), say hello and wait for the slot grant.

        Raises :class:`TransferError` (op ``connect``) when no grant arrives in time.
        """
        with self._lock:
            self._open_socket(address)
            self._hello(timeout if timeout is not None else self.config.connect_timeout_s)
        if self._hb_thread is None or not self._hb_thread.is_alive():
            self._thread_error = None
            self._hb_stop.clear()
            self._hb_thread = threading.Thread(target=self._background, name=f"{self.name}-background", daemon=True)
            self._hb_thread.start()
        return self

    def reconnect(self, timeout: float | None = None) -> PrefillSender:
        """Drop the connection (in-flight requests count as ``transfer:decode_lost``) and connect again."""
        with self._lock:
            address = self._control.address
            self._reset("transfer:decode_lost", "reconnecting")
        return self.connect(address, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` seconds for the outcome of every request sent (:meth:`flush`),
        then finish writes in flight, say bye, stop the background thread and close.

        What has no outcome by then counts as ``transfer:decode_lost``: closing at once
        dropped the acks the decode was still sending for requests it had received.
        Idempotent.
        """
        control = self._control
        if control.sock is not None and control.lost is None and timeout > 0:
            self.flush(timeout)
        self._hb_stop.set()
        self._work.set()
        if self._hb_thread is not None:
            self._hb_thread.join(5.0)
            self._hb_thread = None
        with self._lock:
            if control.sock is not None and control.lost is None and self._bulk_path is not None:
                self._bulk_path.settle(0)  # their headers go out before the bye
            if control.sock is not None and control.lost is None:
                control.send_msg(wire.Bye(reason="prefill sender closed"))
            self._reset("transfer:decode_lost", "sender closed", linger=100)
            writer = self._bulk
            if writer is not None and not writer.engine.closed:
                writer.close()
                if self._owns_engine:
                    writer.engine.close()

    def _open_socket(self, address: str) -> None:
        self._control.open(self._ctx if self._ctx is not None else zmq.Context.instance(), address)

    def _reset(self, key: str, why: str, linger: int = 0) -> None:
        if self._bulk_path is not None:
            self._bulk_path.drop()
        self._ledger.fail_all(key, why)
        self._slots.clear()
        self._control.close(why, linger)

    def _hello(self, timeout: float) -> None:
        control = self._control
        sock = control.sock
        assert sock is not None
        want = self.config.slots.per_peer if self.engine is not None else 0
        mc = self.engine.peer_name if self.engine is not None else None
        control.send_msg(wire.Hello(name=self.name, want_slots=want, mooncake=mc, ts=time.time()))
        deadline = self._clock() + timeout
        while True:
            left = deadline - self._clock()
            if left <= 0 or not sock.poll(poll_ms(left)):
                control.lost = "no grant"
                raise TransferError(
                    f"no slot grant from the decode within {timeout:g} s", op="connect", peer=control.address
                )
            msg = control.recv_one()
            if isinstance(msg, wire.Grant):
                break
        self._slots.grant(msg.slots, msg.addrs, msg.slot_size)
        control.granted(msg.session)
        if self._bulk_path is not None:  # staging regions; slot generations
            self._bulk_path.granted(msg.mooncake, msg.slot_size, msg.slots, msg.gens)

    # -- outbound ---------------------------------------------------------------

    def send(self, payload: Payload) -> None:
        """Send one payload. Inline: returns once it is queued on the control socket. Bulk:
        returns once its write is submitted (``max_inflight_writes`` > 1; the header follows
        when the bytes land) or, with ``max_inflight_writes = 1``, once the write landed and
        the header is queued.

        Raises :class:`NoSlotError` when the bulk path has no free slot within
        ``slots.wait_s``, and :class:`TransferError` when the decode is gone, when this
        write could not be submitted or (``max_inflight_writes = 1``) failed, or when an
        earlier pipelined write failed (that request is then ``failed["transfer:write"]``
        and the sender needs ``reconnect()``). When it raises, this payload was not sent.
        """
        with self._lock:
            control, slots, bulk = self._control, self._slots, self._bulk_path
            control.drain()
            control.check_alive("send")
            seq = self._seq
            size = payload_codec.bulk_bytes(payload)
            if bulk is not None and (slots.free or slots.addr):
                use_bulk = size > self.config.inline_threshold_bytes
            else:
                use_bulk = False
            if use_bulk:
                if size > slots.size:
                    raise TransferError(
                        f"payload {payload.request_id!r} needs {size} bulk bytes, slots hold {slots.size}",
                        op="send",
                        peer=control.address,
                    )
                bulk.send(payload, seq, size)  # type: ignore[union-attr]  # use_bulk only with a bulk path
            else:
                header, parts = payload_codec.build_header(payload, seq)
                frames = [b for b, _ in parts]
                control.send_msg(header, frames)
                self._ledger.bytes["inline"] += sum(memoryview(b).nbytes for b in frames)
            self._seq = seq + 1
            self._ledger.sent_one(seq, payload.request_id)
            if bulk is not None and bulk.inflight:
                # One pass over the writes in flight (headers of those that landed go out),
                # then at most max_inflight_writes - 1 left running, so the next send finds a
                # staging region; the background thread completes the rest.
                bulk.poll()
                bulk.settle(self._max_inflight - 1)
                if bulk.inflight:
                    self._work.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every sent request has a status; False on timeout (or if the decode is gone)."""
        deadline = self._clock() + timeout
        backoff = Backoff(self._clock)
        while True:
            with self._lock:
                control = self._control
                control.drain()
                if self._inflight and control.lost is None:
                    self._bulk_path.poll()  # type: ignore[union-attr]  # writes in flight only with a bulk path
                if not self._ledger.outstanding:
                    return True
                if control.sock is None:
                    return False
                # This loop holds the lock through each poll and takes it straight back (a
                # Python lock is not fair), so the background thread can wait seconds for it:
                # the waiter does the heartbeat duties itself. Else a silent decode went
                # unnoticed until the timeout, and a live decode heard nothing from us and
                # dropped this prefill after its peer_timeout_s.
                now = self._clock()
                self._heartbeat_duties(now)
                if control.lost is not None:
                    return False
                sock = control.sock
                left = deadline - now
                if left <= 0:
                    return False
                if not self._inflight:
                    sock.poll(poll_ms(min(left, 0.05, self.config.heartbeat_s / 2)))
                    continue
            backoff.sleep()  # writes still landing: poll them again shortly

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
        if self._bulk_path is None:
            raise TransferError("no Mooncake engine: nothing to register with", op="register_memory")
        self._bulk_path.register_source(buf)

    # -- accounting -------------------------------------------------------------

    def statuses(self) -> dict[str, Any]:
        """Counters: sent, delivered, failed (total and by reason), outstanding, bytes by plane."""
        with self._lock:
            self._control.drain()
            ledger = self._ledger
            return {
                "sent": ledger.sent,
                "delivered": ledger.delivered,
                "failed": sum(ledger.failed.values()),
                "failed_by_reason": dict(ledger.failed),
                "outstanding": len(ledger.outstanding),
                "rejected_by_decode": dict(self._control.rejected),
                "bytes_by_plane": dict(ledger.bytes),
                "free_slots": len(self._slots.free),
                "refused_slot_frees": self._slots.refused,
                "decode_suspect": self._slots.suspect,
                "writes_in_flight": len(self._inflight),
                "connected": self.connected,
                "background_error": self._thread_error,
            }

    def failures(self) -> list[tuple[str, str, str]]:
        """Recent failed requests as ``(request_id, key, reason)``, oldest first."""
        with self._lock:
            return list(self._ledger.failures)

    @property
    def connected(self) -> bool:
        """True while the decode is reachable and the background thread runs."""
        return self._control.lost is None and self._thread_error is None

    # -- background thread ------------------------------------------------------

    def _background(self) -> None:
        """Run :meth:`_background_loop`; if it ever ends on an exception, the decode is lost
        (``connected`` reads False and the next send raises) instead of a silent stall."""
        try:
            self._background_loop()
        except BaseException as exc:
            self._thread_error = f"{type(exc).__name__}: {exc}"
            self._control.lost = f"the sender's background thread died ({self._thread_error})"
            raise

    def _background_loop(self) -> None:
        """Complete writes in flight promptly; heartbeat and watch the decode when idle."""
        hb = self.config.heartbeat_s
        next_hb = self._clock() + hb / 2
        backoff = Backoff(self._clock)
        seen_seq = -1
        lock = self._lock
        control, bulk = self._control, self._bulk_path
        while not self._hb_stop.is_set():
            quiet = (
                (bulk.polled_at if bulk is not None else 0.0) + _QUIET_S - time.monotonic()
            )  # real time, whatever the clock
            if self._inflight and quiet > 0:
                # A sending thread polled just now: it completes its own writes while it
                # sends; taking the lock (and the GIL) from it would only slow both down.
                time.sleep(quiet)
                continue
            # With writes in flight, a send()/flush() holding the lock polls them itself: do
            # not queue behind it. Otherwise wait for the lock (the silence watch must run).
            if not lock.acquire(blocking=not self._inflight):
                backoff.sleep()
                continue
            try:
                if bulk is not None and bulk.inflight and control.sock is not None and control.lost is None:
                    bulk.poll()
                busy = bool(self._inflight) and control.lost is None
                now = self._clock()
                if self._seq != seen_seq:  # new writes since the last pass: poll fast again
                    seen_seq = self._seq
                    backoff.reset()
                if now >= next_hb:
                    next_hb = now + hb / 2
                    self._heartbeat_duties(now)
            finally:
                lock.release()
            if busy:
                backoff.sleep()
            else:
                backoff.reset()
                self._work.wait(max(0.0, next_hb - self._clock()))
                self._work.clear()

    def _heartbeat_duties(self, now: float) -> None:
        control = self._control
        if control.sock is None or control.lost is not None:
            return
        control.drain()
        # An idle sender notices a dead decode too: flush() then returns early
        # and statuses()["connected"] turns False without waiting for a send.
        control.note_silence()
        if control.lost is not None:  # note_silence() may set it
            return  # type: ignore[unreachable]  # mypy keeps the narrowing across the call
        if now - control.last_sent >= self.config.heartbeat_s:
            try:
                control.send_msg(wire.Heartbeat())
            except TransferError:
                pass  # queue full: the decode is not reading; the timeout will tell


def open_sender(
    config: TransportConfig,
    address: str,
    *,
    name: str | None = None,
    context: zmq.Context[Any] | None = None,
) -> PrefillSender:
    """Open a Mooncake engine when ``config.mooncake.enabled``, then build and connect a sender.

    The sender owns that engine: :meth:`PrefillSender.close` closes it.
    """
    from .mooncake import open_engine

    engine = open_engine(config.mooncake) if config.mooncake.enabled else None
    tx = PrefillSender(config, engine=engine, context=context, name=name)
    tx._owns_engine = engine is not None
    try:
        return tx.connect(address)
    except BaseException:
        tx.close()
        raise
