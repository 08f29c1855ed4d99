"""The wheel on its own: build it, install it into a fresh venv outside the repo, run it.

What this proves: the one wheel (``pd-middleware``, its first-party plugins and the
full-distribution pair included) carries everything the package needs at run time (code,
the shipped configs, entry points, the console script), so `pd-middleware ab` and
`check-config` work from an empty directory. What it does not prove: dependency
resolution. This fast, offline variant lets the fresh venv see this environment's
already-installed dependencies (torch, Mooncake, ...) through a ``.pth`` line; the test
checks that ``pd_middleware`` itself is imported from the venv, never from the repo.
tests/test_wheel.py (``make test-wheel``) is the full bar: pip resolves every dependency.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sh(
    cmd: list[str], cwd: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_repo(tmp_path):
    pytest.importorskip("wheel", reason="building a wheel without isolation needs the 'wheel' package (test extra)")
    wheels = tmp_path / "wheels"
    _sh(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        cwd=tmp_path,
    )
    built = sorted(p.name for p in wheels.glob("*.whl"))
    assert len(built) == 1 and built[0].startswith("pd_middleware-0"), built

    venv = tmp_path / "venv"
    _sh([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    vsite = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    # Dependencies only: this environment's site directories, appended after the venv's own.
    here = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    here |= {p for p in sys.path if p.endswith("site-packages")}
    (vsite / "_deps_from_test_env.pth").write_text("\n".join(sorted(here)) + "\n")
    _sh(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            *map(str, sorted(wheels.glob("*.whl"))),
        ],
        cwd=tmp_path,
    )

    work = tmp_path / "empty"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PD_MIDDLEWARE_CONFIG")}
    where = _sh(
        [
            str(py),
            "-c",
            (
                "import pd_middleware, pd_middleware_plugins, pd_middleware_full as f; "
                "print(pd_middleware.__file__); print(pd_middleware_plugins.__file__); print(f.__file__)"
            ),
        ],
        cwd=work,
        env=env,
    )
    for line in where.stdout.split():
        assert line.startswith(str(vsite)), f"imported from outside the venv: {line}"

    cli = str(venv / "bin" / "pd-middleware")
    listed = _sh([cli, "config", "list"], cwd=work, env=env).stdout
    assert "ab.toml" in listed and "sparse_topk.toml" in listed
    ok = _sh([cli, "check-config", "ab", "--no-probe"], cwd=work, env=env).stdout
    assert "ab.toml: OK" in ok and "arm full_fp32: encoder=full synthesizer=full_distribution" in ok
    shown = _sh([cli, "config", "show", "ab"], cwd=work, env=env).stdout
    (work / "mine.toml").write_text(shown)
    assert "mine.toml: OK" in _sh([cli, "check-config", "mine.toml", "--no-probe"], cwd=work, env=env).stdout

    run = _sh([cli, "ab", "--requests", "50", "--no-progress"], cwd=work, env=env, timeout=900)
    assert "Traceback" not in run.stderr
    report = json.loads((work / "out" / "ab" / "report.json").read_text())
    assert [a["name"] for a in report["arms"]] == ["one_hot", "full_fp32", "recompute", "topp_2000", "sparse_floor"]
    for arm in report["arms"]:
        assert arm["payloads"]["delivered"] == 50 and arm["exact"]["pass"], arm["name"]
