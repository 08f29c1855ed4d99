"""The A/B comparison job (``pd-middleware ab``): arms, effect size, typed report.

Modules: :mod:`.config` (the job's reading of the ``[ab]`` table, whose schema is a
section of :mod:`pd_middleware.config`), :mod:`.prefill` (the spawned prefill),
:mod:`.collector` (outcomes -> assembled batches), :mod:`.verifier` (targets and the
reference verify), :mod:`.runner` (``run_ab``), :mod:`.schema` and :mod:`.report` (the
typed :class:`Report`), :mod:`.render` and :mod:`.plot` (its outputs).
"""

from __future__ import annotations

from typing import Any

from .config import ABConfig, WorkloadRef
from .effect import ResponseEffect, later_tokens_per_verify, response_effect

__all__ = [
    "ABConfig",
    "Report",
    "ResponseEffect",
    "WorkloadRef",
    "later_tokens_per_verify",
    "response_effect",
    "run_ab",
]


def __getattr__(name: str) -> Any:  # lazy: the job imports torch, zmq and the transport
    if name == "run_ab":
        from .runner import run_ab

        return run_ab
    if name == "Report":
        from .schema import Report

        return Report
    raise AttributeError(name)
