"""Load: several prefill processes into one decode, nothing lost.

``python reliability/load.py [--procs 4] [--per-proc 25000] [--bulk-procs 2] [--budget-s 240]``

One :class:`~pd_middleware.transport.DecodeReceiver` (ZMQ ROUTER + Mooncake slots,
real ``one_hot``/``sparse`` synthesizers) runs in this process; ``--procs`` prefill
processes (``--bulk-procs`` of them writing through Mooncake, the rest inline) each send
``--per-proc`` payloads as fast as the transport takes them. Each request id carries its
send time (``CLOCK_MONOTONIC``, shared by all processes on Linux), so the decode measures
send-to-delivery latency. Every 10th delivery is compared bit for bit with what was sent.

Figures: ``sent`` (``send()`` returned), ``delivered`` (distinct request ids the decode
delivered), ``failed`` (with a reason, either side), ``lost = sent - delivered - failed``
(must be 0), ``duplicates`` (0), ``corrupt`` (0), ``send_errors`` (raised by ``send``: not
sent, with a reason), throughput (delivered / time from first to last delivery) and
p50/p99 send-to-delivery latency. Each prefill keeps at most ``--window`` requests
unacknowledged (default 256); ``--window 0`` floods, and latency is then the backlog.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.setup_env()


def transport_config(bulk: bool):
    from pd_middleware.transport import SlotsConfig, TransportConfig

    return TransportConfig(
        heartbeat_s=0.25,
        peer_timeout_s=10.0,
        connect_timeout_s=30.0,
        hwm=1_000_000,
        inline_threshold_bytes=0 if bulk else 1 << 30,
        slots=SlotsConfig(count=256, size_bytes=4096, per_peer=64, wait_s=30.0),
    )


KINDS = ("none", "sparse", "none", "sparse_floor")


def child(address: str, name: str, count: int, bulk: bool, deadline_s: float, window: int) -> None:
    """One prefill process: send ``count`` payloads, flush, print its counters as JSON.

    With ``window > 0`` it keeps at most about ``window`` requests unacknowledged (a
    prefill has a bounded number of requests in flight); 0 floods the control socket.
    """
    from pd_middleware import TransferError
    from pd_middleware.transport import MooncakeEngine, PrefillSender

    engine = MooncakeEngine.open() if bulk else None
    tx = PrefillSender(transport_config(bulk), engine=engine, name=name).connect(address, timeout=30.0)
    print("READY", flush=True)
    stop = time.monotonic() + deadline_s
    errors: Counter[str] = Counter()
    t0 = time.monotonic()
    for i in range(count):
        if time.monotonic() > stop:
            errors["deadline:not_attempted"] += count - i
            break
        if window and i % 32 == 0:
            while tx.statuses()["outstanding"] >= window and time.monotonic() < stop:
                tx.flush(0.002)
        p = C.make_payload(f"{name}/{i}/{time.monotonic_ns()}", KINDS[i % 4], 1 + i % 2, seed=i % 7)
        try:
            tx.send(p)
        except TransferError as exc:
            errors[f"{type(exc).__name__}:{exc.op}"] += 1
    send_s = time.monotonic() - t0
    flushed = tx.flush(60.0)
    st = tx.statuses()
    print(
        json.dumps({"name": name, "flushed": flushed, "send_s": send_s, "send_errors": dict(errors), **st}), flush=True
    )
    tx.close()
    os._exit(0)  # skip engine teardown: nothing left to flush


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--per-proc", type=int, default=25_000)
    ap.add_argument("--bulk-procs", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--window", type=int, default=256, help="most unacknowledged requests per prefill (0: flood)")
    ap.add_argument("--child", nargs=4, metavar=("ADDRESS", "NAME", "COUNT", "MODE"))
    args = ap.parse_args()
    if args.child:
        a, n, c, m = args.child
        child(a, n, int(c), m == "bulk", args.budget_s, args.window)
        return 0

    import zmq

    from pd_middleware.decode.pipeline import Delivery
    from pd_middleware.transport import DecodeReceiver, MooncakeEngine

    budget = C.Budget(args.budget_s)
    ctx = zmq.Context()
    engine = MooncakeEngine.open() if args.bulk_procs else None
    rx = DecodeReceiver(transport_config(False), C.build_pipeline(C.VOCAB, 2), engine=engine, context=ctx).start()
    names = [f"p{k}" for k in range(args.procs)]
    procs = {}
    send_deadline = max(10.0, args.budget_s - 60.0)  # leave time to flush and report
    for k, name in enumerate(names):
        mode = "bulk" if k < args.bulk_procs else "inline"
        procs[name] = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--budget-s",
                str(send_deadline),
                "--window",
                str(args.window),
                "--child",
                rx.address,
                name,
                str(args.per_proc),
                mode,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=C.child_env(),
        )
    delivered: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    seen: set[str] = set()
    dups = corrupt = checked = 0
    lat: list[float] = []
    first = last = 0.0
    target = args.procs * args.per_proc
    try:
        while len(seen) + sum(failures.values()) < target and not budget.over():
            items = rx.drain(4096) or [x for x in [rx.get(timeout=0.1)] if x is not None]
            now_ns = time.monotonic_ns()
            for o in items:
                rid = o.request_id or "?"
                if isinstance(o, Delivery):
                    if rid in seen:
                        dups += 1
                    seen.add(rid)
                    name, i, t_ns = rid.split("/")
                    delivered[name] += 1
                    lat.append((now_ns - int(t_ns)) / 1e6)
                    i = int(i)
                    if i % 10 == 0:
                        want = C.make_payload(rid, KINDS[i % 4], 1 + i % 2, seed=i % 7)
                        checked += 1
                        if bytes(want.hidden) != bytes(o.payload.hidden) or want.draft_tokens != o.payload.draft_tokens:
                            corrupt += 1
                    o.release()
                    last = time.monotonic()
                    if not first:
                        first = last
                else:
                    failures[o.key] += 1
            if all(p.poll() is not None for p in procs.values()) and not items:
                break  # every sender is done and nothing more is queued
        reports = {}
        for name, p in procs.items():
            try:
                out, _ = p.communicate(timeout=max(5.0, budget.left() + 30))
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            lines = [x for x in out.splitlines() if x.startswith("{")]
            reports[name] = json.loads(lines[-1]) if lines else {"name": name, "crashed": p.returncode}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        snap = rx.metrics.snapshot()
        rx.stop()
        if engine is not None:
            engine.close()
        ctx.term()

    sent = sum(r.get("sent", 0) for r in reports.values())
    ack_delivered = sum(r.get("delivered", 0) for r in reports.values())
    ack_failed = sum(r.get("failed", 0) for r in reports.values())
    send_errors: Counter[str] = Counter()
    for r in reports.values():
        send_errors.update(r.get("send_errors", {}))
    n_delivered = len(seen)
    n_failed = sum(failures.values())
    lost = sent - n_delivered - n_failed
    span = (last - first) if last > first else 0.0
    crashed = [n for n, r in reports.items() if "crashed" in r or not r.get("flushed")]
    result = {
        "script": "load",
        "procs": args.procs,
        "bulk_procs": args.bulk_procs,
        "per_proc": args.per_proc,
        "window": args.window,
        "sent": sent,
        "delivered": n_delivered,
        "failed": n_failed,
        "failed_by_reason": dict(failures),
        "lost": lost,
        "acks_agree": ack_delivered == n_delivered and ack_failed == n_failed,
        "duplicates": dups,
        "corrupt": corrupt,
        "bit_checked": checked,
        "send_errors": dict(send_errors),
        "crashes": len(crashed),
        "throughput_per_s": round(n_delivered / span, 1) if span else 0.0,
        "latency_ms_p50": round(C.percentile(lat, 50), 2),
        "latency_ms_p99": round(C.percentile(lat, 99), 2),
        "latency_ms_max": round(max(lat), 2) if lat else 0.0,
        "seconds": round(budget.elapsed(), 1),
        "decode_reconciles": snap["received"] == snap["delivered"] + snap["failed"],
        "bytes_by_plane": snap["bytes_by_plane"],
        "machine": C.machine(),
        "must_be_zero": ["lost", "duplicates", "corrupt", "crashes"],
    }
    C.emit(result)
    ok = lost == 0 and dups == 0 and corrupt == 0 and not crashed and result["acks_agree"] and sent == target
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
