"""Sender and receiver over real ZMQ sockets and real Mooncake engines on loopback.

Every wait is bounded; a test that stalls fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from _helpers import OneHot, inline_frames, make, mutations, same  # tests/ is on sys.path (no __init__.py)
from _transport_peer import collect_outcomes, make_payload  # tests/ is on sys.path (no __init__.py)

from pd_middleware import NoSlotError, OneHotProposal, TransferError
from pd_middleware.decode.pipeline import Delivery, Failure, ReceivePipeline
from pd_middleware.transport import DecodeReceiver, PrefillSender, SlotsConfig, TransportConfig, wire

HERE = pathlib.Path(__file__).resolve().parent


def cfg(**kw) -> TransportConfig:
    base = dict(heartbeat_s=0.05, peer_timeout_s=1.0, connect_timeout_s=5.0)
    base.update(kw)
    return TransportConfig(**base)


def small_slots(**kw) -> SlotsConfig:
    base = dict(count=8, size_bytes=64 * 1024, per_peer=4, wait_s=1.0)
    base.update(kw)
    return SlotsConfig(**base)


def pipeline() -> ReceivePipeline:
    return ReceivePipeline([], {"default": ("one_hot", OneHot())})


def reconcile(rx: DecodeReceiver) -> dict:
    s = rx.metrics.snapshot()
    assert s["received"] == s["delivered"] + s["failed"], s
    return s


# ---- round trips ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["inline", "mooncake"])
def test_round_trip_bit_exact(path: str, zctx, mooncake_pair) -> None:
    decode_engine, prefill_engine = mooncake_pair if path == "mooncake" else (None, None)
    c = cfg(inline_threshold_bytes=0 if path == "mooncake" else 1 << 30, slots=small_slots())
    rx = DecodeReceiver(c, pipeline(), engine=decode_engine, context=zctx).start()
    tx = PrefillSender(c, engine=prefill_engine, context=zctx, name="p").connect(rx.address)
    try:
        sent = [
            make(steps, hd, prop, rid=f"r-{steps}-{hd}-{prop}")
            for steps in (1, 3)
            for hd in ("bf16", "fp16", "fp32")
            for prop in (None, "dense", "dense16", "sparse")
        ]
        for p in sent:
            tx.send(p)
            out = rx.get(timeout=5.0)
            assert isinstance(out, Delivery), out
            same(p, out.payload)
            assert out.proposal == OneHotProposal(p.draft_tokens) and out.payload.request_id == p.request_id
            if path == "mooncake":
                assert isinstance(out.payload.hidden, memoryview) and not out.payload.hidden.readonly  # slot view
            out.release()
        assert tx.flush(5.0)
        st = tx.statuses()
        assert st["sent"] == st["delivered"] == len(sent) and st["outstanding"] == 0
        planes = reconcile(rx)["bytes_by_plane"]
        busy, idle = ("bulk", "inline") if path == "mooncake" else ("inline", "bulk")
        assert planes[busy] > 0 and planes[idle] == 0 and planes["control"] > 0
    finally:
        tx.close()
        rx.stop()


# ---- scale: two real sender processes ---------------------------------------------


def _spawn_peer(address: str, name: str, count: int, mode: str, delay: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ)
    root = str(HERE.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "plugins"), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, str(HERE / "_transport_peer.py"), address, name, str(count), mode, str(delay)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )


def _peer_report(proc: subprocess.Popen, timeout: float) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"peer exited {proc.returncode}: {out[-500:]}"
    return json.loads(lines[-1])


def test_two_senders_10000_payloads_zero_loss(mooncake_pair) -> None:
    n = 5000
    c = cfg(heartbeat_s=0.1, peer_timeout_s=5.0, slots=SlotsConfig(count=64, size_bytes=4096, per_peer=16, wait_s=20.0))
    pipe = pipeline()
    rx = DecodeReceiver(c, pipe, engine=mooncake_pair[0]).start()
    procs = {"inl": _spawn_peer(rx.address, "inl", n, "inline"), "blk": _spawn_peer(rx.address, "blk", n, "bulk")}
    try:
        for name in procs:
            for i in range(n):
                rx.expect(f"{name}-{i}", peer=name, deadline=time.monotonic() + 120)
        seen: dict[str, int] = {}
        deadline = time.monotonic() + 120
        while len(seen) < 2 * n and time.monotonic() < deadline:
            for item in rx.drain() or filter(None, [rx.get(timeout=0.2)]):
                assert isinstance(item, Delivery), item
                rid = item.request_id
                name, i = rid.rsplit("-", 1)
                same(make_payload(name, int(i)), item.payload)  # bit-exact, every payload
                seen[rid] = seen.get(rid, 0) + 1
                item.release()
        assert len(seen) == 2 * n and set(seen.values()) == {1}, f"{len(seen)} distinct of {2 * n}"
        reports = {name: _peer_report(p, 60) for name, p in procs.items()}
        for name, r in reports.items():
            assert r["flushed"] and r["sent"] == r["delivered"] == n and r["failed"] == 0 and r["outstanding"] == 0, (
                name,
                r,
            )
        assert reports["blk"]["bytes_by_plane"]["bulk"] > 0 and reports["inl"]["bytes_by_plane"]["bulk"] == 0
        s = reconcile(rx)
        assert s["received"] == s["delivered"] == 2 * n and s["failed"] == 0
        assert s["bytes_by_plane"]["bulk"] == reports["blk"]["bytes_by_plane"]["bulk"]
        assert s["bytes_by_plane"]["inline"] == reports["inl"]["bytes_by_plane"]["inline"]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        rx.stop()
    assert reconcile(rx)["failed"] == 0  # nothing was still expected at stop


# ---- faults -----------------------------------------------------------------------


def test_kill_9_prefill_fails_only_its_requests(mooncake_pair, zctx) -> None:
    n = 300
    c = cfg(heartbeat_s=0.1, peer_timeout_s=1.0, slots=SlotsConfig(count=64, size_bytes=4096, per_peer=16, wait_s=5.0))
    rx = DecodeReceiver(c, pipeline(), engine=mooncake_pair[0], context=zctx).start()
    victim = _spawn_peer(rx.address, "victim", n, "bulk", delay=0.005)
    survivor = PrefillSender(c, engine=mooncake_pair[1], context=zctx, name="survivor").connect(rx.address)
    try:
        for i in range(n):
            rx.expect(f"victim-{i}", peer="victim", deadline=time.monotonic() + 60)
            rx.expect(f"survivor-{i}", peer="survivor", deadline=time.monotonic() + 60)
        outcomes: dict[str, Delivery | Failure] = {}

        def collect(timeout: float) -> None:
            for item in rx.drain() or filter(None, [rx.get(timeout=timeout)]):
                assert item.request_id not in outcomes, f"two outcomes for {item.request_id}"
                outcomes[item.request_id] = item
                if isinstance(item, Delivery):
                    item.release()

        deadline = time.monotonic() + 30
        while sum(r.startswith("victim") for r in outcomes) < 40 and time.monotonic() < deadline:
            collect(0.1)
        os.kill(victim.pid, signal.SIGKILL)  # mid-stream: it was sending every 5 ms
        victim.wait(10)
        for i in range(n):
            survivor.send(make_payload("survivor", i))
            collect(0)
        deadline = time.monotonic() + 15
        while len(outcomes) < 2 * n and time.monotonic() < deadline:
            collect(0.1)
        assert len(outcomes) == 2 * n, f"{len(outcomes)} outcomes of {2 * n}"
        got_victim = [o for r, o in outcomes.items() if r.startswith("victim")]
        delivered = [o for o in got_victim if isinstance(o, Delivery)]
        failed = [o for o in got_victim if isinstance(o, Failure)]
        assert 40 <= len(delivered) < n and failed, (len(delivered), len(failed))
        for f in failed:
            assert f.key == "transfer:peer_lost" and "prefill 'victim' lost: silent for" in f.reason, f
        for i in range(n):
            o = outcomes[f"survivor-{i}"]
            assert isinstance(o, Delivery), o
            same(make_payload("survivor", i), o.payload)
        assert survivor.flush(5.0) and survivor.statuses()["delivered"] == n
        assert "victim" not in rx.peers and rx.peers["survivor"] == 16
        assert rx.free_slots == 64 - 16  # the victim's slots came back to the pool
        s = reconcile(rx)
        assert s["failed_by_reason"] == {"transfer:peer_lost": len(failed)}
    finally:
        if victim.poll() is None:
            victim.kill()
        survivor.close()
        rx.stop()


def test_expected_request_fails_at_its_deadline(zctx) -> None:
    rx = DecodeReceiver(cfg(), pipeline(), context=zctx).start()
    try:
        rx.expect("never", deadline=time.monotonic() + 0.2)
        out = rx.get(timeout=5.0)
        assert isinstance(out, Failure) and out.key == "transfer:deadline" and out.request_id == "never"
        assert out.reason == "request 'never' did not arrive by its deadline"
    finally:
        rx.stop()


def test_slot_exhaustion_backpressure(zctx, mooncake_pair) -> None:
    c = cfg(inline_threshold_bytes=0, slots=small_slots(per_peer=2, wait_s=0.3))
    rx = DecodeReceiver(c, pipeline(), engine=mooncake_pair[0], context=zctx).start()
    tx = PrefillSender(c, engine=mooncake_pair[1], context=zctx, name="p").connect(rx.address)
    try:
        held = []
        for i in range(2):
            tx.send(make(1, "fp32", "dense", rid=f"h{i}"))
            held.append(collect_outcomes(rx, 1)[0])
        before = [bytes(d.payload.hidden) + bytes(d.payload.proposal.data) for d in held]
        t0 = time.monotonic()
        with pytest.raises(NoSlotError) as info:
            tx.send(make(1, "fp32", "dense", rid="third"))
        waited = time.monotonic() - t0
        print(f"\nslot exhaustion: NoSlotError after {waited:.2f} s (wait_s=0.3)")
        # At least wait_s (a lower bound load cannot break); the upper one only a hang crosses.
        assert 0.3 <= waited < 30.0, f"NoSlotError after {waited:.2f} s, wait_s=0.3"
        assert "all 2 slots stayed in use for 0.3 s" in str(info.value)
        assert info.value.op == "send" and info.value.peer == rx.address
        # The held slots were not touched while in use.
        assert [bytes(d.payload.hidden) + bytes(d.payload.proposal.data) for d in held] == before
        held[0].release()
        held[0].release()  # a second release is a no-op
        tx.send(make(1, "fp32", "dense", rid="third"))
        third = collect_outcomes(rx, 1)[0]
        assert isinstance(third, Delivery) and third.request_id == "third"
        assert bytes(held[1].payload.hidden) + bytes(held[1].payload.proposal.data) == before[1]
        third.release()
        held[1].release()
        assert tx.flush(5.0) and tx.statuses()["delivered"] == 3
    finally:
        tx.close()
        rx.stop()


@pytest.mark.parametrize("decode_silent", [False, True], ids=["live decode", "silent decode"])
def test_a_slot_wait_longer_than_peer_timeout_keeps_the_sender_beating(zctx, mooncake_pair, decode_silent) -> None:
    """A send waiting for a slot holds the sender's lock for up to ``slots.wait_s``; with the
    background thread stopped (the worst case of waiting for that lock), the waiter itself
    sends the heartbeats. A live decode keeps this prefill through a wait of three times its
    peer_timeout_s (the wait ends in NoSlotError): before, it dropped this silent prefill
    mid-wait (the send failed after 0.58 s, "the decode was silent": it had stopped
    answering a peer it had dropped). A decode that went silent is noticed at
    peer_timeout_s, not at the wait's end (this case passed before too: a guard, and the
    control that the live case's outcome comes from the decode hearing us)."""
    c = cfg(inline_threshold_bytes=0, heartbeat_s=0.05, peer_timeout_s=0.3, slots=small_slots(per_peer=1, wait_s=0.9))
    rx = DecodeReceiver(c, pipeline(), engine=mooncake_pair[0], context=zctx).start()
    tx = PrefillSender(c, engine=mooncake_pair[1], context=zctx, name="p").connect(rx.address)
    try:
        tx.send(make(1, "fp32", "dense", rid="held"))
        held = collect_outcomes(rx, 1)[0]
        assert isinstance(held, Delivery)
        tx._hb_stop.set()  # the background thread never gets the lock: stop it
        tx._work.set()
        assert tx._hb_thread is not None
        tx._hb_thread.join(5.0)
        assert not tx._hb_thread.is_alive()
        if decode_silent:
            rx._running = False  # the decode hangs: its loop stops without a bye
            rx._shutdown = lambda: None  # type: ignore[method-assign]
            rx._wake()
            rx._thread.join(5.0)  # type: ignore[union-attr]
        t0 = time.monotonic()
        with pytest.raises((NoSlotError, TransferError)) as info:
            tx.send(make(1, "fp32", "dense", rid="waits"))
        waited = time.monotonic() - t0
        print(
            f"\nslot wait, {'silent' if decode_silent else 'live'} decode: {type(info.value).__name__} after {waited:.2f} s"
        )
        if decode_silent:
            assert not isinstance(info.value, NoSlotError), info.value
            assert "silent" in (tx._control.lost or "")
            assert tx.statuses()["connected"] is False
        else:
            assert isinstance(info.value, NoSlotError), info.value
            assert tx.statuses()["connected"] is True
            assert [peer.name for peer in rx._peers] == ["p"]  # the decode kept this prefill
            held.release()
            tx.send(make(1, "fp32", "dense", rid="after"))  # the freed slot serves the next send
            assert tx.flush(5.0)  # its header goes out here (no background thread to send it)
            assert isinstance(collect_outcomes(rx, 1)[0], Delivery)
    finally:
        tx.close()
        if decode_silent:
            if rx._sock is not None:
                rx._sock.close(0)
            rx._thread = None
        else:
            rx.stop()


@pytest.mark.parametrize("auth", ["none", "hmac", "curve"])
def test_decode_restart_gives_clear_error_then_reconnect_works(zctx, monkeypatch, auth: str) -> None:
    """Also with HMAC (the new decode's replies carry sequences above the old one's) and CURVE."""
    from pd_middleware.transport.config import CurveConfig

    kw: dict = {}
    c = cfg()
    if auth == "hmac":
        kw = dict(hmac_key="restart-test-key-0123456")
        c = cfg(**kw)
    elif auth == "curve":
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        monkeypatch.setenv("PDM_T_SERVER", ssec.decode())
        monkeypatch.setenv("PDM_T_CLIENT", csec.decode())
        kw = dict(curve=CurveConfig(enabled=True, secret_key_env="PDM_T_SERVER", clients={"p": cpub.decode()}))
        c = cfg(curve=CurveConfig(enabled=True, secret_key_env="PDM_T_CLIENT", server_key=spub.decode()))
    rx = DecodeReceiver(cfg(**kw), pipeline(), context=zctx).start()
    port = int(rx.address.rsplit(":", 1)[1])
    tx = PrefillSender(c, context=zctx, name="p").connect(rx.address)
    try:
        tx.send(make(rid="before"))
        assert isinstance(collect_outcomes(rx, 1)[0], Delivery)
        rx.stop()
        rx = DecodeReceiver(cfg(port=port, **kw), pipeline(), context=zctx).start()
        deadline = time.monotonic() + 5
        with pytest.raises(TransferError) as info:
            while time.monotonic() < deadline:  # the bye arrives asynchronously
                tx.send(make(rid="during"))
                time.sleep(0.05)
        assert info.value.op == "send" and "call reconnect()" in str(info.value)
        assert "the decode closed the connection" in str(info.value) or "does not know this prefill" in str(info.value)
        tx.reconnect()
        tx.send(make(rid="after"))
        outs: list = []
        deadline = time.monotonic() + 5
        while not any(isinstance(o, Delivery) for o in outs) and time.monotonic() < deadline:
            o = rx.get(timeout=0.1)
            if o is not None:
                outs.append(o)
        assert [o.request_id for o in outs if isinstance(o, Delivery)] == ["after"]
        assert all(o.key == "wire:peer" for o in outs if not isinstance(o, Delivery))  # "during", if any arrived
        assert tx.flush(5.0) and tx.statuses()["rejected_by_decode"].get("replay", 0) == 0
    finally:
        tx.close()
        rx.stop()


def test_decode_crash_detected_by_silence(zctx) -> None:
    """No bye at all (a crashed decode): the sender notices the silence and refuses to send."""
    c = cfg(heartbeat_s=0.05, peer_timeout_s=0.3)
    rx = DecodeReceiver(c, pipeline(), context=zctx).start()
    tx = PrefillSender(c, context=zctx, name="p").connect(rx.address)
    try:
        rx._running = False  # simulate a hang: the loop stops without saying bye
        rx._shutdown = lambda: None  # type: ignore[method-assign]
        rx._wake()
        time.sleep(0.6)
        with pytest.raises(TransferError, match="the decode was silent for more than 0.3 s; call reconnect"):
            tx.send(make())
    finally:
        tx.close()
        if rx._sock is not None:
            rx._sock.close(0)
        rx._thread = None


# ---- hostile input ----------------------------------------------------------------


def _raw_peer(ctx: zmq.Context, address: str, signer=None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    frames = [wire.encode(wire.Hello(name="raw", want_slots=0, ts=time.time()))]
    if signer is not None:
        from pd_middleware.transport.auth import TO_DECODE, new_nonce

        frames += signer.sign(frames, new_nonce(), 0, TO_DECODE)
    sock.send_multipart(frames)
    assert sock.poll(5000), "no reply to hello"
    sock.recv_multipart()
    return sock


def test_hmac_rejects_unsigned_and_forged(zctx) -> None:
    from pd_middleware.transport.auth import Signer

    key = "s3cret-shared-key-0123"
    c = cfg(hmac_key=key)
    rx = DecodeReceiver(c, pipeline(), context=zctx).start()
    tx = PrefillSender(c, context=zctx, name="signed").connect(rx.address)
    try:
        tx.send(make(rid="signed"))
        assert isinstance(collect_outcomes(rx, 1)[0], Delivery)
        attacker = zctx.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(rx.address)
        frames = inline_frames(make(rid="injected"))
        attacker.send_multipart(frames)  # unsigned
        attacker.send_multipart([*frames, *Signer(b"wrong-key-wrong-key").sign(frames, bytes(16), 0, b"P")])  # forged
        # Replaying the signed sender's payload under an unsigned hello does not help either.
        outs = collect_outcomes(rx, 2)
        for o in outs:
            assert isinstance(o, Failure) and o.key == "wire:hmac" and o.request_id is None
            assert "missing or invalid HMAC signature" in o.reason
        assert attacker.poll(2000)
        reply = msgspec.msgpack.decode(attacker.recv_multipart()[0])
        assert reply["kind"] == "error" and reply["code"] == "hmac"
        s = reconcile(rx)
        assert s["delivered"] == 1 and s["failed_by_reason"] == {"wire:hmac": 2}
        attacker.close(0)
        # Negative control: the same key on a plain (unsigned) sender cannot even connect.
        with pytest.raises(TransferError, match="no slot grant"):
            PrefillSender(cfg(connect_timeout_s=0.5), context=zctx, name="plain").connect(rx.address)
    finally:
        tx.close()
        rx.stop()


LIVE_FUZZ_SEED = 7


def test_live_fuzz_rejects_and_keeps_serving(zctx) -> None:
    """Mutated messages through a live socket: each accounted for, the receiver unharmed."""
    rng = random.Random(LIVE_FUZZ_SEED)
    rx = DecodeReceiver(cfg(peer_timeout_s=30.0), pipeline(), context=zctx).start()
    sock = _raw_peer(zctx, rx.address)
    try:
        corpus = [
            inline_frames(make(s, hd, prop, rid=f"f{s}{hd}{prop}"))
            for s in (1, 2)
            for hd in ("bf16", "fp32")
            for prop in (None, "dense", "sparse")
        ]
        n = 1000
        kinds = []
        for _ in range(n):
            frames = mutations(rng, rng.choice(corpus))
            try:  # what the receiver should conclude, computed offline
                msg = wire.decode_frame(frames[0], rx.config.limits)
                kinds.append(type(msg).__name__)
            except Exception:
                kinds.append("bad")
            sock.send_multipart(frames)
        expected = sum(k in ("PayloadHeader", "bad") for k in kinds)
        got = collect_outcomes(rx, expected, timeout=20.0)
        for o in got:
            if isinstance(o, Failure):
                assert o.stage == "wire" and o.field, o
            else:
                o.release()
        s = reconcile(rx)
        assert s["received"] == expected, (s, LIVE_FUZZ_SEED)
        # Still serving: a clean payload from a clean sender is delivered.
        tx = PrefillSender(cfg(), context=zctx, name="clean").connect(rx.address)
        tx.send(make(rid="clean"))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            o = rx.get(timeout=0.2)
            if o is not None and o.request_id == "clean":
                break
        assert isinstance(o, Delivery) and o.request_id == "clean"
        tx.close()
    finally:
        sock.close(0)
        rx.stop()


def test_payload_before_hello_is_rejected(zctx) -> None:
    rx = DecodeReceiver(cfg(), pipeline(), context=zctx).start()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rx.address)
    try:
        sock.send_multipart(inline_frames(make(rid="early")))
        (out,) = collect_outcomes(rx, 1)
        # Unauthenticated: it names no request (a keyed store must not let it fail "early").
        assert isinstance(out, Failure) and out.key == "wire:peer" and out.request_id is None
        assert "unknown peer: send hello first" in out.reason and "'early'" in out.reason
    finally:
        sock.close(0)
        rx.stop()


def test_metrics_export_prometheus(zctx) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    pipe = pipeline()
    registry = prometheus_client.CollectorRegistry()
    pipe.metrics.register_prometheus(registry)
    rx = DecodeReceiver(cfg(), pipe, context=zctx).start()
    tx = PrefillSender(cfg(), context=zctx, name="p").connect(rx.address)
    try:
        tx.send(make())
        collect_outcomes(rx, 1)
        text = prometheus_client.generate_latest(registry).decode()
        assert 'pd_middleware_received_bytes_total{plane="inline"} 128.0' in text
        assert "pd_middleware_payloads_delivered_total" in text
    finally:
        tx.close()
        rx.stop()


def test_config_values_and_secret_from_env(monkeypatch) -> None:
    from pd_middleware import ConfigError
    from pd_middleware.core._errors import OptionValueError

    with pytest.raises(OptionValueError, match="port: must be in"):
        TransportConfig(port=70000)
    with pytest.raises(OptionValueError, match=r"peer_timeout_s: must be in \[2 x heartbeat_s = 1, 3600\]"):
        TransportConfig(heartbeat_s=0.5, peer_timeout_s=0.9)
    with pytest.raises(OptionValueError, match="hmac_key: must be at least 16 characters"):
        TransportConfig(hmac_key="short")
    c = TransportConfig(hmac_key_env="PD_TEST_TRANSPORT_KEY")
    monkeypatch.delenv("PD_TEST_TRANSPORT_KEY", raising=False)
    with pytest.raises(ConfigError) as info:
        c.secret()  # a missing secret must not silently turn signing off
    assert info.value.path == "transport.hmac_key_env" and "is unset or shorter than 16" in str(info.value)
    monkeypatch.setenv("PD_TEST_TRANSPORT_KEY", "k" * 20)
    assert c.secret() == b"k" * 20
    assert TransportConfig().secret() is None


def test_open_receiver_and_sender_close_the_engines_they_open(zctx) -> None:
    from pd_middleware.transport import open_receiver, open_sender

    c = cfg(slots=small_slots())
    rx = open_receiver(c, pipeline(), context=zctx)
    tx = open_sender(c, rx.address, name="owner", context=zctx)
    assert rx.engine is not None and not rx.engine.closed
    assert tx.engine is not None and not tx.engine.closed
    tx.close()
    rx.stop()
    assert tx.engine.closed and rx.engine.closed
