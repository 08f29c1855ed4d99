"""Workloads: seeded streams of per-request target and draft distributions.

A workload is built once from typed options (:func:`make_workload`) and then yields
:class:`WorkloadBatch` es, each holding, for B requests of a chain of S draft steps:

- ``target_probs``: float32 (B, S+1, V), p at each position, position S being the bonus
  distribution;
- ``draft_probs``: float32 (B, S, V), the draft model's q at each step.

Rows at positions >= 1 condition on a *reference* draft prefix, ``prefix`` (B, S),
drawn by the workload from the draft's own q; ``-1`` where the rows do not depend on the
prefix (``synthetic``). An A/B job that samples X from an *encoding* of q may instead
ask for rows conditioned on the tokens it really drafted, step by step, with
:meth:`WorkloadBatch.draft_given` and :meth:`WorkloadBatch.target_given`.

Every batch depends only on ``(seed, request index)``, not on the batch size, so two
runs with different batch sizes see the same requests. Memory per batch is
``B * (2S + 1) * V * 4`` bytes: 117 MB for B = 64, S = 1, V = 152064; keep
``B * (2S + 1) <= ~200`` at that vocab (``docs/workloads.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = [
    "WORKLOAD_NAMES",
    "Conditional",
    "Workload",
    "WorkloadBatch",
    "make_workload",
    "workload_draft_head",
    "workload_options_type",
]


@runtime_checkable
class Conditional(Protocol):
    """Rows of one batch conditioned on a given drafted prefix (prefix-dependent workloads)."""

    def draft(self, step: int, drafted: torch.Tensor) -> torch.Tensor:
        """float32 (B, V): q at ``step`` given int64 (B, step) drafted tokens."""
        ...

    def target(self, drafted: torch.Tensor) -> torch.Tensor:
        """float32 (B, S+1, V): p at every position given int64 (B, S) drafted tokens."""
        ...


@dataclass(frozen=True)
class WorkloadBatch:
    """B requests of one workload; see the module docstring for shapes."""

    request_ids: tuple[str, ...]
    target_probs: torch.Tensor
    draft_probs: torch.Tensor
    prefix: torch.Tensor
    conditional: Conditional | None = None
    draft_state: torch.Tensor | None = None
    """int64 (B,): the draft model's state at step 0, what its draft head reads
    (:mod:`pd_middleware.workloads.heads`); None when the workload has no draft head."""

    @property
    def batch_size(self) -> int:
        return int(self.target_probs.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.draft_probs.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.target_probs.shape[2])

    def draft_given(self, step: int, drafted: torch.Tensor) -> torch.Tensor:
        """float32 (B, V): q at ``step`` given int64 (B, step) really-drafted tokens."""
        if self.conditional is None:
            return self.draft_probs[:, step]
        return self.conditional.draft(step, drafted)

    def target_given(self, drafted: torch.Tensor) -> torch.Tensor:
        """float32 (B, S+1, V): p at every position given int64 (B, S) drafted tokens."""
        if self.conditional is None:
            return self.target_probs
        return self.conditional.target(drafted)


@runtime_checkable
class Workload(Protocol):
    """A seeded source of :class:`WorkloadBatch` es."""

    name: str
    vocab_size: int
    num_steps: int

    def describe(self) -> dict[str, Any]:
        """JSON-ready description (name, options, corpus facts) for reports."""
        ...

    def batches(self, n_requests: int, batch_size: int, seed: int) -> Iterator[WorkloadBatch]:
        """Yield ``ceil(n_requests / batch_size)`` batches; the last may be smaller."""
        ...


def workload_draft_head(wl: Workload, seed: int, hidden_size: int) -> Any:
    """The workload's draft head (:class:`~pd_middleware.core.draft_head.DraftHead`) for runs
    with ``seed``, or None when the workload has none (``trace``)."""
    make = getattr(wl, "draft_head", None)
    return None if make is None else make(seed, hidden_size)


def _synthetic() -> tuple[type, Callable[[Any], Workload]]:
    from .synthetic import SyntheticOptions, SyntheticWorkload

    return SyntheticOptions, SyntheticWorkload


def _ngram() -> tuple[type, Callable[[Any], Workload]]:
    from .ngram import NgramOptions, NgramWorkload

    return NgramOptions, NgramWorkload


def _trace() -> tuple[type, Callable[[Any], Workload]]:
    from .trace import TraceOptions, TraceWorkload

    return TraceOptions, TraceWorkload


# Built-in workloads by name, imported lazily.
_WORKLOADS: dict[str, Callable[[], tuple[type, Callable[[Any], Workload]]]] = {
    "synthetic": _synthetic,
    "ngram": _ngram,
    "trace": _trace,
}
WORKLOAD_NAMES: tuple[str, ...] = tuple(_WORKLOADS)


def workload_options_type(name: str) -> type:
    """The msgspec options struct of workload ``name``."""
    from ..core._errors import ConfigError

    if name not in _WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; expected one of {', '.join(WORKLOAD_NAMES)}", path="name")
    return _WORKLOADS[name]()[0]


def make_workload(name: str, *, config_key: str = "ab.workload", **options: Any) -> Workload:
    """Build workload ``name`` from keyword options (checked strictly).

    Unknown or bad options raise :class:`~pd_middleware.ConfigError` whose path starts
    with ``{config_key}.options`` (``ab.workload.options.noise_std``).
    """
    import msgspec

    from ..core._errors import ConfigError, OptionValueError

    if name not in _WORKLOADS:
        raise ConfigError(
            f"unknown workload {name!r}; expected one of {', '.join(WORKLOAD_NAMES)}", path=f"{config_key}.name"
        )
    opt_type, factory = _WORKLOADS[name]()
    prefix = f"{config_key}.options"
    try:
        opts: Any = msgspec.convert(options, opt_type, strict=True)  # the workload's own options type
    except msgspec.ValidationError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OptionValueError):
            raise ConfigError(cause.message, path=f"{prefix}.{cause.field}") from None
        msg = str(exc)
        where = ""
        if " - at `$." in msg:
            msg, where = msg.rsplit(" - at `$.", 1)
            where = "." + where.rstrip("`")
        elif " field `" in msg:  # unknown or missing field at the options' top level
            where = "." + msg.split(" field `", 1)[1].split("`")[0]
        raise ConfigError(msg, path=f"{prefix}{where}") from None
    try:
        return factory(opts)
    except OptionValueError as exc:  # a check that needs the data (e.g. the corpus) failed
        raise ConfigError(exc.message, path=f"{prefix}.{exc.field}") from None
