"""Lost KV transfers in a real SGLang PD pair on CPU: their rate per 1,000 requests, with and without the drop-in.

Why: a request of the server tier once waited 300 s for SGLang's "KV transfer done"
signal. That wait is SGLang's own: a decode receiver that has bootstrapped waits for the
prefill's transfer until ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s by default;
``disaggregation/common/conn.py``, ``_check_waiting_timeout``, about line 2888), then
fails the request ("Request ... timed out after ...s in KVPoll.WaitingForInput") and
counts it in ``sglang:num_transfer_failed_reqs_total``. The prefill side has the same
bound for the decode's KV indices (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``,
``_check_bootstrap_timeout``, about line 2388).

What it does: for each mode (``none``: no drop-in; ``dropin``: ``configs/sglang_live_ab.toml``
on both nodes, the in-band row and the live A/B split; ``recompute``: the default
``configs/sglang.toml`` on the decode), one pair (prefill + decode + sglang-router,
Mooncake over TCP, EAGLE3 with rejection sampling, the tier's trained tiny models) with
both timeouts set to ``--transfer-timeout`` seconds (a lost transfer then fails in that
time with SGLang's error instead of 300 s), and ``--n`` requests in a bounded loop
(``--concurrency`` at a time, each bounded by ``--request-timeout``). Per mode: requests
answered 200, failed (with SGLang's reasons), slower than ``--slow`` seconds, SGLang's
``num_transfer_failed_reqs`` on both nodes, its timeout lines in both logs, and each
as a rate per 1,000 requests. Prints one JSON line. Usage::

    python benchmarks/pd_stall.py [--n 1000] [--modes none dropin recompute]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from server import harness as h
from server import workload as w

MODES = {
    "none": (None, None),
    "dropin": ("sglang_live_ab.toml", "sglang_live_ab.toml"),
    "recompute": (None, "sglang.toml"),
}
TIMEOUT_LINES = ("in KVPoll.WaitingForInput", "in KVPoll.Bootstrapping", "Lost connection with prefill")


def _one(url: str, text: str, max_new_tokens: int, timeout_s: float) -> tuple[int, float, str]:
    t0 = time.monotonic()
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    status, body = h.post_json(url + "/generate", {"text": text, "sampling_params": params}, timeout_s=timeout_s)
    return status, time.monotonic() - t0, "" if status == 200 else str(body)[:200]


def _transfer_failed(url: str) -> float:
    try:
        return sum(h.metric_values(h.get_text(url + "/metrics"), "sglang:num_transfer_failed_reqs_total").values())
    except Exception:
        return float("nan")


def run_mode(name: str, models: h.Models, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    pre_cfg, dec_cfg = MODES[name]
    cfg = {c: h.server_config(REPO / "configs" / c, tmp / c) for c in {pre_cfg, dec_cfg} if c}
    env = {
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(args.transfer_timeout),
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(args.transfer_timeout),
    }
    pair = h.start_pair(
        models,
        tmp / name,
        prefill_config=cfg.get(pre_cfg) if pre_cfg else None,
        decode_config=cfg.get(dec_cfg) if dec_cfg else None,
        prefill_env=env,
        decode_env=env,
        extra_args=["--enable-metrics"],
    )
    texts = w.prompts(64, offset=11)
    results: list[tuple[int, float, str]] = []
    t0 = time.monotonic()
    try:
        url = pair.router.url  # type: ignore[union-attr]
        with ThreadPoolExecutor(args.concurrency) as pool:
            step = 100
            for start in range(0, args.n, step):  # bounded: n requests, each bounded in time
                batch = [texts[i % len(texts)] for i in range(start, min(args.n, start + step))]
                results += pool.map(lambda t: _one(url, t, args.max_new_tokens, args.request_timeout), batch)
                print(f"pd_stall {name}: {len(results)}/{args.n} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        time.sleep(3)  # SGLang's /metrics
        failed_pre, failed_dec = _transfer_failed(pair.prefill.url), _transfer_failed(pair.decode.url)
        logs = pair.prefill.log(10**8) + pair.decode.log(10**8)
    finally:
        pair.stop()
    n = len(results)
    lat = sorted(r[1] for r in results)
    errors: dict[str, int] = {}
    for status, _, err in results:
        if status != 200:
            key = f"{status}: {err[:100]}"
            errors[key] = errors.get(key, 0) + 1
    bad = sum(r[0] != 200 for r in results)
    slow = sum(r[1] > args.slow for r in results)
    lines = {k: logs.count(k) for k in TIMEOUT_LINES}
    per_k = 1000.0 / max(1, n)
    return {
        "n": n,
        "ok": n - bad,
        "failed": bad,
        "failed_per_1000": round(bad * per_k, 2),
        "slow": slow,
        "slow_per_1000": round(slow * per_k, 2),
        "transfer_failed_metric": {"prefill": failed_pre, "decode": failed_dec},
        "timeout_log_lines": lines,
        "errors": errors,
        "latency_s": {
            "p50": round(_percentile(lat, 0.5), 2),
            "p99": round(_percentile(lat, 0.99), 2),
            "max": round(lat[-1], 2),
        },
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000, help="requests per mode (default 1000)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--transfer-timeout", type=int, default=30, help="both SGLang PD transfer timeouts, s (default 30)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="each request's bound, s (default 120)")
    ap.add_argument(
        "--slow", type=float, default=10.0, help="a request slower than this is counted slow (default 10 s)"
    )
    args = ap.parse_args(argv)
    if importlib.util.find_spec("sglang_router") is None:
        print(json.dumps({"bench": "pd_stall", "skipped": "needs make setup-server (docs/server.md)"}))
        return 0
    from server_acceptance import load_models  # the same models as the acceptance benchmark

    models = load_models()
    tmp = Path(tempfile.mkdtemp(prefix="pd-stall-"))
    out: dict[str, Any] = {
        "bench": "pd_stall",
        "transfer_timeout_s": args.transfer_timeout,
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
    }
    for name in args.modes:
        out[name] = run_mode(name, models, tmp, args)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
