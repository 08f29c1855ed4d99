"""The side channel's decode feed: received outcomes by request id, and the wait for them.

:class:`ProposalStore` keeps the outcomes a :class:`~pd_middleware.transport.DecodeReceiver`
delivered (the prefill's ``bootstrap_room`` as a decimal string is the request id), drained
on the scheduler thread; the decode's proposer takes each request's outcome when SGLang
builds its first draft input. A request built without its payload is marked
(:meth:`ProposalStore.built`): a payload of that life that arrives later is an orphan,
released at once and counted, so it never holds the receiver's byte cap or a receive slot.

:class:`ArrivalWait` holds a request whose KV transfer is done until its payload is in the
store, bounded in time: SGLang's transfer poll reports it still transferring meanwhile
(its ranks take the MIN of every rank's poll), so the scheduler loop never blocks.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...decode.pipeline import Delivery, Failure


class ProposalStore:
    """Received outcomes by request id, fed by an optional receiver.

    ``receiver``: anything with ``drain() -> list[Delivery | Failure]`` (a started
    :class:`~pd_middleware.transport.DecodeReceiver`), or None to feed it with
    :meth:`put` only. ``capacity``: most outcomes kept; ``ttl_s``: an outcome older
    than this (by ``clock``, the receiver's ``time.perf_counter`` stamps) is dropped,
    so a request aborted between prefill and decode does not hold a receive slot.
    ``max_bytes``: most bytes the kept Deliveries may hold (hidden states and proposal
    tensors); a Delivery past it is released and kept as a ``store:bytes`` Failure
    instead (counted in ``refused["bytes"]``), so its request falls back with a reason.
    The receiver's own ``max_queued_inline_bytes`` counts until release as well, so a
    store fed by a receiver also holds the receiver back.
    """

    def __init__(
        self,
        receiver: Any = None,
        *,
        capacity: int = 65536,
        ttl_s: float = 300.0,
        max_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if capacity < 1 or ttl_s <= 0 or max_bytes < 1:
            raise ValueError("capacity and max_bytes must be >= 1 and ttl_s > 0")
        self.receiver = receiver
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0  # held by the kept Deliveries (under _lock)
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, Delivery | Failure]] = OrderedDict()
        # Requests built without their payload: request id -> the life that was built.
        self._built: OrderedDict[str, int | None] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted: Counter[str] = Counter()
        # Outcomes put() would not keep: failure_over_delivery, other_peer, bytes, orphan.
        self.refused: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, outcome: Delivery | Failure) -> None:
        """Keep one outcome under its request id.

        A newer outcome replaces (and releases) an older one, except that a Failure never
        replaces a Delivery, and an outcome from another peer never replaces one: those
        are refused (counted in ``refused`` by reason; a refused Delivery is released),
        so one peer's message can neither evict nor impersonate another's request.
        """
        rid = outcome.request_id
        if rid is None:  # a wire failure that could not name its request: nothing to key
            return
        if rid in self._built and self._orphan(rid, outcome):
            _release(outcome)
            self.refused["orphan"] += 1
            return
        stamp = outcome.received_at if isinstance(outcome, Delivery) else self._clock()
        refused = ""
        over_budget: Delivery | None = None
        with self._lock:
            old = self._items.get(rid)
            if old is not None:
                refused = _refusal(old[1], outcome)
            if not refused:
                if isinstance(outcome, Delivery):
                    size = _held_bytes(outcome)
                    freed = _held_bytes(old[1]) if old is not None else 0
                    if self.bytes - freed + size > self.max_bytes:
                        over_budget = outcome
                        outcome = Failure(
                            rid,
                            "store",
                            f"ProposalStore holds {self.bytes} of max_bytes={self.max_bytes}: "
                            f"a delivery of {size} bytes would pass it",
                            field="bytes",
                            peer=outcome.peer,
                        )
                self._items.pop(rid, None)
                if old is not None:
                    self.bytes -= _held_bytes(old[1])
                self._items[rid] = (stamp, outcome)
                self.bytes += _held_bytes(outcome)
            over = len(self._items) - self.capacity
            dropped = [self._pop_oldest() for _ in range(max(0, over))]
        if over_budget is not None:
            over_budget.release()
            self.refused["bytes"] += 1
        if refused:
            _release(outcome)
            self.refused[refused] += 1
        elif old is not None:
            _release(old[1])
            self.evicted["replaced"] += 1
        for o in dropped:
            _release(o)
            self.evicted["capacity"] += 1

    def pump(self) -> int:
        """Move everything the receiver holds now into the store; returns how many."""
        if self.receiver is None:
            return 0
        got = self.receiver.drain()
        for o in got:
            self.put(o)
        self._expire()
        return len(got)

    def take(self, request_id: str | None) -> Delivery | Failure | None:
        """Remove and return the outcome of ``request_id``, or None if none arrived."""
        if request_id is None:
            return None
        with self._lock:
            item = self._items.pop(request_id, None)
            if item is not None:
                self.bytes -= _held_bytes(item[1])
        return None if item is None else item[1]

    def has(self, request_id: str, life: int | None = None) -> bool:
        """Whether an outcome of ``request_id`` is here: a Failure, or a Delivery of ``life``
        (any life when either is None)."""
        item = self._items.get(request_id)
        if item is None:
            return False
        o = item[1]
        return not isinstance(o, Delivery) or life is None or o.payload.life is None or o.payload.life == life

    def built(self, request_id: str | None, life: int | None) -> None:
        """``request_id``'s ``life`` was built without its payload: a payload of that life
        (or of no life) that arrives later is an orphan (:meth:`put` releases it at once,
        ``refused["orphan"]``). Bounded by ``capacity``: the oldest mark is forgotten."""
        if request_id is None:
            return
        with self._lock:
            self._built.pop(request_id, None)
            self._built[request_id] = life
            if len(self._built) > self.capacity:
                self._built.popitem(last=False)

    def _orphan(self, rid: str, outcome: Delivery | Failure) -> bool:
        with self._lock:
            if rid not in self._built:
                return False
            life = self._built[rid]
            got = outcome.payload.life if isinstance(outcome, Delivery) else None
            if got is not None and life is not None and got != life:
                return False  # another life's: a request served again is awaited anew
            del self._built[rid]
            return True

    def _pop_oldest(self) -> Delivery | Failure:
        o = self._items.popitem(last=False)[1][1]
        self.bytes -= _held_bytes(o)
        return o

    def clear(self) -> None:
        """Drop (and release) everything."""
        with self._lock:
            items = list(self._items.values())
            self._items.clear()
            self._built.clear()
            self.bytes = 0
        for _, o in items:
            _release(o)

    def _expire(self) -> None:
        limit = self._clock() - self.ttl_s
        dropped = []
        with self._lock:
            while self._items:
                rid, (stamp, o) = next(iter(self._items.items()))
                if stamp >= limit:
                    break
                del self._items[rid]
                self.bytes -= _held_bytes(o)
                dropped.append(o)
        for o in dropped:
            _release(o)
            self.evicted["ttl"] += 1


def _refusal(old: Delivery | Failure, new: Delivery | Failure) -> str:
    """Why ``new`` may not replace ``old`` under the same request id ("" when it may)."""
    if isinstance(old, Delivery) and not isinstance(new, Delivery):
        return "failure_over_delivery"
    if old.peer is not None and new.peer != old.peer:
        return "other_peer"
    return ""


def _held_bytes(outcome: Delivery | Failure) -> int:
    """Bytes a kept outcome holds: a Delivery's hidden state and proposal tensors."""
    if not isinstance(outcome, Delivery):
        return 0
    hidden = outcome.payload.hidden
    n = hidden.nbytes if isinstance(hidden, memoryview) else len(hidden)
    p = outcome.proposal
    for name in ("indices", "values", "probs", "scale"):
        t = getattr(p, name, None)
        if isinstance(t, torch.Tensor):
            n += t.nelement() * t.element_size()
    return n


def _release(outcome: Delivery | Failure) -> None:
    if isinstance(outcome, Delivery):
        outcome.release()


class ArrivalWait:
    """Which requests, their KV transfer done, still wait for their side-channel payload.

    ``store``: the :class:`ProposalStore` (pumped on every call); ``wait_s``: the longest a
    request is held after its transfer was first seen done; ``expecting()``: whether any
    payload is coming at all (a shipping prefill is connected; without one nothing is
    held); ``count(key)``: the counter of ``wait:held`` (a request held at least once),
    ``wait:arrived`` (its payload came while it was held) and ``wait:expired`` (the bound
    passed: it goes on without, and its build counts ``fallback:missing``).
    """

    def __init__(
        self,
        store: ProposalStore,
        wait_s: float,
        *,
        expecting: Callable[[], bool],
        count: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if wait_s < 0:
            raise ValueError("wait_s must be >= 0")
        self.store = store
        self.wait_s = wait_s
        self._expecting = expecting
        self._count = count
        self._clock = clock
        self._since: dict[str, float] = {}  # request id -> when its transfer was first seen done

    def hold(self, keys: Sequence[tuple[str | None, int | None]]) -> list[bool]:
        """Per request whose transfer is done, ``(request id, life)``: whether to hold it
        (report it still transferring this poll). A request without an id is never held."""
        store = self.store
        store.pump()
        now = self._clock()
        expecting: bool | None = None  # asked once per call, and only when a payload is missing
        out: list[bool] = []
        since = self._since
        for rid, life in keys:
            if rid is None:
                out.append(False)
                continue
            if store.has(rid, life):
                if since.pop(rid, None) is not None:
                    self._count("wait:arrived")
                out.append(False)
                continue
            if expecting is None:
                expecting = self._expecting()
            t = since.get(rid)
            if t is None:
                if not expecting or self.wait_s == 0:
                    out.append(False)
                    continue
                since[rid] = now
                self._count("wait:held")
                out.append(True)
            elif now - t < self.wait_s:
                out.append(True)
            else:
                del since[rid]
                self._count("wait:expired")
                out.append(False)
        if len(since) > 64:  # a held request that failed or was aborted is never seen again
            stale = now - 4 * self.wait_s
            for rid in [r for r, t in since.items() if t < stale]:
                del since[rid]
        return out
