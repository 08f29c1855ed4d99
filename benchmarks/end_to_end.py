"""End to end over real ZMQ and Mooncake on loopback: payloads/s and receive-to-batch latency.

A prefill *process* (this script with ``--producer``) runs a real
:class:`~pd_middleware.transport.PrefillSender` with its own Mooncake engine; this
process runs the decode: a :class:`~pd_middleware.transport.DecodeReceiver` with its
Mooncake engine and slots, the receive pipeline (one counting hook, then the arm's
synthesizer), and a scheduler loop that takes batches of exactly B deliveries, builds
``draft_probs`` with the :class:`~pd_middleware.decode.assembler.ProposalAssembler` (V =
152064) and releases the deliveries (which frees their slots).

Every payload carries an 8 KiB bf16 hidden state (H = 4096). ``inline_threshold_bytes``
is 0, so every payload's tensors go through Mooncake into a receive slot and the header
through ZMQ: both planes on every request.

Encodings:

- ``one_hot``: the draft token only (0 proposal bytes), synthesizer ``one_hot``;
- ``sparse_floor``: the best compressed encoding of configs/ab.toml, encoder
  ``sparse`` (mode ``tv``, epsilon 0.01, k_max 1536, floor, fp16 values) on the
  synthetic Zipf workload, synthesizer ``sparse``. Its floor makes every row a
  whole-row fill in the assembler (its content is a whole row), so its batches cost
  more at large B.

Figures per (encoding, B in 1, 16, 64):

- ``payloads_per_s``: delivered payloads / time from the first receive to the last
  batch built (the producer keeps at most ``--window`` requests unacknowledged);
- ``latency_us_p50`` / ``latency_us_p99``: per payload, from the moment the receiver
  hands it to the pipeline (``Delivery.received_at``) to the moment its batch's
  ``draft_probs`` is built. At B > 1 this includes waiting for the batch to fill.

Usage: ``python benchmarks/end_to_end.py [--n 4000] [--quick]``. The last stdout line
is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT), str(ROOT / "plugins")]

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

from _common import emit

VOCAB = 152064
HIDDEN_BYTES = 8192
ENCODINGS = ("one_hot", "sparse_floor")
BATCHES = (1, 16, 64)
SPARSE_OPTIONS = {"mode": "tv", "epsilon": 0.01, "k_max": 1536, "floor": True}


def transport_config(window: int, bulk: bool = True) -> Any:
    """The same transport settings on both sides (slots sized for hidden + sparse).

    ``bulk``: every payload's tensors through Mooncake; otherwise all inline (ZMQ frames).
    """
    from pd_middleware.transport import SlotsConfig, TransportConfig

    return TransportConfig(
        inline_threshold_bytes=0 if bulk else 1 << 30,
        heartbeat_s=0.2,
        peer_timeout_s=30.0,
        slots=SlotsConfig(count=max(2 * window, 64), size_bytes=32 * 1024, per_peer=max(2 * window, 64), wait_s=30.0),
    )


# ---------------------------------------------------------------- prefill process


def _pool(encoding: str, size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` pre-encoded request bodies (tokens, probs, provenance, proposal)."""
    import torch

    from pd_middleware import PluginContext, Provenance

    if encoding == "one_hot":
        g = torch.Generator().manual_seed(seed)
        toks = torch.randint(0, VOCAB, (size,), generator=g).tolist()
        return [
            {"tokens": (t,), "probs": (0.5,), "provenance": Provenance(rule="sampled"), "proposal": None} for t in toks
        ]
    from pd_middleware.workloads import make_workload
    from pd_middleware_plugins.sparse import SparseEncoder, SparseEncoderOptions

    wl = make_workload("synthetic", vocab_size=VOCAB)
    enc = SparseEncoder(SparseEncoderOptions(**SPARSE_OPTIONS), PluginContext(VOCAB, 1, True, side="prefill"))
    out: list[dict[str, Any]] = []
    g = torch.Generator().manual_seed(seed)
    for wb in wl.batches(size, 16, seed):
        eb = enc.encode(wb.draft_probs, generator=g)
        for i in range(eb.tokens.shape[0]):
            out.append(
                {
                    "tokens": tuple(eb.tokens[i].tolist()),
                    "probs": tuple(eb.token_probs[i].tolist()),
                    "provenance": eb.provenance,
                    "proposal": eb.proposals[i],
                }
            )
    return out[:size]


def producer_main(spec: dict[str, Any]) -> None:
    """Send ``spec['n']`` payloads to ``spec['address']``; print one JSON line of counters."""
    from pd_middleware import Payload
    from pd_middleware.transport import MooncakeEngine, PrefillSender

    window = spec["window"]
    bulk = spec.get("bulk", True)
    cfg = transport_config(window, bulk)
    bodies = _pool(spec["encoding"], 64, spec["seed"])
    hidden = bytes(range(256)) * (HIDDEN_BYTES // 256)
    engine = MooncakeEngine.open() if bulk else None
    tx = PrefillSender(cfg, engine=engine, name=f"bench-{spec['tag']}").connect(spec["address"], timeout=30.0)
    print("READY", flush=True)
    t0 = time.perf_counter()
    for i in range(spec["n"]):
        if i % 16 == 0:
            deadline = time.monotonic() + 60.0
            while tx.statuses()["outstanding"] >= window:
                if time.monotonic() > deadline:
                    raise SystemExit("decode stopped acknowledging")
                time.sleep(0.0002)
        b = bodies[i % len(bodies)]
        tx.send(
            Payload(
                f"{spec['tag']}-{i}",
                b["tokens"],
                b["probs"],
                VOCAB,
                hidden=hidden,
                hidden_dtype="bf16",
                provenance=b["provenance"],
                proposal=b["proposal"],
            )
        )
    ok = tx.flush(timeout=60.0)
    st = tx.statuses()
    st["flushed"] = ok
    st["send_s"] = time.perf_counter() - t0
    tx.close()
    if engine is not None:
        engine.close()
    print(json.dumps(st), flush=True)


def start_producer(spec: dict[str, Any]) -> subprocess.Popen:
    """Start the prefill process and wait for its READY line (bounded)."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--producer", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if line.strip() != "READY":
        proc.kill()
        raise SystemExit(f"producer did not start: {line!r}")
    return proc


def finish_producer(proc: subprocess.Popen, timeout: float = 90.0) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit("producer did not finish in time") from None
    if proc.returncode != 0:
        raise SystemExit(f"producer exited with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- decode process


class CountHook:
    """A minimal receive hook, so the hook chain is part of the measured path."""

    def __init__(self) -> None:
        self.seen = 0

    def on_receive(self, payload: Any, context: Any) -> None:
        self.seen += 1


def make_decode(encoding: str, max_batch: int) -> tuple[Any, Any]:
    """Pipeline (count hook + the encoding's synthesizer) and assembler."""
    from pd_middleware import PluginContext
    from pd_middleware.core.contracts import NoOptions
    from pd_middleware.decode.assembler import ProposalAssembler
    from pd_middleware.decode.pipeline import ReceivePipeline
    from pd_middleware_plugins.one_hot import OneHotSynthesizer
    from pd_middleware_plugins.sparse import SparseSynthesizer

    ctx = PluginContext(VOCAB, 1, True)
    synth = OneHotSynthesizer(NoOptions(), ctx) if encoding == "one_hot" else SparseSynthesizer(NoOptions(), ctx)
    name = "one_hot" if encoding == "one_hot" else "sparse"
    pipe = ReceivePipeline([("count", CountHook())], {"default": (name, synth)})
    return pipe, ProposalAssembler(VOCAB, 1, max_batch)


def run_one(encoding: str, batch: int, n: int, window: int, engine: Any, seed: int) -> dict[str, Any]:
    """One (encoding, B) run: start a receiver, a producer, consume n payloads in batches of B."""
    import zmq

    from pd_middleware.decode.pipeline import Delivery
    from pd_middleware.transport import DecodeReceiver

    pipe, asm = make_decode(encoding, max(batch, 1))
    zctx = zmq.Context()
    rx = DecodeReceiver(transport_config(window), pipe, engine=engine, context=zctx).start()
    spec = {
        "address": rx.address,
        "n": n,
        "encoding": encoding,
        "window": window,
        "seed": seed,
        "tag": f"{encoding}-b{batch}",
    }
    proc = start_producer(spec)
    lat: list[float] = []
    failures: list[Any] = []
    got = 0
    t_first = t_last = 0.0
    pending: list[Any] = []
    deadline = time.monotonic() + 120.0
    try:
        while got < n and time.monotonic() < deadline:
            item = rx.get(timeout=0.05)
            if item is None:
                continue
            items = [item, *rx.drain(max(batch - 1 - len(pending), 0))] if batch > 1 else [item]
            for it in items:
                if type(it) is Delivery:
                    pending.append(it)
                else:
                    failures.append(it)
                    got += 1
            if not t_first and pending:
                t_first = pending[0].received_at
            # Build only full batches, except for the tail of the run.
            while len(pending) >= batch or (pending and got + len(pending) >= n):
                take, pending = pending[:batch], pending[batch:]
                out = asm.build([d.proposal for d in take])
                t_built = time.perf_counter()
                assert out is not None and out.shape == (len(take), VOCAB)
                for d in take:
                    lat.append(t_built - d.received_at)
                    d.release()
                got += len(take)
                t_last = t_built
        counters = finish_producer(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        rx.stop()
        zctx.term()
    if got < n or failures:
        raise SystemExit(
            f"{encoding} B={batch}: got {got} of {n}, failures {[(f.key, f.reason) for f in failures[:3]]}"
        )
    lat.sort()
    return {
        "payloads_per_s": round(len(lat) / (t_last - t_first)),
        "latency_us_p50": round(statistics.median(lat) * 1e6, 1),
        "latency_us_p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e6, 1),
        "bulk_bytes_per_payload": round(counters["bytes_by_plane"]["bulk"] / max(counters["sent"], 1)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4000, help="payloads per (encoding, batch size)")
    ap.add_argument("--window", type=int, default=256, help="most unacknowledged requests at the prefill")
    ap.add_argument("--quick", action="store_true", help="fewer payloads (smoke run)")
    ap.add_argument("--producer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.producer:
        producer_main(json.loads(args.producer))
        return
    if args.quick:
        args.n = 640
    import torch

    from pd_middleware.transport import MooncakeEngine

    torch.set_num_threads(1)
    engine = MooncakeEngine.open()
    results: dict[str, dict[str, Any]] = {}
    try:
        for enc in ENCODINGS:
            for b in BATCHES:
                r = run_one(enc, b, args.n, max(args.window, 2 * b), engine, seed=0)
                results[f"{enc}_b{b}"] = r
                print(
                    f"{enc:13s} B={b:3d}: {r['payloads_per_s']:8,d} payloads/s  "
                    f"p50 {r['latency_us_p50']:9.1f} us  p99 {r['latency_us_p99']:9.1f} us  "
                    f"bulk {r['bulk_bytes_per_payload']} B/payload",
                    flush=True,
                )
    finally:
        engine.close()
    emit(
        {
            "benchmark": "end_to_end",
            "results": results,
            "n_per_run": args.n,
            "vocab": VOCAB,
            "hidden_bytes": HIDDEN_BYTES,
            "transport": "zmq+mooncake(tcp) loopback, every payload bulk",
            "cpus": os.cpu_count(),
        }
    )


if __name__ == "__main__":
    main()
