"""Prefill side of the transport: a ZMQ DEALER plus, optionally, Mooncake writes.

:meth:`PrefillSender.connect` says hello and receives the decode's slot grant (its
Mooncake peer name and the addresses of the slots this prefill may write). Per
request, :meth:`PrefillSender.send` either

- writes the bulk tensors into a free slot it owns with one (merged) Mooncake write,
  then sends the header naming the slot (*bulk*, above ``inline_threshold_bytes``), or
- sends the header followed by the tensors as raw ZMQ frames (*inline*).

The decode answers with batched acks: per-request status (delivered, or failed with a
reason) and slot-free notices. A slot is reused only after the decode freed it; with no
free slot, ``send`` waits up to ``slots.wait_s`` and then raises
:class:`~pd_middleware.NoSlotError`.

Counters reconcile: ``sent == delivered + failed + outstanding``; requests in flight
when the decode is lost are moved to ``failed['transfer:decode_lost']`` by
:meth:`reconnect`/:meth:`close`.

Threading: ``send``/``flush`` may be called from any thread (one lock serialises them);
a small heartbeat thread, started by ``connect``, keeps the connection alive when idle
and notices a silent or restarted decode.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from collections import Counter, deque
from typing import Any, Callable

import zmq

from .._errors import NoSlotError, TransferError, WireError
from ..payload import Payload
from . import wire
from .auth import Signer
from .config import TransportConfig
from .mooncake import MooncakeEngine

_FAILURE_LOG = 1024  # most recent failures kept for failures()


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
        context: zmq.Context | None = None,
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
        self._lock = threading.RLock()
        self._sock: zmq.Socket | None = None
        self._address = ""
        self._session = ""
        self._lost: str | None = "not connected"
        self._decode_mc: str | None = None
        self._slot_addr: dict[int, int] = {}
        self._free: deque[int] = deque()
        self._slot_size = 0
        self._staging: mmap.mmap | None = None
        self._staging_view: memoryview | None = None
        self._staging_addr = 0
        self._sources: list[tuple[int, int]] = []
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

    def connect(self, address: str, timeout: float | None = None) -> "PrefillSender":
        """Connect to ``address`` (``tcp://host:port``), say hello and wait for the slot grant.

        Raises :class:`TransferError` (op ``connect``) when no grant arrives in time.
        """
        with self._lock:
            self._open_socket(address)
            self._hello(timeout if timeout is not None else self.config.connect_timeout_s)
        if self._hb_thread is None:
            self._hb_stop.clear()
            self._hb_thread = threading.Thread(target=self._heartbeats, name=f"{self.name}-heartbeat", daemon=True)
            self._hb_thread.start()
        return self

    def reconnect(self, timeout: float | None = None) -> "PrefillSender":
        """Drop the connection (in-flight requests count as ``transfer:decode_lost``) and connect again."""
        with self._lock:
            address = self._address
            self._reset("transfer:decode_lost", "reconnecting")
        return self.connect(address, timeout)

    def close(self) -> None:
        """Say bye, stop the heartbeat thread and close the socket. Idempotent."""
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(5.0)
            self._hb_thread = None
        with self._lock:
            if self._sock is not None and self._lost is None:
                self._send_msg(wire.Bye(reason="prefill sender closed"))
            self._reset("transfer:decode_lost", "sender closed", linger=100)
            if self.engine is not None and not self.engine.closed:
                if self._staging is not None:
                    self.engine.unregister(self._staging_addr)
                    self._staging = None
                for lo, _ in self._sources:
                    self.engine.unregister(lo)
                self._sources.clear()
                if self._owns_engine:
                    self.engine.close()

    def _open_socket(self, address: str) -> None:
        ctx = self._ctx if self._ctx is not None else zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.limits.max_message_bytes)
        sock.connect(address)
        self._sock = sock
        self._address = address

    def _reset(self, key: str, why: str, linger: int = 0) -> None:
        for seq, rid in self._outstanding.items():
            self.failed[key] += 1
            self._failures.append((rid, key, why))
        self._outstanding.clear()
        self._free.clear()
        self._slot_addr.clear()
        if self._sock is not None:
            self._sock.close(linger)
            self._sock = None
        self._lost = why

    def _hello(self, timeout: float) -> None:
        sock = self._sock
        assert sock is not None
        want = self.config.slots.per_peer if self.engine is not None else 0
        mc = self.engine.peer_name if self.engine is not None else None
        self._send_msg(wire.Hello(name=self.name, want_slots=want, mooncake=mc))
        deadline = self._clock() + timeout
        while True:
            left = deadline - self._clock()
            if left <= 0 or not sock.poll(left * 1000.0):
                self._lost = "no grant"
                raise TransferError(f"no slot grant from the decode within {timeout:g} s", op="connect", peer=self._address)
            msg = self._recv_one()
            if isinstance(msg, wire.Grant):
                break
        self._session = msg.session
        self._decode_mc = msg.mooncake
        self._slot_size = msg.slot_size
        self._slot_addr = dict(zip(msg.slots, msg.addrs))
        self._free = deque(msg.slots)
        self._lost = None
        self._last_heard = self._clock()
        if self.engine is not None and msg.mooncake is not None and msg.slots:
            if self._staging is None or len(self._staging) < msg.slot_size:
                if self._staging is not None:
                    self.engine.unregister(self._staging_addr)
                self._staging = mmap.mmap(-1, msg.slot_size)
                self._staging_view = memoryview(self._staging)
                self._staging_addr = self.engine.register(self._staging)
            self.engine.probe(msg.mooncake, force=True)

    # -- inbound ----------------------------------------------------------------

    def _recv_one(self) -> wire.Message | None:
        """Receive and apply one message (the socket must be readable)."""
        assert self._sock is not None
        frames = self._sock.recv_multipart()
        if self._signer is not None:
            if not self._signer.verify(frames):
                self.rejected["hmac"] += 1
                return None
            frames = frames[:-1]
        try:
            msg = wire.decode_frame(frames[0], self.config.limits, wire.OUTBOUND_DECODER)
        except WireError as exc:
            self.rejected[f"wire:{exc.field}"] += 1
            return None
        self._last_heard = self._clock()
        kind = type(msg)
        if kind is wire.Ack:
            self._on_ack(msg)  # type: ignore[arg-type]
        elif kind is wire.ErrorReply:
            self.rejected[msg.code] += 1  # type: ignore[attr-defined]
            if msg.code == "hello":  # type: ignore[attr-defined]
                self._lost = f"the decode does not know this prefill (restarted?): {msg.reason}"  # type: ignore[attr-defined]
        elif kind is wire.Heartbeat:
            if self._session and msg.session != self._session:  # type: ignore[attr-defined]
                self._lost = "the decode restarted (new session)"
        elif kind is wire.Bye:
            self._lost = f"the decode closed the connection: {msg.reason}"  # type: ignore[attr-defined]
        return msg

    def _on_ack(self, ack: wire.Ack) -> None:
        slots = self._slot_addr
        for s in ack.freed:
            if s in slots:
                self._free.append(s)
        out = self._outstanding
        for seq in ack.delivered:
            if out.pop(seq, None) is not None:
                self.delivered += 1
        for seq, key, reason in ack.failed:
            rid = out.pop(seq, None)
            if rid is not None:
                self.failed[key] += 1
                self._failures.append((rid, key, reason))

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while sock.poll(0):
            self._recv_one()

    def _note_silence(self) -> None:
        """Mark the decode lost once it has been silent for more than ``peer_timeout_s``."""
        if self._lost is None and self._clock() - self._last_heard > self.config.peer_timeout_s:
            self._lost = f"the decode was silent for more than {self.config.peer_timeout_s:g} s"

    def _check_alive(self, op: str) -> None:
        self._note_silence()
        if self._lost is not None:
            raise TransferError(f"{self._lost}; call reconnect()", op=op, peer=self._address)

    # -- outbound ---------------------------------------------------------------

    def _send_msg(self, msg: wire.Message, extra: list[Any] | None = None) -> None:
        frames: list[Any] = [wire.encode(msg)]
        if extra:
            frames += extra
        if self._signer is not None:
            frames.append(self._signer.sign(frames))
        assert self._sock is not None
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise TransferError("control queue to the decode is full", op="send", peer=self._address) from None
        self._last_sent = self._clock()
        self.bytes["control"] += len(frames[0])

    def send(self, payload: Payload) -> None:
        """Send one payload. Returns once it is handed to the control socket.

        Raises :class:`NoSlotError` when the bulk path has no free slot within
        ``slots.wait_s``, and :class:`TransferError` when the decode is gone or a
        Mooncake write failed (the payload is then not sent).
        """
        with self._lock:
            self._drain()
            self._check_alive("send")
            seq = self._seq
            size = wire.bulk_bytes(payload)
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
                slot = self._acquire_slot()
                header, parts = wire.build_header(payload, seq, slot)
                try:
                    self._write_slot(slot, parts)
                    self._send_msg(header)
                except TransferError:
                    self._free.appendleft(slot)  # the decode never heard of it: still ours
                    raise
                self.bytes["bulk"] += size
            else:
                header, parts = wire.build_header(payload, seq)
                frames = [b for b, _ in parts]
                self._send_msg(header, frames)
                self.bytes["inline"] += sum(memoryview(b).nbytes for b in frames)
            self._seq = seq + 1
            self._outstanding[seq] = payload.request_id
            self.sent += 1

    def _acquire_slot(self) -> int:
        if self._free:
            return self._free.popleft()
        wait = self.config.slots.wait_s
        deadline = self._clock() + wait
        sock = self._sock
        assert sock is not None
        while not self._free:
            left = deadline - self._clock()
            if left <= 0:
                raise NoSlotError(
                    f"all {len(self._slot_addr)} slots stayed in use for {wait:g} s", op="send", peer=self._address
                )
            if sock.poll(min(left, 0.05) * 1000.0):
                self._drain()
            self._check_alive("send")
        return self._free.popleft()

    def register_source(self, buf: Any) -> None:
        """Register a prefill-side output buffer (writable, e.g. an mmap or bytearray).

        Payload tensors that are views into it are then written straight from it, with no
        staging copy, like SGLang's pre-registered metadata buffers. The caller must not
        modify the viewed bytes until :meth:`send` has returned.
        """
        if self.engine is None:
            raise TransferError("no Mooncake engine: nothing to register with", op="register_memory")
        addr = self.engine.register(buf)
        self._sources.append((addr, addr + memoryview(buf).nbytes))

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

    def _write_slot(self, slot: int, parts: list[tuple[Any, int]]) -> None:
        """Write the tensors to their slot offsets with as few (merged) transfers as possible.

        Tensors inside a registered source buffer go as they are; others are copied into
        the staging buffer at their slot offsets, padded so that they merge into one range.
        """
        view = self._staging_view
        assert view is not None and self.engine is not None and self._decode_mc is not None
        base, dst = self._staging_addr, self._slot_addr[slot]
        ranges = []
        for i, (buf, off) in enumerate(parts):
            mv = memoryview(buf)
            if mv.format != "B" or mv.ndim != 1:
                mv = mv.cast("B")
            n = mv.nbytes
            src = self._source_addr(mv)
            if src:
                ranges.append((src, dst + off, n))
                continue
            view[off : off + n] = mv
            # Cover the alignment padding up to the next tensor so staged ranges merge into one.
            span = parts[i + 1][1] - off if i + 1 < len(parts) else n
            ranges.append((base + off, dst + off, span))
        self.engine.write(self._decode_mc, ranges)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every sent request has a status; False on timeout (or if the decode is gone)."""
        deadline = self._clock() + timeout
        while True:
            with self._lock:
                self._drain()
                if not self._outstanding:
                    return True
                if self._lost is not None or self._sock is None:
                    return False
                sock = self._sock
                left = deadline - self._clock()
                if left <= 0:
                    return False
                sock.poll(min(left, 0.05) * 1000.0)

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
                "connected": self._lost is None,
            }

    def failures(self) -> list[tuple[str, str, str]]:
        """Recent failed requests as ``(request_id, key, reason)``, oldest first."""
        with self._lock:
            return list(self._failures)

    @property
    def connected(self) -> bool:
        return self._lost is None

    # -- heartbeat thread -------------------------------------------------------

    def _heartbeats(self) -> None:
        hb = self.config.heartbeat_s
        while not self._hb_stop.wait(hb / 2):
            with self._lock:
                if self._sock is None or self._lost is not None:
                    continue
                self._drain()
                # An idle sender notices a dead decode too: flush() then returns early
                # and statuses()["connected"] turns False without waiting for a send.
                self._note_silence()
                if self._lost is not None:
                    continue
                if self._clock() - self._last_sent >= hb:
                    try:
                        self._send_msg(wire.Heartbeat())
                    except TransferError:
                        pass  # queue full: the decode is not reading; the timeout will tell


def open_sender(
    config: TransportConfig,
    address: str,
    *,
    name: str | None = None,
    context: zmq.Context | None = None,
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
