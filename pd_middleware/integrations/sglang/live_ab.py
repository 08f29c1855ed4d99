"""Live A/B on an SGLang PD decode: each request's arm and the result of its first verify.

Only a request's first verify depends on the proposal strategy (``docs/strategies.md``):
later drafts run on the decode and are the same in every arm. So the live comparison
counts, per arm, the first verifies and the draft tokens accepted at them
(:meth:`~pd_middleware.core.metrics.Metrics.record_first_verify`); ``pd-middleware live-ab``
turns the counts into acceptance with 95% CIs and the ratio against a baseline arm.

Where SGLang 0.5.23 has the per-request result: the EAGLE verify
(``speculative/eagle_utils.py``, ``verify_tree_greedy``/the rejection-sampling kernel)
returns ``accept_lens`` (b,), drafts accepted plus the bonus token, carried on the
``GenerationBatchResult`` to the scheduler. There
``SchedulerBatchResultProcessor._resolve_spec_v2_tokens(self, result, batch)``
(``managers/scheduler_components/batch_result_processor.py``), on the overlap and the
non-overlap path alike, copies it to CPU, sets ``result.num_correct_drafts_per_req_cpu``
(accepted drafts per request, the bonus excluded) and increments ``req.spec_verify_ct``
for every request still running. A request's first verify is the call in which its
``spec_verify_ct`` goes from 0 to 1; a request that finished at the prebuilt step or
was retracted is not counted (SGLang skips it too).

The drop-in wraps that method (feature ``live_ab`` of the table, declared at the end of
this module, installed only when the config has ``[[arms]]``): it reads each request's ``spec_verify_ct`` before the call and
records the requests whose first verify this was. The arm is read from the request:
``req.pd_middleware.arm``, the record the decode path attaches (the arm that the
``ab_split`` hook routed its payload to). A request with no record counts as
unattributed.

The copy into SGLang's own ``/metrics`` (:func:`start_sglang_export`, with or without
arms, on the prefill and the decode) is started at scheduler start by the installation's
activation, when SGLang runs with ``--enable-metrics``, on SGLang's stats-logging rank of
each DP group only (attention-TP rank 0 and attention-CP rank 0), under every metrics
flag: see :func:`sglang_exports_metrics`. It carries the middleware's counters and the
integration's own (:class:`CounterSource`: ``pd_middleware_integration_events_total``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ...core.metrics import Metrics
from .common import is_probe
from .patching import PROCESSOR_MODULE, RUNTIME_MODULE, Feature, Hook, Symbols, Target, read, register_feature

logger = logging.getLogger("pd_middleware.integrations.sglang")


def arm_of(req: Any) -> str | None:
    """The A/B arm the decode path attached to ``req`` (``req.pd_middleware.arm``), or None."""
    record = getattr(req, "pd_middleware", None)
    arm = getattr(record, "arm", None)
    return arm if isinstance(arm, str) else None


class FirstVerifyRecorder:
    """Counts each request's first verify into ``metrics``, by arm.

    ``arm_of``: reads a request's arm (default :func:`arm_of`). ``log_path``: a JSON-lines
    file to append one ``{"request_id", "arm", "accepted", "t"}`` line per first verify
    (``[metrics] first_verify_log``), or None.
    """

    def __init__(
        self,
        metrics: Metrics,
        *,
        arm_of: Callable[[Any], str | None] = arm_of,
        log_path: str | Path | None = None,
    ) -> None:
        self.metrics = metrics
        self.arm_of = arm_of
        self.log_path = log_path
        self._log: Any = None  # opened at the first line, so a refused install leaves no file open
        self._lock = threading.Lock()

    def before(self, batch: Any) -> list[int]:
        """Positions of the batch's requests not verified yet (``spec_verify_ct == 0``)."""
        # SGLang's warmups and health checks are not requests of any arm: never counted.
        return [i for i, r in enumerate(batch.reqs) if r.spec_verify_ct == 0 and not is_probe(r)]

    def after(self, batch: Any, result: Any, before: list[int]) -> int:
        """Record the requests whose first verify this was; returns how many.

        ``before``: what :meth:`before` returned for this batch.
        """
        if not before:
            return 0
        reqs = batch.reqs
        accepted = getattr(result, "num_correct_drafts_per_req_cpu", None)
        if accepted is None or len(accepted) != len(reqs):
            return 0
        n = 0
        for i in before:
            req = reqs[i]
            if req.spec_verify_ct > 0:
                arm = self.arm_of(req)
                self.metrics.record_first_verify(arm, int(accepted[i]))
                n += 1
                if self.log_path is not None:
                    self._write(req, arm, int(accepted[i]))
        return n

    def _write(self, req: Any, arm: str | None, accepted: int) -> None:
        room = getattr(req, "bootstrap_room", None)
        rid = str(int(room)) if room is not None else str(getattr(req, "rid", ""))
        line = json.dumps({"request_id": rid, "arm": arm, "accepted": accepted, "t": round(time.time(), 3)})
        with self._lock:
            path = self.log_path
            if path is None:  # stopped meanwhile
                return
            if self._log is None:
                self._log = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115  # held open across calls; stop() closes it
            self._log.write(line + "\n")

    def stop(self) -> None:
        """Close the log file (a middleware exporter: ``DecodeMiddleware.close`` calls it)."""
        with self._lock:
            log, self._log, self.log_path = self._log, None, None
        if log is not None:
            log.close()


def sglang_exports_metrics(symbols: Symbols) -> bool:
    """Whether this SGLang scheduler process copies the counters into SGLang's ``/metrics``.

    True under ``--enable-metrics`` with ``PROMETHEUS_MULTIPROC_DIR`` set, on SGLang's
    stats-logging rank (``SchedulerMetricsCollectorContext.init_new``: attention-TP rank 0
    and attention-CP rank 0), **with or without** ``--enable-metrics-for-all-schedulers``.
    Every attention-TP (and CP) rank of a DP group runs the same requests, so its
    counters are the same series; our families carry no rank label, and SGLang's
    ``MultiProcessCollector`` sums one series over every process that writes it, so a
    copy from each rank would multiply every count by the group's size. SGLang's own
    series under that flag carry ``tp_rank``; ours are copied once per DP group instead,
    and the DP groups (distinct requests) add up. Rank 0's counters are also the ones
    that describe what is verified: SGLang broadcasts the verify's result from
    attention-TP rank 0 (``docs/sglang.md``). False outside a scheduler whose runtime
    context is published (SGLang's ``runtime_context``, through the table's READ targets).
    """
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return False
    get_observability = symbols.get(f"{RUNTIME_MODULE}.get_observability")
    get_parallel = symbols.get(f"{RUNTIME_MODULE}.get_parallel")
    if get_observability is None or get_parallel is None:
        return False
    try:
        if not get_observability().enable_metrics:
            return False
        par = get_parallel()
        return bool(par.attn_tp_rank == 0 and par.attn_cp_rank == 0)
    except (AttributeError, ValueError):  # not a published scheduler context
        return False


#: The integration's own counters, by part (decode, prefill, inband, recompute, guard).
EVENTS_FAMILY = "integration_events"


class CounterSource:
    """What the copy into SGLang's ``/metrics`` carries: ``metrics``' families, and
    ``pd_middleware_integration_events_total{part, event}`` from ``events()`` (the
    installation's counters by part: ``decode.proposal:prefill``, ``prefill.published``,
    ``inband:written``, ``guard:<wrapper>:<error>``...).

    ``events`` runs on the copy's thread while the scheduler counts: a copy that meets a
    dict being resized is retried, then skipped until the next sync.
    """

    def __init__(self, metrics: Metrics, events: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.metrics = metrics
        self.events = events

    def families(self, prefix: str) -> Iterator[Any]:
        yield from self.metrics.families(prefix)
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily(
            f"{prefix}_{EVENTS_FAMILY}",
            "The SGLang integration's counters, by part and event",
            labels=["part", "event"],
        )
        for _ in range(3):
            try:
                parts = self.events()
                break
            except RuntimeError:  # "dictionary changed size during iteration"
                continue
        else:
            parts = {}
        for part, counts in sorted(parts.items()):
            for event, n in sorted(counts.items()):
                fam.add_metric([part, event], float(n))
        yield fam


def start_sglang_export(source: Any, interval_s: float, exporters: list[Any], *, enabled: Callable[[], bool]) -> Any:
    """Start copying ``source`` (a :class:`Metrics` or a :class:`CounterSource`) into
    SGLang's ``/metrics`` when ``enabled()`` (:func:`sglang_exports_metrics`).

    The mirror joins ``exporters`` (a middleware's list: stopped by its ``close()``).
    Returns it, or None when this process does not report. A failed start is logged, once,
    and returns None: metrics never stop a server.
    """
    if not enabled():
        return None
    from ...metrics_export import MultiprocessMirror

    try:
        mirror = MultiprocessMirror(source, interval_s).start()
    except Exception as exc:  # metrics never stop a server: any failure is logged, once
        logger.error("pd-middleware: counters not copied into SGLang's /metrics: %s", exc)
        return None
    exporters.append(mirror)
    logger.info("pd-middleware counters copied into SGLang's /metrics every %.2f s", interval_s)
    return mirror


def make_recorder(metrics: Metrics, config: Any, exporters: list[Any]) -> FirstVerifyRecorder:
    """The live A/B recorder of an SGLang installation (its wrapper: :func:`wrap_first_verify`).

    ``metrics``: the decode's counters; ``config``: its
    :class:`~pd_middleware.config.MetricsConfig` (``first_verify_log``); ``exporters``:
    the list whose owner stops its entries on close (the recorder joins it).
    """
    recorder = FirstVerifyRecorder(metrics, log_path=config.first_verify_log)
    exporters.append(recorder)
    return recorder


# --------------------------------------------------------------------- the features


def wrap_first_verify(original: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    recorder = inst.recorder

    def _resolve_spec_v2_tokens(self: Any, result: Any, batch: Any) -> Any:
        try:
            before = recorder.before(batch)
        except Exception as exc:
            inst.events.failed("first_verify", exc, "no A/B record")
            before = []
        out = original(self, result, batch)
        try:
            recorder.after(batch, result, before)
        except Exception as exc:
            inst.events.failed("first_verify", exc, "no A/B record")
        return out

    return _resolve_spec_v2_tokens


register_feature(
    Feature(
        "live_ab",
        (
            Target(
                PROCESSOR_MODULE,
                "SchedulerBatchResultProcessor._resolve_spec_v2_tokens",
                ("self", "result", "batch"),
                Hook.AROUND,
                wrap_first_verify,
            ),
        ),
        lambda plan: bool(plan.config.arms),
        summary="the first-verify counter per arm (only with [[arms]])",
    )
)
register_feature(
    Feature(
        "metrics_export",
        (read(RUNTIME_MODULE, "get_observability", ()), read(RUNTIME_MODULE, "get_parallel", ())),
        lambda plan: True,
        summary="the counters copied into SGLang's /metrics (--enable-metrics), on the ranks SGLang reports from",
    )
)
