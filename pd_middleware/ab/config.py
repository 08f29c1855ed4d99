"""The job's reading of the ``[ab]`` table: which arms its roles name, and the
workload's options with the model's facts filled in.

The table's schema (:class:`ABConfig`, :class:`WorkloadRef`) is pure data and lives
with the other sections in :mod:`pd_middleware.config`, so a document is checked whole
when it is loaded and the config layer imports nothing of the job; both names are
re-exported here and from :mod:`pd_middleware.ab`. Nothing here imports a workload
until :func:`workload_options` runs.
"""

from __future__ import annotations

from typing import Any

from ..config import ABConfig, WorkloadRef
from ..core._errors import ConfigError

__all__ = ["ABConfig", "WorkloadRef", "arm_roles", "workload_options"]


def arm_roles(ab: ABConfig, arm_names: tuple[str, ...], source: str | None = None) -> tuple[str, str | None]:
    """``(baseline, reference)`` arm names; ConfigError at ``ab.baseline``/``ab.reference``."""
    for key in ("baseline", "reference"):
        name = getattr(ab, key)
        if name and name not in arm_names:
            raise ConfigError(f"{name!r} is not an arm; arms are {list(arm_names)}", path=f"ab.{key}", source=source)
    return (ab.baseline or arm_names[0]), (ab.reference or None)


def workload_options(cfg: Any) -> dict[str, Any]:
    """Workload options of ``cfg.ab``, with model facts filled in where the workload takes them."""
    from ..workloads import workload_options_type

    opts = dict(cfg.ab.workload.options)
    fields = set(getattr(workload_options_type(cfg.ab.workload.name), "__struct_fields__", ()))
    if "vocab_size" in fields:
        opts.setdefault("vocab_size", cfg.model.vocab_size)
    if "num_steps" in fields:
        opts.setdefault("num_steps", cfg.model.num_steps)
    return opts
