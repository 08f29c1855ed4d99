"""Test-only: the tier's fault switch for decode-only recompute (a failure on one TP rank).

``PDM_TEST_RECOMPUTE_FAULT=<where>[:<rank>]`` in a test server's environment turns it on
(the overrides ``recompute_fault_source`` and ``recompute_fault_head`` of :mod:`cpu_gaps`,
which wrap the product's per-rank steps with :func:`wrap_source` and :func:`wrap_head`):
the step ``where`` fails on TP rank ``rank`` (every rank without one), to show that a
failure on one rank becomes its vote (docs/server.md):

- ``hidden``: the batch's hidden states read as absent (``RecomputeSource._hidden`` is
  handed the requests without theirs: its own ``no_hidden`` path);
- ``head``: this rank's part of the draft head, before its gather
  (``SGLangDraftHead._local``), raises;
- ``draw``: staging what is written after the vote (``RecomputeSource._stage``) raises,
  once it has run.

``PDM_TEST_RECOMPUTE_FAULT_WHILE=<file>`` with it: the fault is on only while that file
exists (checked per batch, in ``RecomputeSource.prepare``), so one running server can be
served with the fault and without it. A file that is not empty holds the spec in force
(``<where>[:<rank>]``, e.g. ``head`` for every rank) in place of the environment's: one
server can then be served with a fault on every rank, on one rank, and none.

Which step fails is decided once per batch, on the thread that prepares it, and only
inside that ``prepare``: the head's first call at scheduler start (which measures its
output dtype) never fails. Each rank logs once at bind, on stderr, ``test fault '<where>'
is armed for TP rank <rank>``.
"""

from __future__ import annotations

import contextvars
import os
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

ENV = "PDM_TEST_RECOMPUTE_FAULT"
ENV_WHILE = "PDM_TEST_RECOMPUTE_FAULT_WHILE"
#: The steps the switch can break.
STEPS = ("hidden", "head", "draw")

#: The step failing in the batch this thread is preparing ("" for none).
_NOW: contextvars.ContextVar[str] = contextvars.ContextVar("recompute_fault", default="")


def where(spec: str, tp_rank: int) -> str:
    """The step ``spec`` (``<where>[:<rank>]``) breaks on ``tp_rank`` ("" for none).
    Raises ValueError for a step that is not one of :data:`STEPS`."""
    step, _, rank = spec.strip().partition(":")
    if step and step not in STEPS:
        raise ValueError(f"{ENV}: unknown step {step!r} in {spec!r}; known: {', '.join(STEPS)}")
    return "" if not step or (rank and rank != str(tp_rank)) else step


def now(tp_rank: int, environ: Any = None) -> str:
    """The step failing on ``tp_rank`` for the next batch: the environment's spec, unless a
    gating file is named (absent: none; not empty: its spec)."""
    env = os.environ if environ is None else environ
    spec = env.get(ENV, "")
    if not spec:
        return ""
    gate = env.get(ENV_WHILE, "")
    if gate:
        try:
            with open(gate, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:  # absent: the fault is off
            return ""
        if text:
            spec = text
    return where(spec, tp_rank)


def _say(msg: str) -> None:
    print(f"[recompute-fault] {msg}", file=sys.stderr, flush=True)


def wrap_source(cls: Any) -> None:
    """Wrap ``RecomputeSource``'s ``bind_head`` (log the armed step), ``prepare`` (decide
    the step for the batch), ``_hidden`` and ``_stage`` (fail there when asked)."""
    bind_head, prepare, hidden, stage = cls.bind_head, cls.prepare, cls._hidden, cls._stage

    def bind_head_(self: Any, head: Any, **kwargs: Any) -> Any:
        out = bind_head(self, head, **kwargs)
        step = where(os.environ.get(ENV, ""), self.tp_rank)
        if step:
            gate = os.environ.get(ENV_WHILE, "")
            _say(
                f"test fault {step!r} is armed for TP rank {self.tp_rank} ({ENV}"
                f"{f', on while {gate} exists' if gate else ''})"
            )
        return out

    def prepare_(self: Any, batch: Any) -> Any:
        token = _NOW.set(now(self.tp_rank))
        try:
            return prepare(self, batch)
        finally:
            _NOW.reset(token)

    def hidden_(self: Any, reqs: list[Any]) -> Any:
        if _NOW.get() == "hidden":
            return hidden(self, [SimpleNamespace(hidden_states_tensor=None) for _ in reqs])
        return hidden(self, reqs)

    def stage_(self: Any, rec: Any, tokens: Any) -> Any:
        out = stage(self, rec, tokens)
        if _NOW.get() == "draw":
            raise RuntimeError(f"injected by {ENV}: draw fails on TP rank {self.tp_rank}")
        return out

    _install(cls, {"bind_head": bind_head_, "prepare": prepare_, "_hidden": hidden_, "_stage": stage_})


def wrap_head(cls: Any) -> None:
    """Wrap ``SGLangDraftHead._local`` (this rank's part, before the gather): it raises
    while the batch being prepared asks for ``head``."""
    local = cls._local

    def local_(self: Any, hidden: Any) -> Any:
        if _NOW.get() == "head":
            raise RuntimeError(f"injected by {ENV}: the head fails on this rank")
        return local(self, hidden)

    _install(cls, {"_local": local_})


def _install(cls: Any, wrappers: dict[str, Callable[..., Any]]) -> None:
    for name, fn in wrappers.items():
        fn.__wrapped__ = getattr(cls, name)  # type: ignore[attr-defined]  # the product's own, for tests
        fn.__name__ = name
        setattr(cls, name, fn)


def unwrap(cls: Any) -> None:
    """Put back the product's own methods (tests that wrap a class for a while)."""
    for name, fn in list(vars(cls).items()):
        orig = getattr(fn, "__wrapped__", None)
        if orig is not None and fn.__module__ == __name__:
            setattr(cls, name, orig)
