"""``pd-middleware ab``: compare proposal strategies on the same seeded traffic.

This process is the decode node of an embedded loopback deployment. This module checks
the config, builds the decode side through the public
:class:`~pd_middleware.middleware.DecodeMiddleware` (with a router that reads the arm
from the request id) and the per-arm statistics, runs the deployment
(:mod:`~pd_middleware.ab.deploy`: a real receiver, the prefill process of
:mod:`~pd_middleware.ab.prefill`, the bounded pipeline between them) and hands the
measurements to :mod:`~pd_middleware.ab.report`, which turns them into the typed report.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ..config import Config, ResolvedConfig, resolve_plugins
from ..core._errors import ConfigError
from ..core.metrics import Metrics
from ..registry import default_registry
from .collector import ArmStats, BatchPlan, Collector, RouteByRequestId
from .config import arm_roles, workload_options
from .credit import IN_FLIGHT_BATCHES
from .deploy import deploy
from .report import RunFacts, build_report
from .schema import Report

if TYPE_CHECKING:
    from ..middleware import DecodeMiddleware


def run_ab(
    config: Config,
    *,
    requests: int | None = None,
    seed: int | None = None,
    out_dir: str | Path | None = "out/ab",
    progress: bool = True,
    source: str | None = None,
    timeout_s: float = 1800.0,
    cancel: threading.Event | None = None,
    in_flight_batches: int = IN_FLIGHT_BATCHES,
) -> Report:
    """Run the A/B job and return its :class:`Report`.

    The report is also written to ``out_dir`` (``report.json``, ``report.png``) unless
    ``out_dir`` is None. ``cancel``: when it is set, the job stops between batches,
    ends the prefill process and returns what it measured so far, marked
    ``partial`` (within about a second). ``timeout_s``: the longest wait for progress
    (an outcome, a verified batch, the prefill's report), not a limit on the whole run.
    ``in_flight_batches``: the decode's credit,
    how many batches of every arm may be between the prefill and the verifier
    (:mod:`~pd_middleware.ab.credit`; memory grows with it, not with ``requests``). Raises ConfigError/PluginError before
    anything starts, PDMiddlewareError when the deployment itself fails.
    """
    import torch

    from ..workloads import make_workload

    cfg = config
    plan, seed_v, baseline, reference = _check(cfg, requests, seed, source)
    registry = default_registry()
    resolved = resolve_plugins(cfg, registry, source)  # both sides: fail before spawning anything
    wl = make_workload(cfg.ab.workload.name, **workload_options(cfg))
    _check_workload(cfg, wl, source)
    torch.set_num_threads(1)

    metrics = Metrics()
    mw = _decode_side(cfg, registry, metrics, plan, wl, seed_v)
    stats = _arm_stats(plan, resolved)
    collector = Collector(plan, stats, mw.assemble)
    stop = cancel if cancel is not None else threading.Event()
    t_start = time.perf_counter()
    prefill_report: dict[str, Any] | None = None
    pipeline: dict[str, Any] | None = None
    try:
        if not stop.is_set():  # cancelled during set-up: start nothing
            prefill_report, pipeline = deploy(
                cfg, mw, collector, wl, seed_v, progress, stop, timeout_s, in_flight_batches
            )
    finally:
        mw.close()
    facts = RunFacts(
        config=cfg,
        workload=wl.describe(),
        requests=plan.requests,
        seed=seed_v,
        wall_s=time.perf_counter() - t_start,
        partial=stop.is_set(),
        baseline=baseline,
        reference=reference,
        receiver=metrics.snapshot(),
        prefill=prefill_report,
        pipeline=pipeline,
    )
    report = build_report(stats, facts)
    if out_dir is not None:
        write_outputs(report, Path(out_dir))
    return report


def _decode_side(cfg: Config, registry: Any, metrics: Metrics, plan: BatchPlan, wl: Any, seed: int) -> DecodeMiddleware:
    """The job's decode, built through the public composition path
    (:meth:`DecodeMiddleware.from_config`) with the job's router, assembler and draft head."""
    from ..decode.assembler import ProposalAssembler
    from ..middleware import DecodeMiddleware
    from ..workloads import workload_draft_head

    return DecodeMiddleware.from_config(
        cfg,
        registry,
        metrics,
        router=RouteByRequestId(),
        # One assembler for every arm: the collector copies each batch out at once.
        assembler_factory=lambda c: ProposalAssembler(
            c.model.vocab_size, c.model.num_steps, plan.batch_size, device=c.decode.device
        ),
        # The workload's draft head, for the recompute arm (workloads/heads.py).
        capabilities={"draft_head": workload_draft_head(wl, seed, cfg.model.hidden_size)},
    )


def _arm_stats(plan: BatchPlan, resolved: ResolvedConfig) -> dict[str, ArmStats]:
    """One empty accumulator per arm, named by its plugins."""
    from ..evaluation.stats import ExactnessAccumulator

    return {
        a: ArmStats(
            name=a,
            synthesizer=resolved.synthesizers[a].spec.name,
            encoder=resolved.encoders[a].spec.name,
            encoder_options=_options(resolved.encoders[a].options),
            exactness=ExactnessAccumulator(num_bins=16, alpha=1e-6),
        )
        for a in plan.arm_names
    }


def write_outputs(report: Report, out: Path) -> None:
    """``report.json`` and ``report.png`` into ``out`` (created if missing).

    A partial (cancelled) report gets its JSON only: drawing the plot takes a second
    or two, and a cancelled run must end promptly.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_bytes(report.to_json())
    if not report.partial:
        from .plot import write_plot

        write_plot(report, out / "report.png")


def _check(
    cfg: Config, requests: int | None, seed: int | None, source: str | None
) -> tuple[BatchPlan, int, str, str | None]:
    """Validate what the job needs from the config; ConfigError naming the key."""
    if not cfg.arms:
        raise ConfigError("the ab job needs at least one [[arms]] entry", path="arms", source=source)
    n_req = requests if requests is not None else cfg.ab.requests
    if n_req < 1:
        raise ConfigError(f"--requests must be >= 1, got {n_req}", path="ab.requests", source=source)
    if not cfg.decode.rejection_sampling:
        raise ConfigError(
            "the ab job compares proposals, so it needs rejection sampling on",
            path="decode.rejection_sampling",
            source=source,
        )
    names = tuple(a.name for a in cfg.arms)
    baseline, reference = arm_roles(cfg.ab, names, source)
    plan = BatchPlan(arm_names=names, requests=n_req, batch_size=cfg.ab.batch_size)
    return plan, (seed if seed is not None else cfg.ab.seed), baseline, reference


def _check_workload(cfg: Config, wl: Any, source: str | None) -> None:
    if wl.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"workload {wl.name!r} has V={wl.vocab_size} but model.vocab_size={cfg.model.vocab_size}; make them equal",
            path="model.vocab_size",
            source=source,
        )
    if wl.num_steps != cfg.model.num_steps:
        raise ConfigError(
            f"workload has num_steps={wl.num_steps} but model.num_steps={cfg.model.num_steps}",
            path="model.num_steps",
            source=source,
        )


def _options(options: Any) -> dict[str, Any]:
    return msgspec.to_builtins(options) if hasattr(options, "__struct_fields__") else {}
