"""The prefill sender's background thread against a hostile or broken decode.

A raw ROUTER plays the decode: it grants, then sends what a real decode never would.
- A 1 KB frame nested 1000 deep is counted (``wire:nesting``) and the sender stays up.
- If the background thread dies anyway, ``connected`` reads False at once and ``send``
  raises, instead of a sender that looks connected and never heartbeats again.
- ``close()`` waits (bounded) for the acks of what the decode received before its bye.
"""

from __future__ import annotations

import time

import pytest
import zmq

from pd_middleware import Payload, Provenance, TransferError
from pd_middleware.transport import PrefillSender, TransportConfig, wire

NESTED = b"\x91" * 1000 + b"\x01"


def cfg() -> TransportConfig:
    return TransportConfig(heartbeat_s=0.05, peer_timeout_s=5.0)


def fake_decode(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    return r, f"tcp://127.0.0.1:{port}"


def connect(ctx: zmq.Context, router: zmq.Socket, address: str) -> tuple[PrefillSender, bytes]:
    """A sender connected to the fake decode (which answers its hello with a grant)."""
    import threading

    tx = PrefillSender(cfg(), context=ctx, name="p")
    ident: list[bytes] = []

    def grant() -> None:
        assert router.poll(5000)
        frames = router.recv_multipart()
        ident.append(frames[0])
        g = wire.Grant(session="s", mooncake=None, slot_size=0, slots=(), addrs=(), heartbeat_s=0.05)
        router.send_multipart([frames[0], wire.encode(g)])

    t = threading.Thread(target=grant)
    t.start()
    tx.connect(address, timeout=5)
    t.join(5)
    return tx, ident[0]


def make(rid: str) -> Payload:
    return Payload(
        rid, (3,), (0.5,), 100, hidden=bytes(64), hidden_dtype="bf16", provenance=Provenance("sampled", 1.0, None)
    )


def test_nested_frame_from_the_decode_is_counted_and_the_sender_stays_up(zctx) -> None:
    router, address = fake_decode(zctx)
    tx, ident = connect(zctx, router, address)
    try:
        for _ in range(5):
            router.send_multipart([ident, NESTED])
        router.send_multipart([ident, wire.encode(wire.Heartbeat(session="s"))])
        deadline = time.monotonic() + 5
        while tx.statuses()["rejected_by_decode"].get("wire:nesting", 0) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        st = tx.statuses()
        assert st["rejected_by_decode"] == {"wire:nesting": 5}
        assert st["connected"] and tx._hb_thread is not None and tx._hb_thread.is_alive()
        tx.send(make("after"))  # negative control: it still sends (the fake decode gets it)
        assert router.poll(2000)
    finally:
        tx.close(timeout=0)  # the fake decode never acks: do not wait for it
        router.close(0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread re-raises, by design
def test_a_dead_background_thread_reads_disconnected(zctx, monkeypatch) -> None:
    router, address = fake_decode(zctx)
    tx, _ = connect(zctx, router, address)
    try:
        assert tx.connected  # control
        monkeypatch.setattr(tx, "_heartbeat_duties", lambda now: (_ for _ in ()).throw(RuntimeError("bug")))
        deadline = time.monotonic() + 5
        while tx.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        st = tx.statuses()
        assert not st["connected"] and "RuntimeError: bug" in st["background_error"]
        with pytest.raises(TransferError, match="background thread died"):
            tx.send(make("x"))
    finally:
        tx.close()
        router.close(0)


def _ack_later(router: zmq.Socket, ident: bytes, n: int, delay: float) -> None:
    """The fake decode receives ``n`` payloads, then acks them all after ``delay`` seconds."""
    seqs = []
    deadline = time.monotonic() + 5
    while len(seqs) < n and time.monotonic() < deadline:
        if router.poll(100):
            frames = router.recv_multipart()
            msg = wire.INBOUND_DECODER.decode(frames[1])
            if isinstance(msg, wire.PayloadHeader):
                seqs.append(msg.seq)
    time.sleep(delay)
    router.send_multipart([ident, wire.encode(wire.Ack(delivered=tuple(seqs)))])


@pytest.mark.parametrize("timeout", [5.0, 0.0])
def test_close_waits_for_the_acks_of_what_was_sent(zctx, timeout) -> None:
    import threading

    router, address = fake_decode(zctx)
    tx, ident = connect(zctx, router, address)
    try:
        t = threading.Thread(target=_ack_later, args=(router, ident, 10, 0.3))
        t.start()
        for i in range(10):
            tx.send(make(f"r{i}"))
        time.sleep(0.1)  # the fake decode has them all; its acks come 0.3 s later
        tx.close(timeout=timeout)
        t.join(5)
        st = tx.statuses()
        if timeout:
            assert st["delivered"] == 10 and not st["failed_by_reason"]
        else:  # negative control: closing at once loses the outcomes the decode reached
            assert st["delivered"] == 0 and st["failed_by_reason"] == {"transfer:decode_lost": 10}
    finally:
        tx.close(timeout=0)
        router.close(0)
