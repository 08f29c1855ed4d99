"""The decode's per-message dispatch and peer handshake.

:meth:`Handshake.handle` takes one inbound message: frame count, HMAC and replay window
(:mod:`.auth`), the CURVE key a connection was opened with, then the header
(:mod:`.wire`); a payload goes to admission (:mod:`.admission`), a hello opens (or
reopens) a connection and is answered by a grant of slots, a heartbeat from an unknown
peer asks it to say hello, a bye forgets the peer. :meth:`Handshake.tick` fails
overdue expectations, drops silent peers and sends heartbeats; :meth:`Handshake.drop`
forgets a peer, reclaims its slots and fails what was expected from it.

A part of :class:`~.receiver.DecodeReceiver`, an object it holds for one run of the
receive loop: it owns the HMAC hello guard (nonces seen, freshness) and decides who a
connection is; payloads and refusals go to the :class:`~.admission.Admission` it is
given, replies out through :class:`~.admission.Replies`. Runs only on the receive thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..core._errors import WireError
from . import integrity, wire
from .admission import Admission, Replies
from .auth import NO_NONCE, TO_DECODE, CurveGate, HelloGuard, Signer
from .config import TransportConfig
from .expects import Expectations
from .mooncake import MooncakeEngine
from .peers import REASON_CAP, Peer, PeerTable
from .slots import SlotPool

_PayloadHeader = wire.PayloadHeader


class Handshake:
    """Dispatch of inbound messages, hello/grant, heartbeats, bye and peer loss.

    ``gate``: the CURVE allowlist (None without CURVE); ``pool`` and ``pool_addr``: the
    slot pool and its registered address (None and 0: inline only).
    """

    def __init__(
        self,
        config: TransportConfig,
        session: str,
        engine: MooncakeEngine | None,
        admission: Admission,
        replies: Replies,
        peers: PeerTable,
        expects: Expectations,
        gate: CurveGate | None,
        pool: SlotPool | None,
        pool_addr: int,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.session = session
        self.engine = engine
        self.metrics = admission.metrics
        self._limits = config.limits
        self._admission = admission
        self._replies = replies
        self._signer = replies.signer
        self._peers = peers
        self._expects = expects
        self._curve = config.curve.enabled
        self._gate = gate
        self._pool = pool
        self._pool_addr = pool_addr
        self._clock = clock
        self._hellos = HelloGuard()  # HMAC: hello nonces seen, freshness
        # Per-prefill HMAC keys (hmac_peers): name -> (signer, bulk-digest key); None: shared key or none.
        self._keys: dict[str, tuple[Signer, bytes]] | None = None
        if config.hmac_peers:
            secrets = config.peer_secrets()
            self._keys = {n: (Signer(k), integrity.key_from_secret(k)) for n, k in secrets.items()}

    def handle(self, frames: list[Any], user: str | None = None) -> None:
        """``frames``: the routing id and control frame (bytes), then tensor frames (views)."""
        ident = frames[0]
        body = frames[1:]
        limits = self._limits
        keyed = self._keys is not None
        signed = self._signer is not None or keyed
        if not body or len(body) > limits.max_frames + 2 * signed:
            n = sum(map(len, body))
            self._admission.reject(
                ident, WireError(f"{len(body)} frames is not in [1, {limits.max_frames}]", field="frames"), "wire", n
            )
            return
        peer = self._peers.by_ident.get(ident)
        nonce, seq = NO_NONCE, 0
        hello_signer: Signer | None = None
        if signed:
            if keyed:
                opened, hello_signer = self._open_keyed(body, peer)
            else:
                opened = self._signer.open(body, TO_DECODE)  # type: ignore[union-attr]  # set whenever `signed`
            if opened is None:
                self._admission.reject(
                    ident, WireError("missing or invalid HMAC signature", field="hmac"), "hmac", sum(map(len, body))
                )
                return
            nonce, seq = opened
            body = body[:-2]
            if peer is not None and nonce == peer.nonce:
                if seq <= peer.rx_seq:
                    exc = WireError(f"sequence {seq} was already used on this connection", field="replay")
                    self._admission.reject(ident, exc, "replay", sum(map(len, body)), nonce)  # no request id: a replay
                    return
                peer.rx_seq = seq
            else:
                peer = None  # only a fresh hello may open (or reopen) a connection
        if user is not None and peer is not None and peer.key != user:
            peer = None  # never expected (libzmq keeps one key per connection): a reused routing id
        try:
            msg = wire.decode_frame(body[0], limits)
        except WireError as exc:
            self._admission.reject(ident, exc, "wire", sum(map(len, body)), nonce, peer)
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
                self._admission.reject(ident, err, "hello", sum(map(len, body)), nonce)
            else:
                self._admission.on_payload(peer, msg, body)  # type: ignore[arg-type]  # `kind is` dispatch: a PayloadHeader
            return
        self.metrics.bytes["control"] += len(body[0])
        if kind is wire.Hello:
            self._on_hello(ident, msg, now, user, nonce, seq, hello_signer)  # type: ignore[arg-type]  # `kind is` dispatch: a Hello
        elif kind is wire.Heartbeat:
            if peer is None:
                self._replies.send_to(
                    ident, wire.ErrorReply(code="hello", reason="unknown peer (decode restarted?)"), nonce
                )
        elif kind is wire.Bye and peer is not None:
            self.drop(peer, "peer_closed", f"prefill {peer.name!r} closed: {msg.reason}")  # type: ignore[attr-defined]  # `kind is` dispatch: a Bye

    def _open_keyed(self, body: list[Any], peer: Peer | None) -> tuple[tuple[bytes, int] | None, Signer | None]:
        """Per-prefill keys: verify ``body`` with its connection's key, or, for a hello, with
        the key of the name it claims, so that the name is the one whose key signed it.
        Returns the ``(nonce, seq)`` opened (None: no key verifies it) and, for a hello, its signer."""
        if peer is not None and peer.signer is not None:
            opened = peer.signer.open(body, TO_DECODE)
            if opened is not None and opened[0] == peer.nonce:
                return opened, None
        if len(body) < 3:
            return None, None
        try:  # only a hello may open a connection: its name picks the key to check it with
            msg = wire.decode_frame(body[0], self._limits)
        except WireError:
            return None, None
        if type(msg) is not wire.Hello:
            return None, None
        entry = self._keys.get(msg.name)  # type: ignore[union-attr]  # only called when keyed
        if entry is None:
            return None, None
        opened = entry[0].open(body, TO_DECODE)
        return (opened, entry[0]) if opened is not None else (None, None)

    def _on_hello(
        self,
        ident: bytes,
        msg: wire.Hello,
        now: float,
        user: str | None,
        nonce: bytes,
        seq: int,
        signer: Signer | None = None,
    ) -> None:
        name = msg.name
        if self._curve:
            if self._gate is None or user not in self._gate.allowed:
                self._admission.reject(ident, WireError("CURVE key not on the allowlist", field="peer"), "hello", 0)
                return
            name = self._gate.allowed[user]  # the authenticated identity, whatever the hello says
        if self._signer is not None or signer is not None:
            why = self._hellos.check(msg.ts, nonce, seq)
            if why:
                self._replies.send_to(
                    ident, wire.ErrorReply(code="replay", reason=why[:REASON_CAP]), nonce, None, signer
                )
                self._admission.reject(ident, WireError(why, field="replay"), "replay", 0, nonce, reply=False)
                return
        for other in self._peers.same_identity(ident, name, user):
            # The same prefill reconnected: it stays responsible for its expected requests.
            self.drop(other, None, "")
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
        if signer is not None:  # per-prefill keys: the key that signed this hello, and its digest key
            peer.signer = signer
            peer.digest_key = self._keys[name][1]  # type: ignore[index]  # keyed whenever a hello signer is set
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
        self._replies.send(
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

    def tick(self, now: float) -> None:
        for rid in self._expects.overdue(now):
            self._admission.fail_expected(rid, "deadline", f"request {rid!r} did not arrive by its deadline")
        timeout = self.config.peer_timeout_s
        hb = self.config.heartbeat_s
        for peer in self._peers:
            if self._admission.backpressure:
                peer.last_seen = now  # not reading: their heartbeats wait in libzmq, unheard
            silent = now - peer.last_seen
            if silent > timeout:
                self.drop(
                    peer,
                    "peer_lost",
                    f"prefill {peer.name!r} lost: silent for {silent:.1f} s (peer_timeout_s={timeout:g})",
                )
            elif now - peer.last_sent >= hb:
                self._replies.send(peer, wire.Heartbeat(session=self.session))

    def drop(self, peer: Peer, why: str | None, reason: str) -> None:
        """Forget ``peer``, reclaim its slots and (if ``why``) fail the requests expected from it."""
        self._peers.remove(peer)
        if self._pool is not None:
            self._pool.reclaim(peer.ident)
        if why is not None:
            for rid in self._expects.take(peer.name):
                self._admission.fail_expected(rid, why, reason)
