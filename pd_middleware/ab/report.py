"""Builds the typed :class:`~pd_middleware.ab.schema.Report` from a run's per-arm statistics.

The report is the single source of ``report.json``, the table and the plot
(:mod:`pd_middleware.ab.render`). Arms are compared by role: every arm against the
``baseline`` arm (verify steps) and against the ``reference`` arm (acceptance, bytes).
"""

from __future__ import annotations

import datetime
import math
import sys
from importlib import metadata
from typing import Any

import msgspec

from ..core.payload import ITEMSIZE
from ..evaluation.stats import wilson_interval
from .collector import ArmStats
from .effect import response_effect
from .schema import (
    RESPONSE_LENGTHS,
    SCHEMA_VERSION,
    Acceptance,
    ArmReport,
    BytesPerRequest,
    Effect,
    EffectPoint,
    Exactness,
    FailureCount,
    HookFailures,
    Latency,
    Payloads,
    Pipeline,
    Report,
    VsReference,
)

_PACKAGES = (
    "pd-middleware",
    "torch",
    "msgspec",
    "pyzmq",
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
)


def _num(x: float) -> float | None:
    return None if (x is None or math.isnan(x)) else x


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _versions() -> dict[str, str]:
    out = {"python": ".".join(map(str, sys.version_info[:3]))}
    for name in _PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


class RunFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the runner knows about a run besides the per-arm statistics."""

    config: Any
    workload: dict[str, Any]
    requests: int
    seed: int
    wall_s: float
    partial: bool
    baseline: str
    reference: str | None
    receiver: dict[str, Any]
    prefill: dict[str, Any] | None
    # The decode's side of the pipeline (deploy.deploy), None when nothing started.
    pipeline: dict[str, Any] | None = None


def build_report(stats: dict[str, ArmStats], facts: RunFacts) -> Report:
    """Turn the per-arm statistics of a (possibly partial) run into a :class:`Report`."""
    cfg = facts.config
    hidden_bytes = cfg.model.hidden_size * ITEMSIZE[cfg.model.hidden_dtype]
    pre = facts.prefill or {}
    arms = [_arm(st, cfg, hidden_bytes, pre, facts) for st in stats.values()]
    base = next(a for a in arms if a.name == facts.baseline)
    ref = next((a for a in arms if a.name == facts.reference), None)
    arms = [_compare(a, base, ref, cfg) for a in arms]
    return Report(
        schema_version=SCHEMA_VERSION,
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        partial=facts.partial,
        seed=facts.seed,
        requests_per_arm=facts.requests,
        baseline=facts.baseline,
        reference=facts.reference,
        workload=facts.workload,
        model=msgspec.to_builtins(cfg.model),
        ab=msgspec.to_builtins(cfg.ab),
        config=msgspec.to_builtins(cfg),
        versions=_versions(),
        wall_s=facts.wall_s,
        arms=arms,
        hook_failures=_hook_failures(stats),
        receiver=facts.receiver,
        sender=pre.get("sender"),
        pipeline=_pipeline(facts.pipeline, facts.prefill),
    )


def _pipeline(dec: dict[str, Any] | None, pre: dict[str, Any] | None) -> Pipeline | None:
    """Both processes' stage CPU seconds and peak RSS, once both have reported."""
    if dec is None or pre is None or "cpu_s" not in dec or "cpu_s" not in pre:
        return None
    cpu = {f"prefill.{k}": v for k, v in pre["cpu_s"].items()}
    cpu["prefill.rest"] = max(0.0, pre["process_cpu_s"] - sum(pre["cpu_s"].values()))
    cpu.update({f"decode.{k}": v for k, v in dec["cpu_s"].items()})
    return Pipeline(
        in_flight_batches=dec["in_flight_batches"],
        peak_rss_bytes={"decode": dec["peak_rss_bytes"], "prefill": pre["peak_rss_bytes"]},
        cpu_s={k: round(v, 3) for k, v in cpu.items()},
        credit_wait_s=round(pre["credit_wait_s"], 3),
    )


def _arm(st: ArmStats, cfg: Any, hidden_bytes: int, pre: dict[str, Any], facts: RunFacts) -> ArmReport:
    sent = pre.get("sent", {}).get(st.name, 0)
    per_req = {k: (v / sent if sent else 0.0) for k, v in pre.get("bytes", {}).get(st.name, {}).items()}
    n = st.verified
    mean_len = st.accepted_sum / n if n else None
    ex = st.exactness.result() if st.exactness.n else None
    span = (st.last_t - st.first_t) if (st.first_t is not None and st.last_t is not None) else 0.0
    bulk = per_req.get("bulk", 0.0) + per_req.get("inline", 0.0)
    errors = pre.get("send_errors", {}).get(st.name) or []
    return ArmReport(
        name=st.name,
        role="baseline" if st.name == facts.baseline else "reference" if st.name == facts.reference else "candidate",
        synthesizer=st.synthesizer,
        encoding=st.encoder,
        encoder_options=st.encoder_options,
        acceptance=Acceptance(
            mean=st.first_accepted / n if n else None,
            ci95=wilson_interval(st.first_accepted, n) if n else None,
            n=n,
            expected=st.expected_first_sum / n if n else None,
            exact_expected=st.exact_first_sum / n if n else None,
        ),
        full_distribution_bound=st.full_bound_sum / n if n else None,
        accepted_length=mean_len,
        exact=Exactness(
            tv=ex.tv if ex else None,
            bound=ex.bound if ex else None,
            passed=bool(ex and ex.passed),
            tokens=ex.n if ex else 0,
            bins=ex.num_bins if ex else 0,
        ),
        bytes_per_request=BytesPerRequest(
            control=per_req.get("control", 0.0),
            bulk=bulk,
            bulk_mooncake=per_req.get("bulk", 0.0),
            bulk_inline=per_req.get("inline", 0.0),
            total=sum(per_req.values()),
            # What the proposal itself costs: bulk bytes beyond the hidden state.
            proposal=max(0.0, bulk - hidden_bytes),
        ),
        latency_ms=Latency(p50=_num(st.latency_ms.quantile(50)), p99=_num(st.latency_ms.quantile(99))),
        throughput_per_s=(st.delivered / span) if span > 0 else None,
        payloads=Payloads(
            sent=sent,
            delivered=st.delivered,
            failed=st.failed,
            failed_by_reason={k: t.count for k, t in st.failures.items()},
        ),
        failures=[
            FailureCount(kind=k, count=t.count, first_error=t.first_error, first_request=t.first_request)
            for k, t in st.failures.items()
        ],
        send_failures=FailureCount(
            kind="send",
            count=pre.get("send_error_count", {}).get(st.name, len(errors)),
            first_error=errors[0].partition(": ")[2],
            first_request=errors[0].partition(": ")[0],
        )
        if errors
        else None,
        effect=_effect(mean_len, cfg),
        vs_reference=None,
    )


def _effect(mean_len: float | None, cfg: Any) -> Effect:
    later = response_effect(
        1.0, response_tokens=1, later_acceptance=cfg.ab.later_acceptance, num_steps=cfg.model.num_steps
    ).later_tokens_per_verify
    if mean_len is None:
        return Effect(
            first_verify_tokens=None,
            later_tokens_per_verify=round(later, 5),
            verifies_per_response=None,
            verifies_vs_baseline=None,
            by_response_length=[],
        )
    e = response_effect(
        mean_len + 1.0,
        response_tokens=cfg.ab.response_tokens,
        later_acceptance=cfg.ab.later_acceptance,
        num_steps=cfg.model.num_steps,
    )
    return Effect(
        first_verify_tokens=round(e.first_verify_tokens, 5),
        later_tokens_per_verify=round(later, 5),
        verifies_per_response=round(e.verifies_per_response, 5),
        verifies_vs_baseline=None,
        by_response_length=[],
    )


def _compare(a: ArmReport, base: ArmReport, ref: ArmReport | None, cfg: Any) -> ArmReport:
    """Fill the baseline-relative effect and the reference-relative shares of ``a``."""
    eff = a.effect
    points = []
    if eff.first_verify_tokens is not None and base.effect.first_verify_tokens is not None:
        for t in RESPONSE_LENGTHS:
            kw = dict(response_tokens=t, later_acceptance=cfg.ab.later_acceptance, num_steps=cfg.model.num_steps)
            mine = response_effect(eff.first_verify_tokens, **kw).verifies_per_response
            theirs = response_effect(base.effect.first_verify_tokens, **kw).verifies_per_response
            points.append(
                EffectPoint(
                    response_tokens=t,
                    verifies=round(mine, 5),
                    saved_vs_baseline=round(theirs - mine, 5),
                    saved_pct_vs_baseline=round((theirs - mine) / theirs * 100, 5),
                )
            )
    eff = msgspec.structs.replace(
        eff,
        by_response_length=points,
        verifies_vs_baseline=_ratio(eff.verifies_per_response, base.effect.verifies_per_response),
    )
    vs = None
    if ref is not None and a is not ref:
        ab, rb = a.bytes_per_request, ref.bytes_per_request
        vs = VsReference(
            acceptance_ratio=_ratio(a.acceptance.exact_expected, ref.acceptance.exact_expected),
            bytes_ratio=_ratio(ab.total, rb.total),
            proposal_bytes_ratio=_ratio(ab.proposal, rb.proposal),
        )
    return msgspec.structs.replace(a, effect=eff, vs_reference=vs)


def _hook_failures(stats: dict[str, ArmStats]) -> list[HookFailures]:
    """Failures whose stage is ``hook:<name>``, per hook over all arms (first text kept)."""
    out: dict[str, dict[str, Any]] = {}
    for st in stats.values():
        for key, t in st.failures.items():
            stage, _, rest = key.partition(":")
            if stage != "hook":
                continue
            hook = rest.partition(":")[0]
            h = out.setdefault(
                hook, {"count": 0, "first_error": t.first_error, "first_request": t.first_request, "by_arm": {}}
            )
            h["count"] += t.count
            h["by_arm"][st.name] = h["by_arm"].get(st.name, 0) + t.count
    return [HookFailures(hook=k, **v) for k, v in out.items()]
