"""Bulk data-plane throughput: dense proposals through our sender/receiver vs raw Mooncake.

Each payload carries one dense fp32 proposal of V = 152,064 values (608,256 bytes).
*Ours*: :class:`PrefillSender` in this process writes the bytes with one Mooncake
transfer into a slot the decode registered, and sends the header; the headline figure
has the payload bytes in a prefill buffer registered once (``register_source``, like
SGLang's metadata buffers), and ``staged_copy_ratio`` the variant where the sender
first copies them into its staging buffer; a
:class:`DecodeReceiver` in a separate process validates, delivers and releases the
slot. Throughput is sends/s until every payload is acknowledged. *Raw*: one
``transfer_sync_write`` of the same 608,256 bytes per payload, registered source to a
registered buffer in a separate process, same engine setup (TCP, loopback). Repeats
alternate raw/ours; the headline ratio is the median of the per-repeat ratios.

Every bulk region carries a digest the decode checks before delivery
(``transport/integrity.py``): the headline runs the always-on xxh3-128; ``blake3_ratio``
is the cryptographic mode (``mooncake.digest = "blake3"``, the default with
authentication), both sides hashing.

``--crossover`` instead measures ours inline (ZMQ frames) vs ours bulk (Mooncake) at
several sizes, to place ``inline_threshold_bytes`` (docs/transport.md).

Last stdout line: ``{"benchmark": "bulk", "ratio_vs_raw_mooncake": x, ...}`` (target >= 0.8).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections import deque

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "plugins")]

from pd_middleware import DenseEncoding, OneHotProposal, Payload
from pd_middleware.decode.pipeline import Delivery, ReceivePipeline
from pd_middleware.transport import (
    DecodeReceiver,
    MooncakeConfig,
    MooncakeEngine,
    PrefillSender,
    SlotsConfig,
    TransportConfig,
)

VOCAB = 152064
NBYTES = VOCAB * 4


class _OneHot:
    def synthesize(self, payload: Payload) -> OneHotProposal:
        return OneHotProposal(payload.draft_tokens)


def _config(threshold: int, inflight: int = 8, digest: str = "auto") -> TransportConfig:
    return TransportConfig(
        inline_threshold_bytes=threshold,
        peer_timeout_s=60.0,
        slots=SlotsConfig(count=64, size_bytes=1 << 20, per_peer=64, wait_s=30.0),
        mooncake=MooncakeConfig(max_inflight_writes=inflight, digest=digest),  # type: ignore[arg-type]
    )


def decode_process(mode: str, threshold: int, conn: mp.connection.Connection, digest: str = "auto") -> None:
    """Remote side: a registered buffer (raw) or a decode receiver (ours), until told to stop."""
    engine = MooncakeEngine.open()
    if mode == "raw":
        buf = mmap.mmap(-1, 1 << 20)
        addr = engine.register(buf)
        conn.send((engine.peer_name, addr))
        conn.recv()
        return
    rx = DecodeReceiver(
        _config(threshold, digest=digest), ReceivePipeline([], {"default": ("one_hot", _OneHot())}), engine=engine
    ).start()
    conn.send((rx.address, 0))
    while True:
        item = rx.get(timeout=0.05)  # the scheduler blocks for work rather than spinning
        if item is None:
            if conn.poll(0):  # told to stop (looked at only when idle: a syscall per batch cost the run CPU)
                break
            continue
        for it in (item, *rx.drain()):
            if isinstance(it, Delivery):  # a Failure holds nothing (the run then reports it)
                it.release()
    rx.stop()


def _spawn(
    mode: str, threshold: int = 0, digest: str = "auto"
) -> tuple[mp.Process, mp.connection.Connection, str, int]:
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=decode_process, args=(mode, threshold, child, digest), daemon=True)
    proc.start()
    if not parent.poll(60):
        raise SystemExit(f"{mode} decode process did not start")
    name, addr = parent.recv()
    return proc, parent, name, addr


def _stop(proc: mp.Process, conn: mp.connection.Connection) -> None:
    conn.send("stop")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def run_raw(engine: MooncakeEngine, n: int, nbytes: int, depth: int = 0) -> float:
    """Raw binding calls, on purpose: this is the baseline. ``depth`` 0: one
    ``transfer_sync_write`` after another (the issue's baseline); ``depth`` k > 0: up to k
    ``transfer_submit_write`` in flight, polled with 20 us sleeps (the engine's own
    pipelined limit, what our sender's pipelining is measured against too)."""
    proc, conn, peer, dst = _spawn("raw")
    try:
        src = mmap.mmap(-1, 1 << 20)
        src[:nbytes] = os.urandom(nbytes)
        addr = engine.register(src)
        raw = engine._engine
        engine.probe(peer)
        if raw.transfer_sync_write(peer, addr, dst, nbytes) != 0:
            raise SystemExit("raw warm-up write failed")
        t0 = time.perf_counter()
        if depth == 0:
            for _ in range(n):
                if raw.transfer_sync_write(peer, addr, dst, nbytes) != 0:
                    raise SystemExit("raw write failed")
        else:
            flight: deque[int] = deque()
            for i in range(n + depth):
                if i < n:
                    bid = raw.transfer_submit_write(peer, addr, dst, nbytes)
                    if not 0 < bid < 1 << 63:
                        raise SystemExit("raw submit failed")
                    flight.append(bid)
                while flight and (len(flight) >= depth or i >= n):
                    st = raw.transfer_check_status(flight[0])  # each id polled until it ends, never after
                    if st == 1:
                        flight.popleft()
                    elif st == 0:
                        time.sleep(20e-6)
                    else:
                        raise SystemExit(f"raw async write failed: {st}")
        dt = time.perf_counter() - t0
        engine.unregister(addr)
    finally:
        _stop(proc, conn)
    return n / dt


def _payloads(nbytes: int, source: mmap.mmap | None, count: int = 8, ids: int = 8) -> list[Payload]:
    """``ids`` dense payloads over ``count`` distinct data buffers (views of ``source`` when
    given: no staging copy). Every payload has its own request id: the receiver refuses an
    id its peer already has outstanding (``wire:duplicate``)."""
    values = nbytes // 4
    row = bytes(ctypes.c_float(1.0 / values)) * values
    datas: list[bytes | memoryview] = []
    for i in range(count):
        data: bytes | memoryview = row
        if source is not None:
            source[i * nbytes : (i + 1) * nbytes] = row
            data = memoryview(source)[i * nbytes : (i + 1) * nbytes]
        datas.append(data)
    return [
        Payload(
            f"bulk-{i}",
            (i % values,),
            (1.0 / values,),
            values,
            hidden=b"",
            proposal=DenseEncoding("fp32", datas[i % count]),
        )
        for i in range(ids)
    ]


def run_ours(
    engine: MooncakeEngine,
    n: int,
    nbytes: int,
    threshold: int = 0,
    registered: bool = True,
    inflight: int = 8,
    digest: str = "auto",
) -> float:
    """Sends/s through our sender and receiver; ``registered``: payload bytes live in a
    registered prefill buffer (SGLang-style) rather than being staged by a copy;
    ``inflight``: ``mooncake.max_inflight_writes`` (1 = each send waits for its write);
    ``digest``: ``mooncake.digest`` on both sides."""
    proc, conn, address, _ = _spawn("ours", threshold, digest)
    tx = PrefillSender(_config(threshold, inflight, digest), engine=engine, name="bench").connect(address)
    try:
        source = mmap.mmap(-1, 8 * nbytes) if registered and threshold < nbytes else None
        if source is not None:
            tx.register_source(source)
        payloads = _payloads(nbytes, source, ids=n + 1)  # built before the clock starts
        tx.send(payloads[n])
        if not tx.flush(30):
            raise SystemExit("warm-up payload was not acknowledged")
        t0 = time.perf_counter()
        for i in range(n):
            tx.send(payloads[i])
        if not tx.flush(60):
            raise SystemExit(f"not all payloads acknowledged: {tx.statuses()}")
        dt = time.perf_counter() - t0
        s = tx.statuses()
        if s["delivered"] != n + 1:
            raise SystemExit(f"delivered {s['delivered']} of {n + 1}: {s}")
    finally:
        tx.close()
        _stop(proc, conn)
    return n / dt


def crossover(engine: MooncakeEngine, n: int) -> dict[str, object]:
    rows = []
    for size in (16 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1000 << 10):
        inline = statistics.median(run_ours(engine, n, size, threshold=1 << 30) for _ in range(3))
        bulk = statistics.median(run_ours(engine, n, size, threshold=0) for _ in range(3))
        rows.append({"bytes": size, "inline_per_s": round(inline), "bulk_per_s": round(bulk)})
        print(f"{size:>8} B: inline {inline:,.0f}/s bulk {bulk:,.0f}/s", file=sys.stderr)
    # The crossover is the smallest size from which bulk wins at every larger size too
    # (None: inline won somewhere at the top of the range, so no crossover was reached).
    cross = None
    for r in reversed(rows):
        if r["bulk_per_s"] < r["inline_per_s"]:
            break
        cross = r["bytes"]
    return {"benchmark": "bulk_crossover", "rows": rows, "crossover_bytes": cross}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--crossover", action="store_true")
    ap.add_argument("--inflight", type=int, default=8, help="max_inflight_writes for ours, depth for raw pipelined")
    args = ap.parse_args()
    engine = MooncakeEngine.open()
    try:
        if args.crossover:
            print(json.dumps(crossover(engine, args.n)))
            return
        depth = args.inflight
        runs: dict[str, list[float]] = {
            k: [] for k in ("raw", "raw_pipelined", "ours", "blake3", "staged", "ours_sync")
        }
        ratio: dict[str, list[float]] = {k: [] for k in ("ours", "blake3", "staged", "ours_sync", "ours_vs_pipelined")}
        for i in range(args.repeats):
            runs["raw"].append(run_raw(engine, args.n, NBYTES))
            runs["raw_pipelined"].append(run_raw(engine, args.n, NBYTES, depth=depth))
            runs["ours"].append(run_ours(engine, args.n, NBYTES, inflight=depth))
            runs["blake3"].append(run_ours(engine, args.n, NBYTES, inflight=depth, digest="blake3"))
            runs["staged"].append(run_ours(engine, args.n, NBYTES, registered=False, inflight=depth))
            runs["ours_sync"].append(run_ours(engine, args.n, NBYTES, inflight=1))
            last = {k: v[-1] for k, v in runs.items()}
            for k in ("ours", "blake3", "staged", "ours_sync"):
                ratio[k].append(last[k] / last["raw"])
            ratio["ours_vs_pipelined"].append(last["ours"] / last["raw_pipelined"])
            print(
                f"repeat {i}: raw sync {last['raw']:,.0f}/s, raw pipelined x{depth} {last['raw_pipelined']:,.0f}/s | "
                f"ours {last['ours']:,.0f}/s ({ratio['ours'][-1]:.3f}), blake3 {last['blake3']:,.0f}/s "
                f"({ratio['blake3'][-1]:.3f}), staged {last['staged']:,.0f}/s "
                f"({ratio['staged'][-1]:.3f}), ours with max_inflight_writes=1 {last['ours_sync']:,.0f}/s "
                f"({ratio['ours_sync'][-1]:.3f})",
                file=sys.stderr,
            )
    finally:
        engine.close()
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(
        json.dumps(
            {
                "benchmark": "bulk",
                "ratio_vs_raw_mooncake": round(statistics.median(ratio["ours"]), 3),
                "ratio_of_medians": round(med["ours"] / med["raw"], 3),
                "digest": "xxh3_128",
                "blake3_ratio_vs_raw_mooncake": round(statistics.median(ratio["blake3"]), 3),
                "staged_copy_ratio_vs_raw_mooncake": round(statistics.median(ratio["staged"]), 3),
                "sync_sender_ratio_vs_raw_mooncake": round(statistics.median(ratio["ours_sync"]), 3),
                "ratio_vs_raw_pipelined": round(statistics.median(ratio["ours_vs_pipelined"]), 3),
                "max_inflight_writes": depth,
                "ours_payloads_per_s": round(med["ours"]),
                "raw_writes_per_s": round(med["raw"]),
                "raw_pipelined_writes_per_s": round(med["raw_pipelined"]),
                "ours_GBps": round(med["ours"] * NBYTES / 1e9, 3),
                "raw_GBps": round(med["raw"] * NBYTES / 1e9, 3),
                "bytes": NBYTES,
                "n": args.n,
                "repeats": args.repeats,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
