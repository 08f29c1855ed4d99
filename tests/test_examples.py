"""The README's Python example runs as written (small vocab to keep it fast)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_loopback_example_runs():
    out = subprocess.run(
        [sys.executable, "examples/loopback.py", "configs/sparse_floor.toml", "--vocab", "2048", "--batch", "6"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "delivered 6/6; draft_probs (6, 2048) torch.float32" in out.stdout
    assert "failed    0" in out.stdout


def test_example_plugin_package_tests_pass():
    """examples/pd-middleware-example-plugin's own tests (`make setup` installs the package)."""
    pkg = ROOT / "examples" / "pd-middleware-example-plugin"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(pkg / "tests")],
        cwd=pkg,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "4 passed" in out.stdout
