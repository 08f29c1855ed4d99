"""The decode receiver against hostile and unusual input, over real sockets on loopback.

- No message stops the loop: a 1 KB frame nested 1000 deep is ``wire:nesting``, an
  exception no check foresaw is ``receiver:internal``, and the next payload is delivered.
- If the loop dies anyway, ``get``/``drain`` raise, ``healthy`` and the metric say so.
- Identity: ``expect(rid, peer)`` is enforced (``wire:peer``), and a request id stays its
  sender's after the expectation was consumed; a request id the same peer has
  outstanding is ``wire:duplicate``; neither refusal names the request id, and
  ``Delivery.peer`` names the sender.
- Memory: the outcome queue and inline bytes held until release are bounded by
  backpressure, with nothing dropped; RCVHWM defaults to the inline cap over the tensor
  cap; the hidden state's width and dtype are checked against the config.
- Acks: split under ``max_message_bytes``; ``ack = "consumed"`` acks a delivery only
  once it was released.
Every test has a negative control showing it can fail.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from _helpers import OneHot, inline_frames  # tests/ is on sys.path (no __init__.py)
from _transport_peer import collect_outcomes  # tests/ is on sys.path (no __init__.py)

from pd_middleware import Payload, Provenance, TransferError
from pd_middleware.decode.pipeline import Delivery, Failure, ReceivePipeline
from pd_middleware.transport import DecodeReceiver, LimitsConfig, PrefillSender, TransportConfig, payload_codec, wire
from pd_middleware.transport.nesting import MAX_DEPTH, nesting_depth

NESTED = b"\x91" * 1000 + b"\x01"  # [[[...1...]]], 1001 bytes


def cfg(**kw) -> TransportConfig:
    base: dict = dict(heartbeat_s=0.05, peer_timeout_s=5.0)
    base.update(kw)
    return TransportConfig(**base)


def receiver(zctx, **kw) -> DecodeReceiver:
    return DecodeReceiver(cfg(**kw), ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx).start()


def make(rid: str, hidden: int = 128) -> Payload:
    return Payload(
        rid, (3,), (0.5,), 100, hidden=bytes(hidden), hidden_dtype="bf16", provenance=Provenance("sampled", 1.0, None)
    )


def raw_peer(ctx: zmq.Context, address: str, name: str = "raw") -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    s.send_multipart([wire.encode(wire.Hello(name=name, want_slots=0))])
    assert s.poll(5000), "no grant"
    s.recv_multipart()
    return s


# ---- the loop survives any message ----------------------------------------------------


def test_nested_frame_is_a_counted_wire_nesting_failure(zctx) -> None:
    # Negative control: this frame is the one that raised RecursionError from an untyped decode.
    with pytest.raises(RecursionError):
        msgspec.msgpack.decode(NESTED)
    assert nesting_depth(NESTED) == MAX_DEPTH + 1 and nesting_depth(inline_frames(make("x"))[0]) <= 4
    rx = receiver(zctx)
    try:
        s = raw_peer(zctx, rx.address)
        for _ in range(3):
            s.send_multipart([NESTED])
            s.send_multipart([b"\x81\xa4kind" + b"\x81\xa1a" * 2000 + b"\x01"])  # nested maps under a key
        s.send_multipart(inline_frames(make("after")))
        outs = collect_outcomes(rx, 7)
        assert [o.key for o in outs[:6]] == ["wire:nesting"] * 6
        assert isinstance(outs[6], Delivery) and outs[6].request_id == "after"
        assert rx.healthy and rx.metrics.snapshot()["receiver_alive"] == 1
    finally:
        rx.stop()


def test_unforeseen_exception_fails_one_message_not_the_loop(zctx, monkeypatch) -> None:
    rx = receiver(zctx)
    real = payload_codec.payload_from_header
    calls = {"n": 0}

    def flaky(h, *a, **kw):
        calls["n"] += 1
        if h.request_id == "boom":
            raise RuntimeError("a bug no check foresaw")
        return real(h, *a, **kw)

    monkeypatch.setattr(payload_codec, "payload_from_header", flaky)
    try:
        s = raw_peer(zctx, rx.address)
        s.send_multipart(inline_frames(make("boom")))
        s.send_multipart(inline_frames(make("fine"), seq=1))
        a, b = collect_outcomes(rx, 2)
        assert isinstance(a, Failure) and a.key == "receiver:internal" and "RuntimeError" in a.reason
        assert isinstance(b, Delivery) and b.request_id == "fine"  # negative control: the loop went on
        assert calls["n"] == 2 and rx.metrics.snapshot()["failed_by_reason"] == {"receiver:internal": 1}
    finally:
        rx.stop()


def test_a_message_cut_short_in_libzmq_fails_alone(zctx, monkeypatch) -> None:
    """libzmq delivers a message whole, so after its routing id the rest is always there. If
    reading the rest ever raised anyway, that message fails as ``receiver:internal`` and the
    loop goes on. Stand-in: the receive thread's first frame read after the routing id of
    the message "cut" raises ``zmq.Again`` (libzmq never does)."""
    import threading

    real = zmq.Socket.recv
    armed = {"on": False}

    def recv(self, flags=0, copy=True, track=False):
        if armed["on"] and not copy and threading.current_thread().name == "pd-decode-receiver":
            armed["on"] = False
            raise zmq.Again()
        return real(self, flags, copy=copy, track=track)

    monkeypatch.setattr(zmq.Socket, "recv", recv)  # before the loop binds sock.recv
    rx = receiver(zctx)
    try:
        s = raw_peer(zctx, rx.address)
        armed["on"] = True  # after the hello
        s.send_multipart(inline_frames(make("cut")))
        s.send_multipart(inline_frames(make("whole"), seq=1))
        a, b = collect_outcomes(rx, 2)
        assert isinstance(a, Failure) and a.key == "receiver:internal" and "Again" in a.reason
        assert isinstance(b, Delivery) and b.request_id == "whole"  # negative control: the loop went on
        assert rx.healthy
    finally:
        monkeypatch.undo()
        rx.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop re-raises, by design
def test_a_dead_loop_is_reported_at_once(zctx, monkeypatch) -> None:
    rx = receiver(zctx)
    try:
        assert rx.healthy and rx.metrics.receiver_alive == 1 and rx.get(timeout=0.05) is None  # control
        tx = PrefillSender(cfg(), context=zctx, name="p").connect(rx.address)
        tx.send(make("queued"))
        (first,) = collect_outcomes(rx, 1)
        assert first.request_id == "queued"

        def broken(now: float) -> None:
            raise MemoryError("simulated: outside any one message")

        monkeypatch.setattr(rx, "_tick", broken)
        deadline = time.monotonic() + 5
        while rx.healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not rx.healthy and rx.metrics.snapshot()["receiver_alive"] == 0 and rx.metrics.receiver_deaths == 1
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="receive loop stopped: MemoryError"):
            rx.get(timeout=60.0)
        waited = time.monotonic() - t0
        print(f"\ndead loop: get() raised after {1e3 * waited:.1f} ms")
        # At once, not after the timeout: only a get() that waits it out crosses half of it.
        assert waited < 30.0, f"get() raised after {waited:.1f} s: it waited for its timeout"
        with pytest.raises(TransferError):
            rx.drain()
        tx.close()
    finally:
        rx._thread = None  # already ended; nothing left to join
        rx.stop()


# ---- identity ---------------------------------------------------------------------------


def test_expect_with_peer_is_enforced_and_delivery_names_the_peer(zctx) -> None:
    rx = receiver(zctx)
    a = PrefillSender(cfg(), context=zctx, name="alice").connect(rx.address)
    b = PrefillSender(cfg(), context=zctx, name="bob").connect(rx.address)
    try:
        rx.expect("r1", peer="alice")
        time.sleep(0.05)
        b.send(make("r1"))  # the wrong peer
        (bad,) = collect_outcomes(rx, 1)
        assert isinstance(bad, Failure) and bad.key == "wire:peer" and "'alice'" in bad.reason
        a.send(make("r1"))  # still expected: the right peer delivers it
        b.send(make("r2"))  # negative control: not expected from anyone, so bob may deliver it
        got = {o.request_id: o for o in collect_outcomes(rx, 2)}
        assert isinstance(got["r1"], Delivery) and got["r1"].peer == "alice"
        assert isinstance(got["r2"], Delivery) and got["r2"].peer == "bob"
        assert a.flush(5) and b.flush(5)
        assert b.statuses()["failed_by_reason"] == {"wire:peer": 1}
    finally:
        a.close()
        b.close()
        rx.stop()


def test_outstanding_request_id_from_the_same_peer_is_a_duplicate(zctx) -> None:
    rx = receiver(zctx)
    s = raw_peer(zctx, rx.address, "p")
    t = raw_peer(zctx, rx.address, "q")
    try:
        s.send_multipart(inline_frames(make("r"), 0))
        s.send_multipart(inline_frames(make("r"), 1))  # again while the first is outstanding
        first, dup = collect_outcomes(rx, 2)
        t.send_multipart(inline_frames(make("r"), 0))  # another peer: the id is p's, refused
        (other,) = collect_outcomes(rx, 1)
        assert isinstance(first, Delivery) and dup.key == "wire:duplicate" and other.key == "wire:peer"
        # Neither refusal names the request: a store keyed by id must keep the Delivery.
        assert dup.request_id is None and other.request_id is None and (dup.peer, other.peer) == ("p", "q")
        first.release()
        time.sleep(0.1)  # the loop applies the release
        s.send_multipart(inline_frames(make("r"), 2))  # negative control: released, so it may come again
        (again,) = collect_outcomes(rx, 1)
        assert isinstance(again, Delivery)
    finally:
        rx.stop()


def test_request_id_owned_by_another_peer_is_refused_after_expect_was_consumed(zctx) -> None:
    rx = receiver(zctx)
    p = raw_peer(zctx, rx.address, "p")
    q = raw_peer(zctx, rx.address, "q")
    stranger = zctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(rx.address)
    try:
        rx.expect("r", peer="p")
        time.sleep(0.05)
        p.send_multipart(inline_frames(make("r"), 0))
        (d,) = collect_outcomes(rx, 1)
        assert isinstance(d, Delivery) and d.peer == "p"
        d.release()  # released and the expectation consumed: the id is still p's
        time.sleep(0.05)
        q.send_multipart(inline_frames(make("r"), 0))
        bad = msgspec.structs.replace(wire.INBOUND_DECODER.decode(inline_frames(make("r"), 1)[0]), draft_tokens=(500,))
        q.send_multipart([wire.encode(bad)])  # a malformed header naming p's request
        stranger.send_multipart(inline_frames(make("r"), 0))  # no hello: unknown peer
        got = collect_outcomes(rx, 3)
        assert [o.key for o in got] == ["wire:peer"] * 3  # the owner check runs before the header's
        assert all(isinstance(o, Failure) and o.request_id is None and "'r'" in o.reason for o in got)
        assert rx.metrics.failed["wire:peer"] == 3
        # Negative controls: q's own id is delivered, q's own malformed header names its id,
        # and p may send "r" again.
        q.send_multipart(inline_frames(make("mine"), 2))
        own_bad = msgspec.structs.replace(
            wire.INBOUND_DECODER.decode(inline_frames(make("mine2"), 3)[0]), draft_tokens=(500,)
        )
        q.send_multipart([wire.encode(own_bad)])
        p.send_multipart(inline_frames(make("r"), 1))
        got = {(o.request_id, type(o).__name__) for o in collect_outcomes(rx, 3)}
        assert got == {("mine", "Delivery"), ("mine2", "Failure"), ("r", "Delivery")}
    finally:
        stranger.close(0)
        rx.stop()


# ---- acks -------------------------------------------------------------------------------


def test_split_ack_stays_under_the_frame_cap_and_loses_nothing() -> None:
    from pd_middleware.transport.peers import REASON_CAP, split_ack

    freed = list(range(300))
    delivered = list(range(1 << 40, (1 << 40) + 700))  # 9-byte ints
    failed = [(i, "hook:" + "k" * 200, ("é" if i % 2 else "x") * 5000) for i in range(300)]
    for cap in (1024, 4096, 64 * 1024):
        acks = split_ack(freed, delivered, failed, cap)
        assert all(len(wire.encode(a)) <= cap for a in acks)
        assert [s for a in acks for s in a.freed] == freed and [s for a in acks for s in a.delivered] == delivered
        got = [f for a in acks for f in a.failed]
        assert [f[0] for f in got] == [f[0] for f in failed] and max(len(f[2]) for f in got) == REASON_CAP
    # Negative control: one ack of everything (what flush sent before) is far over the cap.
    (one,) = split_ack(freed, delivered, failed, 1 << 30)
    assert len(wire.encode(one)) > 64 * 1024


def test_many_long_failure_reasons_reach_the_prefill(zctx) -> None:
    class Loud:
        def on_receive(self, payload, ctx):
            raise ValueError("policy rejected this request: " + "x" * 400)

    pipe = ReceivePipeline([("loud", Loud())], {"default": ("one_hot", OneHot())})
    rx = DecodeReceiver(cfg(), pipe, context=zctx).start()
    tx = PrefillSender(cfg(), context=zctx, name="A").connect(rx.address)
    try:
        for i in range(400):  # ~190 KB of reasons: one ack would pass the 64 KiB frame cap
            tx.send(make(f"r{i}"))
        assert tx.flush(10.0), tx.statuses()
        st = tx.statuses()
        assert st["failed_by_reason"] == {"hook:loud": 400} and st["connected"]
        tx.send(make("ok"))  # negative control: the same connection still carries outcomes
        assert tx.flush(5.0) and tx.statuses()["failed"] == 401
    finally:
        tx.close()
        rx.stop()


# ---- memory -----------------------------------------------------------------------------


def test_hidden_size_and_dtype_checked_against_config(zctx) -> None:
    rx = receiver(zctx, limits=LimitsConfig(hidden_size=64, hidden_dtype="bf16"))
    try:
        s = raw_peer(zctx, rx.address)
        s.send_multipart(inline_frames(make("wide", hidden=16 * 1024 * 1024 // 64)))  # 128K elements
        fp32 = Payload(
            "fp32",
            (3,),
            (0.5,),
            100,
            hidden=bytes(256),
            hidden_dtype="fp32",
            provenance=Provenance("sampled", 1.0, None),
        )
        s.send_multipart(inline_frames(fp32, 1))
        s.send_multipart(inline_frames(make("ok", hidden=128), 2))  # 64 bf16 elements: the control
        # No hidden state at all (SGLang's side channel: the engine carries it) is not a wrong one.
        bare = Payload("bare", (3,), (0.5,), 100, hidden_dtype="fp32", provenance=Provenance("sampled", 1.0, None))
        s.send_multipart(inline_frames(bare, 3))
        wide, dt, ok, none = collect_outcomes(rx, 4)
        assert wide.key == "wire:hidden.shape" and dt.key == "wire:hidden_dtype" and isinstance(ok, Delivery)
        assert isinstance(none, Delivery) and none.payload.hidden == b""
    finally:
        rx.stop()


@pytest.mark.parametrize("limit", ["outcomes", "bytes"])
def test_backpressure_bounds_the_queue_and_drops_nothing(zctx, limit: str) -> None:
    n, size = 60, 16 * 1024
    lim = LimitsConfig(max_queued_outcomes=8) if limit == "outcomes" else LimitsConfig(max_queued_inline_bytes=1 << 16)
    rx = receiver(zctx, limits=lim, peer_timeout_s=0.5, heartbeat_s=0.1)
    tx = PrefillSender(cfg(peer_timeout_s=0.5, heartbeat_s=0.1), context=zctx, name="p").connect(rx.address)
    try:
        for i in range(n):
            tx.send(make(f"r{i}", hidden=size))
        time.sleep(1.0)  # the scheduler is stalled past peer_timeout_s
        queued = len(rx._queue.items)
        held = rx._queue.bytes_in - rx._queue.bytes_out
        if limit == "outcomes":
            assert queued <= 8
        else:
            assert held <= (1 << 16) + size
        assert queued < n  # negative control: without backpressure all n would be queued
        got = []
        deadline = time.monotonic() + 20
        while len(got) < n and time.monotonic() < deadline:
            o = rx.get(timeout=0.1)
            if o is not None:
                got.append(o)
                o.release()  # inline bytes count against the cap until released
        assert [o.request_id for o in got] == [f"r{i}" for i in range(n)]
        assert all(isinstance(o, Delivery) for o in got) and rx.peers == {"p": 0}  # not dropped as silent
        assert tx.flush(5) and tx.statuses()["delivered"] == n
    finally:
        tx.close()
        rx.stop()


# ---- acks -------------------------------------------------------------------------------


def test_receive_hwm_defaults_to_the_inline_cap_over_the_tensor_cap(zctx) -> None:
    lim = LimitsConfig(max_queued_inline_bytes=8 << 20, max_tensor_bytes=1 << 20)
    rx = receiver(zctx, limits=lim)
    set_rx = receiver(zctx, limits=lim, hwm=1000)  # negative control: a set hwm is kept
    try:
        assert rx._sock.getsockopt(zmq.RCVHWM) == 8 and rx._sock.getsockopt(zmq.SNDHWM) == 100_000
        assert set_rx._sock.getsockopt(zmq.RCVHWM) == 1000
        assert cfg(limits=LimitsConfig(max_queued_inline_bytes=1 << 16)).recv_hwm() == 1  # at least one
    finally:
        rx.stop()
        set_rx.stop()


def test_inline_bytes_count_until_release_not_until_take(zctx) -> None:
    """A consumer that takes outcomes and keeps them (SGLang's ProposalStore) stays under
    max_queued_inline_bytes: the loop stops reading until something is released."""
    n, size, cap = 40, 16 * 1024, 1 << 16
    rx = receiver(zctx, limits=LimitsConfig(max_queued_inline_bytes=cap), peer_timeout_s=5.0)
    tx = PrefillSender(cfg(), context=zctx, name="p").connect(rx.address)
    kept: list = []
    try:
        for i in range(n):
            tx.send(make(f"r{i}", hidden=size))
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # take everything, release nothing
            kept += rx.drain()
            time.sleep(0.02)
        held = sum(len(d.payload.hidden) for d in kept)
        assert 0 < len(kept) < n and held <= cap + size, (len(kept), held)
        for d in kept:  # negative control: releasing lets the rest in
            d.release()
        deadline = time.monotonic() + 10
        while len(kept) < n and time.monotonic() < deadline:
            for d in rx.drain():
                kept.append(d)
                d.release()
            time.sleep(0.02)
        assert sorted(d.request_id for d in kept) == sorted(f"r{i}" for i in range(n))
        assert all(isinstance(d, Delivery) for d in kept)
    finally:
        tx.close()
        rx.stop()


@pytest.mark.parametrize("mode", ["queued", "consumed"])
def test_consumed_acks_wait_for_release(zctx, mode: str) -> None:
    rx = receiver(zctx, ack=mode)
    tx = PrefillSender(cfg(), context=zctx, name="p").connect(rx.address)
    try:
        tx.send(make("r"))
        (d,) = collect_outcomes(rx, 1)
        flushed = tx.flush(0.3)
        if mode == "queued":
            assert flushed and tx.statuses()["delivered"] == 1  # the control: acked once queued
        else:
            assert not flushed and tx.statuses()["outstanding"] == 1  # used by nobody yet
            d.release()
            assert tx.flush(5) and tx.statuses()["delivered"] == 1
    finally:
        tx.close()
        rx.stop()


def test_poll_timeouts_round_up_so_the_loop_never_spins() -> None:
    """pyzmq truncates a float ``poll`` timeout to whole milliseconds: a wait under 1 ms was a
    0 ms poll, and the receive loop spun through the last millisecond of every ack interval
    and tick (the bulk benchmark's decode used a quarter of a core on it)."""
    from pd_middleware.transport.sockets import poll_ms

    assert [poll_ms(s) for s in (0.0, -0.5, 1e-6, 0.0004, 0.001, 0.0011, 0.05)] == [0, 0, 1, 1, 1, 2, 50]


def test_an_idle_receiver_holding_a_delivery_does_not_spin(zctx, monkeypatch) -> None:
    """A held delivery makes the loop look for releases every ack interval and tick every
    50 ms. Counted over 0.5 s idle: polls that returned at once with nothing to do. With
    the timeout truncated (the negative control) they number in the thousands."""
    from pd_middleware.transport import receiver as receiver_module

    def count(truncate: bool) -> int:
        empty = 0
        real = zmq.Poller.poll

        def poll(self, timeout=None):
            nonlocal empty
            t = int(timeout) if truncate and timeout is not None else timeout
            got = real(self, t)
            empty += not got and t == 0
            return got

        monkeypatch.setattr(zmq.Poller, "poll", poll)
        if truncate:  # the old call: seconds * 1000.0, truncated by pyzmq
            monkeypatch.setattr(receiver_module, "poll_ms", lambda s: max(0.0, s) * 1000.0)
        rx = receiver(zctx)
        tx = PrefillSender(rx.config, context=zctx, name="idle").connect(rx.address)
        try:
            tx.send(make("held"))
            (held,) = collect_outcomes(rx, 1, timeout=5.0)
            assert isinstance(held, Delivery)
            empty = 0
            time.sleep(0.5)
            spins = empty
            held.release()
        finally:
            tx.close()
            rx.stop()
            monkeypatch.undo()
        return spins

    fixed, truncated = count(truncate=False), count(truncate=True)
    print(f"empty zero-timeout polls in 0.5 s: {fixed} rounded up, {truncated} truncated")
    assert fixed < 50
    assert truncated > 500  # negative control: the truncated timeout spins


def test_inline_tensors_arrive_as_read_only_views_of_the_received_frame(zctx) -> None:
    """Inline tensor frames are not copied out of libzmq's buffer: the hidden state is a
    read-only memoryview with the bytes sent, still valid after release (only slots are
    reused). A view that could be written would let a hook change the frame under others."""
    rx = receiver(zctx)
    tx = PrefillSender(rx.config, context=zctx, name="views").connect(rx.address)
    try:
        hidden = bytes(range(256))
        sent = Payload("view", (3,), (0.5,), 100, hidden=hidden, hidden_dtype="bf16")
        tx.send(sent)
        (out,) = collect_outcomes(rx, 1, timeout=5.0)
        assert isinstance(out, Delivery)
        got = out.payload.hidden
        assert isinstance(got, memoryview) and got.readonly
        assert bytes(got) == hidden
        with pytest.raises(TypeError):
            got[0] = 1  # type: ignore[index]
        out.release()
        assert bytes(got) == hidden
    finally:
        tx.close()
        rx.stop()
