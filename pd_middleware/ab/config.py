"""The ``[ab]`` table: what ``pd-middleware ab`` runs, on which traffic, against which arms.

It lives with the job, not in the core config: :class:`~pd_middleware.config.Config`
only holds an :class:`ABConfig` field so a deployment file can carry its A/B defaults.
Nothing here imports a workload until :func:`check_workload_options` runs.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from .._errors import ConfigError, OptionValueError

_STRUCT = dict(forbid_unknown_fields=True, frozen=True, kw_only=True)
_ARM_RE = re.compile(r"^[A-Za-z0-9_.\-]{0,64}$")


class WorkloadRef(msgspec.Struct, **_STRUCT):
    """Which traffic the offline A/B job generates."""

    # synthetic | ngram | trace
    name: Literal["synthetic", "ngram", "trace"] = "synthetic"
    # Workload options (see docs/workloads.md); checked by the workload.
    options: dict[str, Any] = {}


class ABConfig(msgspec.Struct, **_STRUCT):
    """Defaults of ``pd-middleware ab`` (command-line flags override them)."""

    workload: WorkloadRef = WorkloadRef()
    # Requests per arm.
    requests: int = 2000
    # Seed of the workload and of every sampler.
    seed: int = 0
    # Requests per batch sent through the deployment.
    batch_size: int = 32
    # Tokens per response, for the whole-response effect-size estimate.
    response_tokens: int = 256
    # Acceptance rate of the later verifies (drafted on the decode node, same for all arms).
    later_acceptance: float = 0.7
    # Arm every other arm's verify steps are compared with (e.g. today's one-hot
    # proposal); "" = the first [[arms]] entry.
    baseline: str = ""
    # Arm that ships the whole draft distribution, the upper bound that acceptance
    # and bytes are shown as a share of; "" = none (acceptance is then shown as a
    # share of the computed full-distribution bound).
    reference: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.requests <= 10_000_000:
            raise OptionValueError("requests", f"must be in [1, 10000000], got {self.requests}")
        if not 1 <= self.batch_size <= 4096:
            raise OptionValueError("batch_size", f"must be in [1, 4096], got {self.batch_size}")
        if not 1 <= self.response_tokens <= 1 << 20:
            raise OptionValueError("response_tokens", f"must be >= 1, got {self.response_tokens}")
        if not 0.0 <= self.later_acceptance < 1.0:
            raise OptionValueError("later_acceptance", f"must be in [0, 1), got {self.later_acceptance}")
        for key in ("baseline", "reference"):
            if not _ARM_RE.match(getattr(self, key)):
                raise OptionValueError(key, f"must be an arm name, got {getattr(self, key)!r}")


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


def check_workload_options(config: Any, source: str | None) -> None:
    """Convert ``ab.workload.options`` to the workload's options type (as make_workload will).

    Without this, a misspelled workload option passed ``check-config`` and failed only
    when the A/B job started. Paths match :func:`~pd_middleware.workloads.make_workload`.
    """
    from ..config_loader import convert  # the core's one conversion path: errors at the full key path
    from ..workloads import workload_options_type

    convert(
        dict(config.ab.workload.options), workload_options_type(config.ab.workload.name), "ab.workload.options", source
    )
