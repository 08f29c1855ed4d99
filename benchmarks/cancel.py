"""How long stopping takes: a cancelled ``ab`` run, Ctrl-C on ``pd-middleware ab``, a YAML bomb.

The tests check the behaviour (a partial report, exit 130, a refusal naming the limit)
with bounds only a hang crosses; the figures they used to assert live here:

- ``ab_cancel_s``: ``run_ab(cancel=...)`` in process, from ``cancel.set()`` to the
  partial report returned (target <= 2; the runner's docstring says "about a second").
  Each run is cancelled once the decode has received its first payload (a hook in this
  file signals it), not after a fixed sleep.
- ``ctrl_c_exit_s``: ``pd-middleware ab`` in a subprocess, from SIGINT to the process's
  exit, once its first progress line is out (target <= 2: ``ab --help`` promises "Ctrl-C
  stops within 2 s"). The CLI aborts a job that has not returned 1.8 s after Ctrl-C
  (``cli.interrupt_to_cancel``), without a report; ``ctrl_c_partial_share`` is the
  share of runs that still wrote theirs (target 1: all of them).
- ``yaml_bomb_refusal_s``: ``check-config`` in process on a billion-laughs document
  (9**10 values once expanded), to its refusal naming ``MAX_YAML_NODES`` (target <= 1).

Medians over ``--repeats`` runs (maxima alongside: a slow tail is what a loaded machine
shows). Usage: ``python benchmarks/cancel.py [--repeats 5] [--quick]``. The last stdout
line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import emit

from pd_middleware import PluginSpec

#: A stop that has not ended after this long is reported as a hang, not timed.
HANG_S = 120.0


class FirstPayload:
    """A receive hook that signals the first payload the decode receives."""

    arrived: ClassVar[threading.Event] = threading.Event()

    def __init__(self, options: object, context: object) -> None:
        pass

    def on_receive(self, payload: object, context: object) -> None:
        FirstPayload.arrived.set()


FIRST_PAYLOAD = PluginSpec(
    name="first_payload", kind="hook", factory=FirstPayload, summary="benchmark: signal the first payload"
)


def ab_cancel_once(requests: int) -> float:
    """One ``run_ab`` on ab_tiny, cancelled after its first payload; seconds from cancel to return."""
    import msgspec

    from pd_middleware.ab.runner import run_ab
    from pd_middleware.config import load_config, parse_config

    # The registry imports the hook as module ``cancel`` (this file is ``__main__``): signal
    # through that module's class, the one whose instance the decode calls.
    hook = importlib.import_module("cancel").FirstPayload
    hook.arrived.clear()
    data = msgspec.to_builtins(load_config(ROOT / "configs" / "ab_tiny.toml"))
    data["hooks"] = [{"name": "cancel:FIRST_PAYLOAD"}]
    cancel = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        box["report"] = run_ab(
            parse_config(data), requests=requests, seed=1, out_dir=None, progress=False, cancel=cancel
        )

    t = threading.Thread(target=run, daemon=True)
    t.start()
    if not hook.arrived.wait(HANG_S):
        raise SystemExit(f"ab_cancel: no payload reached the decode in {HANG_S:.0f} s")
    t0 = time.perf_counter()
    cancel.set()
    t.join(HANG_S)
    took = time.perf_counter() - t0
    if t.is_alive():
        raise SystemExit(f"ab_cancel: run_ab still running {HANG_S:.0f} s after cancel")
    if not box["report"].partial:
        raise SystemExit("ab_cancel: the cancelled run's report is not marked partial")
    return took


def ctrl_c_once(requests: int) -> tuple[float, bool]:
    """One ``pd-middleware ab ab_tiny``, SIGINT after its first progress line: (seconds to exit, partial report written)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pd_middleware.cli", "ab", "ab_tiny", "--requests", str(requests), "--out", "o"],
            cwd=tmp,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stderr is not None
            line = "x"
            while line and not line.startswith("ab: "):  # the first progress line: the run is under way
                line = proc.stderr.readline()
            if not line:
                raise SystemExit(f"ctrl_c: the run ended before its first progress line (exit {proc.wait()})")
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGINT)
            _out, err = proc.communicate(timeout=HANG_S)
            took = time.perf_counter() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if proc.returncode != 130 or "Traceback" in err:
            raise SystemExit(f"ctrl_c: exit {proc.returncode}, stderr: {err[-2000:]}")
        report = Path(tmp) / "o" / "report.json"
        partial = report.exists() and json.loads(report.read_text())["partial"] is True
        return took, partial


def yaml_bomb_once(path: Path) -> float:
    """``check-config`` on a billion-laughs document in process: seconds to its refusal."""
    from pd_middleware.cli import main

    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        rc = main(["check-config", str(path)])
    took = time.perf_counter() - t0
    if rc != 2 or "MAX_YAML_NODES" not in err.getvalue():
        raise SystemExit(f"yaml_bomb: exit {rc}, stderr: {err.getvalue()[-2000:]}")
    return took


def write_laughs(path: Path, levels: int = 10) -> None:
    """A YAML document of a few hundred bytes that expands to ``9**levels`` values."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    lines.append(f"model: *a{levels - 1}")
    path.write_text("\n".join(lines) + "\n")


def _summary(samples: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(samples), 4), "max": round(max(samples), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="runs of each stop (default 5)")
    ap.add_argument("--quick", action="store_true", help="2 runs of each (smoke run)")
    args = ap.parse_args()
    repeats = 2 if args.quick else args.repeats
    # 20000 (in process) and 200000 (CLI) requests per arm take minutes: every run is cancelled mid-way.
    ab = [ab_cancel_once(20_000) for _ in range(repeats)]
    print(f"ab cancel   {' '.join(f'{x:.2f}' for x in ab)} s", flush=True)
    ctrl = [ctrl_c_once(200_000) for _ in range(repeats)]
    shown = [f"{x:.2f}" + ("" if ok else " (aborted, no report)") for x, ok in ctrl]
    print(f"Ctrl-C exit {' '.join(shown)} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        doc = Path(tmp) / "laughs.yaml"
        write_laughs(doc)
        bomb = [yaml_bomb_once(doc) for _ in range(max(repeats, 5))]
    print(f"YAML bomb   {' '.join(f'{1e3 * x:.1f}' for x in bomb)} ms")
    ctrl_s = [x for x, _ in ctrl]
    emit(
        {
            "benchmark": "cancel",
            "ab_cancel_s": round(statistics.median(ab), 3),
            "ctrl_c_exit_s": round(statistics.median(ctrl_s), 3),
            "ctrl_c_partial_share": round(sum(ok for _, ok in ctrl) / len(ctrl), 3),
            "yaml_bomb_refusal_s": round(statistics.median(bomb), 4),
            "samples": {"ab_cancel_s": _summary(ab), "ctrl_c_exit_s": _summary(ctrl_s), "yaml_bomb_s": _summary(bomb)},
            "repeats": repeats,
            "quick": args.quick,
        }
    )


if __name__ == "__main__":
    main()
