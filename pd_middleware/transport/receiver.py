"""Decode side of the transport: a ZMQ ROUTER loop feeding the receive pipeline.

One thread (:meth:`DecodeReceiver.start`) owns the socket and the slot pool. Per
inbound message it verifies the optional HMAC, decodes and validates the header
(:mod:`.wire`), resolves inline frames or slot ranges as zero-copy views, runs
``pipeline.process`` (hooks, then the arm's synthesizer) and puts the outcome
(:class:`~pd_middleware.pipeline.Delivery` or :class:`~pd_middleware.pipeline.Failure`)
on a queue the scheduler reads with :meth:`get`/:meth:`drain` (a waiting scheduler is
woken once per receive batch). Per-request statuses go back to each prefill in acks
coalesced over ``_ACK_INTERVAL_S``. Freed slots ride on those acks too, and go at once
when a peer has an eighth of its grant freed but unacknowledged; likewise a release
wakes the loop only every ``slots.per_peer // 8`` releases, and the loop looks for
releases at least every ``_ACK_INTERVAL_S`` while any slot is held.

Every inbound message ends as exactly one counted outcome: a delivery, a pipeline
failure, or a wire failure (``wire:<field>``; ``wire:hmac`` for a bad signature,
counted even when the message was not a payload, since it cannot be known). Requests
announced with :meth:`expect` that never arrive fail with ``transfer:deadline`` or,
when their peer goes silent for ``peer_timeout_s``, ``transfer:peer_lost``.

Bulk views stay valid until :meth:`Delivery.release` is called; after that the slot
may be overwritten by the next payload. Hooks that keep payloads must copy them.
"""

from __future__ import annotations

import heapq
import os
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from .._errors import IntegrityError, TransferError, WireError
from ..contracts import ReceiveContext
from ..pipeline import Delivery, Failure, ReceivePipeline
from . import integrity, wire
from .auth import Signer
from .config import TransportConfig
from .mooncake import MooncakeEngine
from .slots import SlotPool

_PayloadHeader = wire.PayloadHeader
_perf_counter = time.perf_counter
_ARRIVED_CAP = 1 << 16  # request ids remembered so a late expect() does not fail an arrived request
# Ack coalescing: a prefill hears about outcomes within this long (freed slots at once).
_ACK_INTERVAL_S = 0.002
_ACK_BATCH = 256  # pending outcomes that trigger an ack before the interval is up


@dataclass(eq=False)
class _Peer:
    ident: bytes
    name: str
    last_seen: float
    last_sent: float
    slots: tuple[int, ...] = ()
    freed: list[int] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)
    failed: list[tuple[int, str, str]] = field(default_factory=list)
    resolver: Callable[..., memoryview] | None = None


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
        context: zmq.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.metrics = pipeline.metrics
        self.engine = engine
        self._ctx = context
        self._clock = clock
        key = config.secret()
        self._signer = Signer(key) if key is not None else None
        self._limits = config.limits
        self.session = secrets.token_hex(8)
        self.address = ""
        # Outcomes for the scheduler. A deque plus an event set once per receive batch,
        # not a queue woken per item: waking the scheduler thread for every payload
        # made the two threads trade the GIL on every message (benchmarks/receive.py).
        self._out: deque[Delivery | Failure] = deque()
        self._ready = threading.Event()
        self._pending_wake = False
        self._released: deque[tuple[int, int]] = deque()
        # Releases that wake the loop at once; the rest are found within _ACK_INTERVAL_S.
        self._release_batch = max(1, config.slots.per_peer >> 3)
        self._held_n = 0  # slots held by delivered payloads (receiver thread only)
        self._expects: deque[tuple[str, str | None, float | None]] = deque()
        self._expected: dict[str, tuple[str | None, float | None]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._arrived: dict[str, None] = {}
        self._peers: dict[bytes, _Peer] = {}
        self._wake_armed = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket | None = None
        self._pool: SlotPool | None = None
        self._pool_addr = 0
        self._pipe: tuple[int, int] | None = None
        self._owns_engine = False  # set by open_receiver, which opened the engine: stop() closes it
        self.unsent = 0  # replies dropped because a peer's queue was full or gone

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> "DecodeReceiver":
        """Bind, register the slots with the engine and start the receive thread."""
        cfg = self.config
        ctx = self._ctx if self._ctx is not None else zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, cfg.hwm)
        sock.setsockopt(zmq.SNDHWM, cfg.hwm)
        # libzmq drops (and disconnects) any frame above this before Python sees it.
        sock.setsockopt(zmq.MAXMSGSIZE, max(cfg.limits.max_message_bytes, cfg.limits.max_tensor_bytes))
        # A fixed port may still be held for a moment by a receiver stopping in this
        # process (libzmq unbinds asynchronously): retry briefly, then fail clearly.
        deadline = time.monotonic() + 2.0
        while True:
            try:
                if cfg.port:
                    sock.bind(f"tcp://{cfg.bind_host}:{cfg.port}")
                    port = cfg.port
                else:
                    port = sock.bind_to_random_port(f"tcp://{cfg.bind_host}")
                break
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE and cfg.port and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                sock.close(0)
                raise TransferError(str(exc), op="bind", peer=f"{cfg.bind_host}:{cfg.port}") from None
        self.address = f"tcp://{cfg.bind_host}:{port}"
        digest = integrity.algorithm_for(cfg)
        self._pool = SlotPool(cfg.slots.count, cfg.slots.size_bytes, digest) if self.engine is not None else None
        if self._pool is not None and self.engine is not None:
            self._pool_addr = self.engine.register(self._pool.buffer)
        self._sock = sock
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._running = True
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

    def __enter__(self) -> "DecodeReceiver":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scheduler-side API (any thread) ----------------------------------------

    def get(self, timeout: float | None = None) -> Delivery | Failure | None:
        """Next outcome, waiting up to ``timeout`` seconds; None if none arrived."""
        out = self._out
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return out.popleft()
            except IndexError:
                pass
            self._ready.clear()
            try:  # re-check after clearing: an append before the clear is not lost
                return out.popleft()
            except IndexError:
                pass
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._ready.wait(left)

    def drain(self, max_items: int = 1 << 30) -> list[Delivery | Failure]:
        """Every outcome ready now, at most ``max_items``."""
        out: list[Delivery | Failure] = []
        pop = self._out.popleft
        try:
            while len(out) < max_items:
                out.append(pop())
        except IndexError:
            pass
        return out

    def expect(self, request_id: str, peer: str | None = None, deadline: float | None = None) -> None:
        """Announce a request the decode awaits (like SGLang's prealloc queue).

        It fails with ``transfer:deadline`` if it has not arrived by ``deadline``
        (this receiver's clock, ``time.monotonic`` by default), or with
        ``transfer:peer_lost`` when ``peer`` (the prefill's hello name) goes silent.
        """
        self._expects.append((request_id, peer, deadline))
        self._wake()

    @property
    def peers(self) -> dict[str, int]:
        """Connected prefill peers by name, with the number of slots each holds a grant for."""
        return {p.name: len(p.slots) for p in list(self._peers.values())}

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

    def _releaser(self, slot: int, gen: int) -> Callable[[], None]:
        done = False
        released = self._released
        batch = self._release_batch

        def release() -> None:
            nonlocal done
            if not done:  # idempotent: a second release must not free a reused slot
                done = True
                released.append((slot, gen))  # generation-checked when applied
                if len(released) >= batch:
                    self._wake()

        return release

    def _run(self) -> None:
        assert self._sock is not None and self._pipe is not None
        sock, rfd = self._sock, self._pipe[0]
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(rfd, zmq.POLLIN)
        tick = min(0.05, self.config.heartbeat_s / 2)
        next_tick = self._clock()
        batch = self.config.recv_batch
        # Frame by frame with copy=False and Frame.more: pyzmq's recv_multipart asks the
        # socket for RCVMORE through an enum conversion per frame, ~2 us a message here.
        recv = sock.recv
        noblock = zmq.NOBLOCK
        last_flush = self._clock()
        try:
            while self._running:
                now = self._clock()
                wait = next_tick - now
                if self._acks_pending():
                    wait = min(wait, last_flush + _ACK_INTERVAL_S - now)
                elif self._held_n:  # a release may come without a wake-up: look every interval
                    wait = min(wait, _ACK_INTERVAL_S)
                events = dict(poller.poll(max(0.0, wait) * 1000.0))
                if rfd in events:
                    try:
                        os.read(rfd, 4096)
                    except BlockingIOError:
                        pass
                self._wake_armed = False
                self._apply_expects()
                if sock in events:
                    for _ in range(batch):
                        try:
                            f = recv(noblock, copy=False)
                        except zmq.Again:
                            break
                        frames = [f.bytes]
                        while f.more:  # the rest of a multipart message has arrived with it
                            f = recv(noblock, copy=False)
                            frames.append(f.bytes)
                        self._handle(frames)
                self._notify()
                self._apply_releases()
                now = self._clock()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + tick
                # Outcome acks are coalesced: one per peer every _ACK_INTERVAL_S (or
                # _ACK_BATCH outcomes), not one per poll wake-up. Freed slots go at once
                # (a prefill may be waiting for one); pending outcomes ride along.
                pending = self._acks_pending()
                if pending and (
                    pending >= _ACK_BATCH or now - last_flush >= _ACK_INTERVAL_S or self._slots_freed()
                ):
                    self._flush()
                    last_flush = now
                self._notify()  # outcomes of expiries found by _tick
        finally:
            self._shutdown()
            self._notify()

    def _shutdown(self) -> None:
        for peer in list(self._peers.values()):
            self._send(peer, wire.Bye(reason="decode receiver stopped"))
        self._apply_expects()
        for rid in list(self._expected):
            self._fail_expected(rid, "stopped", "decode receiver stopped before the request arrived")
        if self._sock is not None:
            try:
                self._sock.unbind(self.address)  # free the port for a successor at once
            except zmq.ZMQError:
                pass
            self._sock.close(linger=100)  # let the byes out
            self._sock = None

    def _send(self, peer: _Peer, msg: wire.Message) -> None:
        body = [wire.encode(msg)]
        if self._signer is not None:
            body.append(self._signer.sign(body))
        self._send_raw(peer.ident, body)
        peer.last_sent = self._clock()

    def _send_raw(self, ident: bytes, body: list[bytes]) -> None:
        assert self._sock is not None
        try:
            self._sock.send_multipart([ident, *body], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.unsent += 1  # peer gone or its queue full: it will time out and resync

    def _emit(self, outcome: Delivery | Failure) -> None:
        self._out.append(outcome)
        self._pending_wake = True

    def _notify(self) -> None:
        """Wake a waiting scheduler once for everything emitted since the last call."""
        if self._pending_wake:
            self._pending_wake = False
            self._ready.set()

    def _reject(self, ident: bytes, exc: WireError, code: str, nbytes: int) -> None:
        """Count and report a message that failed before its payload could be built."""
        self.metrics.bytes["control"] += nbytes
        f = self.pipeline.fail(Failure(request_id=exc.request_id, stage="wire", reason=str(exc), field=exc.field))
        self._emit(f)
        reply: list[bytes] = [wire.encode(wire.ErrorReply(code=code, reason=str(exc), request_id=exc.request_id))]
        if self._signer is not None:
            reply.append(self._signer.sign(reply))
        self._send_raw(ident, reply)

    def _handle(self, frames: list[bytes]) -> None:
        ident = frames[0]
        body = frames[1:]
        limits = self._limits
        if not body or len(body) > limits.max_frames:
            n = sum(map(len, body))
            self._reject(ident, WireError(f"{len(body)} frames is not in [1, {limits.max_frames}]", field="frames"), "wire", n)
            return
        if self._signer is not None:
            if not self._signer.verify(body):
                n = sum(map(len, body))
                self._reject(ident, WireError("missing or invalid HMAC signature", field="hmac"), "hmac", n)
                return
            body = body[:-1]
        try:
            msg = wire.decode_frame(body[0], limits)
        except WireError as exc:
            self._reject(ident, exc, "wire", sum(map(len, body)))
            return
        peer = self._peers.get(ident)
        now = self._clock()
        if peer is not None:
            peer.last_seen = now
        kind = type(msg)
        if kind is _PayloadHeader:
            if peer is None:
                exc = WireError("unknown peer: send hello first (decode restarted?)", field="peer", request_id=msg.request_id)  # type: ignore[attr-defined]
                self._reject(ident, exc, "hello", sum(map(len, body)))
            else:
                self._on_payload(peer, msg, body)  # type: ignore[arg-type]
            return
        self.metrics.bytes["control"] += len(body[0])
        if kind is wire.Hello:
            self._on_hello(ident, msg, now)  # type: ignore[arg-type]
        elif kind is wire.Heartbeat:
            if peer is None:
                reply = [wire.encode(wire.ErrorReply(code="hello", reason="unknown peer (decode restarted?)"))]
                if self._signer is not None:
                    reply.append(self._signer.sign(reply))
                self._send_raw(ident, reply)
        elif kind is wire.Bye:
            if peer is not None:
                self._drop(peer, "peer_closed", f"prefill {peer.name!r} closed: {msg.reason}")  # type: ignore[attr-defined]

    def _on_hello(self, ident: bytes, msg: wire.Hello, now: float) -> None:
        for other in list(self._peers.values()):
            if other.name == msg.name or other.ident == ident:
                # The same prefill reconnected: it stays responsible for its expected requests.
                self._drop(other, None, "")
        peer = _Peer(ident=ident, name=msg.name, last_seen=now, last_sent=now)
        slots: list[int] = []
        pool = self._pool
        if pool is not None:
            slots = pool.grant(ident, min(msg.want_slots, self.config.slots.per_peer))

            def resolve(slot: int, offset: int, nbytes: int, fld: str, rid: str) -> memoryview:
                return pool.view_of(ident, slot, offset, nbytes, fld, rid)

            peer.resolver = resolve
        peer.slots = tuple(slots)
        self._peers[ident] = peer
        size = self.config.slots.size_bytes
        self._send(
            peer,
            wire.Grant(
                session=self.session,
                mooncake=self.engine.peer_name if self.engine is not None else None,
                slot_size=size if pool is not None else 0,
                slots=peer.slots,
                addrs=tuple(self._pool_addr + s * size for s in slots),
                heartbeat_s=self.config.heartbeat_s,
                gens=tuple(pool.gen[s] for s in slots) if pool is not None else (),
            ),
        )

    def _on_payload(self, peer: _Peer, h: wire.PayloadHeader, body: list[bytes]) -> None:
        m = self.metrics
        try:
            payload, slot = wire.payload_from_header(h, body, self._limits, peer.resolver)
            if slot >= 0:  # bulk integrity (integrity.py): generation and digests, before delivery
                gen = self._pool.admit(slot, wire.slot_refs(h), h.request_id)  # type: ignore[union-attr]
        except (WireError, IntegrityError) as exc:
            named = _named_slot(h)
            if named >= 0 and self._pool is not None and named < self._pool.count:
                pool = self._pool
                if pool.owner[named] == peer.ident and not pool.held[named]:
                    peer.freed.append(named)  # the sender counts it busy until told otherwise
            m.bytes["control"] += sum(map(len, body))
            stage, fld = ("transfer", "digest") if isinstance(exc, IntegrityError) else ("wire", exc.field)
            f = self.pipeline.fail(Failure(request_id=exc.request_id, stage=stage, reason=str(exc), field=fld))
            self._emit(f)
            peer.failed.append((h.seq, f.key, f.reason))
            return
        by_plane = m.bytes
        by_plane["control"] += len(body[0])
        releaser = None
        if slot >= 0:
            self._pool.hold(slot)  # type: ignore[union-attr]
            self._held_n += 1
            releaser = self._releaser(slot, gen)
            by_plane["bulk"] += wire.bulk_bytes(payload)
        elif len(body) == 2:
            by_plane["inline"] += len(body[1])
        elif len(body) > 2:
            by_plane["inline"] += sum(map(len, body[1:]))
        rid = h.request_id
        if self._expected and rid in self._expected:
            del self._expected[rid]
        arrived = self._arrived
        arrived[rid] = None
        if len(arrived) > _ARRIVED_CAP:
            del arrived[next(iter(arrived))]
        out = self.pipeline.process(payload, ReceiveContext(peer.name, "default", _perf_counter()), releaser)
        self._out.append(out)
        self._pending_wake = True
        if type(out) is Delivery:
            peer.delivered.append(h.seq)
        else:
            peer.failed.append((h.seq, out.key, out.reason))  # type: ignore[union-attr]

    def _apply_releases(self) -> None:
        pool = self._pool
        released = self._released
        while released:
            slot, gen = released.popleft()
            done, owner = pool.release(slot, gen)  # type: ignore[union-attr]
            if not done:  # stale: the slot was freed or reused since; never free a later use
                continue
            self._held_n -= 1
            if owner is not None:
                peer = self._peers.get(owner)  # type: ignore[arg-type]
                if peer is not None:
                    peer.freed.append(slot)

    def _apply_expects(self) -> None:
        while self._expects:
            rid, peer, deadline = self._expects.popleft()
            if rid in self._arrived:
                continue
            self._expected[rid] = (peer, deadline)
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, rid))

    def _fail_expected(self, rid: str, why: str, reason: str) -> None:
        del self._expected[rid]
        self._emit(self.pipeline.fail(Failure(request_id=rid, stage="transfer", reason=reason, field=why)))

    def _tick(self, now: float) -> None:
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            deadline, rid = heapq.heappop(dl)
            entry = self._expected.get(rid)
            if entry is not None and entry[1] == deadline:
                self._fail_expected(rid, "deadline", f"request {rid!r} did not arrive by its deadline")
        timeout = self.config.peer_timeout_s
        hb = self.config.heartbeat_s
        for peer in list(self._peers.values()):
            silent = now - peer.last_seen
            if silent > timeout:
                self._drop(peer, "peer_lost", f"prefill {peer.name!r} lost: silent for {silent:.1f} s (peer_timeout_s={timeout:g})")
            elif now - peer.last_sent >= hb:
                self._send(peer, wire.Heartbeat(session=self.session))

    def _drop(self, peer: _Peer, why: str | None, reason: str) -> None:
        """Forget ``peer``, reclaim its slots and (if ``why``) fail the requests expected from it."""
        self._peers.pop(peer.ident, None)
        if self._pool is not None:
            self._pool.reclaim(peer.ident)
        if why is not None:
            for rid, (name, _) in list(self._expected.items()):
                if name == peer.name:
                    self._fail_expected(rid, why, reason)

    def _slots_freed(self) -> bool:
        """Whether enough freed slots await their ack that a prefill may be short of slots.

        A prefill with no free slot waits for this ack, so freed slots are acked at once
        once a peer has an eighth of its grant (at least one) freed but unacked; below
        that they ride on the next coalesced ack, at most _ACK_INTERVAL_S later.
        """
        return any(p.freed and len(p.freed) >= len(p.slots) >> 3 for p in self._peers.values())

    def _acks_pending(self) -> int:
        """Outcomes and freed slots not yet acknowledged to their prefill."""
        return sum(len(p.freed) + len(p.delivered) + len(p.failed) for p in self._peers.values())

    def _flush(self) -> None:
        for peer in self._peers.values():
            if peer.freed or peer.delivered or peer.failed:
                self._send(peer, wire.Ack(freed=tuple(peer.freed), delivered=tuple(peer.delivered), failed=tuple(peer.failed)))
                peer.freed.clear()
                peer.delivered.clear()
                peer.failed.clear()


def _named_slot(h: wire.PayloadHeader) -> int:
    """The slot a (possibly invalid) header names, or -1."""
    refs: list[Any] = [h.hidden]
    p = h.proposal
    if isinstance(p, wire.DenseMeta):
        refs.append(p.data)
    elif isinstance(p, wire.SparseMeta):
        refs += [p.indices, p.values]
    for r in refs:
        if r is not None and r.frame == 0 and r.slot >= 0:
            return r.slot
    return -1


def open_receiver(
    config: TransportConfig,
    pipeline: ReceivePipeline,
    *,
    context: zmq.Context | None = None,
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
