"""Decode side of the transport: a ZMQ ROUTER loop feeding the receive pipeline.

One thread (:meth:`DecodeReceiver.start`) owns the socket and the slot pool. Per
inbound message it checks authentication (CURVE's key from ZAP, or the HMAC and its
replay window: :mod:`.auth`), decodes and validates the header (:mod:`.wire`), resolves
inline frames or slot ranges as zero-copy views, runs ``pipeline.process`` (hooks, then
the arm's synthesizer) and puts the outcome (:class:`~pd_middleware.pipeline.Delivery`
or :class:`~pd_middleware.pipeline.Failure`) on a queue the scheduler reads with
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
``limits.max_queued_outcomes`` outcomes waiting or holds ``limits.max_queued_inline_bytes``
inline bytes not yet released (taken or not: a consumer that keeps outcomes stays
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
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from .._errors import IntegrityError, TransferError, WireError
from ..contracts import ReceiveContext
from ..pipeline import Delivery, Failure, ReceivePipeline
from . import integrity, wire
from .auth import TO_DECODE, TO_PREFILL, CurveGate, HelloGuard, Signer
from .config import TransportConfig
from .expects import Expectations
from .mooncake import MooncakeEngine
from .outcomes import OutcomeQueue
from .peers import ACK_BATCH, ACK_INTERVAL_S, OUTSTANDING_CAP, REASON_CAP, Peer, PeerTable
from .slots import SlotPool
from .sockets import bind_router

_PayloadHeader = wire.PayloadHeader
_perf_counter = time.perf_counter
_NO_NONCE = bytes(16)
# Failures whose request id is another delivery's or another peer's: never named in the Failure.
_NOT_OWNED = frozenset(("duplicate", "peer"))
# [peer, request id, seq, slot, slot generation, delivered?, inline bytes] of a payload whose
# releaser was called (by the scheduler, or by the pipeline at once when the payload failed).
_Release = list[Any]


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
        self._signer = Signer(key) if key is not None else None
        self._curve = config.curve.enabled
        self._gate: CurveGate | None = None
        self._limits = config.limits
        self._consumed_acks = config.ack == "consumed"
        self.session = secrets.token_hex(8)
        self.address = ""
        self._queue = OutcomeQueue(self._wake)  # outcomes for the scheduler (outcomes.py)
        self._released: deque[_Release] = deque()
        # Releases that wake the loop at once; the rest are found within ACK_INTERVAL_S.
        self._release_batch = max(1, config.slots.per_peer >> 3)
        self._held_n = 0  # releases the loop waits for: held slots, inline bytes, consumed acks (loop only)
        self._expects = Expectations()
        self._peers = PeerTable()
        self._hellos = HelloGuard()  # HMAC: hello nonces seen, freshness
        self._wake_armed = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._sock: zmq.Socket[Any] | None = None
        self._pool: SlotPool | None = None
        self._pool_addr = 0
        self._pipe: tuple[int, int] | None = None
        self._owns_engine = False  # set by open_receiver, which opened the engine: stop() closes it
        self.unsent = 0  # replies dropped because a peer's queue was full or gone

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> DecodeReceiver:
        """Bind, register the slots with the engine and start the receive thread."""
        cfg = self.config
        ctx = self._ctx if self._ctx is not None else zmq.Context.instance()
        sock, self.address, self._gate = bind_router(ctx, cfg, self.session)
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
        not, within the last 65,536 arrivals or while outstanding there). It fails with ``transfer:deadline`` if it has not arrived
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

    def _releaser(self, item: _Release) -> Callable[[], None]:
        done = False
        released = self._released
        prompt = item[3] >= 0 or self._consumed_acks or item[6] > 0  # someone waits on this release
        batch = self._release_batch
        queue = self._queue

        def release() -> None:
            nonlocal done
            if not done:  # idempotent: a second release must not free a reused slot
                done = True
                released.append(item)
                if prompt and (len(released) >= batch or queue.backpressure):
                    self._wake()

        return release

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
        assert self._sock is not None and self._pipe is not None
        sock, rfd = self._sock, self._pipe[0]
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(rfd, zmq.POLLIN)
        tick = min(0.05, self.config.heartbeat_s / 2)
        next_tick = self._clock()
        batch = self.config.recv_batch
        queue = self._queue
        max_out = self._limits.max_queued_outcomes
        max_bytes = self._limits.max_queued_inline_bytes
        # Frames kept per message: past this the rest are counted, not copied (the message
        # fails as wire:frames; libzmq has buffered it already, Python need not double it).
        keep = self._limits.max_frames + 3
        # Frame by frame with copy=False and Frame.more: pyzmq's recv_multipart asks the
        # socket for RCVMORE through an enum conversion per frame, ~2 us a message here.
        recv = sock.recv
        noblock = zmq.NOBLOCK
        curve = self._curve
        last_flush = self._clock()
        reading = True
        while self._running:
            now = self._clock()
            wait = next_tick - now
            if self._peers.pending():
                wait = min(wait, last_flush + ACK_INTERVAL_S - now)
            elif self._held_n:  # a release may come without a wake-up: look every interval
                wait = min(wait, ACK_INTERVAL_S)
            # Backpressure: with the scheduler this far behind, leave messages in libzmq
            # (then TCP) until it catches up; get()/drain() wake the loop.
            full = queue.full(max_out, max_bytes)
            queue.backpressure = full
            if full == reading:
                reading = not full
                poller.modify(sock, zmq.POLLIN if reading else 0)
            events = dict(poller.poll(max(0.0, wait) * 1000.0))  # type: ignore[arg-type]  # pyzmq takes float ms
            if rfd in events:
                try:
                    os.read(rfd, 4096)
                except BlockingIOError:
                    pass
            self._wake_armed = False
            self._expects.apply()
            if sock in events:
                for _ in range(batch):
                    try:
                        f = recv(noblock, copy=False)
                    except zmq.Again:
                        break
                    user: str | None = f.get("User-Id") if curve else None  # type: ignore[assignment]  # a str property
                    frames = [f.bytes]
                    extra = 0
                    while f.more:  # the rest of a multipart message has arrived with it
                        f = recv(noblock, copy=False)
                        if len(frames) < keep:
                            frames.append(f.bytes)
                        else:
                            extra += 1
                    try:
                        if extra:
                            self._reject(
                                frames[0],
                                WireError(
                                    f"{len(frames) - 1 + extra} frames is not in [1, {self._limits.max_frames}]",
                                    field="frames",
                                ),
                                "wire",
                                0,
                            )
                        else:
                            self._handle(frames, user)
                    except Exception as exc:
                        self._internal(frames, exc)
                    if queue.full(max_out, max_bytes):
                        break
            queue.notify()
            self._apply_releases()
            now = self._clock()
            if now >= next_tick:
                self._tick(now)
                next_tick = now + tick
            # Outcome acks are coalesced: one per peer every ACK_INTERVAL_S (or
            # ACK_BATCH outcomes), not one per poll wake-up. Freed slots go at once
            # (a prefill may be waiting for one); pending outcomes ride along.
            pending = self._peers.pending()
            if pending and (pending >= ACK_BATCH or now - last_flush >= ACK_INTERVAL_S or self._peers.slots_freed()):
                self._peers.flush(self._send, self._limits.max_message_bytes)
                last_flush = now
            queue.notify()  # outcomes of expiries found by _tick

    def _internal(self, frames: list[bytes], exc: Exception) -> None:
        """A message raised something no check foresaw: fail it (counted), keep serving."""
        reason = f"{type(exc).__name__}: {str(exc)[:200]}"
        self._emit(self.pipeline.fail(Failure(request_id=None, stage="receiver", reason=reason, field="internal")))
        try:
            self._send_to(frames[0], wire.ErrorReply(code="internal", reason=reason))
        except Exception:
            pass

    def _shutdown(self) -> None:
        for peer in self._peers:
            self._send(peer, wire.Bye(reason="decode receiver stopped"))
        self._expects.apply()
        for rid in self._expects.take():
            self._fail_expected(rid, "stopped", "decode receiver stopped before the request arrived")
        if self._sock is not None:
            try:
                self._sock.unbind(self.address)  # free the port for a successor at once
            except zmq.ZMQError:
                pass
            self._sock.close(linger=100)  # let the byes out
            self._sock = None

    def _send(self, peer: Peer, msg: wire.Message) -> None:
        self._send_to(peer.ident, msg, peer.nonce, peer.tx_seq)
        peer.tx_seq += 1
        peer.last_sent = self._clock()

    def _send_to(self, ident: bytes, msg: wire.Message, nonce: bytes = _NO_NONCE, seq: int | None = None) -> None:
        """The one (signed) send path. With HMAC, a connection with no peer is answered under
        the nonce its verified message carried, and a clock-based sequence that grows
        across decode restarts (a prefill refuses a sequence it has seen)."""
        assert self._sock is not None
        body = [wire.encode(msg)]
        if self._signer is not None:
            body += self._signer.sign(body, nonce, time.time_ns() if seq is None else seq, TO_PREFILL)
        try:
            self._sock.send_multipart([ident, *body], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.unsent += 1  # peer gone or its queue full: it will time out and resync

    def _emit(self, outcome: Delivery | Failure, nbytes: int = 0) -> None:
        self._queue.put(outcome, nbytes)

    def _reject(
        self, ident: bytes, exc: WireError, code: str, nbytes: int, nonce: bytes = _NO_NONCE, peer: Peer | None = None
    ) -> None:
        """Count and report a message that failed before its payload could be built.

        ``peer``: the authenticated sender, if any. Only then may the Failure name the
        request id the message claimed, and only an id no other peer owns: an
        unauthenticated or foreign message must never fail (or evict) another's request.
        """
        self.metrics.bytes["control"] += nbytes
        rid = exc.request_id
        if rid is not None and (peer is None or self._other_owner(rid, peer) is not None):
            rid = None  # the claimed id stays in the reason
        name = peer.name if peer is not None else None
        f = self.pipeline.fail(Failure(request_id=rid, stage="wire", reason=str(exc), field=exc.field, peer=name))
        self._emit(f)
        reply = wire.ErrorReply(code=code, reason=str(exc)[:REASON_CAP], request_id=exc.request_id)
        conn = self._peers.by_ident.get(ident)
        if conn is not None and (self._signer is None or conn.nonce == nonce):
            # A connected peer is answered on its own sequence: a wall-clock one would jump
            # its replay window past every later ack and heartbeat (HMAC).
            self._send(conn, reply)
        else:
            self._send_to(ident, reply, nonce)

    def _other_owner(self, rid: str, peer: Peer) -> str | None:
        """The identity of another peer that owns ``rid`` (expected from it, recently arrived
        from it, or outstanding there), or None when ``peer`` may send it."""
        owner = self._expects.owner(rid)
        if owner is not None:
            return owner if owner != peer.name else None
        for p in self._peers.by_ident.values():  # outstanding for longer than the arrived window
            if p.name != peer.name and rid in p.outstanding:
                return p.name
        return None

    def _handle(self, frames: list[bytes], user: str | None = None) -> None:
        ident = frames[0]
        body = frames[1:]
        limits = self._limits
        signed = self._signer is not None
        if not body or len(body) > limits.max_frames + 2 * signed:
            n = sum(map(len, body))
            self._reject(
                ident, WireError(f"{len(body)} frames is not in [1, {limits.max_frames}]", field="frames"), "wire", n
            )
            return
        peer = self._peers.by_ident.get(ident)
        nonce, seq = _NO_NONCE, 0
        if signed:
            opened = self._signer.open(body, TO_DECODE)  # type: ignore[union-attr]  # set whenever `signed`
            if opened is None:
                self._reject(
                    ident, WireError("missing or invalid HMAC signature", field="hmac"), "hmac", sum(map(len, body))
                )
                return
            nonce, seq = opened
            body = body[:-2]
            if peer is not None and nonce == peer.nonce:
                if seq <= peer.rx_seq:
                    exc = WireError(f"sequence {seq} was already used on this connection", field="replay")
                    self._reject(ident, exc, "replay", sum(map(len, body)), nonce)  # no request id: a replay
                    return
                peer.rx_seq = seq
            else:
                peer = None  # only a fresh hello may open (or reopen) a connection
        if user is not None and peer is not None and peer.key != user:
            peer = None  # never expected (libzmq keeps one key per connection): a reused routing id
        try:
            msg = wire.decode_frame(body[0], limits)
        except WireError as exc:
            self._reject(ident, exc, "wire", sum(map(len, body)), nonce, peer)
            return
        now = self._clock()
        if peer is not None:
            peer.last_seen = now
        kind = type(msg)
        if kind is _PayloadHeader:
            if peer is None:
                err = WireError(
                    "unknown peer: send hello first (decode restarted?)",
                    field="peer",
                    request_id=msg.request_id,  # type: ignore[attr-defined]  # kind is PayloadHeader (checked above)
                )
                self._reject(ident, err, "hello", sum(map(len, body)), nonce)
            else:
                self._on_payload(peer, msg, body)  # type: ignore[arg-type]  # `kind is` dispatch: a PayloadHeader
            return
        self.metrics.bytes["control"] += len(body[0])
        if kind is wire.Hello:
            self._on_hello(ident, msg, now, user, nonce, seq)  # type: ignore[arg-type]  # `kind is` dispatch: a Hello
        elif kind is wire.Heartbeat:
            if peer is None:
                self._send_to(ident, wire.ErrorReply(code="hello", reason="unknown peer (decode restarted?)"), nonce)
        elif kind is wire.Bye and peer is not None:
            self._drop(peer, "peer_closed", f"prefill {peer.name!r} closed: {msg.reason}")  # type: ignore[attr-defined]  # `kind is` dispatch: a Bye

    def _on_hello(self, ident: bytes, msg: wire.Hello, now: float, user: str | None, nonce: bytes, seq: int) -> None:
        name = msg.name
        if self._curve:
            if self._gate is None or user not in self._gate.allowed:
                self._reject(ident, WireError("CURVE key not on the allowlist", field="peer"), "hello", 0)
                return
            name = self._gate.allowed[user]  # the authenticated identity, whatever the hello says
        if self._signer is not None:
            why = self._hellos.check(msg.ts, nonce, seq)
            if why:
                self._reject(ident, WireError(why, field="replay"), "replay", 0, nonce)
                return
        for other in self._peers.same_identity(ident, name, user):
            # The same prefill reconnected: it stays responsible for its expected requests.
            self._drop(other, None, "")
        peer = Peer(
            ident=ident,
            name=name,
            last_seen=now,
            last_sent=now,
            key=user,
            nonce=nonce,
            rx_seq=seq,
            tx_seq=time.time_ns(),
        )
        slots: list[int] = []
        pool = self._pool
        if pool is not None:
            slots = pool.grant(ident, min(msg.want_slots, self.config.slots.per_peer))

            def resolve(slot: int, offset: int, nbytes: int, fld: str, rid: str) -> memoryview:
                return pool.view_of(ident, slot, offset, nbytes, fld, rid)

            peer.resolver = resolve
        peer.slots = tuple(slots)
        self._peers.add(peer)
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

    def _on_payload(self, peer: Peer, h: wire.PayloadHeader, body: list[bytes]) -> None:
        m = self.metrics
        rid = h.request_id
        try:
            # Neither of these failures names the request: it is another delivery's (or
            # another peer's) id, and a keyed store must not let it replace that outcome.
            if rid in peer.outstanding:
                raise WireError("this peer already has this request outstanding", field="duplicate", request_id=rid)
            other = self._other_owner(rid, peer)
            if other is not None:
                raise WireError(f"it belongs to {other!r}, sent by {peer.name!r}", field="peer", request_id=rid)
            payload, slot = wire.payload_from_header(h, body, self._limits, peer.resolver)
            gen = 0
            if slot >= 0:  # bulk integrity (integrity.py): generation and digests, before delivery
                gen = self._pool.admit(slot, wire.slot_refs(h), h.request_id)  # type: ignore[union-attr]  # slot >= 0 only with a pool
        except (WireError, IntegrityError) as exc:
            named = wire.named_slot(h)
            if named >= 0 and self._pool is not None and named < self._pool.count:
                pool = self._pool
                if pool.owner[named] == peer.ident and not pool.held[named]:
                    peer.freed.append(named)  # the sender counts it busy until told otherwise
            m.bytes["control"] += sum(map(len, body))
            stage, fld = ("transfer", "digest") if isinstance(exc, IntegrityError) else ("wire", exc.field)
            named_rid = exc.request_id if fld not in _NOT_OWNED else None
            if named_rid is not None:
                self._expects.own(rid, peer.name)  # its own request failed: no other peer may claim it now
            f = self.pipeline.fail(
                Failure(request_id=named_rid, stage=stage, reason=str(exc), field=fld, peer=peer.name)
            )
            self._emit(f)
            peer.failed.append((h.seq, f.key, f.reason))
            return
        by_plane = m.bytes
        by_plane["control"] += len(body[0])
        inline = 0
        if slot >= 0:
            self._pool.hold(slot)  # type: ignore[union-attr]  # slot >= 0 only with a pool
            self._held_n += 1
            by_plane["bulk"] += wire.bulk_bytes(payload)
        elif len(body) == 2:
            inline = len(body[1])
        elif len(body) > 2:
            inline = sum(map(len, body[1:]))
        by_plane["inline"] += inline
        self._expects.arrived(rid, peer.name)
        consumed = self._consumed_acks
        item: _Release = [peer, rid, h.seq, slot, gen, False, inline]
        releaser = self._releaser(item)
        out = self.pipeline.process(payload, ReceiveContext(peer.name, "default", _perf_counter()), releaser)
        self._queue.put(out, inline)
        if type(out) is Delivery:
            item[5] = True
            held = peer.outstanding
            held[rid] = None
            if len(held) > OUTSTANDING_CAP:  # bounded: the oldest unreleased id is forgotten
                del held[next(iter(held))]
            if inline:  # its bytes count against max_queued_inline_bytes until released
                self._held_n += 1
            if consumed:
                self._held_n += 1
            else:
                peer.delivered.append(h.seq)
        else:
            peer.failed.append((h.seq, out.key, out.reason))  # type: ignore[union-attr]  # a Failure here

    def _apply_releases(self) -> None:
        pool = self._pool
        released = self._released
        consumed = self._consumed_acks
        peers = self._peers
        queue = self._queue
        while released:
            peer, rid, seq, slot, gen, delivered, inline = released.popleft()
            if inline:
                queue.freed(inline)
                if delivered:
                    self._held_n -= 1
            if delivered:
                peer.outstanding.pop(rid, None)
            if slot >= 0:
                done, owner = pool.release(slot, gen)  # type: ignore[union-attr]  # slot >= 0 only with a pool
                if done:  # else stale: the slot was freed or reused since; never free a later use
                    self._held_n -= 1
                if done and owner is not None:
                    holder = peers.get(owner)  # type: ignore[arg-type]  # slot owners are peer idents
                    if holder is not None:
                        holder.freed.append(slot)
            if consumed and delivered:
                self._held_n -= 1
                if peers.get(peer.ident) is peer:  # still connected: ack it now it was used
                    peer.delivered.append(seq)  # type: ignore[union-attr]  # `is` narrowed it to get()'s Optional

    def _fail_expected(self, rid: str, why: str, reason: str) -> None:
        self._emit(self.pipeline.fail(Failure(request_id=rid, stage="transfer", reason=reason, field=why)))

    def _tick(self, now: float) -> None:
        for rid in self._expects.overdue(now):
            self._fail_expected(rid, "deadline", f"request {rid!r} did not arrive by its deadline")
        timeout = self.config.peer_timeout_s
        hb = self.config.heartbeat_s
        for peer in self._peers:
            if self._queue.backpressure:
                peer.last_seen = now  # not reading: their heartbeats wait in libzmq, unheard
            silent = now - peer.last_seen
            if silent > timeout:
                self._drop(
                    peer,
                    "peer_lost",
                    f"prefill {peer.name!r} lost: silent for {silent:.1f} s (peer_timeout_s={timeout:g})",
                )
            elif now - peer.last_sent >= hb:
                self._send(peer, wire.Heartbeat(session=self.session))

    def _drop(self, peer: Peer, why: str | None, reason: str) -> None:
        """Forget ``peer``, reclaim its slots and (if ``why``) fail the requests expected from it."""
        self._peers.remove(peer)
        if self._pool is not None:
            self._pool.reclaim(peer.ident)
        if why is not None:
            for rid in self._expects.take(peer.name):
                self._fail_expected(rid, why, reason)


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
