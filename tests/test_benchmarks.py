"""Benchmark scripts: the GPU check skips cleanly on a CPU machine, the runner's CLI works.

The heavy benchmarks themselves never run here: performance claims live in
``benchmarks/`` and ``docs/performance.md``, not in timed tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _run(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "plugins"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_gpu_check_skips_cleanly_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_check would run for real")
    proc = _run(str(BENCH / "gpu_check.py"))
    assert proc.returncode == 0, f"gpu_check exited {proc.returncode}: {proc.stderr[-2000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    result = json.loads(last)
    assert result["benchmark"] == "gpu_check"
    assert "CUDA not available" in result["skipped"], result


def test_gpu_sampling_skips_cleanly_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_sampling would run for real")
    proc = _run(str(BENCH / "gpu_sampling.py"))
    assert proc.returncode == 0, f"gpu_sampling exited {proc.returncode}: {proc.stderr[-2000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "gpu_sampling"
    assert "CUDA not available" in result["skipped"], result


def test_gpu_check_skip_reason_is_none_only_with_cuda():
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(BENCH))
    reason = gpu_check.skip_reason()
    assert (reason is None) == torch.cuda.is_available(), reason


def test_run_all_help_and_unknown_name():
    proc = _run(str(BENCH / "run_all.py"), "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--only" in proc.stdout and "--quick" in proc.stdout
    # Negative control: a wrong name is refused with the list of real ones, nothing runs.
    bad = _run(str(BENCH / "run_all.py"), "--only", "no_such_bench", timeout=60)
    assert bad.returncode != 0
    assert "unknown benchmark(s): no_such_bench" in bad.stderr


def test_run_all_reports_a_skip_without_failing():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_check would run for real")
    proc = _run(str(BENCH / "run_all.py"), "--only", "gpu_check")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SKIP" in proc.stdout and "0 error" in proc.stdout


def test_sglang_inband_quick_mode_prints_its_figures():
    """The in-band benchmark runs end to end in quick mode and reports every figure it
    promises (values are not asserted: timings on a shared machine are not facts)."""
    pytest.importorskip("torch")
    proc = _run(str(BENCH / "sglang_inband.py"), "--quick", timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "sglang_inband" and result["quick"] is True
    assert set(result["aux_bytes_per_request"]) == {"one_hot", "sparse_floor"}
    # One-hot rows carry X and q(X) only; sparse_floor rows carry thousands of entries.
    assert result["aux_bytes_per_request"]["one_hot"] < 128 < result["aux_bytes_per_request"]["sparse_floor"]
    assert result["entries_per_request"]["sparse_floor"] > 100
    assert (
        result["per_request_us"] > 0
        and result["per_request_us_by_strategy"]["sparse_floor"] == result["per_request_us"]
    )
    ratios = result["ratio_vs_sglang_builder"]
    if importlib.util.find_spec("sglang") is None:
        assert ratios == {"skipped": "SGLang is not installed"}
    else:
        assert set(ratios["sparse_floor"]) == {"B1", "B16"} and result["ratio_vs_sglang_builder_B16"] > 0


def test_ab_memory_reports_both_processes_at_each_size():
    """The main job's memory benchmark at two tiny sizes: one JSON line with both peaks per
    size and the ratios (values are not asserted: RSS on a shared machine is not a fact)."""
    proc = _run(str(BENCH / "ab_memory.py"), "--config", "configs/ab_tiny.toml", "--sizes", "16,32", timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "ab_memory" and result["sizes"] == [16, 32]
    for run in result["runs"]:
        assert set(run["peak_rss_mb"]) == {"decode", "prefill"} and min(run["peak_rss_mb"].values()) > 0
        assert run["exact"] is True and run["lost"] == 0 and run["payloads_per_s"] > 0
        assert abs(sum(run["cpu_share"].values()) - 1) < 0.01 and "decode.verify" in run["cpu_share"]
    assert set(result["ratio"]) == {"decode", "prefill"} and isinstance(result["met"], bool)
    bad = _run(str(BENCH / "ab_memory.py"), "--sizes", "0")
    assert bad.returncode == 2 and "--sizes: need at least one size, each >= 1" in bad.stderr


def test_prefill_encode_quick_mode_prints_its_figures():
    """The prefill encode benchmark runs in quick mode and reports both paths for every
    strategy (values are not asserted: timings on a shared machine are not facts)."""
    pytest.importorskip("torch")
    proc = _run(str(BENCH / "prefill_encode.py"), "--quick", "--repeats", "1", timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "prefill_encode" and result["quick"] is True
    for key in ("ms_per_batch", "ratio_per_request_over_batched", "ratio_vs_floor"):
        assert set(result[key]) == {"sparse_floor", "one_hot", "full_fp32"}
        assert all(set(v) == {"B1", "B16"} and all(x > 0 for x in v.values()) for v in result[key].values())


def test_recompute_quick_mode_prints_its_peak_memory_beside_sglangs_one_hot():
    """The recompute benchmark in quick mode reports its peak memory per B beside SGLang's
    one-hot rows, with the method. Behaviour, not values: the measure sees the allocations
    it claims to (SGLang's (B, 1, V) fp32 one-hot is B x V x 4 bytes, and the recompute's
    peak holds at least q' of that size), and says how it measured."""
    pytest.importorskip("torch")
    proc = _run(str(BENCH / "recompute.py"), "--quick", timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "recompute" and result["quick"] is True
    peaks = result["peak_memory"]
    if importlib.util.find_spec("sglang") is None:
        assert peaks == {"skipped": "SGLang is not installed"}
        return
    assert "torch.profiler(profile_memory=True)" in peaks["method"] or "cuda" in peaks["method"], peaks
    for b in ("B1", "B16"):
        row = peaks[b]
        assert abs(row["sglang_one_hot_mb"] - row["q_prime_mb"]) <= 0.1, row
        assert row["recompute_peak_mb"] >= row["q_prime_mb"], row
    assert result["peak_over_one_hot_largest_B"] == peaks["B16"]["ratio"]
