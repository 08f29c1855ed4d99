"""GPU check of the graph-safe assembler buffer, for a machine with CUDA (< 3 min on one GPU).

Without CUDA it prints ``{"benchmark": "gpu_check", "skipped": "<reason>"}`` and exits 0.

(a) Graph freshness. A CUDA graph is captured once on
:meth:`ProposalAssembler.graph_buffer` (max_batch 64, V = 152064): per row, the sum and
the argmax of ``draft_probs``, as a verify kernel reading the static buffer would.
Then batches of different sizes and kinds (one-hot, sparse without and with a floor,
dense, mixed) are assembled into the same buffer, and the graph is replayed after each.
Every replay must see the fresh batch: row sums and argmaxes equal the reference built
on the CPU from the same descriptors, rows past B read 0, and the whole buffer equals
the reference (the assembler's invariant). A negative control checks that each replay
*differs* from the previous batch's reference, so a stale read would be caught.

(b) Timing, B = 256, V = 152064, one-hot, wall time per batch with the device
synchronised (so host work and the H2D copy of indices count):

- ours: ``ProposalAssembler.build`` (clear the previous entries, one scatter);
- zeros + scatter: take the tokens from the same descriptors, allocate a zeroed (B, V)
  FP32 tensor, then scatter the ones (what a plain implementation does per batch);
- memset: ``fill_(0)`` of a preallocated (B, V) FP32 tensor, the same bytes, no
  scatter at all: the bandwidth floor of any approach that touches whole rows.

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _common import emit

VOCAB = 152064
GRAPH_BATCH = 64


def skip_reason() -> str | None:
    """Why this check cannot run here, or None when a CUDA device is usable."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a hard dependency
        return f"torch not importable: {exc}"
    if not torch.cuda.is_available():
        return f"CUDA not available (torch {torch.__version__}, built with CUDA {torch.version.cuda})"
    return None


def _batches(gen, vocab: int):
    """(label, proposals) pairs of different sizes and kinds, deterministic from ``gen``."""
    import torch

    from pd_middleware.core.proposal import DenseProposal, OneHotProposal, SparseProposal

    def one_hot(b):
        return [OneHotProposal((int(t),)) for t in torch.randint(0, vocab, (b,), generator=gen)]

    def sparse(b, k, floor):
        out = []
        for _ in range(b):
            idx = torch.randperm(vocab, generator=gen)[:k]
            val = torch.rand(k, generator=gen) + 0.01
            val = val / val.sum() * (1.0 - floor * (vocab - k))
            out.append(SparseProposal((k,), idx, val.float(), (floor,)))
        return out

    def dense(b):
        out = []
        for _ in range(b):
            row = torch.rand(1, vocab, generator=gen)
            out.append(DenseProposal(row / row.sum(), torch.ones(1)))
        return out

    mixed = one_hot(5) + sparse(4, 64, 0.0) + dense(2) + sparse(3, 128, 1e-7)
    perm = torch.randperm(len(mixed), generator=gen).tolist()
    return [
        ("one_hot B=64", one_hot(GRAPH_BATCH)),
        ("one_hot B=3", one_hot(3)),
        ("sparse k=1024 B=17", sparse(17, 1024, 0.0)),
        ("sparse+floor k=256 B=9", sparse(9, 256, 1e-7)),
        ("dense B=5", dense(5)),
        ("one_hot B=1", one_hot(1)),
        ("mixed B=14", [mixed[i] for i in perm]),
        ("sparse k=1024 B=64", sparse(GRAPH_BATCH, 1024, 0.0)),
        ("one_hot B=2", one_hot(2)),
    ]


def check_graph(device: str) -> dict:
    """Part (a): capture once, assemble many, replay after each; count fresh and stale."""
    import torch

    from pd_middleware.decode.assembler import ProposalAssembler

    asm = ProposalAssembler(VOCAB, 1, GRAPH_BATCH, device=device)
    buf = asm.graph_buffer()
    # Warm up the reduction kernels on a side stream before capture (CUDA graph rule).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            buf.sum(dim=1)
            buf.argmax(dim=1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sums = buf.sum(dim=1)
        argmax = buf.argmax(dim=1)

    gen = torch.Generator().manual_seed(0)
    results = []
    prev_ref = torch.zeros(GRAPH_BATCH, VOCAB)
    ok_all = True
    for label, proposals in _batches(gen, VOCAB):
        b = len(proposals)
        view = asm.build(proposals)
        assert view is not None and view.data_ptr() == buf.data_ptr(), "build must return a view of the graph buffer"
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.zeros(GRAPH_BATCH, VOCAB)
        for i, p in enumerate(proposals):
            ref[i] = p.to_dense(VOCAB)[0]
        got_sum, got_arg = sums.cpu(), argmax.cpu()
        fresh_sum = torch.allclose(got_sum, ref.sum(dim=1), rtol=1e-5, atol=1e-5)
        fresh_arg = torch.equal(got_arg[:b], ref[:b].argmax(dim=1))
        stale_rows = int((got_sum[b:] != 0).sum())
        buffer_equal = torch.equal(buf.cpu(), ref)
        # Negative control: the previous batch's reference must not also match.
        discriminates = not torch.equal(ref, prev_ref) and not (
            torch.allclose(got_sum, prev_ref.sum(dim=1), rtol=1e-5, atol=1e-5)
            and torch.equal(got_arg[:b], prev_ref[:b].argmax(dim=1))
        )
        ok = fresh_sum and fresh_arg and stale_rows == 0 and buffer_equal and discriminates
        ok_all &= ok
        results.append(
            {
                "batch": label,
                "fresh_sums": fresh_sum,
                "fresh_argmax": fresh_arg,
                "stale_rows": stale_rows,
                "buffer_equals_reference": buffer_equal,
                "control_discriminates": discriminates,
            }
        )
        print(f"  {label:24s} {'ok' if ok else 'FAIL'}  {results[-1]}", flush=True)
        prev_ref = ref
    return {"ok": ok_all, "replays": len(results), "details": results}


def _wall(fn, sync, repeats: int = 15, inner: int = 50) -> float:
    """Median over ``repeats`` of the mean wall seconds per call, device synchronised."""
    for _ in range(5):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def time_assembly(device: str, b: int = 256) -> dict:
    """Part (b): ours vs zeros + scatter vs memset of the same bytes, B x V FP32."""
    import torch

    from pd_middleware.core.proposal import OneHotProposal
    from pd_middleware.decode.assembler import ProposalAssembler

    gen = torch.Generator().manual_seed(1)
    batches = [[OneHotProposal((int(t),)) for t in torch.randint(0, VOCAB, (b,), generator=gen)] for _ in range(16)]
    asm = ProposalAssembler(VOCAB, 1, b, device=device)
    rows = torch.arange(b, device=device)
    plain = torch.empty(b, VOCAB, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize
    k = iter(range(1 << 30))

    def ours() -> None:
        asm.build(batches[next(k) % 16])

    def zeros_scatter() -> None:
        batch = batches[next(k) % 16]
        toks = torch.tensor([p.tokens[0] for p in batch], device=device)
        out = torch.zeros(b, VOCAB, dtype=torch.float32, device=device)
        out[rows, toks] = 1.0

    def memset() -> None:
        plain.fill_(0.0)

    t = {name: _wall(fn, sync) for name, fn in (("ours", ours), ("zeros_scatter", zeros_scatter), ("memset", memset))}
    return {
        "batch": b,
        "vocab": VOCAB,
        "bytes": b * VOCAB * 4,
        "us_ours": round(t["ours"] * 1e6, 2),
        "us_zeros_scatter": round(t["zeros_scatter"] * 1e6, 2),
        "us_memset": round(t["memset"] * 1e6, 2),
        "speedup_vs_zeros_scatter": round(t["zeros_scatter"] / t["ours"], 2),
        "ratio_vs_memset": round(t["ours"] / t["memset"], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="accepted for run_all; the check is already short")
    ap.parse_args()
    reason = skip_reason()
    if reason is not None:
        print(f"gpu_check skipped: {reason}")
        emit({"benchmark": "gpu_check", "skipped": reason})
        return 0
    import torch

    dev = "cuda"
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    print("(a) CUDA graph on the assembler buffer:", flush=True)
    graph = check_graph(dev)
    print("(b) assembly timing:", flush=True)
    timing = time_assembly(dev)
    print(f"  {timing}", flush=True)
    emit(
        {
            "benchmark": "gpu_check",
            "device": torch.cuda.get_device_name(0),
            "graph_fresh": graph["ok"],
            "graph_replays": graph["replays"],
            "graph_details": graph["details"],
            **{f"assemble_{k}": v for k, v in timing.items()},
        }
    )
    return 0 if graph["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
