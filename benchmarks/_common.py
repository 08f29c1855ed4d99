"""Shared timing helpers for benchmarks: medians over repeats, one JSON line last."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def median_time(fn: Callable[[], Any], *, repeats: int = 7, inner: int = 20, warmup: int = 3) -> float:
    """Median over ``repeats`` of the mean seconds per call of ``inner`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def emit(result: dict[str, Any]) -> None:
    """Print the benchmark's result as the last line: one JSON object."""
    print(json.dumps(result, sort_keys=False))
