"""Receive-path throughput: payloads/s through the decode receiver vs raw pyzmq PUSH/PULL.

Both sides receive the *same* pre-encoded frames (a 1-token payload header and an
8 KiB bf16 hidden state, inline) from a producer in a separate process. The raw
baseline only calls ``recv_multipart``; ours runs the full decode receive path: ROUTER
socket, wire decode and validation, zero-copy views, one hook, the one-hot synthesizer,
the outcome queue, the scheduler's ``drain`` and per-batch acks. Each repeat runs both,
alternating; the headline is the median of the per-repeat ratios (robust to load drift
on a shared machine), with the ratio of medians alongside.

Each payload has its own request id (the receiver refuses a request id its peer
already has outstanding), pre-encoded before the clock starts, for both sides.

``--curve`` runs our side with CURVE on (encryption and the ZAP allowlist). The headline
raw baseline stays plain pyzmq; each repeat also runs the same bare PULL socket with
CURVE on both ends (``ratio_vs_raw_zmq_curve``: our path against the limit with the same
crypto; ``curve_cost_raw``: the share of raw throughput libzmq's encryption takes).

Usage: ``python benchmarks/receive.py [--n 20000] [--repeats 5] [--hidden 8192] [--curve]``.
The last stdout line is one JSON object:
``{"benchmark": "receive", "ratio_vs_raw_zmq": x, "curve": bool, ...}`` (target x >= 0.5).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "plugins")]

from pd_middleware import Payload
from pd_middleware.core.contracts import NoOptions, PluginContext
from pd_middleware.decode.pipeline import ReceivePipeline
from pd_middleware.transport import (
    DecodeReceiver,
    TransportConfig,
    payload_codec,
    wire,
)
from pd_middleware.transport.config import CurveConfig

VOCAB = 152064


def messages_for(n: int, hidden: int) -> list[list[bytes]]:
    """``n`` payload messages, request ids ``bench-<i>``, sharing one hidden-state buffer."""
    data = bytes(range(256)) * (hidden // 256)
    out = []
    for i in range(n):
        payload = Payload(f"bench-{i}", (17,), (0.5,), VOCAB, hidden=data, hidden_dtype="bf16")
        header, _ = payload_codec.build_header(payload, i)
        out.append([wire.encode(header), data])
    return out


def _curve_keys() -> dict[str, str]:
    """Fresh server and client key pairs (Z85), shared by the benchmark's two processes."""
    spub, ssec = zmq.curve_keypair()
    cpub, csec = zmq.curve_keypair()
    return {
        "server_pub": spub.decode(),
        "server_sec": ssec.decode(),
        "client_pub": cpub.decode(),
        "client_sec": csec.decode(),
    }


def produce(kind: str, address: str, n: int, hidden: int, keys: dict[str, str] | None = None) -> None:
    """Producer process: send ``n`` payload messages as fast as the socket takes them."""
    ctx = zmq.Context()
    messages = messages_for(n, hidden)
    if kind == "raw":
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        if keys is not None:  # raw CURVE: libzmq's encryption alone, no ZAP handler
            sock.curve_serverkey = keys["server_pub"].encode()
            sock.curve_publickey = keys["client_pub"].encode()
            sock.curve_secretkey = keys["client_sec"].encode()
        sock.connect(address)
    else:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if keys is not None:
            sock.curve_serverkey = keys["server_pub"].encode()
            sock.curve_publickey = keys["client_pub"].encode()
            sock.curve_secretkey = keys["client_sec"].encode()
        sock.connect(address)
        sock.send_multipart([wire.encode(wire.Hello(name="bench", want_slots=0, ts=time.time()))])
        if not sock.poll(10_000):
            raise SystemExit("no grant from the receiver")
        sock.recv_multipart()
    for frames in messages:
        sock.send_multipart(frames, copy=True)
    if kind == "raw":
        time.sleep(1.0)  # let the queue drain before the context closes
    else:
        _await_acks(sock, n)
        sock.send_multipart([wire.encode(wire.Bye(reason="benchmark done"))])
    sock.close(linger=120_000)
    ctx.term()


def _await_acks(sock: zmq.Socket, n: int, timeout: float = 120.0) -> None:
    """Read the decode's acks until all ``n`` requests have an outcome (like
    ``PrefillSender.flush``). A producer that closes while acks wait unread in its socket
    makes the kernel reset the TCP connection, which discards the payloads it has not yet
    sent: the receiver then misses the tail of the run, with or without CURVE (a raw
    ROUTER that acks loses it the same way; one that never acks does not)."""
    done = 0
    deadline = time.monotonic() + timeout
    while done < n and time.monotonic() < deadline:
        if not sock.poll(1000):
            continue
        msg = wire.OUTBOUND_DECODER.decode(sock.recv_multipart()[0])
        if isinstance(msg, wire.Ack):
            done += len(msg.delivered) + len(msg.failed)
    if done < n:
        raise SystemExit(f"producer: {done} of {n} requests acked within {timeout:g} s")


def run_raw(n: int, hidden: int, curve: bool = False) -> float:
    """Messages/s through a bare PULL socket; ``curve``: with libzmq's CURVE on both ends."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    keys = _curve_keys() if curve else None
    if keys is not None:
        sock.curve_server = True
        sock.curve_secretkey = keys["server_sec"].encode()
        sock.curve_publickey = keys["server_pub"].encode()
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=produce, args=("raw", f"tcp://127.0.0.1:{port}", n, hidden, keys))
    proc.start()
    try:
        if not sock.poll(30_000):
            raise SystemExit("raw producer sent nothing")
        sock.recv_multipart()
        t0 = time.perf_counter()
        for _ in range(n - 1):
            sock.recv_multipart()
        dt = time.perf_counter() - t0
    finally:
        proc.join(30)
        sock.close(0)
        ctx.term()
    return (n - 1) / dt


class CountHook:
    """A minimal receive hook, so the hook chain is part of the measured path."""

    def __init__(self) -> None:
        self.seen = 0

    def on_receive(self, payload: Payload, context: object) -> None:
        self.seen += 1


def run_ours(n: int, hidden: int, curve: bool = False) -> float:
    try:
        from pd_middleware_plugins.one_hot import OneHotSynthesizer

        synth = OneHotSynthesizer(NoOptions(), PluginContext(vocab_size=VOCAB, num_steps=1, rejection_sampling=True))
    except ImportError:  # pragma: no cover - plugins not on the path
        raise SystemExit("plugins/pd_middleware_plugins/one_hot.py is required") from None
    pipeline = ReceivePipeline([("count", CountHook())], {"default": ("one_hot", synth)})
    keys = _curve_keys() if curve else None
    cfg = TransportConfig(hwm=10_000_000, peer_timeout_s=60.0)
    if keys is not None:
        os.environ["PDM_BENCH_CURVE_SECRET"] = keys["server_sec"]
        curve_cfg = CurveConfig(
            enabled=True, secret_key_env="PDM_BENCH_CURVE_SECRET", clients={"bench": keys["client_pub"]}
        )
        cfg = TransportConfig(hwm=10_000_000, peer_timeout_s=60.0, curve=curve_cfg)
    ctx = zmq.Context()
    rx = DecodeReceiver(cfg, pipeline, context=ctx).start()
    proc = mp.get_context("spawn").Process(target=produce, args=("ours", rx.address, n, hidden, keys))
    proc.start()
    try:
        first = rx.get(timeout=30)
        if first is None or not hasattr(first, "payload"):
            raise SystemExit(f"receiver delivered nothing useful: {first!r}")
        t0 = time.perf_counter()
        got = 1
        deadline = time.monotonic() + 120
        while got < n and time.monotonic() < deadline:
            # A scheduler blocks for work, then takes everything that is ready.
            first = rx.get(timeout=1.0)
            items = rx.drain() if first is None else [first, *rx.drain()]
            for it in items:
                it.release()
            got += len(items)
        dt = time.perf_counter() - t0
        if got < n:
            raise SystemExit(
                f"received {got} of {n}: {pipeline.metrics.snapshot()}, queued {len(rx._queue.items)}, healthy {rx.healthy}, unsent {rx.unsent}"
            )
        m = pipeline.metrics.snapshot()
        if m["delivered"] != n:
            raise SystemExit(f"delivered {m['delivered']} of {n}: {m}")
    finally:
        proc.join(30)
        rx.stop()
        ctx.term()
    return (n - 1) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=8192, help="hidden-state bytes per payload")
    ap.add_argument("--curve", action="store_true", help="CURVE on for our side (the raw baseline stays plain)")
    args = ap.parse_args()
    raw, ours, ratios = [], [], []
    raw_curve: list[float] = []  # --curve: the same bare PULL with CURVE on both ends
    for i in range(args.repeats):
        raw.append(run_raw(args.n, args.hidden))
        if args.curve:
            raw_curve.append(run_raw(args.n, args.hidden, curve=True))
        ours.append(run_ours(args.n, args.hidden, args.curve))
        ratios.append(ours[-1] / raw[-1])
        line = f"repeat {i}: raw {raw[-1]:,.0f}/s  ours {ours[-1]:,.0f}/s  ratio {ratios[-1]:.3f}"
        if args.curve:
            line += f"  | raw with CURVE {raw_curve[-1]:,.0f}/s  ours/raw-CURVE {ours[-1] / raw_curve[-1]:.3f}"
        print(line, file=sys.stderr)
    r, o = statistics.median(raw), statistics.median(ours)
    out: dict[str, object] = {
        "benchmark": "receive",
        "ratio_vs_raw_zmq": round(statistics.median(ratios), 3),
        "ratio_of_medians": round(o / r, 3),
        "ours_payloads_per_s": round(o),
        "raw_zmq_msgs_per_s": round(r),
    }
    if args.curve:
        # The same bare socket with CURVE on both ends: what libzmq's encryption alone costs,
        # and our receive path against the limit with the same crypto.
        out["ratio_vs_raw_zmq_curve"] = round(statistics.median(o_ / c for o_, c in zip(ours, raw_curve)), 3)
        out["raw_zmq_curve_msgs_per_s"] = round(statistics.median(raw_curve))
        out["curve_cost_raw"] = round(1 - statistics.median(raw_curve) / r, 3)
    out.update(n=args.n, repeats=args.repeats, hidden_bytes=args.hidden, curve=args.curve, cpus=os.cpu_count())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
