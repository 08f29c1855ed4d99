"""Requests the decode's scheduler announced with ``expect()``: who may deliver them, and until when.

Announcements come from any thread (a deque); the receive loop moves them into the
table, matches arrivals against it and fails what is overdue or whose peer was lost.
A request that arrived is remembered with the peer that sent it (a bounded window of
ids): a late ``expect()`` does not fail it, and the receiver refuses the same id from
any other peer (``wire:peer``) even after the expectation was consumed.
"""

from __future__ import annotations

import heapq
from collections import deque

#: Request ids remembered as arrived (with their owner), so a late expect() does not fail
#: an arrived request and another peer cannot claim it.
ARRIVED_CAP = 1 << 16


class Expectations:
    """The expect() table of one receiver; every method but :meth:`announce` is loop-only."""

    def __init__(self) -> None:
        self._incoming: deque[tuple[str, str | None, float | None]] = deque()
        # request id -> (peer identity or None, deadline or None)
        self.expected: dict[str, tuple[str | None, float | None]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._arrived: dict[str, str] = {}  # request id -> identity of the peer it came from

    def announce(self, rid: str, peer: str | None, deadline: float | None) -> None:
        """Queue an announcement (any thread)."""
        self._incoming.append((rid, peer, deadline))

    def apply(self) -> None:
        """Move queued announcements into the table (those not arrived already)."""
        incoming = self._incoming
        while incoming:
            rid, peer, deadline = incoming.popleft()
            if rid in self._arrived:
                continue
            self.expected[rid] = (peer, deadline)
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, rid))

    def arrived(self, rid: str, peer: str) -> None:
        """``rid`` came from ``peer`` and was delivered or failed in the pipeline: no longer awaited."""
        if self.expected:
            self.expected.pop(rid, None)
        self.own(rid, peer)

    def own(self, rid: str, peer: str) -> None:
        """Remember ``peer`` as the owner of ``rid`` (bounded: the oldest id is forgotten)."""
        arrived = self._arrived
        got = arrived.get(rid)
        if got is None:  # the common case: a new id goes in last
            arrived[rid] = peer
            if len(arrived) > ARRIVED_CAP:
                del arrived[next(iter(arrived))]
        elif got == peer:
            arrived[rid] = arrived.pop(rid)  # most recent last

    def owner(self, rid: str) -> str | None:
        """The peer ``rid`` arrived from (within the window), or that :meth:`announce` named."""
        got = self._arrived.get(rid)
        if got is None:
            entry = self.expected.get(rid)
            got = entry[0] if entry is not None else None
        return got

    def overdue(self, now: float) -> list[str]:
        """Remove and return the requests whose deadline has passed."""
        out = []
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            deadline, rid = heapq.heappop(dl)
            entry = self.expected.get(rid)
            if entry is not None and entry[1] == deadline:
                del self.expected[rid]
                out.append(rid)
        return out

    def take(self, peer: str | None = None) -> list[str]:
        """Remove and return the requests expected from ``peer`` (every one when None)."""
        out = [rid for rid, (name, _) in self.expected.items() if peer is None or name == peer]
        for rid in out:
            del self.expected[rid]
        return out
