"""The pipelined bulk path: writes in flight, headers sent once the bytes landed, and
what a write that fails after ``send`` returned does. Real ZMQ sockets and real Mooncake
engines on loopback; every wait is bounded.
"""

from __future__ import annotations

import time

import pytest
from _helpers import OneHot  # tests/ is on sys.path (no __init__.py)
from _transport_peer import collect_outcomes, make_payload  # tests/ is on sys.path (no __init__.py)

from pd_middleware import Payload, TransferAbandoned, TransferError
from pd_middleware.decode.pipeline import Delivery, ReceivePipeline
from pd_middleware.transport import DecodeReceiver, MooncakeConfig, PrefillSender, SlotsConfig, TransportConfig


def cfg(inflight: int, per_peer: int = 32) -> TransportConfig:
    return TransportConfig(
        heartbeat_s=0.05,
        peer_timeout_s=2.0,
        inline_threshold_bytes=0,  # every payload through a Mooncake slot
        slots=SlotsConfig(count=64, size_bytes=64 * 1024, per_peer=per_peer, wait_s=2.0),
        mooncake=MooncakeConfig(max_inflight_writes=inflight),
    )


def _pair(inflight: int, zctx, mooncake_pair) -> tuple[DecodeReceiver, PrefillSender]:
    decode_engine, prefill_engine = mooncake_pair
    c = cfg(inflight)
    rx = DecodeReceiver(
        c, ReceivePipeline([], {"default": ("one_hot", OneHot())}), engine=decode_engine, context=zctx
    ).start()
    tx = PrefillSender(c, engine=prefill_engine, context=zctx, name="pipelined").connect(rx.address)
    return rx, tx


def test_idle_sender_still_delivers(zctx, mooncake_pair) -> None:
    """One send and then nothing: the background thread sends the header once the write lands."""
    rx, tx = _pair(8, zctx, mooncake_pair)
    try:
        p = make_payload("idle", 1)
        tx.send(p)
        (out,) = collect_outcomes(rx, 1, timeout=5.0)
        assert isinstance(out, Delivery) and out.payload.request_id == p.request_id
        assert bytes(out.payload.hidden) == bytes(p.hidden)
        out.release()
        deadline = time.monotonic() + 5.0
        while tx.writes_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tx.writes_in_flight == 0
    finally:
        tx.close()
        rx.stop()


def test_bulk_bytes_are_counted_when_sent(zctx, mooncake_pair) -> None:
    """Per-caller accounting (the A/B job diffs statuses() around each arm's sends) must
    see a payload's bulk bytes when send returns, not when its write lands later."""
    from pd_middleware.transport import payload_codec

    rx, tx = _pair(8, zctx, mooncake_pair)
    try:
        for i in range(6):
            p = make_payload("bytes", i)
            before = tx.statuses()["bytes_by_plane"]["bulk"]
            tx.send(p)
            assert tx.statuses()["bytes_by_plane"]["bulk"] - before == payload_codec.bulk_bytes(p)
        assert tx.flush(5.0)
        for o in collect_outcomes(rx, 6, timeout=5.0):
            o.release()
    finally:
        tx.close()
        rx.stop()


def test_close_finishes_writes_in_flight(zctx, mooncake_pair) -> None:
    """close() right after a burst of sends: every payload is still delivered, bit-exact."""
    rx, tx = _pair(8, zctx, mooncake_pair)
    sent = [make_payload("burst", i) for i in range(24)]
    try:
        for p in sent:
            tx.send(p)
        tx.close()
        outs = collect_outcomes(rx, len(sent), timeout=10.0)
        got = {o.payload.request_id: o for o in outs}
        assert all(isinstance(o, Delivery) for o in outs)
        for p in sent:
            assert bytes(got[p.request_id].payload.hidden) == bytes(p.hidden)
        for o in outs:
            o.release()
    finally:
        tx.close()
        rx.stop()


@pytest.mark.parametrize("inflight", [1, 8])
def test_write_failure_fails_the_request_then_refuses_until_reconnect(inflight, zctx, mooncake_pair) -> None:
    """The decode's slot memory is unregistered under a live connection, so the next write is
    rejected by the decode's engine. With max_inflight_writes = 1 that send raises; when
    pipelined, send returns, the request fails with ``transfer:write`` and the next send
    raises the write's error. Either way the counters reconcile and a reconnect recovers."""
    decode_engine, _ = mooncake_pair
    rx, tx = _pair(inflight, zctx, mooncake_pair)
    pool = rx._pool
    try:
        tx.send(make_payload("ok", 0))
        assert tx.flush(5.0)
        decode_engine.unregister(rx._pool_addr)
        try:
            if inflight == 1:
                with pytest.raises(TransferError) as info:
                    tx.send(make_payload("bad", 1))
                assert tx.statuses()["sent"] == 1  # the refused payload was not sent
            else:
                tx.send(make_payload("bad", 1))  # returns: the write is in flight
                assert tx.flush(5.0)  # every request has a status: this one failed
                st = tx.statuses()
                assert st["failed_by_reason"] == {"transfer:write": 1} and st["writes_in_flight"] == 0
                assert st["connected"] is False  # a failed write loses the decode until reconnect()
                rid, key, reason = tx.failures()[-1]
                assert (rid, key) == (make_payload("bad", 1).request_id, "transfer:write")
                assert "transfer_check_status" in reason
                with pytest.raises(TransferError) as info:
                    tx.send(make_payload("refused", 2))
                assert "call reconnect()" in str(info.value)
            assert info.value.op == "transfer_check_status" and info.value.code == -1
            assert info.value.peer == decode_engine.peer_name
        finally:
            assert decode_engine.register(pool.buffer) == rx._pool_addr
        st = tx.statuses()
        assert st["sent"] == st["delivered"] + st["failed"] + st["outstanding"]
        tx.reconnect()
        tx.send(make_payload("after", 3))
        assert tx.flush(5.0)
        outs = collect_outcomes(rx, 2, timeout=5.0)  # "ok" and "after": the decode never saw the rest
        assert [o.payload.request_id for o in outs] == [
            make_payload("ok", 0).request_id,
            make_payload("after", 3).request_id,
        ]
        for o in outs:
            o.release()
        st = tx.statuses()
        assert st["delivered"] == 2 and st["sent"] == st["delivered"] + st["failed"] + st["outstanding"]
    finally:
        tx.close()
        rx.stop()


@pytest.mark.parametrize("inflight", [1, 8])
def test_a_write_given_up_on_retires_its_slot(inflight, zctx, mooncake_pair, monkeypatch) -> None:
    """A write that never reports done is given up after write_timeout_s. It may still land,
    so its slot must not be reused and the sender must not send again before a reconnect.
    Stand-in: the prefill engine's status poll is made to say "running" forever."""
    _, prefill_engine = mooncake_pair
    rx, tx = _pair(inflight, zctx, mooncake_pair)
    try:
        tx.send(make_payload("ok", 0))
        assert tx.flush(5.0)
        free_before = tx.statuses()["free_slots"]
        monkeypatch.setattr(prefill_engine, "write_timeout_s", 0.2)
        monkeypatch.setattr(prefill_engine, "poll_write", lambda peer, bids: (list(bids), None))
        if inflight == 1:
            with pytest.raises(TransferAbandoned) as info:
                tx.send(make_payload("stuck", 1))
            assert info.value.op == "transfer_check_status" and "write_timeout_s" in str(info.value)
        else:
            tx.send(make_payload("stuck", 1))
            deadline = time.monotonic() + 5.0
            while tx.statuses()["writes_in_flight"] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert tx.statuses()["failed_by_reason"] == {"transfer:write": 1}
        st = tx.statuses()
        assert st["connected"] is False and st["free_slots"] == free_before - 1  # retired, not reused
        with pytest.raises(TransferError, match="call reconnect"):
            tx.send(make_payload("refused", 2))
        monkeypatch.undo()
        tx.reconnect()
        tx.send(make_payload("after", 3))
        assert tx.flush(5.0)
        assert tx.statuses()["delivered"] == 2
    finally:
        monkeypatch.undo()
        tx.close()
        rx.stop()
        for o in rx.drain():
            o.release()


@pytest.mark.parametrize("inflight", [1, 8])
def test_a_payload_that_cannot_be_staged_leaks_nothing(inflight, zctx, mooncake_pair) -> None:
    """A tensor view that cannot be cast to bytes (not contiguous) fails its send with the
    error; its slot and staging region go back, so more such sends than there are regions
    leave the sender working."""
    import numpy as np

    from pd_middleware import DenseEncoding

    rx, tx = _pair(inflight, zctx, mooncake_pair)
    vocab = 64
    strided = memoryview(np.arange(2 * vocab, dtype=np.float32)[::2])
    bad = Payload("strided", (3,), (0.5,), vocab, hidden=b"\0" * 64, proposal=DenseEncoding("fp32", strided))
    try:
        for _ in range(inflight + 3):
            with pytest.raises((TypeError, ValueError)):
                tx.send(bad)
        st = tx.statuses()
        assert st["sent"] == 0 and st["free_slots"] == 32
        p = make_payload("good", 0)
        tx.send(p)
        (out,) = collect_outcomes(rx, 1, timeout=5.0)
        assert isinstance(out, Delivery) and out.payload.request_id == p.request_id
        out.release()
    finally:
        tx.close()
        rx.stop()


def test_writes_are_polled_oldest_first_and_stop_at_one_still_running(zctx, mooncake_pair, monkeypatch) -> None:
    """A pass polls the oldest write first and stops at the first one still running (writes to
    one decode land in order), so a burst costs one status call per landed write, not one
    per write in flight per pass; once the oldest lands, every header goes out in order.
    Stand-in: the prefill engine's status poll says "running" for the first write until
    released, and records which writes it was asked about."""
    _, prefill_engine = mooncake_pair
    rx, tx = _pair(8, zctx, mooncake_pair)
    real = prefill_engine.poll_write
    asked: list[tuple[int, ...]] = []
    hold: dict[str, object] = {"bids": None, "on": True}

    def poll(peer, bids):
        asked.append(tuple(bids))
        if hold["bids"] is None:
            hold["bids"] = tuple(bids)
        if hold["on"] and tuple(bids) == hold["bids"]:
            return list(bids), None
        return real(peer, bids)

    try:
        monkeypatch.setattr(prefill_engine, "poll_write", poll)
        for i in range(4):
            tx.send(make_payload(f"burst-{i}", i))
        time.sleep(0.05)  # the others have landed by now; their headers must wait for the first
        assert tx.writes_in_flight == 4
        assert asked and set(asked) == {hold["bids"]}, "a write behind the oldest was polled"
        assert rx.drain() == []
        hold["on"] = False
        outs = collect_outcomes(rx, 4, timeout=5.0)
        assert [o.payload.request_id for o in outs] == [f"burst-{i}-{i}" for i in range(4)]  # type: ignore[union-attr]
        for o in outs:
            o.release()
        assert tx.flush(5.0) and tx.statuses()["delivered"] == 4
    finally:
        monkeypatch.undo()
        tx.close()
        rx.stop()
