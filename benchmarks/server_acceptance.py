"""First-verify acceptance in a real SGLang PD pair on CPU: aggregated against PD, per decode strategy.

The same seeded-order prompts (standard-library function openings) go through an
aggregated server and through a PD pair (prefill + decode + sglang-router, Mooncake over
TCP) once per decode strategy, all with EAGLE3 and rejection sampling, on the trained
tiny models (tests/server: harness, CPU stand-ins, docs/server.md). Prints one JSON line:

- ``first_verify``: P(the first verify accepts >= 1 draft) at T = 1, ``max_new_tokens = 2``
  (one verify a request), from SGLang's per-request ``spec_num_correct_drafts``, with
  its standard error; for PD with the drop-in also from the decode's own counters in
  SGLang's ``/metrics`` (``pd_middleware_first_verify_accepted_tokens``), no manual join;
- ``accept_length``: SGLang's own mean ``spec_accept_length`` per request at T = 1,
  ``max_new_tokens = 16`` (accepted drafts + bonus per verify, every verify);
- ``gap_won_back``: (PD strategy - PD one-hot) / (aggregated - PD one-hot) for first_verify.

Strategies: ``none`` (no drop-in: SGLang's own one-hot), ``sglang`` (configs/sglang.toml),
``sparse_floor``, ``full_fp32``, ``one_hot``. Usage::

    PDM_SERVER_MODELS=<dir with target/ and eagle3/> python benchmarks/server_acceptance.py [--n 128] [--strategies ...]
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
    "one_hot": "one_hot.toml",
}


def _rate_json(r: w.Rate) -> dict[str, float | int]:
    return {"p": round(r.p, 4), "se": round(r.se, 4), "n": r.n}


def _counters_rate(text: str) -> dict[str, float | int] | None:
    buckets = h.metric_values(text, "pd_middleware_first_verify_accepted_tokens_bucket")
    counts = h.metric_values(text, "pd_middleware_first_verify_accepted_tokens_count")
    total = int(sum(counts.values()))
    if not total:
        return None
    zero = sum(v for k, v in buckets.items() if 'le="0.0"' in k or 'le="0"' in k)
    hits = total - int(zero)
    return _rate_json(w.Rate(hits, total))


def measure(url: str, n: int) -> tuple[w.Rate, float]:
    first = w.first_verify_rate(w.generate(url, w.prompts(n, offset=2), temperature=1.0, max_new_tokens=2))
    res = w.generate(url, w.prompts(min(n, 64), offset=4), temperature=1.0, max_new_tokens=16)
    lengths = [r.accept_length for r in res if r.status == 200 and r.accept_length is not None]
    return first, sum(lengths) / max(1, len(lengths))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=128, help="requests per mode at max_new_tokens = 2 (default 128)")
    ap.add_argument("--strategies", nargs="*", default=list(STRATEGIES), choices=list(STRATEGIES))
    args = ap.parse_args(argv)
    root = os.environ.get("PDM_SERVER_MODELS")
    if not root or importlib.util.find_spec("sglang_router") is None:
        # run_all.py shows a skipped row: this figure needs the server tier (make setup-server).
        why = "needs PDM_SERVER_MODELS (target/, eagle3/) and make setup-server (docs/server.md)"
        print(json.dumps({"bench": "server_acceptance", "skipped": why}))
        return 0
    eagle3 = Path(root) / "eagle3"
    if not eagle3.is_dir():
        eagle3 = Path(root) / "eagle3-fullvocab"
    models = h.Models(Path(root) / "target", eagle3)
    tmp = Path(tempfile.mkdtemp(prefix="server-acceptance-"))
    out: dict[str, object] = {"bench": "server_acceptance", "n": args.n, "temperature": 1.0}
    t0 = time.monotonic()
    agg = h.start_server("aggregated", models, tmp / "agg")
    try:
        a_first, a_len = measure(agg.url, args.n)
    finally:
        h.stop(agg)
    out["aggregated"] = {"first_verify": _rate_json(a_first), "accept_length": round(a_len, 3)}
    pd: dict[str, object] = {}
    rates: dict[str, w.Rate] = {}
    for name in args.strategies:
        cfg = None
        if STRATEGIES[name] is not None:
            cfg = h.server_config(REPO / "configs" / STRATEGIES[name], tmp / STRATEGIES[name])
        pair = h.start_pair(models, tmp / name, prefill_config=cfg, decode_config=cfg, extra_args=["--enable-metrics"])
        try:
            first, length = measure(pair.router.url, args.n)  # type: ignore[union-attr]
            time.sleep(3)  # the counters' copy into SGLang's /metrics runs every sync_interval_s
            counters = _counters_rate(h.get_text(pair.decode.url + "/metrics")) if cfg else None
        finally:
            pair.stop()
        rates[name] = first
        pd[name] = {
            "first_verify": _rate_json(first),
            "accept_length": round(length, 3),
            "first_verify_counters": counters,
        }
    base = rates.get("none")
    for name, r in rates.items():
        if base is not None and a_first.p != base.p:
            pd[name]["gap_won_back"] = round((r.p - base.p) / (a_first.p - base.p), 3)  # type: ignore[index]
    out["pd"] = pd
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
