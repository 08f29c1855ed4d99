"""One-hot proposal assembly: cost must not grow with the vocabulary.

Compares, in one run, for B = 64:
- ours at V = 152064 and at V = 1024 (``vocab_scaling`` = t(152064) / t(1024), target <= 2);
- the naive approach at V = 152064: allocate a zero (B, V) FP32 tensor, then scatter
  (``speedup_vs_naive`` = naive / ours, target >= 100).

Our build includes everything a batch costs: flattening the descriptors, clearing
what the previous batch wrote, and the scatter. Medians over repeats.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, median_time

from pd_middleware.core.proposal import OneHotProposal
from pd_middleware.decode.assembler import ProposalAssembler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    b = args.batch
    rng = random.Random(0)

    def ours(v: int) -> float:
        asm = ProposalAssembler(v, 1, b)
        batches = [[OneHotProposal((rng.randrange(v),)) for _ in range(b)] for _ in range(16)]
        it = iter(range(1 << 30))
        return median_time(lambda: asm.build(batches[next(it) % 16]), repeats=args.repeats, inner=50)

    def naive(v: int) -> float:
        toks = [torch.tensor([rng.randrange(v) for _ in range(b)]) for _ in range(16)]
        rows = torch.arange(b)
        it = iter(range(1 << 30))

        def run():
            t = toks[next(it) % 16]
            out = torch.zeros(b, v, dtype=torch.float32)
            out[rows, t] = 1.0
            return out

        return median_time(run, repeats=args.repeats, inner=5)

    t_big = ours(152064)
    t_small = ours(1024)
    t_naive = naive(152064)
    print(f"ours  B={b} V=152064: {t_big * 1e6:9.1f} us/batch")
    print(f"ours  B={b} V=1024  : {t_small * 1e6:9.1f} us/batch")
    print(f"naive B={b} V=152064: {t_naive * 1e6:9.1f} us/batch (zeros + scatter)")
    scaling = t_big / t_small
    speedup = t_naive / t_big
    print(f"vocab_scaling {scaling:.2f} (target <= 2.0), speedup_vs_naive {speedup:.0f}x (target >= 100)")
    emit(
        {
            "benchmark": "assemble",
            "vocab_scaling": round(scaling, 3),
            "speedup_vs_naive": round(speedup, 1),
            "us_per_batch_v152064": round(t_big * 1e6, 2),
            "us_per_batch_v1024": round(t_small * 1e6, 2),
            "us_per_batch_naive": round(t_naive * 1e6, 2),
            "batch": b,
        }
    )


if __name__ == "__main__":
    main()
