"""The prefill's control channel to the decode: signed sends, and the replies it applies.

:meth:`Control._send_msg` is the one (signed) send path. :meth:`Control._recv_one`
checks a reply's HMAC and replay window (:mod:`.auth`) and its schema (:mod:`.wire`),
then applies it: an ack settles requests as delivered or failed and returns freed
slots (:meth:`Control._on_ack`); an error reply is counted (``hello``: the decode does
not know this prefill); a heartbeat from a new session or a bye loses the decode.
:meth:`Control._check_alive` turns a lost (or silent) decode into a
:class:`~pd_middleware.TransferError`.

A mixin of :class:`~.sender.PrefillSender`: it owns the state declared below; every
method runs under the sender's lock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq

from .._errors import TransferError, WireError
from . import wire
from .auth import TO_DECODE, TO_PREFILL, Signer
from .config import TransportConfig


class Control:
    """Signed sends, inbound replies (acks, errors, heartbeats, byes) and liveness."""

    # Set by PrefillSender.__init__/connect (see there).
    config: TransportConfig
    delivered: int
    failed: Counter[str]
    rejected: Counter[str]
    _clock: Callable[[], float]
    _signer: Signer | None
    _nonce: bytes
    _tx_seq: int
    _rx_seq: int
    _sock: zmq.Socket[Any] | None
    _address: str
    _session: str
    _lost: str | None
    _lost_error: TransferError | None
    _slot_addr: dict[int, int]
    _free: deque[int]
    _outstanding: dict[int, str]
    _failures: deque[tuple[str, str, str]]
    _last_heard: float
    _last_sent: float
    bytes: Counter[str]  # last: as a class-level name it would shadow the builtin in the annotations above

    def _send_msg(self, msg: wire.Message, extra: list[Any] | None = None) -> None:
        frames: list[Any] = [wire.encode(msg)]
        if extra:
            frames += extra
        if self._signer is not None:
            frames += self._signer.sign(frames, self._nonce, self._tx_seq, TO_DECODE)
            self._tx_seq += 1
        assert self._sock is not None
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise TransferError("control queue to the decode is full", op="send", peer=self._address) from None
        self._last_sent = self._clock()
        self.bytes["control"] += len(frames[0])

    def _recv_one(self) -> wire.Message | None:
        """Receive and apply one message (the socket must be readable)."""
        assert self._sock is not None
        frames = self._sock.recv_multipart()
        if self._signer is not None:
            opened = self._signer.open(frames, TO_PREFILL)
            if opened is None:
                self.rejected["hmac"] += 1
                return None
            if opened[0] != self._nonce or opened[1] <= self._rx_seq:
                self.rejected["replay"] += 1  # another connection's message, or one seen already
                return None
            self._rx_seq = opened[1]
            frames = frames[:-2]
        try:
            msg = wire.decode_frame(frames[0], self.config.limits, wire.OUTBOUND_DECODER)
        except WireError as exc:
            self.rejected[f"wire:{exc.field}"] += 1
            return None
        except Exception as exc:
            self.rejected[f"internal:{type(exc).__name__}"] += 1
            return None
        self._last_heard = self._clock()
        kind = type(msg)
        if kind is wire.Ack:
            self._on_ack(msg)  # type: ignore[arg-type]  # `kind is` dispatch: an Ack
        elif kind is wire.ErrorReply:
            self.rejected[msg.code] += 1  # type: ignore[attr-defined]  # `kind is` dispatch: an ErrorReply
            if msg.code == "hello":  # type: ignore[attr-defined]  # an ErrorReply
                self._lost = f"the decode does not know this prefill (restarted?): {msg.reason}"  # type: ignore[attr-defined]  # an ErrorReply
        elif kind is wire.Heartbeat:
            if self._session and msg.session != self._session:  # type: ignore[attr-defined]  # a Heartbeat
                self._lost = "the decode restarted (new session)"
        elif kind is wire.Bye:
            self._lost = f"the decode closed the connection: {msg.reason}"  # type: ignore[attr-defined]  # a Bye
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
            err = self._lost_error
            if err is not None:  # a failed write: report its op, code and Mooncake peer
                raise TransferError(f"{self._lost}; call reconnect()", op=err.op, code=err.code, peer=err.peer)
            raise TransferError(f"{self._lost}; call reconnect()", op=op, peer=self._address)
