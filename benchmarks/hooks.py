"""Receive-hook chain overhead: the pipeline against a plain loop over the same hooks.

A chain of 3 no-op hooks (``on_receive`` returns ``None``) and a trivial synthesizer
(returns a pre-built ``OneHotProposal``) run on the same payloads and the same
``ReceiveContext`` in four ways, interleaved round by round so that drift hits all
of them alike:

- ``pipe3``: ``ReceivePipeline.process`` with the 3 hooks;
- ``pipe0``: ``ReceivePipeline.process`` with no hook (same synthesizer);
- ``plain3``: a for-loop calling the same 3 bound ``on_receive`` methods, then the
  same ``synthesize``;
- ``plain0``: the same for-loop with no hook (only ``synthesize``).

Figures (per payload; ratios are taken within each round, where the variants ran
back to back in shuffled order; differences and ratios within a round, then medians):

- ``overhead_us_per_hook`` = (pipe3 - pipe0) / 3: what each hook adds to a payload in
  the pipeline, i.e. the marginal cost of the chain;
- ``ratio_vs_plain_loop`` = med(pipe3 - pipe0) / med(plain3 - plain0) (target <= 3): the
  chain of 3 hooks inside the pipeline against the same 3 calls in a bare for-loop.
  This is the issue's figure: the cost of the *chain*, everything else being equal
  on both sides;
- ``process_ratio_vs_plain_loop`` = pipe3 / plain3 (informational, no target): the
  whole ``process`` call (chain, synthesizer, routing, counters and the ``Delivery``
  record it returns) against the least code calling the same hooks and synthesizer
  and producing nothing. Building the ``Delivery`` is most of the gap
  (docs/performance.md).

The synthesizer is deliberately trivial: a real one (e.g. one-hot with its checks)
would add the same cost to both sides and only flatter the ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit

from pd_middleware import OneHotProposal, Payload, ReceiveContext
from pd_middleware.decode.pipeline import Delivery, ReceivePipeline


class NoOpHook:
    """A hook that looks at nothing and replaces nothing."""

    def on_receive(self, payload: Payload, context: ReceiveContext) -> None:
        return None


class FixedSynth:
    """Returns one pre-built proposal: the cheapest possible synthesizer."""

    def __init__(self) -> None:
        self.proposal = OneHotProposal((1,))

    def synthesize(self, payload: Payload) -> OneHotProposal:
        return self.proposal


def _pipeline_run(pipe: ReceivePipeline, payloads: list[Payload], ctx: ReceiveContext) -> float:
    process = pipe.process
    t0 = time.perf_counter()
    for p in payloads:
        process(p, ctx)
    return time.perf_counter() - t0


def _plain_run(hooks: list, synth, payloads: list[Payload], ctx: ReceiveContext) -> float:
    # The least code that does the same work: call each hook, honour a replacement,
    # then synthesize. No counters, no routing, no result object.
    t0 = time.perf_counter()
    for p in payloads:
        for h in hooks:
            r = h(p, ctx)
            if r is not None:
                p = r
        synth(p)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--payloads", type=int, default=5_000, help="payloads per round")
    ap.add_argument("--rounds", type=int, default=61)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.payloads = 21, 5_000
    n = args.payloads

    payloads = [
        Payload(request_id=f"r{i}", draft_tokens=(i % 1000,), draft_probs=(0.5,), vocab_size=152064) for i in range(n)
    ]
    ctx = ReceiveContext(received_at=0.0)
    hooks = [NoOpHook() for _ in range(3)]
    synth = FixedSynth()
    pipe3 = ReceivePipeline([(f"noop{i}", h) for i, h in enumerate(hooks)], {"default": ("fixed", synth)})
    pipe0 = ReceivePipeline([], {"default": ("fixed", synth)})
    bound3 = [h.on_receive for h in hooks]

    # Sanity: the pipeline really runs and delivers.
    d = pipe3.process(payloads[0], ctx)
    assert isinstance(d, Delivery) and d.proposal is synth.proposal, d

    variants = {
        "pipe3": lambda: _pipeline_run(pipe3, payloads, ctx),
        "pipe0": lambda: _pipeline_run(pipe0, payloads, ctx),
        "plain3": lambda: _plain_run(bound3, synth.synthesize, payloads, ctx),
        "plain0": lambda: _plain_run([], synth.synthesize, payloads, ctx),
    }
    for fn in variants.values():  # warm-up
        fn()
    rng = random.Random(0)
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        keys = list(variants)
        rng.shuffle(keys)  # no variant always runs first (caches, frequency drift)
        for k in keys:
            samples[k].append(variants[k]() / n)
    med = {k: statistics.median(v) for k, v in samples.items()}
    # Load on a shared machine drifts between rounds more than within one, so the
    # chain cost is taken as a difference within each round (the variants ran back
    # to back), then the median over rounds; a ratio of two such medians is stable
    # where a median of per-round ratios of small differences is not.
    chain_pipe = statistics.median([a - b for a, b in zip(samples["pipe3"], samples["pipe0"])])
    chain_plain = statistics.median([a - b for a, b in zip(samples["plain3"], samples["plain0"])])
    process_ratios = [a / b for a, b in zip(samples["pipe3"], samples["plain3"])]
    per_hook = chain_pipe / 3
    ratio = chain_pipe / chain_plain if chain_plain > 0 else float("nan")
    process_ratio = statistics.median(process_ratios)
    for k, v in med.items():
        print(f"{k:7s} {v * 1e9:8.1f} ns/payload (median over {args.rounds} rounds)")
    print(
        f"overhead per hook {per_hook * 1e9:.1f} ns; ratio_vs_plain_loop {ratio:.2f} (target <= 3); "
        f"whole process() vs plain loop {process_ratio:.2f}"
    )
    emit(
        {
            "benchmark": "hooks",
            "overhead_us_per_hook": round(per_hook * 1e6, 4),
            "ratio_vs_plain_loop": round(ratio, 3),
            "process_ratio_vs_plain_loop": round(process_ratio, 3),
            "ns_per_payload": {k: round(v * 1e9, 1) for k, v in med.items()},
            "chain_ns_per_payload": {"pipeline": round(chain_pipe * 1e9, 1), "plain_loop": round(chain_plain * 1e9, 1)},
            "payloads_per_round": n,
            "rounds": args.rounds,
        }
    )


if __name__ == "__main__":
    main()
