"""The A/B comparison job (``pd-middleware ab``): arms, effect size, report."""

from __future__ import annotations

from .effect import ResponseEffect, later_tokens_per_verify, response_effect

__all__ = ["ResponseEffect", "later_tokens_per_verify", "response_effect", "run_ab"]


def __getattr__(name: str):  # lazy: the job imports torch, zmq and the transport
    if name == "run_ab":
        from .job import run_ab

        return run_ab
    raise AttributeError(name)
