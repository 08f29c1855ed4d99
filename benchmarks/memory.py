"""Memory bound of the receive path: RSS growth over 100,000 payloads after warm-up.

The real transport: a prefill *process* (``end_to_end.py``'s producer: a real
:class:`~pd_middleware.transport.PrefillSender`) sends one-hot payloads (1 draft token,
8 KiB bf16 hidden state) to a :class:`~pd_middleware.transport.DecodeReceiver` in this
process, over ZMQ on loopback. The decode side runs the pipeline (counting hook,
``one_hot`` synthesizer), assembles batches of 64 into the persistent (64, 152064)
buffer and releases every delivery, as a scheduler would.

By default the hidden states travel inline (ZMQ frames): 100,000 payloads through
Mooncake run at about 1,000/s on 2 loaded cores (``end_to_end.py``), i.e. minutes;
``--bulk`` sends them through Mooncake slots instead (use ``--n`` to bound the time).

RSS (``/proc/self/status`` VmRSS of this, the decode, process) is read after
``--warmup`` payloads and after ``--n`` more, each time with the outcome queue
drained and ``gc.collect()`` run; the producer keeps at most 256 requests
unacknowledged, so backlog cannot pass for a leak. Samples every 10% are printed to
show the trend (a leak climbs; a warm process stays flat).

- ``rss_growth_second_half_mb`` (informational): growth over the last 50% alone, the
  leak detector; ``max_backlog_payloads``: most payloads waiting in the outcome queue.
- ``rss_growth_mb`` (target <= 50): RSS after the run minus RSS after warm-up. The
  limit it guards: per-request vocab-wide allocations (608 KB each at V = 152064, so
  100,000 of them would be ~60 GB) or any per-request object kept alive.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "plugins")]
os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

from _common import emit
from end_to_end import finish_producer, make_decode, start_producer, transport_config

BATCH = 64
WINDOW = 256


def rss_mb() -> float:
    """Resident set size of this process, in MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000, help="payloads measured after warm-up")
    ap.add_argument("--warmup", type=int, default=10_000)
    ap.add_argument("--bulk", action="store_true", help="hidden states through Mooncake slots, not inline")
    ap.add_argument("--quick", action="store_true", help="10,000 payloads after 2,000 warm-up (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.n, args.warmup = 10_000, 2_000
    import torch
    import zmq

    from pd_middleware.decode.pipeline import Delivery
    from pd_middleware.transport import DecodeReceiver, MooncakeEngine

    torch.set_num_threads(1)
    total = args.warmup + args.n
    engine = MooncakeEngine.open() if args.bulk else None
    pipe, asm = make_decode("one_hot", BATCH)
    zctx = zmq.Context()
    rx = DecodeReceiver(transport_config(WINDOW, args.bulk), pipe, engine=engine, context=zctx).start()
    spec = {
        "address": rx.address,
        "n": total,
        "encoding": "one_hot",
        "window": WINDOW,
        "seed": 0,
        "tag": "mem",
        "bulk": args.bulk,
    }
    proc = start_producer(spec)
    got = 0
    pending: list[Delivery] = []
    failures = 0
    rss0 = None
    samples: list[tuple[int, float]] = []
    step = max(args.n // 10, 1)
    max_backlog = 0  # delivered by the receiver thread but not yet taken by the scheduler
    deadline = time.monotonic() + 900.0
    try:
        while got < total and time.monotonic() < deadline:
            item = rx.get(timeout=0.05)
            if item is None:
                continue
            max_backlog = max(max_backlog, pipe.metrics.delivered - got - len(pending))
            for it in (item, *rx.drain(BATCH)):
                if type(it) is Delivery:
                    pending.append(it)
                else:
                    failures += 1
                    got += 1
            while len(pending) >= BATCH or (pending and got + len(pending) >= total):
                take, pending = pending[:BATCH], pending[BATCH:]
                asm.build([d.proposal for d in take])
                for d in take:
                    d.release()
                got += len(take)
                del take
                if rss0 is None and got >= args.warmup:
                    gc.collect()
                    rss0 = rss_mb()
                    t_warm = time.perf_counter()
                    samples.append((0, rss0))
                    print(f"after warm-up ({got} payloads): RSS {rss0:.1f} MiB", flush=True)
                elif rss0 is not None and (got - args.warmup) // step > len(samples) - 1:
                    samples.append((got - args.warmup, rss_mb()))
        counters = finish_producer(proc, timeout=120.0)
        gc.collect()
        rss1 = rss_mb()  # before stopping the receiver: everything it holds still counts
    finally:
        if proc.poll() is None:
            proc.kill()
        rx.stop()
        zctx.term()
    if got < total or failures or rss0 is None:
        raise SystemExit(f"received {got} of {total} with {failures} failures")
    dt = time.perf_counter() - t_warm
    for n_after, r in samples:
        print(f"  +{n_after:7d} payloads: RSS {r:8.1f} MiB")
    growth = rss1 - rss0
    # A leak keeps climbing; a high-water mark (e.g. a burst of queued payloads whose
    # freed memory the allocator keeps) steps once and stays flat.
    mid = samples[len(samples) // 2][1]
    second_half = rss1 - mid
    print(f"second half: {second_half:+.1f} MiB; largest scheduler backlog: {max_backlog} payloads")
    print(
        f"RSS growth over {args.n} payloads after warm-up: {growth:.1f} MiB (target <= 50); {args.n / dt:,.0f} payloads/s"
    )
    emit(
        {
            "benchmark": "memory",
            "rss_growth_mb": round(growth, 2),
            "rss_growth_second_half_mb": round(second_half, 2),
            "max_backlog_payloads": max_backlog,
            "rss_after_warmup_mb": round(rss0, 1),
            "rss_end_mb": round(rss1, 1),
            "payloads": args.n,
            "warmup": args.warmup,
            "payloads_per_s": round(args.n / dt),
            "seconds": round(dt, 1),
            "path": "zmq+mooncake slots" if args.bulk else "zmq inline",
            "sender_delivered": counters["delivered"],
        }
    )


if __name__ == "__main__":
    main()
