"""Decode side of the transport: a ZMQ ROUTER loop feeding the receive pipeline.

One thread (:meth:`DecodeReceiver.start`) owns the socket and the slot pool. The
receiver holds its parts as objects: per inbound message the handshake
(:class:`~.handshake.Handshake`: dispatch, hello and grant, peer loss) passes payloads to
admission (:class:`~.admission.Admission`: payloads, refusals, releases), and every reply
goes out through :class:`~.admission.Replies`; the outcome queue, the expectations and
the peer table are their own objects too. Per inbound message
it checks authentication (CURVE's key from ZAP, or the HMAC and its replay window:
:mod:`.auth`), decodes and validates the header (:mod:`.wire`), resolves inline frames
or slot ranges as zero-copy views, runs ``pipeline.process`` (hooks, then the arm's
synthesizer) and puts the outcome (:class:`~pd_middleware.decode.pipeline.Delivery`
or :class:`~pd_middleware.decode.pipeline.Failure`) on a queue the scheduler reads with
:meth:`get`/:meth:`drain` (a waiting scheduler is woken once per receive batch). Acks go
back coalesced (:mod:`.peers`); with ``ack = "consumed"`` a request is acked delivered
only once its Delivery was released.

Every payload header and every refused message ends as exactly one counted outcome: a
delivery, a pipeline failure, a wire failure (``wire:<field>``: ``wire:hmac``,
``wire:replay``, ``wire:nesting``, ``wire:duplicate``, ``wire:peer``...), or
``receiver:internal`` for an exception no check foresaw; the loop goes on after each. A
valid hello, heartbeat or bye produces none. A request id belongs to the peer it came
from (or was expected from): the same id from another peer is ``wire:peer``, and a
Failure names a request id only when its authenticated sender owns it. If the loop ends anyway, the
application learns it at once: :meth:`get`/:meth:`drain` raise
:class:`~pd_middleware.TransferError`, :attr:`healthy` turns False and the metric
``receiver_alive`` drops to 0. Requests announced with :meth:`expect` that never arrive
fail with ``transfer:deadline`` or, when their peer goes silent for ``peer_timeout_s``,
``transfer:peer_lost``.

Memory is bounded: libzmq refuses frames over the size caps (``ZMQ_MAXMSGSIZE``), and
the loop stops reading (backpressure, nothing dropped) while the scheduler has
``limits.max_queued_outcomes`` outcomes waiting, holds ``limits.max_live_requests``
deliveries not yet released, or holds ``limits.max_queued_inline_bytes`` inline bytes
not yet released (taken or not: a consumer that keeps outcomes stays
under the cap). What libzmq buffers of a multipart message before Python sees it is
bounded only by authentication: see docs/transport.md.

Bulk views stay valid until :meth:`Delivery.release` is called; after that the slot
may be overwritten by the next payload. Hooks that keep payloads must copy them.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..core._errors import TransferError, WireError
from ..decode.pipeline import Delivery, Failure, ReceivePipeline
from . import integrity, wire
from .admission import Admission, Replies
from .auth import CurveGate, Signer
from .config import TransportConfig
from .expects import Expectations
from .handshake import Handshake
from .mooncake import MooncakeEngine
from .outcomes import OutcomeQueue
from .peers import ACK_BATCH, ACK_INTERVAL_S, PeerTable
from .slots import SlotPool
from .sockets import bind_router, poll_ms


class DecodeReceiver:
    """Binds the control socket and delivers validated payloads to the scheduler.

    ``engine``: an open :class:`MooncakeEngine` to register the slots with (None:
    inline only). ``context``: the ``zmq.Context`` to use (default: the process one).
    Nothing is bound or started until :meth:`start`.
    """

    def __init__(
        self,
        config: TransportConfig,
        pipeline: ReceivePipeline,
        engine: MooncakeEngine | None = None,
        context: zmq.Context[Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.metrics = pipeline.metrics
        self.engine = engine
        self._ctx = context
        self._clock = clock
        key = config.secret()
        self._curve = config.curve.enabled
        self._gate: CurveGate | None = None
        self._limits = config.limits
        self.session = secrets.token_hex(8)
        self.address = ""
        self._queue = OutcomeQueue(self._wake)  # outcomes for the scheduler (outcomes.py)
        self._expects = Expectations()
        self._peers = PeerTable()
        self._replies = Replies(Signer(key) if key is not None else None, clock)
        # The parts of one run of the loop (built by start()): admission, then the handshake.
        self._admission: Admission | None = None
        self._handshake: Handshake | None = None
        self._wake_armed = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._pool: SlotPool | None = None
        self._pool_addr = 0
        self._pipe: tuple[int, int] | None = None
        self._owns_engine = False  # set by open_receiver, which opened the engine: stop() closes it

    @property
    def unsent(self) -> int:
        """Replies dropped because a peer's queue was full or gone."""
        return self._replies.unsent

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> DecodeReceiver:
        """Bind, register the slots with the engine and start the receive thread."""
        cfg = self.config
        ctx = self._ctx if self._ctx is not None else zmq.Context.instance()
        cfg.peer_secrets()  # a missing per-prefill HMAC key fails (naming it) before anything is bound
        sock, self.address, self._gate = bind_router(ctx, cfg, self.session)
        digest = integrity.algorithm_for(cfg)
        key = integrity.key_for(cfg)
        self._pool = SlotPool(cfg.slots.count, cfg.slots.size_bytes, digest, key) if self.engine is not None else None
        if self._pool is not None and self.engine is not None:
            self._pool_addr = self.engine.register(self._pool.buffer)
        self._sock = sock
        self._replies.sock = sock
        admission = Admission(
            cfg, self.pipeline, self._queue, self._expects, self._peers, self._replies, self._pool, self._wake
        )
        self._admission = admission
        self._handshake = Handshake(
            cfg,
            self.session,
            self.engine,
            admission,
            self._replies,
            self._peers,
            self._expects,
            self._gate,
            self._pool,
            self._pool_addr,
            self._clock,
        )
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._running = True
        self._queue.dead = None
        self._queue.where = self.address
        self.metrics.receiver_alive = 1
        self._thread = threading.Thread(target=self._run, name="pd-decode-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Say bye to every peer, fail what is still expected, stop the thread and unbind."""
        if self._thread is None:
            return
        self._running = False
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TransferError(f"receive thread did not stop within {timeout} s", op="stop")
        self._thread = None
        if self._pool is not None and self.engine is not None and not self.engine.closed:
            self.engine.unregister(self._pool_addr)
        if self._owns_engine and self.engine is not None:
            self.engine.close()
        if self._pipe is not None:
            os.close(self._pipe[0])
            os.close(self._pipe[1])
            self._pipe = None
        self._close_gate()

    def _close_gate(self) -> None:
        if self._gate is not None:
            self._gate.close()
            self._gate = None

    def __enter__(self) -> DecodeReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scheduler-side API (any thread) ----------------------------------------

    @property
    def healthy(self) -> bool:
        """False once the receive loop has ended on its own (never, by design; see :meth:`get`)."""
        return self._queue.dead is None

    def get(self, timeout: float | None = None) -> Delivery | Failure | None:
        """Next outcome, waiting up to ``timeout`` seconds; None if none arrived.

        Raises :class:`TransferError` (op ``receive``) once the receive loop has died and
        every outcome it queued was taken: nothing more will ever arrive.
        """
        got: Delivery | Failure | None = self._queue.get(timeout)
        return got

    def drain(self, max_items: int = 1 << 30) -> list[Delivery | Failure]:
        """Every outcome ready now, at most ``max_items``; raises like :meth:`get` once the loop died."""
        return self._queue.drain(max_items)

    def expect(self, request_id: str, peer: str | None = None, deadline: float | None = None) -> None:
        """Announce a request the decode awaits (like SGLang's prealloc queue).

        With ``peer`` (the prefill's identity: its CURVE allowlist name, or its hello
        name without CURVE) only that peer may deliver it: the same id from another peer
        fails as ``wire:peer`` (so does an id that arrived from another peer, expected or
        not, while it is live there: delivered and not released, or expected from it; and
        for the last 65,536 arrivals besides). It fails with ``transfer:deadline`` if it has not arrived
        by ``deadline`` (this receiver's clock, ``time.monotonic`` by default), or with
        ``transfer:peer_lost`` when ``peer`` goes silent.
        """
        self._expects.announce(request_id, peer, deadline)
        self._wake()

    @property
    def peers(self) -> dict[str, int]:
        """Connected prefill peers by identity, with the number of slots each holds a grant for."""
        return {p.name: len(p.slots) for p in self._peers}

    @property
    def double_releases(self) -> int:
        """Releases of a delivery that was already released: counted no-ops (inline and bulk)."""
        return self._admission.double_releases if self._admission is not None else 0

    @property
    def free_slots(self) -> int:
        """Slots not granted to any peer (for tests and monitoring)."""
        return self._pool.available if self._pool is not None else 0

    # -- internals --------------------------------------------------------------

    def _wake(self) -> None:
        if not self._wake_armed and self._pipe is not None:
            self._wake_armed = True
            try:
                os.write(self._pipe[1], b"\0")
            except (BlockingIOError, OSError):
                pass  # a full pipe already wakes the loop; a closed one means stopped

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            self._queue.dead = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self._running and self._queue.dead is None:
                self._queue.dead = "the receive loop returned while running"
            if self._queue.dead is not None:
                self.metrics.receiver_alive = 0
                self.metrics.receiver_deaths += 1
            try:
                self._shutdown()
            finally:
                self.metrics.receiver_alive = 0
                self._queue.pending_wake = True
                self._queue.notify()

    def _loop(self) -> None:
        assert self._sock is not None and self._pipe is not None and self._admission is not None
        sock, admission = self._sock, self._admission
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._pipe[0], zmq.POLLIN)
        tick = min(0.05, self.config.heartbeat_s / 2)
        next_tick = self._clock()
        last_flush = self._clock()
        reading = True
        while self._running:
            reading, ready = self._poll(poller, reading, next_tick, last_flush)
            if ready:
                self._read_batch(sock)
            self._queue.notify()
            admission.apply_releases()
            now = self._clock()
            if now >= next_tick:
                self._tick(now)
                next_tick = now + tick
            if self._flush_acks(now, last_flush):
                last_flush = now
            self._queue.notify()  # outcomes of expiries found by _tick

    def _poll(self, poller: zmq.Poller, reading: bool, next_tick: float, last_flush: float) -> tuple[bool, bool]:
        """Wait for a message, a wake-up or the next deadline (a tick, an ack flush, a
        release to look for); returns whether the socket is now read and has messages."""
        assert self._sock is not None and self._pipe is not None and self._admission is not None
        sock, rfd, admission = self._sock, self._pipe[0], self._admission
        now = self._clock()
        wait = next_tick - now
        if self._peers.pending():
            wait = min(wait, last_flush + ACK_INTERVAL_S - now)
        elif admission.waiting:  # a release may come without a wake-up: look every interval
            wait = min(wait, ACK_INTERVAL_S)
        # Backpressure: with the scheduler this far behind, leave messages in libzmq
        # (then TCP) until it catches up; get()/drain() wake the loop.
        full = admission.full()
        self._queue.backpressure = full
        if full == reading:
            reading = not full
            poller.modify(sock, zmq.POLLIN if reading else 0)
        events = dict(poller.poll(poll_ms(wait)))
        if rfd in events:
            try:
                os.read(rfd, 4096)
            except BlockingIOError:
                pass
        self._wake_armed = False
        self._expects.apply()
        return reading, sock in events

    def _read_batch(self, sock: zmq.Socket[Any]) -> None:
        """Read and handle up to ``recv_batch`` messages, or until admission is full."""
        assert self._admission is not None and self._handshake is not None
        admission, handshake = self._admission, self._handshake
        # Frames kept per message: past this the rest are counted, not copied (the message
        # fails as wire:frames; libzmq has buffered it already, Python need not double it).
        keep = self._limits.max_frames + 3
        # Frame by frame with copy=False and Frame.more: pyzmq's recv_multipart asks the
        # socket for RCVMORE through an enum conversion per frame, ~2 us a message here.
        # Tensor frames stay in libzmq's buffer behind a read-only view: copying an 8 KiB
        # hidden state out with Frame.bytes cost another ~2 us a message.
        recv = sock.recv
        noblock = zmq.NOBLOCK
        curve = self._curve
        for _ in range(self.config.recv_batch):
            try:
                ident = recv(noblock)  # a ROUTER message: the routing id, then at least one frame
            except zmq.Again:
                break
            frames: list[Any] = [ident]
            extra = 0
            try:  # the rest arrived with it: libzmq delivers a message whole
                f = recv(noblock, copy=False)
                user: str | None = f.get("User-Id") if curve else None  # type: ignore[assignment]  # a str property
                frames.append(f.bytes)
                while f.more:
                    f = recv(noblock, copy=False)
                    if len(frames) < keep:  # tensor frames (or a signature): read-only views, no copy
                        frames.append(f.buffer.toreadonly())
                    else:
                        extra += 1
            except zmq.ZMQError as exc:  # never seen; if it happens, it fails this message only
                self._discard_rest(sock)
                self._internal(frames, exc)
                continue
            try:
                if extra:
                    admission.reject(
                        frames[0],
                        WireError(
                            f"{len(frames) - 1 + extra} frames is not in [1, {self._limits.max_frames}]",
                            field="frames",
                        ),
                        "wire",
                        0,
                    )
                else:
                    handshake.handle(frames, user)
            except Exception as exc:
                self._internal(frames, exc)
            if admission.full():
                break

    def _flush_acks(self, now: float, last_flush: float) -> bool:
        """Send the coalesced outcome acks when they are due; True when sent.

        One ack per peer every ACK_INTERVAL_S (or ACK_BATCH outcomes), not one per poll
        wake-up. Freed slots go at once (a prefill may be waiting for one); pending
        outcomes ride along.
        """
        pending = self._peers.pending()
        if pending and (pending >= ACK_BATCH or now - last_flush >= ACK_INTERVAL_S or self._peers.slots_freed()):
            self._peers.flush(self._replies.send, self._limits.max_message_bytes)
            return True
        return False

    def _tick(self, now: float) -> None:
        """Fail overdue expectations, drop silent peers, send heartbeats (the handshake's)."""
        assert self._handshake is not None
        self._handshake.tick(now)

    @staticmethod
    def _discard_rest(sock: zmq.Socket[Any]) -> None:
        """Drop what is left of a message read only in part, so the next read starts a message."""
        try:
            while sock.get(zmq.RCVMORE):
                sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass

    def _internal(self, frames: list[Any], exc: Exception) -> None:
        """A message raised something no check foresaw: fail it (counted), keep serving."""
        reason = f"{type(exc).__name__}: {str(exc)[:200]}"
        self._queue.put(self.pipeline.fail(Failure(request_id=None, stage="receiver", reason=reason, field="internal")))
        try:
            self._replies.send_to(frames[0], wire.ErrorReply(code="internal", reason=reason))
        except Exception:
            pass

    def _shutdown(self) -> None:
        for peer in self._peers:
            self._replies.send(peer, wire.Bye(reason="decode receiver stopped"))
        self._expects.apply()
        for rid in self._expects.take():
            reason = "decode receiver stopped before the request arrived"
            self._queue.put(
                self.pipeline.fail(Failure(request_id=rid, stage="transfer", reason=reason, field="stopped"))
            )
        if self._sock is not None:
            try:
                self._sock.unbind(self.address)  # free the port for a successor at once
            except zmq.ZMQError:
                pass
            self._sock.close(linger=100)  # let the byes out
            self._sock = None
            self._replies.sock = None


def open_receiver(
    config: TransportConfig,
    pipeline: ReceivePipeline,
    *,
    context: zmq.Context[Any] | None = None,
) -> DecodeReceiver:
    """Open a Mooncake engine when ``config.mooncake.enabled``, then build and start a receiver.

    The receiver owns that engine: :meth:`DecodeReceiver.stop` closes it.
    """
    from .mooncake import open_engine

    engine = open_engine(config.mooncake) if config.mooncake.enabled else None
    rx = DecodeReceiver(config, pipeline, engine=engine, context=context)
    rx._owns_engine = engine is not None
    try:
        return rx.start()
    except BaseException:
        if engine is not None:
            engine.close()
        raise
