"""The decode's table of prefill peers and the acks it owes them.

A :class:`Peer` is one connection (a ZMQ routing id) bound to an identity: the
allowlist name of its CURVE key, or its hello name without CURVE. It collects the
outcomes and freed slots to acknowledge; :class:`PeerTable` coalesces them into one
:class:`~.wire.Ack` per peer every ``ACK_INTERVAL_S`` (or ``ACK_BATCH`` outcomes), and
at once when a peer has an eighth of its grant freed but unacknowledged (a prefill with
no free slot is waiting for exactly that ack). An ack never exceeds the prefill's
``max_message_bytes`` (its ``ZMQ_MAXMSGSIZE``: libzmq drops a connection that sends a
larger frame): what is owed is split over as many acks as it takes, and each failure's
key and reason are cut to :data:`KEY_CAP` and :data:`REASON_CAP` characters.

Single-threaded: only the receive loop touches it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import wire

#: A prefill hears about outcomes within this long (freed slots at once).
ACK_INTERVAL_S = 0.002
#: Pending outcomes that trigger an ack before the interval is up.
ACK_BATCH = 256
#: Characters of a failure's reason and key sent back in an ack (the full text is in the Failure).
REASON_CAP = 256
KEY_CAP = 96
# Bytes an ack's msgpack envelope takes besides its entries (tag, field names, array headers),
# with room to spare, and the most one entry of each kind can take: an int is at most 9
# bytes, a string its UTF-8 length (4 per character at most) plus a 5-byte header.
_ACK_ENVELOPE = 64
_INT_BYTES = 9


@dataclass(eq=False)
class Peer:
    ident: bytes
    name: str
    last_seen: float
    last_sent: float
    # The authenticated CURVE key (Z85), None without CURVE.
    key: str | None = None
    # HMAC mode: this connection's nonce, the last sequence received and the next one to send.
    nonce: bytes = b""
    rx_seq: int = -1
    tx_seq: int = 0
    slots: tuple[int, ...] = ()
    freed: list[int] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)
    failed: list[tuple[int, str, str]] = field(default_factory=list)
    resolver: Callable[..., memoryview] | None = None
    # Per-prefill HMAC keys (``hmac_peers``): this peer's signer and bulk-digest key.
    signer: Any = None
    digest_key: bytes | None = None


class PeerTable:
    """Peers by routing id, and the coalesced acks owed to them."""

    def __init__(self) -> None:
        self.by_ident: dict[bytes, Peer] = {}

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self.by_ident.values()))

    def __len__(self) -> int:
        return len(self.by_ident)

    def get(self, ident: bytes) -> Peer | None:
        return self.by_ident.get(ident)

    def add(self, peer: Peer) -> None:
        self.by_ident[peer.ident] = peer

    def remove(self, peer: Peer) -> None:
        self.by_ident.pop(peer.ident, None)

    def same_identity(self, ident: bytes, name: str, key: str | None) -> list[Peer]:
        """Peers that this hello replaces: the same connection, or the same identity
        (its CURVE key when authenticated, else its name) reconnecting."""
        return [
            p
            for p in self.by_ident.values()
            if p.ident == ident or (p.key == key if key is not None else p.name == name)
        ]

    def slots_freed(self) -> bool:
        """Whether some peer has at least an eighth of its grant (at least one) freed but unacked."""
        return any(p.freed and len(p.freed) >= len(p.slots) >> 3 for p in self.by_ident.values())

    def pending(self) -> int:
        """Outcomes and freed slots not yet acknowledged."""
        return sum(len(p.freed) + len(p.delivered) + len(p.failed) for p in self.by_ident.values())

    def flush(self, send: Callable[[Peer, wire.Message], None], max_bytes: int) -> None:
        """Ack every peer that is owed one, each ack's frame under ``max_bytes``."""
        for peer in list(self.by_ident.values()):
            if peer.freed or peer.delivered or peer.failed:
                for ack in split_ack(peer.freed, peer.delivered, peer.failed, max_bytes):
                    send(peer, ack)
                peer.freed.clear()
                peer.delivered.clear()
                peer.failed.clear()


def _str_bytes(s: str) -> int:
    return len(s) * 4 + 5 if not s.isascii() else len(s) + 5


def _cut(s: str, n: int) -> str:
    """At most ``n`` characters, and at most ``n`` bytes' worth (``n // 4``) when not ASCII,
    so the largest failed entry fits the smallest ``max_message_bytes`` (1024)."""
    return s[:n] if s.isascii() else s[: n // 4]


def split_ack(
    freed: list[int], delivered: list[int], failed: list[tuple[int, str, str]], max_bytes: int
) -> list[wire.Ack]:
    """The acks that carry ``freed``, ``delivered`` and ``failed`` in order, each encoding
    to at most ``max_bytes`` (a bound on the msgpack size, never exceeded)."""
    budget = max_bytes - _ACK_ENVELOPE
    out: list[wire.Ack] = []
    cur: tuple[list[int], list[int], list[tuple[int, str, str]]] = ([], [], [])
    used = 0

    def cut() -> None:
        nonlocal cur, used
        out.append(wire.Ack(freed=tuple(cur[0]), delivered=tuple(cur[1]), failed=tuple(cur[2])))
        cur, used = ([], [], []), 0

    entries: list[tuple[int, int, Any]] = [(0, _INT_BYTES, s) for s in freed]
    entries += [(1, _INT_BYTES, s) for s in delivered]
    for seq, key, reason in failed:
        item = (seq, _cut(key, KEY_CAP), _cut(reason, REASON_CAP))
        entries.append((2, _INT_BYTES + 1 + _str_bytes(item[1]) + _str_bytes(item[2]), item))
    for which, cost, value in entries:
        if used + cost > budget and used:
            cut()
        cur[which].append(value)
        used += cost
    if used:
        cut()
    return out
