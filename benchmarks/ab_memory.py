"""Memory of the main job (``pd-middleware ab``) against its size: flat in the number of requests.

Runs ``pd-middleware ab CONFIG --requests N`` (``configs/ab.toml`` by default: 4 arms,
V = 152064, batches of 32) once per size, each in a fresh process, and reads the peak
RSS of the decode (the ``ab`` process) and of its prefill process from the report
(``pipeline.peak_rss_bytes``: each process's ``ru_maxrss``). One JSON line:

- ``runs[]``: per size, ``peak_rss_mb`` of both processes, ``wall_s``, ``payloads_per_s``
  (every arm's payloads over the run's wall time) and ``cpu_share``: each stage's CPU
  seconds as a share of all stages of both processes (``pipeline.cpu_s``; they run
  concurrently on two processes and four threads, so shares of CPU, not of wall time);
- ``ratio``: largest over smallest peak RSS across sizes, per process (goal <= 1.2);
- ``peak_decode_mb``: the largest decode peak (goal <= 1500 at V = 152064);
- ``met``: both goals, and every run exact with nothing lost and exit code 0.

The default sizes (1,000, 4,000 and 16,000 requests per arm) take about an hour on 2
shared cores; ``--sizes 100,400`` is a quick look. ``run_all.py`` skips this script for
that reason: run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE)]

from _common import emit

GOAL_RATIO = 1.2
GOAL_DECODE_MB = 1500.0
MB = 1e6


def run_size(config: str, n: int, timeout: float) -> dict[str, Any]:
    """One ``pd-middleware ab`` run of ``n`` requests per arm in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="ab-memory-") as out:
        cmd = [sys.executable, "-m", "pd_middleware.cli", "ab", config, "--requests", str(n)]
        cmd += ["--out", out, "--no-progress", "--format", "json"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        dt = time.monotonic() - t0
        path = Path(out) / "report.json"
        if not path.exists():
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
            raise SystemExit(f"ab_memory: --requests {n} wrote no report (exit {proc.returncode}): {tail}")
        rep = json.loads(path.read_text())
    pipe = rep["pipeline"]
    cpu = pipe["cpu_s"]
    total_cpu = sum(cpu.values()) or 1.0
    payloads = sum(a["payloads"]["sent"] for a in rep["arms"])
    return {
        "requests_per_arm": n,
        "arms": len(rep["arms"]),
        "exit_code": proc.returncode,
        # Why a run that wrote its report still exited non-zero (empty when it exited 0).
        "stderr_tail": " | ".join(proc.stderr.strip().splitlines()[-2:]) if proc.returncode else "",
        "exact": all(a["exact"]["pass"] for a in rep["arms"]),
        "lost": sum(a["payloads"]["sent"] - a["payloads"]["delivered"] - a["payloads"]["failed"] for a in rep["arms"]),
        "failed": sum(a["payloads"]["failed"] for a in rep["arms"]),
        "peak_rss_mb": {k: round(v / MB, 1) for k, v in pipe["peak_rss_bytes"].items()},
        "wall_s": round(rep["wall_s"], 1),
        "process_s": round(dt, 1),
        "payloads_per_s": round(payloads / rep["wall_s"], 1),
        "in_flight_batches": pipe["in_flight_batches"],
        "credit_wait_s": pipe["credit_wait_s"],
        "cpu_s": cpu,
        "cpu_share": {k: round(v / total_cpu, 3) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])},
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/ab.toml", help="the job's config (default: configs/ab.toml)")
    ap.add_argument(
        "--sizes", default="1000,4000,16000", help="requests per arm, comma-separated (default: 1000,4000,16000)"
    )
    ap.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds allowed per run (default: 6 h)")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes: expected comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 1:
        ap.error("--sizes: need at least one size, each >= 1")
    runs = []
    for n in sizes:
        r = run_size(args.config, n, args.timeout)
        print(
            f"{n:>6}/arm  decode {r['peak_rss_mb']['decode']:7.1f} MB  prefill {r['peak_rss_mb']['prefill']:7.1f} MB"
            f"  {r['payloads_per_s']:6.1f} payloads/s  {r['wall_s']:7.1f} s  exact {r['exact']}  lost {r['lost']}",
            flush=True,
        )
        runs.append(r)
    ratio = {
        p: round(max(r["peak_rss_mb"][p] for r in runs) / min(r["peak_rss_mb"][p] for r in runs), 3)
        for p in ("decode", "prefill")
    }
    peak_decode = max(r["peak_rss_mb"]["decode"] for r in runs)
    met = (
        max(ratio.values()) <= GOAL_RATIO
        and peak_decode <= GOAL_DECODE_MB
        and all(r["exact"] and r["lost"] == 0 and r["exit_code"] == 0 for r in runs)
    )
    emit(
        {
            "benchmark": "ab_memory",
            "config": args.config,
            "sizes": sizes,
            "runs": runs,
            "ratio": ratio,
            "ratio_goal": GOAL_RATIO,
            "peak_decode_mb": peak_decode,
            "peak_decode_goal_mb": GOAL_DECODE_MB,
            "met": met,
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
