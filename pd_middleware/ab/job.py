"""The ``pd-middleware ab`` command: run the job, write its outputs, print the report.

The job itself is :func:`pd_middleware.ab.runner.run_ab`; this module only adapts the
command line to it (the CLI parser lives in :mod:`pd_middleware.cli`).
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import cast

from ..config import load_config
from .heap import return_big_blocks
from .render import FORMATS, Format, render
from .runner import run_ab

__all__ = ["run_ab", "run_ab_command"]


def run_ab_command(args: argparse.Namespace, cancel: threading.Event | None = None) -> int:
    """CLI adapter for ``pd-middleware ab``: 0 when every arm is exact and nothing is lost.

    ``args.format`` (``table`` when absent) selects what is printed on stdout; the
    report files are written in every format. ``cancel`` is handed to the runner
    (set it from a SIGINT handler to stop with a partial report).
    """
    fmt = cast(Format, getattr(args, "format", None) or "table")
    if fmt not in FORMATS:  # checked before the run, never after it
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    cfg = load_config(args.config)
    return_big_blocks()  # RSS flat in the run's size (heap.py); this process is the job's own
    report = run_ab(
        cfg,
        requests=args.requests,
        seed=args.seed,
        out_dir=args.out,
        progress=not args.no_progress,
        source=args.config,
        cancel=cancel,
    )
    sys.stdout.write(render(report, fmt))
    if fmt == "table":
        png = "" if report.partial else f" and {args.out}/report.png"
        print(f"\nwrote {args.out}/report.json{png}")
    if report.partial:
        print("pd-middleware ab: cancelled; the report is partial", file=sys.stderr)
        return 130
    failed = sum(a.payloads.failed for a in report.arms)
    if report.passed and failed and getattr(args, "fail_on_loss", False):
        print(f"pd-middleware ab: {failed} payload(s) failed (--fail-on-loss)", file=sys.stderr)
        return 1
    if not report.passed:
        ok = all(a.exact.passed for a in report.arms)
        print(f"pd-middleware ab: exactness {'PASS' if ok else 'FAIL'}, lost payloads {report.lost}", file=sys.stderr)
        return 1
    return 0
