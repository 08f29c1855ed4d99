"""Sparse proposal assembly: cost must not grow with the vocabulary.

B = 64 requests, each a :class:`SparseProposal` with 1024 entries (distinct random
token ids, normalised values, floor 0.0: a plain top-k), assembled into the
persistent buffer at V = 152064 and at V = 16384. Each build includes everything a
batch costs: flattening the descriptors, the range check, clearing what the previous
batch wrote, and the scatter. Batches rotate through 16 pre-made sets so every build
clears entries it did not write itself.

- ``vocab_scaling`` = t(152064) / t(16384) (target <= 2.0). The limit: a scatter of
  B x 1024 entries, whose cost depends on the entry count, not on V.
- ``speedup_vs_naive``: zeros (B, V) + scatter at V = 152064, against ours
  (informational).

Medians over repeats; one thread, as a decode loop would run it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, median_time

from pd_middleware.core.proposal import SparseProposal
from pd_middleware.decode.assembler import ProposalAssembler

ENTRIES = 1024
SETS = 16


def make_batches(b: int, v: int, k: int, gen: torch.Generator) -> list[list[SparseProposal]]:
    """``SETS`` batches of ``b`` sparse rows with ``k`` distinct ids in [0, v) each."""
    out = []
    for _ in range(SETS):
        batch = []
        for _ in range(b):
            idx = torch.randperm(v, generator=gen)[:k]
            val = torch.rand(k, generator=gen) + 0.01
            val /= val.sum()
            batch.append(SparseProposal(lengths=(k,), indices=idx, values=val, floor=(0.0,)))
        out.append(batch)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.repeats = 3
    torch.set_num_threads(1)
    b = args.batch
    gen = torch.Generator().manual_seed(0)

    made = {v: make_batches(b, v, ENTRIES, gen) for v in (152064, 16384)}

    def ours(v: int) -> float:
        asm = ProposalAssembler(v, 1, b)
        batches = made[v]
        # Correctness spot check: one row equals its dense reference.
        out = asm.build(batches[0])
        assert torch.equal(out[3], batches[0][3].to_dense(v)[0]), "assembled row differs from its reference"
        it = iter(range(1 << 30))
        return median_time(lambda: asm.build(batches[next(it) % SETS]), repeats=args.repeats, inner=20)

    def naive(v: int) -> float:
        batches = made[v]
        it = iter(range(1 << 30))

        def run() -> torch.Tensor:
            batch = batches[next(it) % SETS]
            out = torch.zeros(b, v, dtype=torch.float32)
            rows = torch.arange(b).repeat_interleave(ENTRIES)
            out[rows, torch.cat([p.indices for p in batch])] = torch.cat([p.values for p in batch])
            return out

        return median_time(run, repeats=args.repeats, inner=5)

    # Interleave the two sizes so drift on a shared machine hits both alike.
    big, small = [], []
    for _ in range(3):
        big.append(ours(152064))
        small.append(ours(16384))
    t_big, t_small = sorted(big)[1], sorted(small)[1]
    t_naive = naive(152064)
    scaling = t_big / t_small
    print(f"ours  B={b} k={ENTRIES} V=152064: {t_big * 1e6:9.1f} us/batch")
    print(f"ours  B={b} k={ENTRIES} V=16384 : {t_small * 1e6:9.1f} us/batch")
    print(f"naive B={b} k={ENTRIES} V=152064: {t_naive * 1e6:9.1f} us/batch (zeros + scatter)")
    print(f"vocab_scaling {scaling:.2f} (target <= 2.0), speedup_vs_naive {t_naive / t_big:.1f}x")
    emit(
        {
            "benchmark": "sparse",
            "vocab_scaling": round(scaling, 3),
            "speedup_vs_naive": round(t_naive / t_big, 2),
            "us_per_batch_v152064": round(t_big * 1e6, 2),
            "us_per_batch_v16384": round(t_small * 1e6, 2),
            "us_per_batch_naive": round(t_naive * 1e6, 2),
            "batch": b,
            "entries_per_row": ENTRIES,
        }
    )


if __name__ == "__main__":
    main()
