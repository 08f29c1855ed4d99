"""The GPU's sampling path against the CPU tier's, on one CUDA device (a check and its figures).

The server tier runs SGLang's seeded ``fast_sample`` on the CPU, its hash served by the
tier's stand-in for sgl-kernel's ``murmur_hash32_cpu`` (``tests/server/site/sgl_cpu_ops.py``).
A GPU hashes with SGLang's Triton ``murmur_hash32_kernel`` instead. On a CUDA machine this
script measures, side by side in one run:

1. ``hash_mismatches``: SGLang's Triton hash on the GPU against the stand-in on the CPU,
   bit for bit, over a (B, V) grid: uint64 seeds across the whole range (``fast_sample``
   adds its draft salt to the request's seed, a wrapping uint64 add: any seed stands for
   a salted one), uint64 positions as ``fast_sample`` passes them, and the columns of
   draft steps 0 and 1;
2. ``race_mismatches``: the token the seeded exponential race picks from those hashes
   (``fast_sample``'s float64 scores ``probs / -log((h + 0.5) / 2^32)``, argmax), on the
   GPU and on the CPU, over B rows of a V-wide law: how often the two devices' float64
   ``log`` lands a different token;
3. ``inverse_cdf_mismatches``: the same for the decode's own seeded draw
   (``pd_middleware.decode.recompute.inverse_cdf``, used where the engine offers no
   ``fast_sample``): the GPU's float64 running sum against the CPU's;
4. ``host_syncs_per_batch``: host synchronisations of one prefill encode of B rows
   (:meth:`ProposalPublisher.encode`) for three shipped strategies (sparse_floor,
   one_hot, full_fp32), counted by ``torch.cuda.set_sync_debug_mode("warn")``.

SGLang's hash kernel comes from an installed SGLang, or from ``--murmur-file`` (SGLang's
``sglang/kernels/ops/sampling/murmur_hash.py``, which needs only torch and Triton).

    python benchmarks/gpu_sampling.py [--rows 256] [--vocab 152064] [--murmur-file F]

Without CUDA it prints ``{"benchmark": "gpu_sampling", "skipped": "<reason>"}`` and exits 0.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "server" / "site"))

from _common import emit

STRATEGIES = ("sparse_floor", "one_hot", "full_fp32")


def murmur_module(path: str | None) -> ModuleType:
    if path:
        spec = importlib.util.spec_from_file_location("sglang_murmur_hash", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module("sglang.kernels.ops.sampling.murmur_hash")


def grid(rows: int, vocab: int, step: int, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g, dtype=torch.int64).view(torch.uint64)
    positions = torch.randint(0, 2**20, (rows,), generator=g, dtype=torch.int64).to(torch.uint64)
    cols = torch.arange(step * vocab, (step + 1) * vocab, dtype=torch.int64)
    return seeds.to(device), positions.to(device), cols.to(device)


def race(hashed: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    scores = hashed.to(torch.float64)
    scores.add_(0.5).div_(2.0**32).log_().neg_().reciprocal_()
    scores.mul_(probs)
    return scores.argmax(dim=-1)


def host_syncs(rows: int, vocab: int) -> dict[str, int]:
    from pd_middleware.integrations.sglang.prefill import ProposalPublisher

    g = torch.Generator().manual_seed(1)
    q = torch.softmax(2.0 * torch.randn(rows, vocab, generator=g), dim=-1).cuda()
    out: dict[str, int] = {}
    for strategy in STRATEGIES:
        pub = ProposalPublisher.from_config(
            ROOT / "configs" / f"{strategy}.toml", stage=lambda *_: None, vocab_size=vocab, num_steps=1
        )
        rooms = list(range(1000, 1000 + rows))
        salts = [f"rid-{r}" for r in rooms]
        pub.encode(rooms, q, 1.0, salts)  # warm-up: allocations, first-call paths
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pub.encode(rooms, q, 1.0, salts)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out[strategy] = sum("synchroniz" in str(w.message) for w in seen)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--murmur-file", default=None, help="SGLang's murmur_hash.py (else import it from SGLang)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        emit({"benchmark": "gpu_sampling", "skipped": f"CUDA not available (torch {torch.__version__})"})
        return
    import sgl_cpu_ops

    mh = murmur_module(args.murmur_file)
    report: dict[str, Any] = {
        "benchmark": "gpu_sampling",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "rows": args.rows,
        "vocab": args.vocab,
    }
    hash_bad, race_bad, draws = 0, 0, 0
    g = torch.Generator().manual_seed(args.seed + 7)
    for step in (0, 1):
        seeds, pos, cols = grid(args.rows, args.vocab, step, "cpu", args.seed + step)
        gpu = mh.murmur_hash32(seeds.cuda(), pos.cuda(), cols.cuda()).cpu()
        cpu = sgl_cpu_ops.murmur_hash32_cpu(seeds, pos, cols)
        hash_bad += int((gpu != cpu).sum())
        probs = torch.softmax(3.0 * torch.randn(args.rows, args.vocab, generator=g, dtype=torch.float64), -1).float()
        x_gpu = race(gpu.cuda(), probs.cuda()).cpu()
        x_cpu = race(cpu, probs)
        race_bad += int((x_gpu != x_cpu).sum())
        draws += args.rows
    report["hashes"] = 2 * args.rows * args.vocab
    report["hash_mismatches"] = hash_bad
    report["race_draws"] = draws
    report["race_mismatches"] = race_bad

    from pd_middleware.decode.recompute import inverse_cdf

    probs = torch.softmax(3.0 * torch.randn(args.rows, args.vocab, generator=g, dtype=torch.float64), -1).float()
    seeds = torch.arange(args.rows, dtype=torch.int64) * 7919 + 13
    positions = torch.full((args.rows,), 37, dtype=torch.int64)
    _, x_cpu = inverse_cdf(probs, seeds, positions)
    _, x_gpu = inverse_cdf(probs.cuda(), seeds.cuda(), positions.cuda())
    report["inverse_cdf_draws"] = args.rows
    report["inverse_cdf_mismatches"] = int((x_gpu.cpu() != x_cpu).sum())
    report["host_syncs_per_batch"] = {f"B{b}": host_syncs(b, args.vocab) for b in (1, 16, 64)}
    for k in ("hash_mismatches", "race_mismatches", "inverse_cdf_mismatches"):
        print(f"{k}: {report[k]}", flush=True)
    print(f"host syncs per prefill batch: {report['host_syncs_per_batch']}", flush=True)
    emit(report)


if __name__ == "__main__":
    main()
