"""The prefill's control channel to the decode, and the books it keeps.

Three parts of :class:`~.sender.PrefillSender`, each an object it holds:

- :class:`Ledger`: every request sent and its outcome (``sent == delivered + failed +
  outstanding``), the recent failures and the bytes by plane;
- :class:`GrantedSlots`: the slots the decode granted this connection, their addresses
  and which of them are free to write;
- :class:`Control`: the connection itself. :meth:`Control.send_msg` is the one (signed)
  send path; :meth:`Control.recv_one` checks a reply's HMAC and replay window
  (:mod:`.auth`) and its schema (:mod:`.wire`), then applies it: an ack settles requests
  in the ledger and returns freed slots to the grant; an error reply is counted
  (``hello``: the decode does not know this prefill); a heartbeat from a new session or
  a bye loses the decode. :meth:`Control.check_alive` turns a lost (or silent) decode
  into a :class:`~pd_middleware.TransferError`.

Every method runs under the sender's lock.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import zmq

from ..core._errors import TransferError, WireError
from . import wire
from .auth import TO_DECODE, TO_PREFILL, Signer, new_nonce
from .config import TransportConfig
from .sockets import connect_dealer

_FAILURE_LOG = 1024  # most recent failures kept for failures()


class Ledger:
    """Requests sent by sequence number, their outcomes, and the bytes sent by plane."""

    def __init__(self) -> None:
        self.sent = 0
        self.delivered = 0
        self.failed: Counter[str] = Counter()
        self.outstanding: dict[int, str] = {}  # sequence -> request id
        self.failures: deque[tuple[str, str, str]] = deque(maxlen=_FAILURE_LOG)
        self.bytes: Counter[str] = Counter({"control": 0, "inline": 0, "bulk": 0})

    def sent_one(self, seq: int, rid: str) -> None:
        self.outstanding[seq] = rid
        self.sent += 1

    def delivered_one(self, seq: int) -> None:
        if self.outstanding.pop(seq, None) is not None:
            self.delivered += 1

    def fail(self, seq: int, key: str, reason: str) -> None:
        """Settle ``seq`` as failed with ``key`` (nothing when it has no outcome pending)."""
        rid = self.outstanding.pop(seq, None)
        if rid is not None:
            self.failed[key] += 1
            self.failures.append((rid, key, reason))

    def fail_all(self, key: str, reason: str) -> None:
        """Every request still outstanding fails with ``key``."""
        for rid in self.outstanding.values():
            self.failed[key] += 1
            self.failures.append((rid, key, reason))
        self.outstanding.clear()


class GrantedSlots:
    """The decode's slot grant to this connection: addresses, size, and which are ours now.

    A slot is *free* (ours to write) or *taken* (named to the decode, or being written).
    The decode's ack may return a slot only while it is taken, once: a freed slot that
    was never granted, is free already, or is named twice is refused, counted in
    :attr:`refused` and marks the connection :attr:`suspect`. So a lying decode cannot
    make two payloads share a slot.
    """

    def __init__(self) -> None:
        self.addr: dict[int, int] = {}
        self.free: deque[int] = deque()
        self.taken: set[int] = set()
        self.size = 0
        self.refused = 0  # freed slots refused over the sender's life
        self.suspect: str | None = None  # why this connection's decode is not trusted, if at all

    def grant(self, slots: tuple[int, ...], addrs: tuple[int, ...], size: int) -> None:
        self.addr = dict(zip(slots, addrs))
        self.free = deque(dict.fromkeys(slots))  # a slot granted twice is one slot
        self.taken = set()
        self.size = size
        self.suspect = None

    def clear(self) -> None:
        self.addr.clear()
        self.free.clear()
        self.taken.clear()

    def take(self) -> int:
        """A free slot (the caller checked :attr:`free`): it is ours until the decode frees it."""
        s = self.free.popleft()
        self.taken.add(s)
        return s

    def untake(self, slot: int) -> None:
        """A slot taken but never named to the decode: free again, first in line."""
        self.taken.discard(slot)
        self.free.appendleft(slot)

    def freed(self, slots: tuple[int, ...]) -> None:
        """The decode's ack says ``slots`` are free again: accept each one only if taken."""
        taken = self.taken
        for s in slots:
            if s in taken:
                taken.remove(s)
                self.free.append(s)
                continue
            self.refused += 1
            why = "never granted" if s not in self.addr else "not in use (a duplicate or unknown free)"
            self.suspect = f"the decode freed slot {s!r}, {why}"


class Control:
    """One connection to the decode: signed sends, inbound replies and liveness.

    Owns the socket, the HMAC nonce and sequences, the decode's session and why (if at
    all) the decode is lost; applies acks to ``ledger`` and ``slots``.
    """

    def __init__(
        self,
        config: TransportConfig,
        clock: Callable[[], float],
        ledger: Ledger,
        slots: GrantedSlots,
    ) -> None:
        self.config = config
        self._clock = clock
        self._ledger = ledger
        self._slots = slots
        key = config.secret()
        self.signer = Signer(key) if key is not None else None
        # HMAC mode: this connection's nonce, the next sequence to send, the last received.
        self.nonce = new_nonce()
        self.tx_seq = 0
        self.rx_seq = -1
        self.sock: zmq.Socket[Any] | None = None
        self.address = ""
        self.session = ""
        self.lost: str | None = "not connected"
        self.lost_error: TransferError | None = None  # the write failure that lost the decode
        self.last_heard = 0.0
        self.last_sent = 0.0
        self.rejected: Counter[str] = Counter()

    def open(self, ctx: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
        # A fresh connection: a fresh nonce, so nothing signed on an earlier one replays here.
        self.nonce = new_nonce()
        self.tx_seq = 0
        self.rx_seq = -1
        self.sock = connect_dealer(ctx, self.config, address)
        self.address = address
        return self.sock

    def close(self, why: str, linger: int = 0) -> None:
        if self.sock is not None:
            self.sock.close(linger)
            self.sock = None
        self.lost = why
        self.lost_error = None

    def granted(self, session: str) -> None:
        """The decode granted this connection: it is alive, in ``session``."""
        self.session = session
        self.lost = None
        self.lost_error = None
        self.last_heard = self._clock()

    def send_msg(self, msg: wire.Message, extra: list[Any] | None = None) -> None:
        frames: list[Any] = [wire.encode(msg)]
        if extra:
            frames += extra
        if self.signer is not None:
            frames += self.signer.sign(frames, self.nonce, self.tx_seq, TO_DECODE)
            self.tx_seq += 1
        assert self.sock is not None
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise TransferError("control queue to the decode is full", op="send", peer=self.address) from None
        self.last_sent = self._clock()
        self._ledger.bytes["control"] += len(frames[0])

    def recv_one(self) -> wire.Message | None:
        """Receive and apply one message (the socket must be readable)."""
        assert self.sock is not None
        frames = self.sock.recv_multipart()
        if self.signer is not None:
            opened = self.signer.open(frames, TO_PREFILL)
            if opened is None:
                self.rejected["hmac"] += 1
                return None
            if opened[0] != self.nonce or opened[1] <= self.rx_seq:
                self.rejected["replay"] += 1  # another connection's message, or one seen already
                return None
            self.rx_seq = opened[1]
            frames = frames[:-2]
        try:
            msg = wire.decode_frame(frames[0], self.config.limits, wire.OUTBOUND_DECODER)
        except WireError as exc:
            self.rejected[f"wire:{exc.field}"] += 1
            return None
        except Exception as exc:
            self.rejected[f"internal:{type(exc).__name__}"] += 1
            return None
        self.last_heard = self._clock()
        kind = type(msg)
        if kind is wire.Ack:
            self._on_ack(msg)  # type: ignore[arg-type]  # `kind is` dispatch: an Ack
        elif kind is wire.ErrorReply:
            self.rejected[msg.code] += 1  # type: ignore[attr-defined]  # `kind is` dispatch: an ErrorReply
            if msg.code == "hello":  # type: ignore[attr-defined]  # an ErrorReply
                self.lost = f"the decode does not know this prefill (restarted?): {msg.reason}"  # type: ignore[attr-defined]  # an ErrorReply
        elif kind is wire.Heartbeat:
            if self.session and msg.session != self.session:  # type: ignore[attr-defined]  # a Heartbeat
                self.lost = "the decode restarted (new session)"
        elif kind is wire.Bye:
            self.lost = f"the decode closed the connection: {msg.reason}"  # type: ignore[attr-defined]  # a Bye
        return msg

    def _on_ack(self, ack: wire.Ack) -> None:
        self._slots.freed(ack.freed)
        ledger = self._ledger
        for seq in ack.delivered:
            ledger.delivered_one(seq)
        for seq, key, reason in ack.failed:
            ledger.fail(seq, key, reason)

    def drain(self) -> None:
        sock = self.sock
        if sock is None:
            return
        while sock.poll(0):
            self.recv_one()

    def note_silence(self) -> None:
        """Mark the decode lost once it has been silent for more than ``peer_timeout_s``."""
        if self.lost is None and self._clock() - self.last_heard > self.config.peer_timeout_s:
            self.lost = f"the decode was silent for more than {self.config.peer_timeout_s:g} s"

    def lose(self, err: TransferError) -> None:
        """A write failed or was given up on: the decode is lost until reconnect()."""
        if self.lost is None:
            self.lost = f"a Mooncake write to the decode failed ({err})"
            self.lost_error = err

    def check_alive(self, op: str) -> None:
        self.note_silence()
        if self.lost is not None:
            err = self.lost_error
            if err is not None:  # a failed write: report its op, code and Mooncake peer
                raise TransferError(f"{self.lost}; call reconnect()", op=err.op, code=err.code, peer=err.peer)
            raise TransferError(f"{self.lost}; call reconnect()", op=op, peer=self.address)
