"""``pd-middleware ab``: compare proposal strategies on the same seeded traffic.

This process is the decode node of an embedded loopback deployment. It builds the
decode side through the public :class:`~pd_middleware.middleware.DecodeMiddleware`
(with a router that reads the arm from the request id), starts a real
:class:`~pd_middleware.transport.receiver.DecodeReceiver` (ZMQ + Mooncake on TCP) and
spawns a prefill process (:mod:`pd_middleware.ab.prefill`) that runs every arm's
encoder on the same workload rows. Delivered payloads are filed and assembled per arm
and batch (:mod:`~pd_middleware.ab.collector`), then verified against the workload's
target rows, regenerated from the same seed (:mod:`~pd_middleware.ab.verifier`).
:mod:`~pd_middleware.ab.report` turns the measurements into the typed report.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from .._errors import ConfigError, PDMiddlewareError
from ..config import Config, resolve_plugins
from ..metrics import Metrics
from ..registry import default_registry
from .collector import ArmStats, BatchPlan, Collector, RouteByRequestId
from .config import arm_roles, workload_options
from .prefill import PrefillJob, run_prefill
from .progress import Progress
from .report import RunFacts, build_report
from .schema import Report


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
) -> Report:
    """Run the A/B job and return its :class:`Report`.

    The report is also written to ``out_dir`` (``report.json``, ``report.png``) unless
    ``out_dir`` is None. ``cancel``: when it is set, the job stops between batches,
    ends the prefill process and returns what it measured so far, marked
    ``partial`` (within about a second). Raises ConfigError/PluginError before
    anything starts, PDMiddlewareError when the deployment itself fails.
    """
    import torch

    from ..assembler import ProposalAssembler
    from ..middleware import DecodeMiddleware
    from ..stats import ExactnessAccumulator
    from ..workloads import make_workload, workload_draft_head

    cfg = config
    plan, seed_v, baseline, reference = _check(cfg, requests, seed, source)
    registry = default_registry()
    resolved = resolve_plugins(cfg, registry, source)  # both sides: fail before spawning anything
    wl = make_workload(cfg.ab.workload.name, **workload_options(cfg))
    _check_workload(cfg, wl, source)
    torch.set_num_threads(1)

    metrics = Metrics()
    mw = DecodeMiddleware.from_config(
        cfg,
        registry,
        metrics,
        router=RouteByRequestId(),
        # One assembler for every arm: the collector copies each batch out at once.
        assembler_factory=lambda c: ProposalAssembler(
            c.model.vocab_size, c.model.num_steps, plan.batch_size, device=c.decode.device
        ),
        # The workload's draft head, for the recompute arm (workloads/heads.py).
        capabilities={"draft_head": workload_draft_head(wl, seed_v, cfg.model.hidden_size)},
    )
    stats = {
        a: ArmStats(
            name=a,
            synthesizer=resolved.synthesizers[a].spec.name,
            encoder=resolved.encoders[a].spec.name,
            encoder_options=_options(resolved.encoders[a].options),
            exactness=ExactnessAccumulator(num_bins=16, alpha=1e-6),
        )
        for a in plan.arm_names
    }
    collector = Collector(plan, stats, mw.assemble)
    stop = cancel if cancel is not None else threading.Event()
    t_start = time.perf_counter()
    prefill_report: dict[str, Any] | None = None
    try:
        if not stop.is_set():  # cancelled during set-up: start nothing
            prefill_report = _deploy(cfg, mw, collector, wl, seed_v, progress, stop, timeout_s)
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
    )
    report = build_report(stats, facts)
    if out_dir is not None:
        write_outputs(report, Path(out_dir))
    return report


def _deploy(
    cfg: Config,
    mw: Any,
    collector: Collector,
    wl: Any,
    seed: int,
    progress: bool,
    stop: threading.Event,
    timeout_s: float,
) -> dict[str, Any] | None:
    """Open the receiver, spawn the prefill, drive the run; always tear everything down.

    Returns the prefill's report (None when cancelled before it arrived).
    """
    import torch

    from ..transport.receiver import open_receiver
    from .verifier import TargetFeed, VerifyThread

    plan = collector.plan
    receiver = open_receiver(cfg.transport, mw.pipeline)
    try:
        mpctx = mp.get_context("spawn")
        results = mpctx.Queue()
        job = PrefillJob(
            config_data=msgspec.to_builtins(cfg),
            address=receiver.address,
            requests=plan.requests,
            seed=seed,
            batch_size=plan.batch_size,
            arm_names=plan.arm_names,
        )
        proc = mpctx.Process(target=run_prefill, args=(job, results), name="pd-middleware-ab-prefill", daemon=True)
        # Target rows are regenerated from the seed, and batches verified, on their own
        # threads, so that batch formation (receive -> assemble) never waits for either.
        targets = TargetFeed(wl, plan.requests, plan.batch_size, seed)
        verifier = VerifyThread(collector.stats, torch.Generator().manual_seed(seed ^ 0xC0FFEE))
        bar = Progress(plan.requests * len(plan.arm_names), "ab", enabled=progress)
        aborted = False
        try:
            if stop.is_set():
                return None
            _start_ignoring_sigint(proc)
            targets.start()
            verifier.start()
            return _drive(receiver, collector, targets, verifier, results, proc, bar, stop, timeout_s)
        except BaseException:
            aborted = True  # failed or interrupted: end the prefill now, never wait for it
            raise
        finally:
            bar.close()
            fast = aborted or stop.is_set()
            verifier.stop(timeout=1.0)
            targets.stop()
            if proc.pid is not None:  # started
                if fast:
                    proc.terminate()
                proc.join(timeout=1.0 if fast else 10.0)
                if proc.is_alive():
                    proc.terminate()
    finally:
        receiver.stop()


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


def _start_ignoring_sigint(proc: Any) -> None:
    """Start the prefill process with SIGINT ignored from its first instruction.

    Ctrl-C reaches the whole process group. The parent handles it (a partial report,
    then it terminates the child), so the child must not die of it first, not even
    while it is still importing; Python keeps an ignored SIGINT ignored in a child.
    Only the main thread may touch signal handlers; elsewhere the child sets it itself.
    """
    if threading.current_thread() is not threading.main_thread():
        proc.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _drive(
    receiver: Any,
    collector: Collector,
    targets: Any,
    verifier: Any,
    results: Any,
    proc: Any,
    bar: Progress,
    stop: threading.Event,
    timeout_s: float,
) -> dict[str, Any] | None:
    """The decode loop: file outcomes, verify complete batches in order, until done or cancelled.

    Returns the prefill's report (None when cancelled before it arrived).
    """
    plan = collector.plan
    deadline = time.monotonic() + timeout_s
    prefill_report: dict[str, Any] | None = None
    next_k = 0
    while next_k < plan.batches:
        if stop.is_set():
            return prefill_report
        item = receiver.get(timeout=0.05)
        if item is not None:
            collector.add(item)
        # Verify, in order, every batch whose arms are all assembled and whose targets exist.
        while next_k < plan.batches and collector.batch_ready(next_k):
            # Never block here: deliveries keep arriving while targets are generated.
            batch = (
                targets.poll(next_k)
                if item is not None
                else targets.get(next_k, min(deadline, time.monotonic() + 0.05))
            )
            if batch is None:
                break
            verifier.submit(batch, collector.take(next_k))
            next_k += 1
            bar.update(sum(st.delivered + st.failed for st in collector.stats.values()))
        verifier.check()
        if item is not None:
            continue
        if stop.is_set():  # before judging the prefill: Ctrl-C reaches its process group too
            return prefill_report
        if time.monotonic() > deadline:
            raise PDMiddlewareError(f"ab: timed out after {timeout_s:.0f}s waiting for batch {next_k}")
        if prefill_report is None and not results.empty():
            prefill_report = _prefill_result(results.get())
        elif prefill_report is None and not proc.is_alive():
            raise PDMiddlewareError(f"ab: the prefill process died (exit code {proc.exitcode})")
        elif prefill_report is not None:
            late = receiver.get(timeout=0.5)
            if late is not None:  # still arriving: file it and keep going
                collector.add(late)
                continue
            # Everything was sent and acknowledged and nothing more arrives:
            # whatever is missing now never reached the decode. Fail it, never drop it.
            collector.fail_missing(next_k)
    verifier.finish(max(1.0, deadline - time.monotonic()))
    while prefill_report is None and not stop.is_set():
        if time.monotonic() > deadline:
            raise PDMiddlewareError(f"ab: timed out after {timeout_s:.0f}s waiting for the prefill's report")
        try:
            prefill_report = _prefill_result(results.get(timeout=0.2))
        except Exception:
            if not proc.is_alive() and results.empty():
                raise PDMiddlewareError(f"ab: the prefill process died (exit code {proc.exitcode})") from None
    return prefill_report


def _prefill_result(msg: tuple[str, Any]) -> dict[str, Any]:
    kind, value = msg
    if kind == "error":
        raise PDMiddlewareError(f"ab: the prefill process failed: {value}")
    report: dict[str, Any] = value
    return report


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
