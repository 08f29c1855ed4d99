"""The one-install bar: one wheel from a clean checkout, pip, a fresh venv with only torch.

``pip install pd_middleware-*.whl[mooncake-cpu]`` (``[mooncake]`` with CUDA) into a new
virtualenv that holds nothing but torch, then ``pd-middleware ab --requests 50`` from an
empty directory: the main job with all its arms, the full-distribution one included.
Unlike tests/test_packaging.py (offline, dependencies borrowed through a ``.pth``), pip
resolves every dependency here from its configured index, and the test checks that
nothing outside the venv is on its path. torch comes from that index too (pip's cache
makes it quick), pinned to this environment's version.

Marker ``wheel``: skipped unless selected (``make test-wheel``, ``pytest -m wheel``),
because it needs the package index and a few minutes. CI runs it (.ci/run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.wheel


def _sh(cmd: list[str], cwd: Path, timeout: float = 900, env: dict[str, str] | None = None) -> str:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def test_one_pip_install_runs_the_main_job(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to build from (git archive HEAD)")
    # A clean checkout: what HEAD holds, nothing built or left in this working tree.
    src = tmp_path / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    wheels = tmp_path / "wheels"
    # No build isolation: the build backend (setuptools) is this environment's; it is not
    # a run-time dependency, and the wheel is what is tested.
    _sh(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        tmp_path,
    )
    (wheel,) = wheels.glob("pd_middleware-*.whl")

    venv = tmp_path / "venv"
    _sh([sys.executable, "-m", "venv", str(venv)], tmp_path)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q"]
    _sh([*pip, f"torch=={torch.__version__.split('+')[0]}"], tmp_path)
    cuda = bool(torch.cuda.is_available())
    _sh([*pip, f"{wheel}[{'mooncake' if cuda else 'mooncake-cpu'}]"], tmp_path)
    _sh([py, "-m", "pip", "check"], tmp_path)

    vsite = Path(_sh([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    # Dependencies resolved by pip into the venv, none borrowed: no .pth names a path outside it.
    for pth in vsite.glob("*.pth"):
        for line in pth.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import ")):
                assert Path(line).resolve().is_relative_to(venv.resolve()), f"{pth.name} borrows {line}"
    work = tmp_path / "empty"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PD_MIDDLEWARE_CONFIG", "VIRTUAL_ENV")}
    code = "import pd_middleware, pd_middleware_full, msgspec, zmq, torch; print(*(m.__file__ for m in (pd_middleware, pd_middleware_full, msgspec, zmq, torch)))"
    for f in _sh([py, "-c", code], work, env=env).split():
        assert Path(f).resolve().is_relative_to(venv.resolve()), f"imported from outside the venv: {f}"

    cli = str(venv / "bin" / "pd-middleware")
    out = _sh([cli, "ab", "--requests", "50", "--no-progress"], work, env=env)
    assert "full_fp32" in out and "PASS" in out
    report = json.loads((work / "out" / "ab" / "report.json").read_text())
    import tomllib

    with open(ROOT / "configs" / "ab.toml", "rb") as f:
        shipped = [a["name"] for a in tomllib.load(f)["arms"]]
    assert [a["name"] for a in report["arms"]] == shipped  # every arm of the shipped comparison
    for arm in report["arms"]:
        assert arm["payloads"]["delivered"] == 50 and arm["exact"]["pass"], arm["name"]
    assert report["arms"][1]["synthesizer"] == "full_distribution"
