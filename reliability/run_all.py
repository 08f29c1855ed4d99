"""Run every reliability script and print a summary table (``make reliability``).

``python reliability/run_all.py [--only fuzz load ...] [--quick] [--json PATH]``

Each script runs as its own subprocess with a timeout and must print one JSON object as
its last stdout line. The summary shows, per script, the wall time, the main figures and
its must-be-zero figures. Exit status 1 when a script crashes, times out, exits non-zero
or reports a non-zero must-be-zero figure. ``--quick`` runs small counts (a smoke run of
about a minute, not the campaign). ``--json PATH`` also writes every script's result.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))

# (script, campaign args, quick args, timeout in seconds)
SCRIPTS: dict[str, tuple[list[str], list[str], float]] = {
    "fuzz": ([], ["--cases", "5000", "--budget-s", "60"], 420.0),
    "load": ([], ["--per-proc", "2000", "--budget-s", "90"], 420.0),
    "faults": ([], [], 300.0),
    "config_fuzz": ([], ["--cases", "1000"], 240.0),
    "attacks_bulk": ([], ["--rounds", "24", "--budget-s", "60"], 300.0),
    "attacks": ([], ["--scale", "0.2"], 300.0),
}

# Figures shown in the table, per script.
SHOWN = {
    "fuzz": [
        "tried",
        "rejected_with_field",
        "accepted",
        "control_accepted",
        "dropped_by_libzmq",
        "receiver_alive",
        "msgs_per_s",
    ],
    "load": ["sent", "delivered", "failed", "lost", "throughput_per_s", "latency_ms_p50", "latency_ms_p99"],
    "faults": ["failed_scenarios"],
    "config_fuzz": ["tried", "rejected_with_path", "accepted_silently"],
    "attacks_bulk": ["attacks", "refused", "controls_delivered", "crashes", "hangs", "lost", "wrong_deliveries"],
    "attacks": ["attacks", "crashes", "hangs", "lost", "wrong"],
}


def run(name: str, quick: bool) -> dict[str, Any]:
    campaign, small, timeout = SCRIPTS[name]
    cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), *(small if quick else campaign)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {
            "_status": f"TIMEOUT after {timeout:g} s",
            "_seconds": round(time.monotonic() - t0, 1),
            "_tail": out[-500:],
        }
    elapsed = round(time.monotonic() - t0, 1)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict):
        return {
            "_status": f"CRASH (exit {proc.returncode}, no JSON line)",
            "_seconds": elapsed,
            "_tail": (proc.stdout + proc.stderr)[-800:],
        }
    result["_status"] = "ok" if proc.returncode == 0 else f"FAIL (exit {proc.returncode})"
    result["_seconds"] = elapsed
    return result


def nonzero_must(result: dict[str, Any]) -> list[str]:
    bad = []
    for key in result.get("must_be_zero", []):
        v = result.get(key)
        if v not in (0, [], None, False):
            bad.append(f"{key}={v}")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=list(SCRIPTS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results: dict[str, dict[str, Any]] = {}
    failed = False
    for name in args.only:
        print(f"== {name} ...", flush=True)
        r = run(name, args.quick)
        results[name] = r
        bad = nonzero_must(r)
        if r["_status"] != "ok" or bad:
            failed = True
        shown = ", ".join(f"{k}={r[k]}" for k in SHOWN[name] if k in r)
        print(
            f"   {r['_status']} in {r['_seconds']} s; {shown}" + (f"; MUST BE ZERO: {', '.join(bad)}" if bad else ""),
            flush=True,
        )
        if "_tail" in r:
            print("   " + r["_tail"].replace("\n", "\n   "), flush=True)
    print()
    print(f"{'script':<12} {'status':<22} {'seconds':>8}  must-be-zero")
    for name, r in results.items():
        must = ", ".join(f"{k}={r.get(k)}" for k in r.get("must_be_zero", [])) or "-"
        print(f"{name:<12} {r['_status']:<22} {r['_seconds']:>8}  {must}")
    if "faults" in results and isinstance(results["faults"].get("scenarios"), dict):
        print()
        print(
            f"{'fault':<20} {'ok':<5} {'affected failed':>15} {'unaffected delivered':>21} {'lost':>5} {'recovery s':>11}"
        )
        for n, s in results["faults"]["scenarios"].items():
            una = s.get("unaffected_delivered", s.get("unaffected_delivered_during_freeze"))
            print(
                f"{n:<20} {s.get('ok')!s:<5} {s.get('affected_failed_with_reason')!s:>15} {una!s:>21} {s.get('lost')!s:>5} {s.get('recovery_s')!s:>11}"
            )
    if "attacks" in results and isinstance(results["attacks"].get("cases"), dict):
        print()
        print(f"{'attack':<16} {'attacks':>8} {'crashes':>8} {'hangs':>6} {'lost':>5} {'wrong':>6}  figures")
        for n, c in results["attacks"]["cases"].items():
            figs = ", ".join(f"{k}={c[k]}" for k in ("rss_growth_mb", "bound_mb", "handshakes_accepted") if k in c)
            print(
                f"{n:<16} {c.get('attacks', '-'):>8} {c.get('crashes'):>8} {c.get('hangs'):>6} {c.get('lost'):>5} {c.get('wrong'):>6}  {figs}"
            )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    print()
    print("reliability: FAILED" if failed else "reliability: all promises held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
