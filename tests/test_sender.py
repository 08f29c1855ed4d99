"""The prefill sender's background thread against a hostile or broken decode.

A raw ROUTER plays the decode: it grants, then sends what a real decode never would.
- A 1 KB frame nested 1000 deep is counted (``wire:nesting``) and the sender stays up.
- If the background thread dies anyway, ``connected`` reads False at once and ``send``
  raises, instead of a sender that looks connected and never heartbeats again.
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
        tx.close()
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
