"""First-verify acceptance in a real SGLang PD pair on CPU: aggregated against PD, per decode strategy.

The same prompts (standard-library function openings) go through an aggregated server
and through a PD pair (prefill + decode + sglang-router, Mooncake over TCP) once per
decode strategy, all with EAGLE3 and rejection sampling, on the trained tiny models
(tests/server: harness, CPU stand-ins, docs/server.md). Prints one JSON line:

- ``first_verify``: P(the first verify accepts >= 1 draft) at T = 1, ``max_new_tokens = 2``
  (one verify a request), from SGLang's per-request ``spec_num_correct_drafts``, with
  its standard error; for the live A/B pair also per arm from the decode's own counters in
  SGLang's ``/metrics`` (``pd_middleware_first_verify_accepted_tokens{arm}``);
- ``accept_length``: SGLang's own mean ``spec_accept_length`` per request at T = 1,
  ``max_new_tokens = 16`` (accepted drafts + bonus per verify, every verify);
- ``gap_won_back``: (PD strategy - PD one-hot) / (aggregated - PD one-hot) for first_verify;
- ``greedy_equal``: of 8 greedy requests (12 tokens), how many gave the aggregated
  server's output ids exactly; ``errors``: requests not answered 200, of all sent.

Strategies: ``none`` (no drop-in: SGLang's own one-hot), ``sglang`` (configs/sglang.toml,
decode-only recompute: the decode alone runs it), ``sparse_floor``, ``full_fp32``,
``full_bf16``, ``sparse_topk``, ``sparse_topp``, ``one_hot``, ``live_ab`` (configs/sglang_live_ab.toml: arms sparse and one_hot on one
pair). The models are ``PDM_SERVER_MODELS`` (a folder with target/ and eagle3/) or the
tier's own trained pair (tests/server/models/build.py, cached under build/); with
``--model deepseek`` the tier's DeepSeek-V3-style target (MLA, MoE) with its NextN layer as
the draft (``--speculative-algorithm EAGLE``, the target its own draft). Usage::

    python benchmarks/server_acceptance.py [--n 128] [--model llama|deepseek] [--strategies none sglang ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from server import harness as h
from server import workload as w

STRATEGIES = {
    "none": None,
    "sglang": "sglang.toml",
    "sparse_floor": "sparse_floor.toml",
    "full_fp32": "full_fp32.toml",
    "full_bf16": "full_bf16.toml",
    "sparse_topk": "sparse_topk.toml",
    "sparse_topp": "sparse_topp.toml",
    "one_hot": "one_hot.toml",
    "live_ab": "sglang_live_ab.toml",
}
#: Greedy prompts per mode, compared token for token with the aggregated server's outputs.
N_GREEDY = 8
#: Strategies whose config runs on the decode alone (the prefill is stock).
DECODE_ONLY = {"sglang"}


def _rate_json(r: w.Rate) -> dict[str, float | int]:
    return {"p": round(r.p, 4), "se": round(r.se, 4), "n": r.n}


def _arm_rates(text: str) -> dict[str, dict[str, float | int]] | None:
    """Per arm, P(first verify accepts >= 1) from the decode's first-verify histogram."""
    from pd_middleware.evaluation.live_ab import parse_prometheus

    try:
        arms = parse_prometheus(text)
    except Exception:  # no [[arms]]: the histogram is not recorded
        return None
    return {a: _rate_json(w.Rate(v.n - v.counts[0], v.n)) for a, v in sorted(arms.items()) if v.n}


def load_models(kind: str = "llama") -> h.Models:
    """The tier's models (``PDM_SERVER_MODELS`` or the trained pair, built and cached under
    build/; ``kind`` ``deepseek``: the trained DeepSeek target, its own NextN draft), after
    the CPU gap transformers' torchvision import needs."""
    sys.path.insert(0, str(REPO / "tests" / "server" / "site"))
    import cpu_gaps  # transformers (the model builder) imports torchvision: its CPU gap first

    cpu_gaps.install_from_env({cpu_gaps.ENV_GAPS: "torchvision_meta"})
    return _models(kind)


def _models(kind: str) -> h.Models:
    root = os.environ.get("PDM_SERVER_MODELS")
    if kind == "deepseek":
        from server.models.build import build_models

        target = Path(build_models(REPO / "build" / "server-models")["trained_deepseek"])
        return h.Models(target, target, "EAGLE")
    if root:
        eagle3 = Path(root) / "eagle3"
        if not eagle3.is_dir():
            eagle3 = Path(root) / "eagle3-fullvocab"
        return h.Models(Path(root) / "target", eagle3)
    from server.models.build import build_models

    built = build_models(REPO / "build" / "server-models")
    return h.Models(Path(built["trained_target"]), Path(built["trained_eagle3"]))


def measure(url: str, n: int) -> tuple[w.Rate, float, list[w.Result]]:
    """First-verify rate, mean accept length, and every result (greedy ones last)."""
    fv = w.generate(url, w.prompts(n, offset=2), temperature=1.0, max_new_tokens=2)
    res = w.generate(url, w.prompts(min(n, 64), offset=4), temperature=1.0, max_new_tokens=16)
    greedy = w.generate(url, w.prompts(N_GREEDY, offset=1), temperature=0.0, max_new_tokens=12)
    lengths = [r.accept_length for r in res if r.status == 200 and r.accept_length is not None]
    return w.first_verify_rate(fv), sum(lengths) / max(1, len(lengths)), fv + res + greedy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=128, help="requests per mode at max_new_tokens = 2 (default 128)")
    ap.add_argument("--strategies", nargs="*", default=list(STRATEGIES), choices=list(STRATEGIES))
    ap.add_argument(
        "--model",
        choices=("llama", "deepseek"),
        default="llama",
        help="the tier's Llama target with its EAGLE3 draft (default), or its DeepSeek-V3-style target with NextN",
    )
    args = ap.parse_args(argv)
    if importlib.util.find_spec("sglang_router") is None:
        # run_all.py shows a skipped row: this figure needs the server tier (make setup-server).
        print(json.dumps({"bench": "server_acceptance", "skipped": "needs make setup-server (docs/server.md)"}))
        return 0
    models = load_models(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="server-acceptance-"))
    out: dict[str, object] = {"bench": "server_acceptance", "model": args.model, "n": args.n, "temperature": 1.0}
    t0 = time.monotonic()
    agg = h.start_server("aggregated", models, tmp / "agg")
    try:
        a_first, a_len, a_res = measure(agg.url, args.n)
    finally:
        h.stop(agg)
    a_greedy = [r.output_ids for r in a_res[-N_GREEDY:]]
    out["aggregated"] = {
        "first_verify": _rate_json(a_first),
        "accept_length": round(a_len, 3),
        "errors": f"{sum(r.status != 200 for r in a_res)}/{len(a_res)}",
    }
    pd: dict[str, object] = {}
    rates: dict[str, w.Rate] = {}
    for name in args.strategies:
        cfg = None
        if STRATEGIES[name] is not None:
            cfg = h.server_config(REPO / "configs" / STRATEGIES[name], tmp / STRATEGIES[name])
        pair = h.start_pair(
            models,
            tmp / name,
            prefill_config=None if name in DECODE_ONLY else cfg,
            decode_config=cfg,
            extra_args=["--enable-metrics"],
        )
        try:
            first, length, res = measure(pair.router.url, args.n)  # type: ignore[union-attr]
            time.sleep(3)  # the counters' copy into SGLang's /metrics runs every sync_interval_s
            arms = _arm_rates(h.get_text(pair.decode.url + "/metrics")) if cfg else None
        finally:
            pair.stop()
        rates[name] = first
        same = sum(r.output_ids == g for r, g in zip(res[-N_GREEDY:], a_greedy))
        pd[name] = {
            "first_verify": _rate_json(first),
            "accept_length": round(length, 3),
            "greedy_equal": f"{same}/{N_GREEDY}",
            "errors": f"{sum(r.status != 200 for r in res)}/{len(res)}",
        }
        if arms:
            pd[name]["first_verify_by_arm"] = arms  # both runs of measure(): max_new_tokens 2 and 16
    base = rates.get("none")
    for name, r in rates.items():
        if base is not None and a_first.p != base.p:
            pd[name]["gap_won_back"] = round((r.p - base.p) / (a_first.p - base.p), 3)  # type: ignore[index]
    out["pd"] = pd
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    print(f"server_acceptance: {out['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
