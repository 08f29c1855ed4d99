"""The prefill's encode per batch: one encoder call where the rows live, against the per-request path.

:meth:`ProposalPublisher.encode <pd_middleware.integrations.sglang.prefill.ProposalPublisher.encode>`
encodes a batch of B finished requests in one encoder call, on the device the draft rows
live on, each row drawn at its counter-based uniform (:mod:`pd_middleware.sampling.draws`). The
path it replaced (still used for an encoder without a ``uniforms`` parameter) copied the
whole (B, V) fp32 batch to the host and called the encoder once per request with a new
``torch.Generator``. Side by side in one run, medians over repeats, V = 152064:

- ``ms_per_batch``: the batched path, per strategy and B;
- ``ratio_per_request_over_batched``: the per-request path over the batched one (> 1:
  the batched one is faster), through the same publisher and the same encoder;
- ``ratio_vs_floor``: the batched path over the least any encoder of that kind does:
  ``sparse_floor``, a ``topk`` of the rows and the host copy of what it keeps;
  ``one_hot`` (X ~ q, nothing sent), one inverse-CDF draw per row; ``full_fp32``, the host
  copy of the rows.

On a CPU machine the host copy is a no-op cast, so the gain shown is the batching and
the dropped generators alone; on a GPU (``--device cuda``, the default when one is
present) the per-request path also pays a (B, V) device-to-host copy.

    python benchmarks/prefill_encode.py [--quick] [--device cpu|cuda] [--repeats 7]

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import emit, median_time

from pd_middleware.integrations.sglang.prefill import ProposalPublisher

V = 152064
STRATEGIES = ("sparse_floor", "one_hot", "full_fp32")


class PerRequest:
    """The encoder without ``uniforms``: the publisher takes its per-request path."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def encode(self, probs: torch.Tensor, *, temperature: float = 1.0, generator: Any = None) -> Any:
        return self.inner.encode(probs, temperature=temperature, generator=generator)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def floor_fn(strategy: str, q: torch.Tensor, cfg_k: int) -> Any:
    """The least work an encoder of the strategy's kind does on ``q`` (see the module docstring)."""
    if strategy == "sparse_floor":
        return lambda: [t.cpu() for t in q.topk(cfg_k, dim=1)]
    if strategy == "full_fp32":
        return lambda: q.to("cpu", copy=True)
    u = torch.rand(q.shape[0], dtype=torch.float64, device=q.device)
    return lambda: torch.searchsorted(q.double().cumsum(1), u.unsqueeze(1) * q.sum(1, keepdim=True).double()).cpu()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="B = 1, 16 and fewer repeats (a smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = (1, 16) if args.quick else (1, 16, 64)
    repeats = min(3, args.repeats) if args.quick else args.repeats
    g = torch.Generator().manual_seed(args.seed)
    q_all = torch.softmax(2.0 * torch.randn(max(sizes), V, generator=g), dim=-1).to(args.device)
    ms: dict[str, dict[str, float]] = {}
    ratio: dict[str, dict[str, float]] = {}
    vs_floor: dict[str, dict[str, float]] = {}
    for strategy in STRATEGIES:
        cfg = ROOT / "configs" / f"{strategy}.toml"

        def stage(target: Any, payload: Any) -> None:
            return None

        batched = ProposalPublisher.from_config(cfg, stage=stage, vocab_size=V, num_steps=1)
        per_req = ProposalPublisher(PerRequest(batched.encoder), vocab_size=V, seed=batched.seed, stage=stage)
        k = getattr(getattr(batched.encoder, "options", None), "k_max", 64)
        ms[strategy], ratio[strategy], vs_floor[strategy] = {}, {}, {}
        for b in sizes:
            q = q_all[:b]
            rooms = list(range(1000, 1000 + b))
            salts = [f"rid-{r}" for r in rooms]

            def run(pub: ProposalPublisher, q: torch.Tensor = q, rooms: list[int] = rooms, salts: Any = salts) -> None:
                pub.encode(rooms, q, 1.0, salts)
                _sync(args.device)

            inner = max(1, 16 // b)
            t_batched = median_time(lambda pub=batched: run(pub), repeats=repeats, inner=inner, warmup=1)
            t_per = median_time(lambda pub=per_req: run(pub), repeats=repeats, inner=inner, warmup=1)
            fl = floor_fn(strategy, q, min(k, 4096))
            t_floor = median_time(fl, repeats=repeats, inner=inner, warmup=1)
            ms[strategy][f"B{b}"] = round(t_batched * 1e3, 3)
            ratio[strategy][f"B{b}"] = round(t_per / t_batched, 2)
            vs_floor[strategy][f"B{b}"] = round(t_batched / t_floor, 2)
            print(
                f"{strategy:>12} B={b:<3} batched {t_batched * 1e3:8.2f} ms  per-request/batched "
                f"{t_per / t_batched:5.2f}  batched/floor {t_batched / t_floor:6.2f}",
                flush=True,
            )
    emit(
        {
            "benchmark": "prefill_encode",
            "quick": args.quick,
            "device": args.device,
            "vocab_size": V,
            "ms_per_batch": ms,
            "ratio_per_request_over_batched": ratio,
            "ratio_vs_floor": vs_floor,
            # Flat figures for run_all's table: each strategy at the largest B.
            **{f"per_request_over_batched_{st}": ratio[st][f"B{sizes[-1]}"] for st in STRATEGIES},
            **{f"batched_over_floor_{st}": vs_floor[st][f"B{sizes[-1]}"] for st in STRATEGIES},
        }
    )


if __name__ == "__main__":
    main()
