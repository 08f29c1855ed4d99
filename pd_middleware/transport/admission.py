"""The decode's payload admission: what becomes of each message's payload, and its release.

A payload header from a connected peer is admitted (:meth:`Admission.on_payload`): a
request id whose same life (``Payload.life``) the peer already has live (delivered, not
released) is ``wire:duplicate``, one
another peer owns (live there, expected from it, or recently arrived from it) ``wire:peer``; else its frames or slot ranges are resolved (:mod:`.wire`), bulk integrity
is checked (:mod:`.integrity`), and the pipeline's outcome is queued for the scheduler.
A message refused before that is counted and answered by :meth:`Admission.reject`,
naming a request id only for the authenticated peer that owns it. A delivery's releaser
records the release for the loop, which frees the slot, the inline bytes and (with
``ack = "consumed"``) acks it (:meth:`Admission.apply_releases`).

Two parts of :class:`~.receiver.DecodeReceiver`, each an object it holds:
:class:`Replies` (the one signed send path: the socket, the signer, ``unsent``) and
:class:`Admission` (the releases not yet applied, what the loop waits on). Both run only
on the receive thread (the releaser excepted: it only appends and wakes).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import zmq

from ..core._errors import IntegrityError, WireError
from ..core.contracts import ReceiveContext
from ..decode.pipeline import Delivery, Failure, ReceivePipeline
from . import payload_codec, wire
from .auth import NO_NONCE, TO_PREFILL, Signer
from .config import TransportConfig
from .expects import Expectations
from .outcomes import OutcomeQueue
from .peers import REASON_CAP, Peer, PeerTable
from .slots import SlotPool

if TYPE_CHECKING:  # annotation only: the pipeline owns (and imports) its metrics
    from ..core.metrics import Metrics

_perf_counter = time.perf_counter
# Failures whose request id is another delivery's or another peer's: never named in the Failure.
_NOT_OWNED = frozenset(("duplicate", "peer"))
# [peer, (request id, life), seq, slot, slot generation, delivered?, inline bytes, released?, waited on?]
# of a payload, recorded once its releaser is called (by the scheduler, or by the pipeline at
# once when the payload failed). "Waited on": a slot the prefill may need, or a consumed ack.
_Release = list[Any]


class Replies:
    """The decode's one (signed) send path to prefill connections.

    ``sock``: the bound ROUTER (None until the receiver starts, and after it stopped).
    ``unsent`` counts replies dropped because a peer's queue was full or gone.
    """

    def __init__(self, signer: Signer | None, clock: Callable[[], float]) -> None:
        self.signer = signer
        self._clock = clock
        self.sock: zmq.Socket[Any] | None = None
        self.unsent = 0

    def send(self, peer: Peer, msg: wire.Message) -> None:
        """Send ``msg`` on ``peer``'s connection, under its nonce and next sequence (and its
        own key, with per-prefill keys)."""
        self.send_to(peer.ident, msg, peer.nonce, peer.tx_seq, peer.signer)
        peer.tx_seq += 1
        peer.last_sent = self._clock()

    def send_to(
        self,
        ident: bytes,
        msg: wire.Message,
        nonce: bytes = NO_NONCE,
        seq: int | None = None,
        signer: Signer | None = None,
    ) -> None:
        """Send to a routing id. With HMAC, a connection with no peer is answered under
        the nonce its verified message carried, and a clock-based sequence that grows
        across decode restarts (a prefill refuses a sequence it has seen). ``signer``: the
        peer's own key (per-prefill keys); else the shared one; with neither, unsigned."""
        assert self.sock is not None
        body = [wire.encode(msg)]
        signer = signer if signer is not None else self.signer
        if signer is not None:
            body += signer.sign(body, nonce, time.time_ns() if seq is None else seq, TO_PREFILL)
        try:
            self.sock.send_multipart([ident, *body], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.unsent += 1  # peer gone or its queue full: it will time out and resync


class Admission:
    """Payload admission, refusals and release bookkeeping of one run of the receive loop.

    Owns the releases recorded but not yet applied and :attr:`waiting` (releases the loop
    waits for: held slots, inline bytes, consumed acks). It reads the peer table, the
    expectations and the slot pool (``None``: inline only) it is given, puts outcomes on
    ``queue`` and calls ``wake`` to wake the loop.
    """

    def __init__(
        self,
        config: TransportConfig,
        pipeline: ReceivePipeline,
        queue: OutcomeQueue,
        expects: Expectations,
        peers: PeerTable,
        replies: Replies,
        pool: SlotPool | None,
        wake: Callable[[], None],
    ) -> None:
        self.pipeline = pipeline
        self.metrics: Metrics = pipeline.metrics
        self._limits = config.limits
        self._consumed_acks = config.ack == "consumed"
        self._queue = queue
        self._expects = expects
        self._peers = peers
        self._replies = replies
        self._signed = replies.signer is not None or bool(config.hmac_peers)
        self._pool = pool
        self._wake = wake
        self._released: deque[_Release] = deque()
        # Releases that wake the loop at once; the rest are found within ACK_INTERVAL_S.
        self._release_batch = max(1, config.slots.per_peer >> 3)
        self.waiting = 0  # releases the loop waits for: held slots, inline bytes, consumed acks
        # (request id, life) delivered and not yet released -> the identity of the peer it
        # came from. The id stays its owner's for as long as it is live (here, or expected
        # from it): no count window. Bounded by limits.max_live_requests (the loop stops
        # reading). Keyed by the life too (Payload.life): a request served again (SGLang's
        # rebootstrap) is a new life, never a duplicate of the one its decode still holds.
        self.live: dict[tuple[str, int | None], str] = {}
        self._max_live = config.limits.max_live_requests
        self.double_releases = 0  # releases of a delivery already released (no-ops)

    def full(self) -> bool:
        """Whether the loop must stop reading: outcomes or inline bytes waiting, or live deliveries, at their caps."""
        limits = self._limits
        return (
            self._queue.full(limits.max_queued_outcomes, limits.max_queued_inline_bytes)
            or len(self.live) >= self._max_live
        )

    @property
    def backpressure(self) -> bool:
        """Whether the loop has stopped reading (the scheduler is this far behind)."""
        return self._queue.backpressure

    def release(self, item: _Release) -> None:
        """A delivery's releaser (bound to its item per payload): record the release for the loop.

        Idempotent: a second release frees nothing (not a reused slot, not the inline
        bytes again, no second consumed ack) and is counted in :attr:`double_releases`. The loop is woken at
        once when it has stopped reading (backpressure), or every ``_release_batch``
        releases that someone waits on (a slot the prefill may need, a consumed ack);
        it finds the rest within ``ACK_INTERVAL_S``.
        """
        if item[7]:
            self.double_releases += 1  # a counted no-op, inline or bulk alike
            return
        item[7] = True
        released = self._released
        released.append(item)
        if self._queue.backpressure or (item[8] and len(released) >= self._release_batch):
            self._wake()

    def emit(self, outcome: Delivery | Failure, nbytes: int = 0) -> None:
        self._queue.put(outcome, nbytes)

    def reject(
        self,
        ident: bytes,
        exc: WireError,
        code: str,
        nbytes: int,
        nonce: bytes = NO_NONCE,
        peer: Peer | None = None,
        reply: bool = True,
    ) -> None:
        """Count and report a message that failed before its payload could be built.

        ``peer``: the authenticated sender, if any. Only then may the Failure name the
        request id the message claimed, and only an id no other peer owns: an
        unauthenticated or foreign message must never fail (or evict) another's request.
        """
        self.metrics.bytes["control"] += nbytes
        rid = exc.request_id
        if rid is not None and (peer is None or self._other_owner(rid, None, peer) is not None):
            rid = None  # the claimed id stays in the reason
        name = peer.name if peer is not None else None
        f = self.pipeline.fail(Failure(request_id=rid, stage="wire", reason=str(exc), field=exc.field, peer=name))
        self.emit(f)
        if not reply:  # answered already (by the caller, under the key it verified)
            return
        msg = wire.ErrorReply(code=code, reason=str(exc)[:REASON_CAP], request_id=exc.request_id)
        conn = self._peers.by_ident.get(ident)
        if conn is not None and (not self._signed or conn.nonce == nonce):
            # A connected peer is answered on its own sequence: a wall-clock one would jump
            # its replay window past every later ack and heartbeat (HMAC).
            self._replies.send(conn, msg)
        else:
            self._replies.send_to(ident, msg, nonce)

    def _other_owner(self, rid: str, life: int | None, peer: Peer) -> str | None:
        """The identity of another peer that owns ``rid`` (this life live there: delivered
        and not released; expected from it; or recently arrived from it), or None when
        ``peer`` may send it."""
        owner = self.live.get((rid, life))
        if owner is None:
            owner = self._expects.owner(rid)
        return owner if owner is not None and owner != peer.name else None

    def on_payload(self, peer: Peer, h: wire.PayloadHeader, body: list[Any]) -> None:
        m = self.metrics
        rid = h.request_id
        try:
            # Neither of these failures names the request: it is another delivery's (or
            # another peer's) id, and a keyed store must not let it replace that outcome.
            if self.live.get((rid, h.life)) == peer.name:
                raise WireError("this peer already has this request outstanding", field="duplicate", request_id=rid)
            other = self._other_owner(rid, h.life, peer)
            if other is not None:
                raise WireError(f"it belongs to {other!r}, sent by {peer.name!r}", field="peer", request_id=rid)
            payload, slot = payload_codec.payload_from_header(h, body, self._limits, peer.resolver)
            gen = 0
            if slot >= 0:  # bulk integrity (integrity.py): generation and digests, before delivery
                gen = self._pool.admit(slot, payload_codec.slot_refs(h), h.request_id, peer.digest_key)  # type: ignore[union-attr]  # slot >= 0 only with a pool
        except (WireError, IntegrityError) as exc:
            named = payload_codec.named_slot(h)
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
            self.emit(f)
            peer.failed.append((h.seq, f.key, f.reason))
            return
        by_plane = m.bytes
        by_plane["control"] += len(body[0])
        inline = 0
        if slot >= 0:
            self._pool.hold(slot)  # type: ignore[union-attr]  # slot >= 0 only with a pool
            self.waiting += 1
            by_plane["bulk"] += payload_codec.bulk_bytes(payload)
        elif len(body) == 2:
            inline = len(body[1])
        elif len(body) > 2:
            inline = sum(map(len, body[1:]))
        by_plane["inline"] += inline
        self._expects.arrived(rid, peer.name)
        consumed = self._consumed_acks
        key = (rid, h.life)
        item: _Release = [peer, key, h.seq, slot, gen, False, inline, False, slot >= 0 or consumed]
        releaser = partial(self.release, item)
        out = self.pipeline.process(payload, ReceiveContext(peer.name, "default", _perf_counter()), releaser)
        self._queue.put(out, inline)
        if type(out) is Delivery:
            item[5] = True
            self.live[key] = peer.name  # its owner's until released (bounded: max_live_requests)
            if inline:  # its bytes count against max_queued_inline_bytes until released
                self.waiting += 1
            if consumed:
                self.waiting += 1
            else:
                peer.delivered.append(h.seq)
        else:
            peer.failed.append((h.seq, out.key, out.reason))  # type: ignore[union-attr]  # a Failure here

    def apply_releases(self) -> None:
        pool = self._pool
        released = self._released
        consumed = self._consumed_acks
        peers = self._peers
        queue = self._queue
        while released:
            peer, key, seq, slot, gen, delivered, inline, _, _ = released.popleft()
            if inline:
                queue.freed(inline)
                if delivered:
                    self.waiting -= 1
            if delivered and self.live.get(key) == peer.name:
                del self.live[key]
            if slot >= 0:
                done, owner = pool.release(slot, gen)  # type: ignore[union-attr]  # slot >= 0 only with a pool
                if done:  # else stale: the slot was freed or reused since; never free a later use
                    self.waiting -= 1
                if done and owner is not None:
                    holder = peers.get(owner)  # type: ignore[arg-type]  # slot owners are peer idents
                    if holder is not None:
                        holder.freed.append(slot)
            if consumed and delivered:
                self.waiting -= 1
                if peers.get(peer.ident) is peer:  # still connected: ack it now it was used
                    peer.delivered.append(seq)  # type: ignore[union-attr]  # `is` narrowed it to get()'s Optional

    def fail_expected(self, rid: str, why: str, reason: str) -> None:
        self.emit(self.pipeline.fail(Failure(request_id=rid, stage="transfer", reason=reason, field=why)))
