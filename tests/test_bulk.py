"""Bulk integrity end to end: a real receiver, real Mooncake engines, hand-driven prefills.

Each attack of issue 13 on the bulk plane has a test that shows it refused
(``transfer:digest`` or a wire field, that request only) and a negative control that
shows the same path delivers when the bytes are right, so the test can fail. The
"attacker" is a second real Mooncake engine (the session's prefill engine, or a raw
peer's) writing into a slot it was never meant to touch: the engine checks nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
from _bulk_peer import RawPrefill  # tests/ is on sys.path (no __init__.py)
from _helpers import OneHot  # tests/ is on sys.path (no __init__.py)
from _transport_peer import collect_outcomes, make_payload

from pd_middleware import DenseEncoding, Payload
from pd_middleware.decode.pipeline import Delivery, Failure, ReceivePipeline
from pd_middleware.transport import DecodeReceiver, MooncakeConfig, PrefillSender, SlotsConfig, TransportConfig

KEY = b"k" * 32


def cfg(per_peer: int = 4, digest: str = "auto", hmac: bool = False) -> TransportConfig:
    return TransportConfig(
        heartbeat_s=0.05,
        peer_timeout_s=2.0,
        inline_threshold_bytes=0,
        hmac_key=KEY.decode() if hmac else None,
        slots=SlotsConfig(count=16, size_bytes=64 * 1024, per_peer=per_peer, wait_s=2.0),
        mooncake=MooncakeConfig(digest=digest),  # type: ignore[arg-type]
    )


def dense(rid: str, seed: int, vocab: int = 256) -> Payload:
    data = bytes((seed * 31 + i) % 251 for i in range(vocab * 4))
    return Payload(
        rid, (seed % vocab,), (0.5,), vocab, hidden=bytes([seed % 256]) * 256, proposal=DenseEncoding("fp32", data)
    )


@pytest.fixture
def rx(zctx, mooncake_pair, request) -> Iterator[DecodeReceiver]:
    c = getattr(request, "param", None) or cfg()
    r = DecodeReceiver(
        c, ReceivePipeline([], {"default": ("one_hot", OneHot())}), engine=mooncake_pair[0], context=zctx
    ).start()
    yield r
    r.stop()
    for o in r.drain():
        if isinstance(o, Delivery):
            o.release()


@pytest.fixture
def peer(zctx, rx, mooncake_pair) -> Iterator[RawPrefill]:
    p = RawPrefill(zctx, rx.address, mooncake_pair[1], "raw", want=4, key=KEY if rx.config.hmac_key else None)
    p.hello()
    yield p
    p.close()


def _one(rx: DecodeReceiver) -> Delivery | Failure:
    (out,) = collect_outcomes(rx, 1, timeout=5.0)
    return out


def _delivered_bytes(out: Delivery) -> tuple[bytes, bytes]:
    p = out.payload
    return bytes(p.hidden), bytes(p.proposal.data)  # type: ignore[union-attr]


def test_unwritten_slot_is_refused_and_freed(rx, peer) -> None:
    s = peer.grant.slots[0]  # type: ignore[union-attr]
    h, _ = peer.header(dense("unwritten", 1), s)
    peer.send_header(h)  # no Mooncake write reached the slot
    out = _one(rx)
    assert isinstance(out, Failure) and out.key == "transfer:digest" and "do not match" in out.reason
    assert peer.wait_freed(s)  # the slot of a refused payload goes back to its owner
    # Control: the same slot, written this time, is delivered bit-exact.
    p = dense("written", 2)
    h, parts = peer.header(p, s)
    peer.write(s, parts)
    peer.send_header(h)
    out = _one(rx)
    assert isinstance(out, Delivery) and _delivered_bytes(out) == (bytes(p.hidden), bytes(p.proposal.data))  # type: ignore[union-attr]
    out.release()


def test_previous_peers_bytes_are_never_delivered_to_a_new_peer(zctx, rx, mooncake_pair) -> None:
    """Issue 13 #4: after a prefill left, a new peer got its slots and 4 of 4 headers naming
    them unwritten were delivered with the old bytes. Also: the old peer's own header,
    replayed on the new connection, matches those bytes; only the generation refuses it."""
    old = RawPrefill(zctx, rx.address, mooncake_pair[1], "old", want=4)
    old.hello()
    headers = []
    for i, s in enumerate(old.grant.slots):  # type: ignore[union-attr]
        h, parts = old.header(dense(f"old-{i}", 10 + i), s)
        old.write(s, parts)
        old.send_header(h)
        headers.append(h)
    for out in collect_outcomes(rx, 4):
        assert isinstance(out, Delivery)
        out.release()
    time.sleep(0.05)
    old.close()
    new = RawPrefill(zctx, rx.address, mooncake_pair[1], "new", want=4)
    try:
        new.hello()
        assert set(new.grant.slots) == set(old.grant.slots)  # type: ignore[union-attr]  # the same memory
        for i, s in enumerate(new.grant.slots):  # type: ignore[union-attr]
            h, _ = new.header(dense(f"new-{i}", 20 + i), s)
            new.send_header(h)  # unwritten: the slot holds the old peer's bytes
        outs = collect_outcomes(rx, 4)
        assert [o.key for o in outs] == ["transfer:digest"] * 4  # type: ignore[union-attr]
        # The old peer's request ids are its own (wire:peer from anyone else), so its headers
        # are replayed under fresh ids: bytes match, the generation does not.
        headers = [msgspec.structs.replace(h, request_id=f"replay-{i}") for i, h in enumerate(headers)]
        for h in headers:
            new.send_header(h)
        outs = collect_outcomes(rx, 4)
        assert all(
            isinstance(o, Failure) and o.key == "transfer:digest" and "not of this grant" in o.reason for o in outs
        )
        # A copied digest with the new grant's generation does not pass either (issue 23):
        # the digest is bound to (request id, slot, generation, offset), not to the bytes alone.
        s = headers[0].hidden.slot  # type: ignore[union-attr]
        fixed = msgspec.structs.replace(
            headers[0],
            hidden=msgspec.structs.replace(headers[0].hidden, gen=new.gens[s] + 1),
            proposal=msgspec.structs.replace(
                headers[0].proposal,
                data=msgspec.structs.replace(headers[0].proposal.data, gen=new.gens[s] + 1),  # type: ignore[union-attr]
            ),
        )
        new.send_header(fixed)
        out = _one(rx)
        assert isinstance(out, Failure) and out.key == "transfer:digest" and "copied" in out.reason
        # Control: a header that this peer stamps for those very bytes passes.
        h, _ = new.header(dense("own-0", 10), s, gen=new.gens[s] + 2)  # the old bytes, its own id
        new.send_header(h)
        out = _one(rx)
        assert isinstance(out, Delivery)
        out.release()
    finally:
        new.close()


@pytest.mark.parametrize(
    "rx, algorithm",
    [(cfg(), "xxh3_128"), (cfg(hmac=True), "blake3")],
    indirect=["rx"],
    ids=["fast", "authenticated"],
)
def test_tampered_bulk_is_refused(rx, peer, mooncake_pair, algorithm) -> None:
    """A second engine overwrites a slot between the legitimate write and the header."""
    assert rx._pool.digest == algorithm  # auto: BLAKE3 exactly when the headers are signed
    decode_engine, _ = mooncake_pair
    s = peer.grant.slots[1]  # type: ignore[union-attr]
    p = dense("tampered", 3)
    h, parts = peer.header(p, s, algorithm=algorithm)
    peer.write(s, parts)
    evil = bytearray(bytes(parts[1][0]))
    evil[100] ^= 0x80  # one bit of one fp32 value
    peer.write(s, [(bytes(evil), parts[1][1])], engine=decode_engine)  # another engine: no check stops it
    peer.send_header(h)
    out = _one(rx)
    assert isinstance(out, Failure) and out.key == "transfer:digest" and algorithm in out.reason
    # Control: rewrite the right bytes, send at the next generation: delivered.
    h, parts = peer.header(p, s, algorithm=algorithm)
    peer.write(s, parts)
    peer.send_header(h)
    out = _one(rx)
    assert isinstance(out, Delivery)
    out.release()


@pytest.mark.parametrize("rx", [cfg(hmac=True)], indirect=True, ids=["authenticated"])
def test_authenticated_decode_refuses_a_forgeable_digest(rx, peer) -> None:
    s = peer.grant.slots[0]  # type: ignore[union-attr]
    p = dense("weak", 4)
    h, parts = peer.header(p, s, algorithm="xxh3_128")
    peer.write(s, parts)
    peer.send_header(h)
    out = _one(rx)
    assert isinstance(out, Failure) and out.key == "transfer:digest" and "requires BLAKE3" in out.reason


def test_a_payload_naming_two_slots_is_refused(rx, peer) -> None:
    """One payload = one held slot: a proposal in another slot could be overwritten in use."""
    a, b = peer.grant.slots[:2]  # type: ignore[union-attr]
    p = dense("two-slots", 5)
    h, parts = peer.header(p, a)
    peer.write(a, parts)
    hb, parts_b = peer.header(p, b)
    peer.write(b, parts_b)
    two = msgspec.structs.replace(h, proposal=hb.proposal)  # hidden in slot a, proposal in slot b
    peer.send_header(two)
    out = _one(rx)
    assert (
        isinstance(out, Failure) and out.key == "wire:proposal.data.slot" and "other tensors are in slot" in out.reason
    )
    assert peer.wait_freed(a)
    assert not rx._pool.held[a] and not rx._pool.held[b]  # nothing is held for a refused payload
    # Control: the same payload in one slot is delivered.
    h, parts = peer.header(p, b)
    peer.write(b, parts)
    peer.send_header(h)
    out = _one(rx)
    assert isinstance(out, Delivery)
    out.release()


def test_a_payload_rejected_at_the_wire_frees_its_slot(rx, peer) -> None:
    s = peer.grant.slots[2]  # type: ignore[union-attr]
    p = dense("bad-vocab", 6)
    h, parts = peer.header(p, s)
    peer.write(s, parts)
    peer.send_header(msgspec.structs.replace(h, vocab_size=0))
    out = _one(rx)
    assert isinstance(out, Failure) and out.key == "wire:vocab_size"
    assert peer.wait_freed(s)
    # Control: a delivered payload's slot is not freed until its delivery is released.
    h, parts = peer.header(p, s)
    peer.write(s, parts)
    peer.freed.clear()
    peer.send_header(h)
    out = _one(rx)
    assert isinstance(out, Delivery)
    assert not peer.wait_freed(s, timeout=0.3)
    out.release()
    assert peer.wait_freed(s)


def test_a_second_release_after_reuse_frees_nothing(zctx, mooncake_pair) -> None:
    decode_engine, prefill_engine = mooncake_pair
    c = cfg(per_peer=1)
    rx = DecodeReceiver(
        c, ReceivePipeline([], {"default": ("one_hot", OneHot())}), engine=decode_engine, context=zctx
    ).start()
    tx = PrefillSender(c, engine=prefill_engine, context=zctx, name="reuse").connect(rx.address)
    try:
        tx.send(make_payload("reuse", 0))
        (a,) = collect_outcomes(rx, 1)
        a.release()
        tx.send(make_payload("reuse", 1))  # waits for the freed slot, then reuses it
        (b,) = collect_outcomes(rx, 1)
        assert isinstance(b, Delivery) and tx.flush(5.0)
        a.release()  # again, after the slot was reused by b
        time.sleep(0.1)
        assert tx.statuses()["free_slots"] == 0  # b's slot was not freed under it
        assert rx._pool.held.count(1) == 1
        b.release()  # control: b's own release frees it
        deadline = time.monotonic() + 3.0
        while tx.statuses()["free_slots"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tx.statuses()["free_slots"] == 1
    finally:
        tx.close()
        rx.stop()


def test_stress_reuse_and_release_stay_bit_exact(zctx, mooncake_pair) -> None:
    """300 payloads through 2 slots; the scheduler thread releases each delivery, and also
    replays every earlier release (stale): every payload arrives bit-exact, no slot is
    freed twice, and both slots are free at the end. Bounded: 60 s at most."""
    decode_engine, prefill_engine = mooncake_pair
    c = cfg(per_peer=2)
    rx = DecodeReceiver(
        c, ReceivePipeline([], {"default": ("one_hot", OneHot())}), engine=decode_engine, context=zctx
    ).start()
    tx = PrefillSender(c, engine=prefill_engine, context=zctx, name="stress").connect(rx.address)
    n = 300
    sent = {f"stress-{i}": make_payload("stress", i) for i in range(n)}
    wrong: list[str] = []
    got: list[str] = []
    stop = time.monotonic() + 60.0

    def scheduler() -> None:
        old: list[Delivery] = []
        while len(got) < n and time.monotonic() < stop:
            out = rx.get(timeout=0.1)
            if out is None:
                continue
            if not isinstance(out, Delivery):
                wrong.append(f"failure {out.key}")
                continue
            p, want = out.payload, sent[out.payload.request_id]
            if bytes(p.hidden) != bytes(want.hidden) or (
                want.proposal is not None and bytes(p.proposal.values) != bytes(want.proposal.values)  # type: ignore[union-attr]
            ):
                wrong.append(p.request_id)
            got.append(p.request_id)
            out.release()
            for o in old[-3:]:  # stale releases of earlier uses of the same slots
                o.release()
            old.append(out)

    t = threading.Thread(target=scheduler, daemon=True)
    t.start()
    try:
        for p in sent.values():
            tx.send(p)
            assert tx.statuses()["free_slots"] <= 2
        assert tx.flush(30.0)
        t.join(max(0.0, stop - time.monotonic()))
        assert not wrong and sorted(got) == sorted(sent)
        deadline = time.monotonic() + 3.0
        while tx.statuses()["free_slots"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        st = tx.statuses()
        assert st["free_slots"] == 2 and st["delivered"] == n and rx._pool.held.count(1) == 0
    finally:
        tx.close()
        rx.stop()


@pytest.mark.parametrize(
    "hmac, algorithm, nbytes", [(False, "xxh3_128", 16), (True, "blake3", 32)], ids=["fast", "authenticated"]
)
def test_the_real_sender_stamps_what_the_decode_requires(zctx, mooncake_pair, hmac, algorithm, nbytes) -> None:
    """``digest = "auto"`` on both sides: BLAKE3 exactly when HMAC is on; deliveries arrive."""
    decode_engine, prefill_engine = mooncake_pair
    c = cfg(hmac=hmac)
    rx = DecodeReceiver(
        c, ReceivePipeline([], {"default": ("one_hot", OneHot())}), engine=decode_engine, context=zctx
    ).start()
    tx = PrefillSender(c, engine=prefill_engine, context=zctx, name="auto").connect(rx.address)
    try:
        assert rx._pool.digest == algorithm
        h, _ = tx._bulk.header(dense("probe", 9), 0, tx._free[0])  # type: ignore[union-attr]
        assert len(h.hidden.digest) == nbytes and h.hidden.gen > 0  # type: ignore[union-attr]
        sent = [dense(f"auto-{i}", 30 + i) for i in range(4)]  # one per slot: this thread also consumes
        for p in sent:
            tx.send(p)
        outs = collect_outcomes(rx, 4)
        assert all(isinstance(o, Delivery) for o in outs)
        for o in outs:
            want = next(p for p in sent if p.request_id == o.request_id)
            assert _delivered_bytes(o) == (bytes(want.hidden), bytes(want.proposal.data))  # type: ignore[union-attr]
            o.release()
    finally:
        tx.close()
        rx.stop()
