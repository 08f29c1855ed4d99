"""A hand-driven prefill for bulk-plane tests and attacks: it writes (or not) and sends any header.

:class:`RawPrefill` is a real DEALER that says hello to a real :class:`DecodeReceiver`
and a real Mooncake engine that writes into the slots it was granted. Unlike
:class:`~pd_middleware.transport.PrefillSender` it lets the caller skip the write, write
other bytes, reuse an old header or name two slots: what an attacker, or a buggy peer,
can do. Shared by ``tests/test_bulk.py`` and ``reliability/attacks_bulk.py``.
"""

from __future__ import annotations

import mmap
import time
from typing import Any

import zmq

from pd_middleware import Payload
from pd_middleware.transport import LimitsConfig, MooncakeEngine, integrity, payload_codec, wire
from pd_middleware.transport.auth import TO_DECODE, Signer, new_nonce


class RawPrefill:
    """``engine``: an open Mooncake engine to write with (None: header-only peer)."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        engine: MooncakeEngine | None,
        name: str,
        want: int = 4,
        key: bytes | None = None,
    ) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.engine = engine
        self.name = name
        self.want = want
        self.signer = Signer(key) if key is not None else None
        self.digest_key = integrity.key_from_secret(key) if key is not None else None
        self.nonce = new_nonce()  # HMAC: this connection's nonce and next sequence (auth.py)
        self.tx_seq = 0
        self.grant: wire.Grant | None = None
        self.gens: dict[int, int] = {}
        self.freed: list[int] = []
        self.failed: list[tuple[int, str, str]] = []
        self.delivered: list[int] = []
        self.seq = 0
        self._staging: mmap.mmap | None = None
        self._staging_addr = 0

    # -- control plane ------------------------------------------------------------

    def _send(self, frames: list[Any]) -> None:
        if self.signer is not None:
            frames = [*frames, *self.signer.sign(frames, self.nonce, self.tx_seq, TO_DECODE)]
            self.tx_seq += 1
        self.sock.send_multipart(frames)

    def hello(self, timeout: float = 5.0) -> wire.Grant:
        self._send([wire.encode(wire.Hello(name=self.name, want_slots=self.want, ts=time.time()))])
        deadline = time.monotonic() + timeout
        while self.grant is None:
            left = deadline - time.monotonic()
            assert left > 0, f"no grant for {self.name} within {timeout} s"
            self.pump(min(left, 0.1))
        g = self.grant
        self.gens = dict(zip(g.slots, g.gens))
        if self.engine is not None and g.slot_size:
            self._staging = mmap.mmap(-1, g.slot_size)
            self._staging_addr = self.engine.register(self._staging)
        return g

    def pump(self, timeout: float = 0.1) -> None:
        """Read what the decode sent within ``timeout`` (grants, acks)."""
        if not self.sock.poll(timeout * 1000.0):
            return
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if self.signer is not None:
                frames = frames[:-2]  # tail and signature
            msg = wire.decode_frame(frames[0], LimitsConfig(), wire.OUTBOUND_DECODER)
            if isinstance(msg, wire.Grant):
                self.grant = msg
            elif isinstance(msg, wire.Ack):
                self.freed += msg.freed
                self.failed += msg.failed
                self.delivered += msg.delivered

    def wait_freed(self, slot: int, timeout: float = 3.0) -> bool:
        deadline = time.monotonic() + timeout
        while slot not in self.freed and time.monotonic() < deadline:
            self.pump(0.05)
        return slot in self.freed

    # -- data plane ---------------------------------------------------------------

    def header(
        self, payload: Payload, slot: int, *, gen: int | None = None, algorithm: str = "xxh3_128"
    ) -> tuple[wire.PayloadHeader, list[tuple[Any, int]]]:
        """A correct header for ``payload`` in ``slot`` at the slot's next generation (or ``gen``)."""
        if gen is None:
            gen = self.gens[slot] = self.gens[slot] + 1
        self.seq += 1
        return payload_codec.build_header(
            payload, self.seq, slot, gen=gen, digest=integrity.Binder(algorithm, self.digest_key)
        )

    def write(self, slot: int, parts: list[tuple[Any, int]], engine: MooncakeEngine | None = None) -> None:
        """Write ``parts`` at their offsets of ``slot`` (with ``engine``: another process's engine)."""
        assert self.grant is not None and self._staging is not None
        eng = engine if engine is not None else self.engine
        assert eng is not None
        dst = dict(zip(self.grant.slots, self.grant.addrs))[slot]
        if eng is self.engine:
            src_base, buf = self._staging_addr, self._staging
            ranges = []
            for b, off in parts:
                n = memoryview(b).nbytes
                buf[off : off + n] = bytes(b)
                ranges.append((src_base + off, dst + off, n))
            eng.write(self.grant.mooncake, ranges)  # type: ignore[arg-type]
            return
        tmp = mmap.mmap(-1, self.grant.slot_size)
        addr = eng.register(tmp)
        try:
            ranges = []
            for b, off in parts:
                n = memoryview(b).nbytes
                tmp[off : off + n] = bytes(b)
                ranges.append((addr + off, dst + off, n))
            eng.write(self.grant.mooncake, ranges)  # type: ignore[arg-type]
        finally:
            eng.unregister(addr)

    def send_header(self, header: wire.PayloadHeader) -> None:
        self._send([wire.encode(header)])

    def close(self) -> None:
        try:
            self._send([wire.encode(wire.Bye(reason="raw prefill closed"))])
        except zmq.ZMQError:
            pass
        self.sock.close(0)
        if self.engine is not None and self._staging is not None and not self.engine.closed:
            self.engine.unregister(self._staging_addr)
            self._staging = None
