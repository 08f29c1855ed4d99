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

The decode answers with batched acks (applied by :mod:`.control`; the bulk path is
:mod:`.bulk_send`): per-request status (delivered, or failed with a reason) and
slot-free notices. A slot is reused only after the decode freed it; with no free slot,
``send`` waits up to ``slots.wait_s`` and then raises :class:`~pd_middleware.NoSlotError`.

Counters reconcile: ``sent == delivered + failed + outstanding``; requests in flight
when the decode is lost are moved to ``failed['transfer:decode_lost']`` by
:meth:`reconnect`/:meth:`close`.

Threading: ``send``/``flush`` may be called from any thread (one lock serialises them);
a small background thread, started by ``connect``, completes writes in flight, keeps the
connection alive when idle and notices a silent or restarted decode.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq

from .._errors import TransferError
from ..payload import Payload
from . import integrity, payload_codec, wire
from .auth import Signer, new_nonce
from .backoff import Backoff
from .bulk import BulkWriter
from .bulk_send import BulkPath
from .config import TransportConfig
from .mooncake import MooncakeEngine
from .sockets import connect_dealer, poll_ms

_FAILURE_LOG = 1024  # most recent failures kept for failures()
# The background thread leaves writes in flight to a thread that polled them this
# recently (a send() in a loop completes its own): about half a 608 KB write on loopback.
_QUIET_S = 100e-6


class PrefillSender(BulkPath):
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
        key = config.secret()
        self._signer = Signer(key) if key is not None else None
        # HMAC mode: this connection's nonce, the next sequence to send, the last received.
        self._nonce = new_nonce()
        self._tx_seq = 0
        self._rx_seq = -1
        self._thread_error: str | None = None  # why the background thread died, if it did
        self._lock = threading.RLock()
        self._sock: zmq.Socket[Any] | None = None
        self._address = ""
        self._session = ""
        self._lost: str | None = "not connected"
        self._decode_mc: str | None = None
        self._slot_addr: dict[int, int] = {}
        self._free: deque[int] = deque()
        self._slot_size = 0
        self._max_inflight = config.mooncake.max_inflight_writes
        self._polled_at = 0.0
        # Staging, registered sources and writes in flight (bulk.py); None without an engine.
        digest = integrity.algorithm_for(config)
        self._bulk = BulkWriter(engine, self._max_inflight, clock, digest) if engine is not None else None
        self._work = threading.Event()  # wakes the background thread for new writes in flight
        self._lost_error: TransferError | None = None  # the write failure that lost the decode
        self._seq = 0
        self._outstanding: dict[int, str] = {}
        self._last_heard = 0.0
        self._last_sent = 0.0
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self.sent = 0
        self.delivered = 0
        self.failed: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter({"control": 0, "inline": 0, "bulk": 0})
        self._failures: deque[tuple[str, str, str]] = deque(maxlen=_FAILURE_LOG)
        self._owns_engine = False  # set by open_sender, which opened the engine: close() closes it

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
            address = self._address
            self._reset("transfer:decode_lost", "reconnecting")
        return self.connect(address, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` seconds for the outcome of every request sent (:meth:`flush`),
        then finish writes in flight, say bye, stop the background thread and close.

        What has no outcome by then counts as ``transfer:decode_lost``: closing at once
        dropped the acks the decode was still sending for requests it had received.
        Idempotent.
        """
        if self._sock is not None and self._lost is None and timeout > 0:
            self.flush(timeout)
        self._hb_stop.set()
        self._work.set()
        if self._hb_thread is not None:
            self._hb_thread.join(5.0)
            self._hb_thread = None
        with self._lock:
            if self._sock is not None and self._lost is None:
                self._settle(0)  # their headers go out before the bye
            if self._sock is not None and self._lost is None:
                self._send_msg(wire.Bye(reason="prefill sender closed"))
            self._reset("transfer:decode_lost", "sender closed", linger=100)
            if self._bulk is not None and not self._bulk.engine.closed:
                self._bulk.close()
                if self._owns_engine:
                    self._bulk.engine.close()

    def _open_socket(self, address: str) -> None:
        ctx = self._ctx if self._ctx is not None else zmq.Context.instance()
        # A fresh connection: a fresh nonce, so nothing signed on an earlier one replays here.
        self._nonce = new_nonce()
        self._tx_seq = 0
        self._rx_seq = -1
        self._sock = connect_dealer(ctx, self.config, address)
        self._address = address

    def _reset(self, key: str, why: str, linger: int = 0) -> None:
        self._drop_inflight()
        for rid in self._outstanding.values():
            self.failed[key] += 1
            self._failures.append((rid, key, why))
        self._outstanding.clear()
        self._free.clear()
        self._slot_addr.clear()
        if self._sock is not None:
            self._sock.close(linger)
            self._sock = None
        self._lost = why
        self._lost_error = None

    def _hello(self, timeout: float) -> None:
        sock = self._sock
        assert sock is not None
        want = self.config.slots.per_peer if self.engine is not None else 0
        mc = self.engine.peer_name if self.engine is not None else None
        self._send_msg(wire.Hello(name=self.name, want_slots=want, mooncake=mc, ts=time.time()))
        deadline = self._clock() + timeout
        while True:
            left = deadline - self._clock()
            if left <= 0 or not sock.poll(poll_ms(left)):
                self._lost = "no grant"
                raise TransferError(
                    f"no slot grant from the decode within {timeout:g} s", op="connect", peer=self._address
                )
            msg = self._recv_one()
            if isinstance(msg, wire.Grant):
                break
        self._session = msg.session
        self._decode_mc = msg.mooncake
        self._slot_size = msg.slot_size
        self._slot_addr = dict(zip(msg.slots, msg.addrs))
        self._free = deque(msg.slots)
        self._lost = None
        self._lost_error = None
        self._last_heard = self._clock()
        if self._bulk is not None and msg.mooncake is not None and msg.slots:
            self._bulk.prepare(msg.slot_size, msg.slots, msg.gens)  # staging regions; slot generations
            self._bulk.engine.probe(msg.mooncake, force=True)

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
            self._drain()
            self._check_alive("send")
            seq = self._seq
            size = payload_codec.bulk_bytes(payload)
            if self._free or self._slot_addr:
                use_bulk = size > self.config.inline_threshold_bytes
            else:
                use_bulk = False
            if use_bulk:
                if size > self._slot_size:
                    raise TransferError(
                        f"payload {payload.request_id!r} needs {size} bulk bytes, slots hold {self._slot_size}",
                        op="send",
                        peer=self._address,
                    )
                self._send_bulk(payload, seq, size)
            else:
                header, parts = payload_codec.build_header(payload, seq)
                frames = [b for b, _ in parts]
                self._send_msg(header, frames)
                self.bytes["inline"] += sum(memoryview(b).nbytes for b in frames)
            self._seq = seq + 1
            self._outstanding[seq] = payload.request_id
            self.sent += 1
            if self._inflight:
                # One pass over the writes in flight (headers of those that landed go out),
                # then at most max_inflight_writes - 1 left running, so the next send finds a
                # staging region; the background thread completes the rest.
                self._poll_inflight()
                self._settle(self._max_inflight - 1)
                if self._inflight:
                    self._work.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every sent request has a status; False on timeout (or if the decode is gone)."""
        deadline = self._clock() + timeout
        backoff = Backoff(self._clock)
        while True:
            with self._lock:
                self._drain()
                if self._inflight and self._lost is None:
                    self._poll_inflight()
                if not self._outstanding:
                    return True
                if self._lost is not None or self._sock is None:
                    return False
                sock = self._sock
                left = deadline - self._clock()
                if left <= 0:
                    return False
                if not self._inflight:
                    sock.poll(poll_ms(min(left, 0.05)))
                    continue
            backoff.sleep()  # writes still landing: poll them again shortly

    # -- accounting -------------------------------------------------------------

    def statuses(self) -> dict[str, Any]:
        """Counters: sent, delivered, failed (total and by reason), outstanding, bytes by plane."""
        with self._lock:
            self._drain()
            return {
                "sent": self.sent,
                "delivered": self.delivered,
                "failed": sum(self.failed.values()),
                "failed_by_reason": dict(self.failed),
                "outstanding": len(self._outstanding),
                "rejected_by_decode": dict(self.rejected),
                "bytes_by_plane": dict(self.bytes),
                "free_slots": len(self._free),
                "writes_in_flight": len(self._inflight),
                "connected": self.connected,
                "background_error": self._thread_error,
            }

    def failures(self) -> list[tuple[str, str, str]]:
        """Recent failed requests as ``(request_id, key, reason)``, oldest first."""
        with self._lock:
            return list(self._failures)

    @property
    def connected(self) -> bool:
        """True while the decode is reachable and the background thread runs."""
        return self._lost is None and self._thread_error is None

    # -- background thread ------------------------------------------------------

    def _background(self) -> None:
        """Run :meth:`_background_loop`; if it ever ends on an exception, the decode is lost
        (``connected`` reads False and the next send raises) instead of a silent stall."""
        try:
            self._background_loop()
        except BaseException as exc:
            self._thread_error = f"{type(exc).__name__}: {exc}"
            self._lost = f"the sender's background thread died ({self._thread_error})"
            raise

    def _background_loop(self) -> None:
        """Complete writes in flight promptly; heartbeat and watch the decode when idle."""
        hb = self.config.heartbeat_s
        next_hb = self._clock() + hb / 2
        backoff = Backoff(self._clock)
        seen_seq = -1
        lock = self._lock
        while not self._hb_stop.is_set():
            quiet = self._polled_at + _QUIET_S - time.monotonic()  # real time, whatever the clock
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
                if self._inflight and self._sock is not None and self._lost is None:
                    self._poll_inflight()
                busy = bool(self._inflight) and self._lost is None
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
        if self._sock is None or self._lost is not None:
            return
        self._drain()
        # An idle sender notices a dead decode too: flush() then returns early
        # and statuses()["connected"] turns False without waiting for a send.
        self._note_silence()
        if self._lost is not None:  # _note_silence() may set it
            return  # type: ignore[unreachable]  # mypy keeps the narrowing across the call
        if now - self._last_sent >= self.config.heartbeat_s:
            try:
                self._send_msg(wire.Heartbeat())
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
