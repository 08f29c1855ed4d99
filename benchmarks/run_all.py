"""Run every benchmark and print one summary table: figure, value, target, limit, pass/fail.

Each ``benchmarks/*.py`` script (except ``_common.py`` and this one) runs as its own
subprocess with a timeout; its last stdout line is parsed as one JSON object. A figure
that misses its target is reported as ``MISS``, never hidden; the exit status is
non-zero only when a script crashed, timed out or printed no JSON (``ERROR``).

Usage: ``python benchmarks/run_all.py [--only NAME ...] [--quick] [--timeout S] [--json PATH]``
(``make bench`` runs it with no option).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# ab_memory runs the main job at 1,000 to 16,000 requests per arm (about an hour on 2
# cores, past any per-script timeout here), and server_acceptance, pd_stall and multi_layer_kv start real
# SGLang servers, a pair per strategy or mode (20 minutes and more): run them alone
# (docs/performance.md, docs/server.md).
SKIP = {"_common", "run_all", "ab_memory", "server_acceptance", "pd_stall", "multi_layer_kv"}
#: Extra runs of a script with arguments, reported under their own name: the receive
#: target must hold with CURVE on (issue 13), measured in the same run as the plain one.
VARIANTS: dict[str, tuple[str, list[str]]] = {"receive_curve": ("receive", ["--curve"])}


@dataclass(frozen=True)
class Figure:
    """A reported figure: where it lives in the JSON, its target and the limit it is measured against."""

    key: str
    target: str
    limit: str
    ok: Callable[[float], bool] | None = None


# Targets come from the issues that defined each benchmark; figures without a target
# are listed for information (target "-").
FIGURES: dict[str, list[Figure]] = {
    "assemble": [
        Figure(
            "vocab_scaling",
            "<= 2.0",
            "one-hot build, t(V=152064) / t(V=1024): a scatter of B entries",
            lambda x: x <= 2.0,
        ),
        Figure("speedup_vs_naive", ">= 100", "zeros (B, V) + scatter at V=152064", lambda x: x >= 100),
    ],
    "sparse": [
        Figure(
            "vocab_scaling", "<= 2.0", "sparse build (B=64, 1024/row), t(V=152064) / t(V=16384)", lambda x: x <= 2.0
        ),
        Figure("speedup_vs_naive", "-", "zeros (B, V) + scatter at V=152064"),
    ],
    "hooks": [
        Figure(
            "ratio_vs_plain_loop",
            "<= 3",
            "3 no-op hooks in the pipeline vs the same 3 calls in a for-loop",
            lambda x: x <= 3,
        ),
        Figure("overhead_us_per_hook", "-", "marginal cost of one hook per payload"),
        Figure("process_ratio_vs_plain_loop", "-", "whole process() vs plain loop of the same hooks + synthesizer"),
    ],
    "memory": [
        Figure(
            "rss_growth_mb",
            "<= 50",
            "RSS after 100k payloads - after warm-up (one vocab row is 0.6 MB)",
            lambda x: x <= 50,
        ),
        Figure("rss_growth_second_half_mb", "-", "growth over the last 50k alone (a leak keeps climbing)"),
        Figure("payloads_per_s", "-", "receive + assemble rate during the run"),
    ],
    "receive": [
        Figure("ratio_vs_raw_zmq", ">= 0.5", "raw pyzmq PUSH/PULL of the same frames", lambda x: x >= 0.5),
        Figure("ours_payloads_per_s", "-", "decode receive path, payloads/s"),
    ],
    "receive_curve": [
        Figure(
            "ratio_vs_raw_zmq",
            ">= 0.5",
            "raw pyzmq PUSH/PULL (plain) vs our receive path with CURVE + ZAP allowlist on",
            lambda x: x >= 0.5,
        ),
        Figure(
            "ratio_vs_raw_zmq_curve",
            ">= 0.5",
            "raw pyzmq PUSH/PULL with CURVE on both ends vs our receive path with CURVE + ZAP allowlist on",
            lambda x: x >= 0.5,
        ),
        Figure("curve_cost_raw", "-", "share of raw pyzmq throughput libzmq's CURVE alone takes"),
        Figure("ours_payloads_per_s", "-", "decode receive path with CURVE, payloads/s"),
    ],
    "bulk": [
        Figure(
            "ratio_vs_raw_mooncake", ">= 0.8", "raw Mooncake transfer_sync_write of the same bytes", lambda x: x >= 0.8
        ),
        Figure(
            "blake3_ratio_vs_raw_mooncake", "-", "the same with the cryptographic digest (BLAKE3, authenticated mode)"
        ),
    ],
    "sglang_inband": [
        Figure(
            "per_request_us",
            "<= 50",
            "one in-band row -> proposal (read, validate, synthesize) at sparse_floor, ~2,700 entries",
            lambda x: x <= 50,
        ),
        Figure(
            "ratio_vs_sglang_builder_B1",
            "<= 1.5",
            "SGLang's pd_first_draft_proposal alone, B=1 (sparse_floor rows: read, decode, synthesize, assemble)",
            lambda x: x <= 1.5,
        ),
        Figure("ratio_vs_sglang_builder_B16", "<= 1.5", "the same at B=16", lambda x: x <= 1.5),
        Figure("ratio_vs_sglang_builder_B256", "<= 1.5", "the same at B=256", lambda x: x <= 1.5),
    ],
    "recompute": [
        Figure(
            "ratio_B1",
            "<= 1.2",
            "SGLang's step 0 (LogitsProcessor + renorm_draft_probs + fast_sample), V=152064, B=1",
            lambda x: x <= 1.2,
        ),
        Figure("ratio_B16", "<= 1.2", "the same at B=16", lambda x: x <= 1.2),
        Figure("ratio_largest_B", "<= 1.2", "the same at the largest B (256 on CUDA, 64 on CPU)", lambda x: x <= 1.2),
        Figure(
            "recompute_over_full_synthetic",
            ">= 0.999",
            "paired E[accept] of the full fp32 row, synthetic",
            lambda x: x >= 0.999,
        ),
        Figure("recompute_over_full_ngram", ">= 0.999", "the same, ngram", lambda x: x >= 0.999),
        Figure(
            "peak_over_one_hot_largest_B",
            "-",
            "extra peak memory over SGLang's one-hot rows (B, 1, V) fp32, largest memory B (256: q' + one chunk)",
        ),
    ],
    "prefill_encode": [
        *(
            Figure(
                f"per_request_over_batched_{st}",
                "-",
                f"{st}: the per-request encode (host copy, a generator each) over one batched call, largest B",
            )
            for st in ("sparse_floor", "one_hot", "full_fp32")
        ),
        *(
            Figure(f"batched_over_floor_{st}", "-", f"{st}: the batched encode over the least work of its kind")
            for st in ("sparse_floor", "one_hot", "full_fp32")
        ),
    ],
    "cancel": [
        Figure("ab_cancel_s", "<= 2", "run_ab: cancel.set() to the partial report, median", lambda x: x <= 2),
        Figure("ctrl_c_exit_s", "<= 2", "pd-middleware ab: SIGINT to exit 130, median", lambda x: x <= 2),
        Figure(
            "ctrl_c_partial_share",
            "1",
            "Ctrl-C runs that wrote the partial report within the CLI's 1.8 s grace",
            lambda x: x >= 1,
        ),
        Figure("yaml_bomb_refusal_s", "<= 1", "check-config on a billion-laughs YAML, median", lambda x: x <= 1),
    ],
    "end_to_end": [],  # one row per (encoding, B) built in _end_to_end_rows
    "gpu_check": [],  # skipped on CPU; rows built in _gpu_rows
}


def scripts(only: list[str] | None) -> list[tuple[str, Path, list[str]]]:
    """(name, script, extra arguments) for every run, variants right after their script."""
    runs: list[tuple[str, Path, list[str]]] = []
    for p in sorted(p for p in HERE.glob("*.py") if p.stem not in SKIP):
        runs.append((p.stem, p, []))
        runs += [(name, p, extra) for name, (base, extra) in VARIANTS.items() if base == p.stem]
    if only:
        names = {n.removesuffix(".py") for n in only}
        unknown = names - {name for name, _, _ in runs}
        if unknown:
            raise SystemExit(
                f"unknown benchmark(s): {', '.join(sorted(unknown))}; have {', '.join(n for n, _, _ in runs)}"
            )
        runs = [r for r in runs if r[0] in names]
    return runs


def run_script(
    path: Path, quick: bool, timeout: float, script_args: list[str] | None = None
) -> tuple[dict[str, Any] | None, str, float]:
    """Run one script (with ``script_args``); returns (parsed last JSON line or None, error text, seconds)."""
    env = dict(os.environ)
    extra = [str(ROOT), str(ROOT / "plugins")]
    env["PYTHONPATH"] = os.pathsep.join(extra + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    # Only scripts that define --quick get it (the others run at their defaults).
    quick = quick and "--quick" in path.read_text()
    cmd = [sys.executable, str(path), *(script_args or [])] + (["--quick"] if quick else [])
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        sys.stdout.write(out)
        return None, f"timed out after {timeout:.0f} s", time.monotonic() - t0
    dt = time.monotonic() - t0
    sys.stdout.write(proc.stdout)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-3:]
        return _parse(lines), f"exit {proc.returncode}: {' | '.join(tail)}", dt
    parsed = _parse(lines)
    if parsed is None:
        return None, "last stdout line is not a JSON object", dt
    return parsed, "", dt


def _parse(lines: list[str]) -> dict[str, Any] | None:
    if not lines:
        return None
    try:
        obj = json.loads(lines[-1])
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,d}"
    return str(v)


def _rows(name: str, res: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(figure, value, target, limit, verdict) rows for one script's JSON."""
    if "skipped" in res:
        return [(f"{name}", "skipped", "-", str(res["skipped"]), "SKIP")]
    if name == "end_to_end":
        return _end_to_end_rows(res)
    if name == "gpu_check":
        return _gpu_rows(res)
    if name == "strategies" and isinstance(res.get("best_within_budget"), dict):
        best = res["best_within_budget"]
        return [
            (
                "strategies.best_within_budget",
                f"{best.get('arm')}: acceptance x{_fmt(best.get('acceptance_ratio'))} at bytes x{_fmt(best.get('bytes_ratio'))}",
                "-",
                "full fp32 distribution (acceptance sum min(p, q) at V x 4 bytes)",
                "-",
            )
        ]
    figs = FIGURES.get(name) or _generic(res)
    rows = []
    for f in figs:
        if f.key not in res:
            rows.append((f"{name}.{f.key}", "absent", f.target, f.limit, "MISS" if f.ok else "-"))
            continue
        v = res[f.key]
        verdict = "-" if f.ok is None else ("pass" if isinstance(v, (int, float)) and f.ok(float(v)) else "MISS")
        rows.append((f"{name}.{f.key}", _fmt(v), f.target, f.limit, verdict))
    return rows


def _generic(res: dict[str, Any]) -> list[Figure]:
    # A benchmark this table does not know yet: list its scalar figures, no targets.
    return [
        Figure(k, "-", "-")
        for k, v in res.items()
        if k != "benchmark" and isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


def _end_to_end_rows(res: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    rows = []
    for run, r in res.get("results", {}).items():
        rows.append(
            (
                f"end_to_end.{run}",
                f"{_fmt(r['payloads_per_s'])}/s p50 {_fmt(r['latency_us_p50'])} us p99 {_fmt(r['latency_us_p99'])} us",
                "-",
                "zmq + mooncake loopback, receive -> batch built",
                "-",
            )
        )
    return rows


def _gpu_rows(res: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    fresh = res.get("graph_fresh")
    return [
        (
            "gpu_check.graph_fresh",
            _fmt(fresh),
            "true",
            "every replay sees the fresh batch, rows past B read 0",
            "pass" if fresh else "MISS",
        ),
        ("gpu_check.assemble_us_ours", _fmt(res.get("assemble_us_ours")), "-", "B=256 V=152064 one-hot build", "-"),
        (
            "gpu_check.assemble_us_zeros_scatter",
            _fmt(res.get("assemble_us_zeros_scatter")),
            "-",
            "zeros + scatter",
            "-",
        ),
        ("gpu_check.assemble_us_memset", _fmt(res.get("assemble_us_memset")), "-", "fill_(0) of the same bytes", "-"),
    ]


def print_table(rows: list[tuple[str, str, str, str, str]]) -> None:
    head = ("figure", "value", "target", "limit measured against", "result")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    widths[3] = min(widths[3], 70)
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths))
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", metavar="NAME", help="run only this benchmark (repeatable), e.g. hooks")
    ap.add_argument("--quick", action="store_true", help="pass --quick to every script (smaller, faster runs)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per script (default 600)")
    ap.add_argument("--json", metavar="PATH", help="also write every script's JSON result to PATH")
    args = ap.parse_args()

    rows: list[tuple[str, str, str, str, str]] = []
    results: dict[str, Any] = {}
    crashed = []
    for name, path, extra in scripts(args.only):
        print(f"=== {name} ===", flush=True)
        res, err, dt = run_script(path, args.quick, args.timeout, extra)
        print(f"--- {name}: {dt:.1f} s{'; ' + err if err else ''}", flush=True)
        if err:
            crashed.append(name)
            rows.append((name, "ERROR", "-", err[:70], "ERROR"))
            continue
        assert res is not None
        results[name] = res
        rows.extend(_rows(name, res))
    print()
    print_table(rows)
    misses = [r[0] for r in rows if r[4] == "MISS"]
    print()
    print(f"{len(rows)} figures; {sum(r[4] == 'pass' for r in rows)} pass, {len(misses)} miss, {len(crashed)} error")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    # Misses are reported above; only a crash fails the run.
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
