"""The decode's table of prefill peers and the acks it owes them.

A :class:`Peer` is one connection (a ZMQ routing id) bound to an identity: the
allowlist name of its CURVE key, or its hello name without CURVE. It collects the
outcomes and freed slots to acknowledge; :class:`PeerTable` coalesces them into one
:class:`~.wire.Ack` per peer every ``ACK_INTERVAL_S`` (or ``ACK_BATCH`` outcomes), and
at once when a peer has an eighth of its grant freed but unacknowledged (a prefill with
no free slot is waiting for exactly that ack).

Single-threaded: only the receive loop touches it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import wire

#: A prefill hears about outcomes within this long (freed slots at once).
ACK_INTERVAL_S = 0.002
#: Pending outcomes that trigger an ack before the interval is up.
ACK_BATCH = 256
#: Request ids remembered per peer as outstanding (delivered, not yet released).
OUTSTANDING_CAP = 1 << 16


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
    # Request ids delivered and not yet released: the same id again is a duplicate.
    outstanding: dict[str, None] = field(default_factory=dict)
    resolver: Callable[..., memoryview] | None = None


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

    def flush(self, send: Callable[[Peer, wire.Message], None]) -> None:
        """One ack to every peer that is owed one."""
        for peer in list(self.by_ident.values()):
            if peer.freed or peer.delivered or peer.failed:
                send(
                    peer, wire.Ack(freed=tuple(peer.freed), delivered=tuple(peer.delivered), failed=tuple(peer.failed))
                )
                peer.freed.clear()
                peer.delivered.clear()
                peer.failed.clear()
