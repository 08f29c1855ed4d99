"""The embedded loopback deployment of the A/B job, and the loop that drives it.

:func:`deploy` opens a real :class:`~pd_middleware.transport.receiver.DecodeReceiver`,
spawns the prefill process (:mod:`~pd_middleware.ab.prefill`) and runs the decode
loop until every batch is verified, the run is cancelled or it fails; it always tears
everything down. The stages form one bounded pipeline:

    prefill (generate, encode, send) -> receiver -> collector (file, assemble)
        -> verifier (with the target rows of :class:`~.verifier.TargetFeed`)

The prefill starts a batch only with the decode's credit (:mod:`~pd_middleware.ab.credit`),
granted back as each batch is verified, so at most ``in_flight`` batches of every
arm are between the two ends, and each stage holds at most that many.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import resource
import signal
import threading
import time
from typing import Any

import msgspec

from ..config import Config
from ..core._errors import PDMiddlewareError
from .collector import BatchPlan, Collector
from .credit import IN_FLIGHT_BATCHES, Credit
from .prefill import PrefillJob, run_prefill
from .progress import Progress


def deploy(
    cfg: Config,
    mw: Any,
    collector: Collector,
    wl: Any,
    seed: int,
    progress: bool,
    stop: threading.Event,
    timeout_s: float,
    in_flight: int = IN_FLIGHT_BATCHES,
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Open the receiver, spawn the prefill, drive the run; always tear everything down.

    Returns the prefill's report (None when cancelled before it arrived) and the
    decode's pipeline facts: the credit window, CPU seconds by stage, peak RSS.
    """
    import torch

    from ..transport.receiver import open_receiver
    from .verifier import TargetFeed, VerifyThread

    plan = collector.plan
    cpu0 = time.process_time()
    facts: dict[str, Any] = {"in_flight_batches": in_flight}
    receiver = open_receiver(cfg.transport, mw.pipeline)
    try:
        mpctx = mp.get_context("spawn")
        results = mpctx.Queue()
        credit = Credit(mpctx, in_flight)
        proc = _prefill_process(mpctx, cfg, receiver.address, plan, seed, timeout_s, results, credit)
        # Target rows are regenerated from the seed, and batches verified, on their own
        # threads, so that batch formation (receive -> assemble) never waits for either.
        targets = TargetFeed(wl, plan.requests, plan.batch_size, seed)
        verifier = VerifyThread(
            collector.stats,
            torch.Generator().manual_seed(seed ^ 0xC0FFEE),
            on_verified=credit.grant,
            max_queued=in_flight,
        )
        bar = Progress(plan.requests * len(plan.arm_names), "ab", enabled=progress)
        aborted = False
        try:
            if stop.is_set():
                return None, facts
            _start_ignoring_sigint(proc)
            targets.start()
            verifier.start()
            report = _drive(receiver, collector, targets, verifier, credit, results, proc, bar, stop, timeout_s)
            return report, facts
        except BaseException:
            aborted = True  # failed or interrupted: end the prefill now, never wait for it
            raise
        finally:
            bar.close()
            _stop_stages(proc, verifier, targets, fast=aborted or stop.is_set())
            stages = {"generate_targets": targets.cpu_s, "assemble": collector.cpu_s, "verify": verifier.cpu_s}
            stages["receive_and_rest"] = max(0.0, time.process_time() - cpu0 - sum(stages.values()))
            facts["cpu_s"] = stages
            # ru_maxrss is in KiB on Linux: the peak of this process since it started.
            facts["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    finally:
        receiver.stop()


def _prefill_process(
    mpctx: Any, cfg: Config, address: str, plan: BatchPlan, seed: int, timeout_s: float, results: Any, credit: Credit
) -> Any:
    """The prefill's ``spawn`` process (not started): everything it needs as plain data."""
    job = PrefillJob(
        config_data=msgspec.to_builtins(cfg),
        address=address,
        requests=plan.requests,
        seed=seed,
        batch_size=plan.batch_size,
        arm_names=plan.arm_names,
        timeout_s=timeout_s,
    )
    return mpctx.Process(target=run_prefill, args=(job, results, credit), name="pd-middleware-ab-prefill", daemon=True)


def _stop_stages(proc: Any, verifier: Any, targets: Any, *, fast: bool) -> None:
    """Stop the verifier and target threads and end the prefill process: at once when
    ``fast`` (failed, interrupted or cancelled), else after it has had time to finish."""
    verifier.stop(timeout=1.0)
    targets.stop()
    if proc.pid is not None:  # started
        if fast:
            proc.terminate()
        proc.join(timeout=1.0 if fast else 10.0)
        if proc.is_alive():
            proc.terminate()


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
    credit: Credit,
    results: Any,
    proc: Any,
    bar: Progress,
    stop: threading.Event,
    timeout_s: float,
) -> dict[str, Any] | None:
    """The decode loop: file outcomes, verify complete batches in order, until done or cancelled.

    ``timeout_s`` bounds each wait for progress (an outcome filed, a batch verified), not
    the whole run, whose length grows with its size. Returns the prefill's report (None
    when cancelled before it arrived).
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
            deadline = time.monotonic() + timeout_s  # progress: the wait starts again
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
            verifier.submit(batch, collector.take(next_k), timeout=max(1.0, deadline - time.monotonic()))
            next_k += 1
            bar.update(sum(st.delivered + st.failed for st in collector.stats.values()))
        verifier.check()
        if item is not None:
            continue
        if stop.is_set():  # before judging the prefill: Ctrl-C reaches its process group too
            return prefill_report
        if time.monotonic() > deadline:
            raise PDMiddlewareError(f"ab: nothing arrived for {timeout_s:.0f}s while waiting for batch {next_k}")
        # Batches every payload of which was sent and acknowledged: all of it (the
        # prefill's report) or, when the prefill waits for credit, those it published.
        acked = plan.batches if prefill_report is not None else credit.acknowledged
        if prefill_report is None and not results.empty():
            prefill_report = _prefill_result(results.get())
        elif prefill_report is None and not proc.is_alive():
            raise PDMiddlewareError(f"ab: the prefill process died (exit code {proc.exitcode})")
        elif acked > next_k and not collector.batch_ready(next_k):
            late = receiver.get(timeout=0.5)
            if late is not None:  # still arriving: file it and keep going
                collector.add(late)
                deadline = time.monotonic() + timeout_s
                continue
            # Everything was sent and acknowledged and nothing more arrives:
            # whatever is missing now never reached the decode. Fail it, never drop it.
            collector.fail_missing(next_k, acked)
    verifier.finish(max(1.0, deadline - time.monotonic()))
    while prefill_report is None and not stop.is_set():
        if time.monotonic() > deadline:
            raise PDMiddlewareError(f"ab: timed out after {timeout_s:.0f}s waiting for the prefill's report")
        try:
            prefill_report = _prefill_result(results.get(timeout=0.2))
        except queue.Empty:
            if not proc.is_alive() and results.empty():
                raise PDMiddlewareError(f"ab: the prefill process died (exit code {proc.exitcode})") from None
    return prefill_report


def _prefill_result(msg: tuple[str, Any]) -> dict[str, Any]:
    kind, value = msg
    if kind == "error":
        raise PDMiddlewareError(f"ab: the prefill process failed: {value}")
    report: dict[str, Any] = value
    return report
