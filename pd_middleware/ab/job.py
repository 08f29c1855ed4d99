"""``pd-middleware ab``: compare proposal strategies on the same seeded traffic.

This process is the decode node of an embedded loopback deployment. It starts a real
:class:`~pd_middleware.transport.receiver.DecodeReceiver` (ZMQ + Mooncake on TCP),
spawns a prefill process (:mod:`pd_middleware.ab.prefill`) that runs every arm's encoder
on the same workload rows, and for every delivered batch runs the arm's synthesizer
(through the receive pipeline), the assembler and the reference chain verifier against
the workload's target rows, which it regenerates from the same seed.

Per arm it measures first-verify acceptance (95% Wilson interval), accepted length,
exactness (binned TV of committed tokens from p, with its bound), bytes per request by
plane, receive-to-batch latency, throughput and payload accounting, then prints a
table and writes ``report.json`` and ``report.png``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from .._errors import ConfigError, PDMiddlewareError
from ..config import Config, load_config, resolve_plugins
from ..contracts import ReceiveContext
from ..metrics import Metrics
from ..payload import Payload
from ..pipeline import Delivery, Failure, ReceivePipeline
from ..registry import default_registry
from .effect import response_effect
from .prefill import PrefillJob, _workload_options, run_prefill
from .progress import Progress


class _RouteByRequestId:
    """Internal hook: the offline job names each request ``<arm>/<index>``."""

    def on_receive(self, payload: Payload, context: ReceiveContext) -> None:
        context.arm = payload.request_id.split("/", 1)[0]


@dataclass
class ArmStats:
    """Everything measured for one arm."""

    name: str
    synthesizer: str
    encoder: str
    encoder_options: dict[str, Any]
    delivered: int = 0
    failed: int = 0
    failure_reasons: dict[str, int] = field(default_factory=dict)
    # The first failure text per reason key ("hook:flaky" -> "ValueError: ..."), for the summary.
    first_errors: dict[str, str] = field(default_factory=dict)
    first_accepted: int = 0
    verified: int = 0
    accepted_sum: int = 0
    expected_first_sum: float = 0.0
    exact_first_sum: float = 0.0
    full_bound_sum: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    first_t: float | None = None
    last_t: float | None = None
    exactness: Any = None


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


def run_ab(
    config: Config,
    *,
    requests: int | None = None,
    seed: int | None = None,
    out_dir: str | Path = "out/ab",
    progress: bool = True,
    source: str | None = None,
    timeout_s: float = 1800.0,
    cancel: threading.Event | None = None,
) -> dict[str, Any]:
    """Run the A/B job and return the report (also written to ``out_dir``).

    ``cancel`` (set by the CLI on Ctrl-C): the job stops collecting within a fraction of
    a second, stops the prefill process without waiting for it, and returns (and writes)
    the report of what was verified so far, with ``"partial": true``.
    """
    import torch

    from ..assembler import ProposalAssembler
    from ..stats import ExactnessAccumulator
    from ..transport.receiver import open_receiver
    from ..workloads import make_workload

    cfg = config
    if not cfg.arms:
        raise ConfigError("the ab job needs at least one [[arms]] entry", path="arms", source=source)
    n_req = requests if requests is not None else cfg.ab.requests
    seed_v = seed if seed is not None else cfg.ab.seed
    if n_req < 1:
        raise ConfigError(f"--requests must be >= 1, got {n_req}", path="ab.requests", source=source)
    registry = default_registry()
    resolved = resolve_plugins(cfg, registry, source)  # both sides: fail before spawning anything
    wl = make_workload(cfg.ab.workload.name, **_workload_options(cfg))
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
    if not cfg.decode.rejection_sampling:
        raise ConfigError("the ab job compares proposals, so it needs rejection sampling on", path="decode.rejection_sampling", source=source)
    torch.set_num_threads(1)

    ctx = cfg.plugin_context("decode")
    arm_names = tuple(a.name for a in cfg.arms)
    hooks = [(r.spec.name, registry.build(r.spec, r.options, ctx, r.key)) for r in resolved.hooks]
    hooks = [(n, h) for n, h in hooks if n != "ab_split"] + [("route", _RouteByRequestId())]
    synths = {a: (r.spec.name, registry.build(r.spec, r.options, ctx, r.key)) for a, r in resolved.synthesizers.items()}
    metrics = Metrics()
    for _, s in synths.values():
        guard = getattr(s, "guard", None)
        if guard is not None and hasattr(guard, "attach_metrics"):
            guard.attach_metrics(metrics)
    pipeline = ReceivePipeline(hooks, synths, metrics)
    b_max = cfg.ab.batch_size
    assemblers = {
        a: ProposalAssembler(cfg.model.vocab_size, cfg.model.num_steps, b_max, device=cfg.decode.device) for a in arm_names
    }
    stats = {
        a: ArmStats(
            name=a,
            synthesizer=resolved.synthesizers[a].spec.name,
            encoder=resolved.encoders[a].spec.name,
            encoder_options=msgspec.to_builtins(resolved.encoders[a].options)
            if hasattr(resolved.encoders[a].options, "__struct_fields__")
            else {},
            exactness=ExactnessAccumulator(num_bins=16, alpha=1e-6),
        )
        for a in arm_names
    }

    receiver = open_receiver(cfg.transport, pipeline)
    mpctx = mp.get_context("spawn")
    results = mpctx.Queue()
    job = PrefillJob(
        config_data=msgspec.to_builtins(cfg),
        address=receiver.address,
        requests=n_req,
        seed=seed_v,
        batch_size=b_max,
        arm_names=arm_names,
    )
    proc = mpctx.Process(target=run_prefill, args=(job, results), name="pd-middleware-ab-prefill", daemon=True)
    # Target rows are regenerated from the seed on a background thread, so that batch
    # formation (receive -> assemble) never waits for the workload generator.
    targets = _TargetFeed(wl, n_req, b_max, seed_v)
    t_start = time.perf_counter()
    proc.start()
    targets.start()
    total = n_req * len(arm_names)
    n_batches = (n_req + b_max - 1) // b_max
    bar = Progress(total, "ab", enabled=progress)
    buckets: dict[tuple[str, int], list[Delivery | Failure]] = {}
    ready: dict[tuple[str, int], _Assembled] = {}
    # Verification runs on its own thread so that it never delays batch formation.
    verifier = _VerifyThread(stats, torch.Generator().manual_seed(seed_v ^ 0xC0FFEE))
    verifier.start()
    prefill_report: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout_s
    next_k = 0
    partial = False
    try:
        while next_k < n_batches:
            if cancel is not None and cancel.is_set():
                partial = True
                break
            item = receiver.get(timeout=0.05)
            if item is not None:
                _collect(item, arm_names, b_max, n_req, buckets, ready, assemblers, stats)
            # Verify, in order, every batch whose arms are all assembled and whose targets exist.
            while next_k < n_batches and all((a, next_k) in ready for a in arm_names):
                # Never block here: deliveries keep arriving while targets are generated.
                batch = targets.poll(next_k) if item is not None else targets.get(next_k, min(deadline, time.monotonic() + 0.05))
                if batch is None:
                    break
                verifier.submit(batch, {a: ready.pop((a, next_k)) for a in arm_names})
                next_k += 1
                bar.update(sum(st.delivered + st.failed for st in stats.values()))
            verifier.check()
            if item is not None:
                continue
            if time.monotonic() > deadline:
                raise PDMiddlewareError(f"ab: timed out after {timeout_s:.0f}s waiting for batch {next_k}")
            if prefill_report is None and not results.empty():
                kind, value = results.get()
                if kind == "error":
                    raise PDMiddlewareError(f"ab: the prefill process failed: {value}")
                prefill_report = value
            elif prefill_report is None and not proc.is_alive():
                raise PDMiddlewareError(f"ab: the prefill process died (exit code {proc.exitcode})")
            elif prefill_report is not None:
                late = receiver.get(timeout=0.5)
                if late is not None:  # still arriving: file it and keep going
                    _collect(late, arm_names, b_max, n_req, buckets, ready, assemblers, stats)
                    continue
                # Everything was sent and acknowledged and nothing more arrives:
                # whatever is missing now never reached the decode. Fail it, never drop it.
                for (arm, k), got in list(buckets.items()):
                    have = {x.request_id for x in got}
                    size = min(b_max, n_req - k * b_max)
                    for i in range(size):
                        rid = f"{arm}/{k * b_max + i}"
                        if rid not in have:
                            _collect(Failure(rid, "transfer", "never arrived at the decode", arm=arm),
                                     arm_names, b_max, n_req, buckets, ready, assemblers, stats)
                for arm in arm_names:
                    for k in range(next_k, n_batches):
                        if (arm, k) not in ready and (arm, k) not in buckets:
                            size = min(b_max, n_req - k * b_max)
                            for i in range(size):
                                _collect(Failure(f"{arm}/{k * b_max + i}", "transfer", "never arrived at the decode", arm=arm),
                                         arm_names, b_max, n_req, buckets, ready, assemblers, stats)
        if partial:  # interrupted: verify nothing more, report what was verified
            verifier.discard_pending()
        verifier.finish(1.0 if partial else max(1.0, deadline - time.monotonic()))
        if prefill_report is None and not partial:
            kind, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            if kind == "error":
                raise PDMiddlewareError(f"ab: the prefill process failed: {value}")
            prefill_report = value
    finally:
        bar.close()
        verifier.stop()
        targets.stop()
        if partial:  # interrupted: the prefill's remaining traffic is not wanted
            proc.terminate()
        proc.join(timeout=1 if partial else 10)
        if proc.is_alive():
            proc.terminate()
        receiver.stop()
        pipeline.close()
    wall = time.perf_counter() - t_start
    report = _report(cfg, wl, stats, prefill_report, metrics, n_req, seed_v, wall)
    report["partial"] = partial
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from .report import format_table, write_plot

    (out / "report.json").write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=2) + b"\n")
    if not partial:  # an interrupted run exits at once: the plot (matplotlib) takes seconds
        write_plot(report, out / "report.png")
    report["_table"] = format_table(report)
    return report


class _TargetFeed:
    """Regenerates the workload's batches (target rows) on a thread, in order."""

    def __init__(self, wl: Any, n_req: int, batch_size: int, seed: int) -> None:
        import queue
        import threading

        self._it = wl.batches(n_req, batch_size, seed)
        self._q: "queue.Queue[Any]" = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        self._held: Any = None
        self._thread = threading.Thread(target=self._run, name="ab-targets", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import queue

        try:
            for k, batch in enumerate(self._it):
                while not self._stop.is_set():
                    try:
                        self._q.put((k, batch), timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._q.put(("error", exc))

    def poll(self, k: int) -> Any:
        """Batch ``k`` if it is generated, else None (never blocks)."""
        return self.get(k, 0.0)

    def get(self, k: int, until: float) -> Any:
        """Batch ``k``, waiting until monotonic time ``until`` at most; None if not ready."""
        import queue

        if self._held is None:
            try:
                self._held = self._q.get(timeout=max(0.0, until - time.monotonic())) if until > 0 else self._q.get_nowait()
            except queue.Empty:
                return None
        got, batch = self._held
        if got == "error":
            raise batch
        assert got == k, f"workload batches out of order: {got} != {k}"
        self._held = None
        return batch

    def stop(self) -> None:
        self._stop.set()


@dataclass
class _Assembled:
    """One arm's share of a batch, assembled as soon as it was complete."""

    rows: list[int]
    tokens: Any
    draft_probs: Any
    # Per row, what X was drawn from, for the paired exact expectation:
    # "law" (X ~ the q' handed over), "sampled" (X ~ the draft q, one-hot q'),
    # "greedy" (X = argmax q, one-hot q').
    kinds: tuple[str, ...] = ()


def _draw_kind(d: Delivery) -> str:
    """How X relates to the q' this delivery hands the verifier (see ``_Assembled.kinds``)."""
    from ..proposal import OneHotProposal

    if d.payload.provenance.rule == "greedy":
        return "greedy"
    return "sampled" if isinstance(d.proposal, OneHotProposal) else "law"


def _collect(item, arm_names, b_max, n_req, buckets, ready, assemblers, stats) -> None:
    """File an outcome in its (arm, batch) bucket; assemble the bucket once complete."""
    import torch

    rid = item.request_id or ""
    arm, _, idx = rid.partition("/")
    if arm not in stats or not idx.isdigit() or int(idx) >= n_req:
        return  # not ours (cannot happen with the embedded prefill); counted by the receiver
    k = int(idx) // b_max
    bucket = buckets.setdefault((arm, k), [])
    bucket.append(item)
    size = min(b_max, n_req - k * b_max)
    if len(bucket) < size:
        return
    del buckets[(arm, k)]
    st = stats[arm]
    bucket.sort(key=lambda x: int(x.request_id.partition("/")[2]))
    deliveries = []
    rows = []
    for x in bucket:
        if isinstance(x, Failure):
            st.failed += 1
            st.failure_reasons[x.key] = st.failure_reasons.get(x.key, 0) + 1
            st.first_errors.setdefault(x.key, x.reason)
        else:
            deliveries.append(x)
            rows.append(int(x.request_id.partition("/")[2]) - k * b_max)
    if not deliveries:
        ready[(arm, k)] = _Assembled([], None, None)
        return
    draft = assemblers[arm].build([d.proposal for d in deliveries])
    t_batch = time.perf_counter()
    for d in deliveries:
        st.latencies_ms.append((t_batch - d.received_at) * 1e3)
    st.first_t = min(d.received_at for d in deliveries) if st.first_t is None else st.first_t
    st.last_t = t_batch
    tokens = torch.tensor([d.payload.draft_tokens for d in deliveries], dtype=torch.int64)
    # The view is reused by the next build of this arm: keep a copy for the verifier.
    kinds = tuple(_draw_kind(d) for d in deliveries)
    ready[(arm, k)] = _Assembled(rows, tokens, draft.clone(), kinds)
    for d in deliveries:
        d.release()
    st.delivered += len(deliveries)


class _VerifyThread:
    """Runs :func:`_verify_batch` in order on a worker thread (torch releases the GIL)."""

    def __init__(self, stats: dict[str, ArmStats], gen: Any) -> None:
        import queue
        import threading

        self._stats = stats
        self._gen = gen
        self._q: "queue.Queue[Any]" = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ab-verify", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, batch: Any, assembled: dict[str, "_Assembled"]) -> None:
        self._q.put((batch, assembled))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            try:
                _verify_batch(item[0], item[1], self._stats, self._gen)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread by check()
                self._error = exc
                return

    def check(self) -> None:
        """Re-raise a failure of the worker on the calling thread."""
        if self._error is not None:
            raise self._error

    def finish(self, timeout: float) -> None:
        """Wait until every submitted batch is verified."""
        self._q.put(None)
        self._thread.join(timeout)
        self.check()
        if self._thread.is_alive():
            raise PDMiddlewareError("ab: verification did not finish in time")

    def discard_pending(self) -> None:
        """Drop the batches not yet verified (an interrupted run reports without them)."""
        import queue

        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass

    def stop(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)


def _verify_batch(batch, assembled: dict[str, _Assembled], stats: dict[str, ArmStats], gen) -> None:
    """Verify every arm's share of one workload batch against its target rows.

    What does not depend on the arm (the full-distribution bound, the binned law of
    each target row for the exactness test) is computed once per batch: those are the
    only V-wide passes besides the verifier itself.
    """
    import torch

    from ..verify import acceptance_probability, sum_min, verify_chain

    full_rows = sum_min(batch.target_probs[:, 0], batch.draft_probs[:, 0])
    shared_law: dict[int, Any] = {}
    b = batch.batch_size
    for arm, asm in assembled.items():
        st = stats[arm]
        if not asm.rows:
            continue
        sel = torch.tensor(asm.rows)
        whole = len(asm.rows) == b
        if batch.conditional is not None:
            target = batch.target_given(_full_prefix(batch, sel, asm.tokens))
            target = target if whole else target[sel]
        else:
            target = batch.target_probs if whole else batch.target_probs[sel]
        res = verify_chain(target, asm.draft_probs, asm.tokens, gen)
        # Rao-Blackwellised acceptance: P(accept | X) = min(1, p(X)/q'(X)), a lower-variance
        # estimate of the same mean as the observed rate.
        draft3 = asm.draft_probs if asm.draft_probs.dim() == 3 else asm.draft_probs.unsqueeze(1)
        st.expected_first_sum += float(acceptance_probability(target, draft3, asm.tokens)[:, 0].sum())
        st.exact_first_sum += _paired_expectation(asm, draft3, batch, sel, sum_min)
        st.verified += len(asm.rows)
        st.first_accepted += int(res.first_accepted.sum())
        st.accepted_sum += int(res.accepted_lengths.sum())
        st.full_bound_sum += float(full_rows[sel].sum())
        # Exactness: every committed position, against p given the accepted prefix.
        for pos in range(res.committed.shape[1]):
            live = res.committed[:, pos] >= 0
            if not bool(live.any()):
                continue
            rows = target[live, pos]
            law = None
            if batch.conditional is None:
                if pos not in shared_law:
                    shared_law[pos] = st.exactness.bin_law(batch.target_probs[:, pos])
                law = shared_law[pos][sel[live]]
            st.exactness.update(rows, res.committed[live, pos], bin_law=law)


def _paired_expectation(asm: _Assembled, draft3, batch, sel, sum_min) -> float:
    """Sum over rows of the exact first-position acceptance given the workload rows.

    X ~ q' handed over: sum min(p, q'). X ~ draft q with one-hot q': sum q.p.
    X = argmax q: p(argmax q). Free of the sampling noise of X and u, and paired
    across arms (same contexts), so ratios between arms are precise.
    """
    import torch

    p0 = batch.target_probs[sel, 0].double()
    q0 = batch.draft_probs[sel, 0].double()
    kinds = asm.kinds
    law = torch.tensor([k == "law" for k in kinds])
    greedy = torch.tensor([k == "greedy" for k in kinds])
    total = 0.0
    if bool(law.any()):
        total += float(sum_min(p0[law], draft3[law, 0]).sum())
    samp = ~(law | greedy)
    if bool(samp.any()):
        total += float((p0[samp] * q0[samp]).sum())
    if bool(greedy.any()):
        total += float(p0[greedy].gather(1, q0[greedy].argmax(1, keepdim=True)).sum())
    return total


def _full_prefix(batch, sel, tokens):
    """(B, S) drafted tokens for the whole batch, with the delivered rows filled in."""
    import torch

    full = torch.zeros(batch.batch_size, tokens.shape[1], dtype=torch.int64)
    full[sel] = tokens
    return full


def _report(cfg, wl, stats, prefill, metrics, n_req, seed, wall) -> dict[str, Any]:
    from ..stats import wilson_interval

    from ..payload import ITEMSIZE

    hidden_bytes = cfg.model.hidden_size * ITEMSIZE[cfg.model.hidden_dtype]
    arms = []
    for a, st in stats.items():
        sent = prefill["sent"].get(a, 0) if prefill else 0
        by_plane = prefill["bytes"].get(a, {}) if prefill else {}
        per_req = {k: (v / sent if sent else 0.0) for k, v in by_plane.items()}
        n = st.verified
        acc = st.first_accepted / n if n else float("nan")
        lo, hi = wilson_interval(st.first_accepted, n) if n else (float("nan"), float("nan"))
        mean_len = st.accepted_sum / n if n else float("nan")
        ex = st.exactness.result() if st.exactness.n else None
        span = (st.last_t - st.first_t) if (st.first_t is not None and st.last_t is not None) else 0.0
        eff = response_effect(
            mean_len + 1.0,
            response_tokens=cfg.ab.response_tokens,
            later_acceptance=cfg.ab.later_acceptance,
            num_steps=cfg.model.num_steps,
        )
        arms.append(
            {
                "name": a,
                "synthesizer": st.synthesizer,
                "encoding": st.encoder,
                "encoder_options": st.encoder_options,
                "acceptance": {
                    "mean": acc,
                    "ci95": [lo, hi],
                    "n": n,
                    "expected": st.expected_first_sum / n if n else float("nan"),
                    "exact_expected": st.exact_first_sum / n if n else float("nan"),
                },
                "full_distribution_bound": st.full_bound_sum / n if n else float("nan"),
                "accepted_length": mean_len,
                "exact": {
                    "tv": ex.tv if ex else float("nan"),
                    "bound": ex.bound if ex else float("nan"),
                    "pass": bool(ex.passed) if ex else False,
                    "tokens": ex.n if ex else 0,
                    "bins": ex.num_bins if ex else 0,
                },
                "bytes_per_request": {
                    "control": per_req.get("control", 0.0),
                    "bulk": per_req.get("bulk", 0.0) + per_req.get("inline", 0.0),
                    "bulk_mooncake": per_req.get("bulk", 0.0),
                    "bulk_inline": per_req.get("inline", 0.0),
                    "total": sum(per_req.values()),
                    # What the proposal itself costs: bulk bytes beyond the hidden state.
                    "proposal": max(0.0, per_req.get("bulk", 0.0) + per_req.get("inline", 0.0) - hidden_bytes),
                },
                "latency_ms": {"p50": _percentile(st.latencies_ms, 50), "p99": _percentile(st.latencies_ms, 99)},
                "throughput_per_s": (st.delivered / span) if span > 0 else float("nan"),
                "payloads": {"sent": sent, "delivered": st.delivered, "failed": st.failed, "failed_by_reason": st.failure_reasons,
                             "first_error_by_reason": st.first_errors},
                "effect": eff.as_dict(),
            }
        )
    full = next((x for x in arms if x["encoding"] == "full" and x["synthesizer"] == "full_distribution"), None)
    for x in arms:
        # (an interrupted run may have no byte counts from the prefill: no ratio then)
        if full is not None and full["acceptance"]["exact_expected"] > 0 and full["bytes_per_request"]["total"] > 0:
            x["vs_full"] = {
                "acceptance_ratio": x["acceptance"]["exact_expected"] / full["acceptance"]["exact_expected"],
                "bytes_ratio": x["bytes_per_request"]["total"] / full["bytes_per_request"]["total"],
                "proposal_bytes_ratio": (
                    x["bytes_per_request"]["proposal"] / full["bytes_per_request"]["proposal"]
                    if full["bytes_per_request"]["proposal"] > 0 else float("nan")
                ),
            }
    base = next((x for x in arms if x["synthesizer"] == "one_hot"), arms[0])
    for x in arms:
        x["effect"]["verifies_vs_" + base["name"]] = (
            x["effect"]["verifies_per_response"] / base["effect"]["verifies_per_response"]
        )
    return {
        "seed": seed,
        "requests_per_arm": n_req,
        "workload": wl.describe(),
        "model": msgspec.to_builtins(cfg.model),
        "ab": msgspec.to_builtins(cfg.ab),
        "wall_s": wall,
        "arms": arms,
        "receiver": metrics.snapshot(),
        "sender": prefill.get("sender") if prefill else None,
        "send_errors_sample": {a: e[:3] for a, e in prefill.get("send_errors", {}).items() if e} if prefill else {},
    }


def run_ab_command(args: argparse.Namespace) -> int:
    """CLI adapter for ``pd-middleware ab``."""
    cfg = load_config(args.config)
    report = run_ab(
        cfg,
        requests=args.requests,
        seed=args.seed,
        out_dir=args.out,
        progress=not args.no_progress,
        source=args.config,
    )
    print(report.pop("_table"))
    out = Path(args.out)
    print(f"\nwrote {out / 'report.json'} and {out / 'report.png'}")
    ok = all(a["exact"]["pass"] for a in report["arms"])
    lost = sum(a["payloads"]["sent"] - a["payloads"]["delivered"] - a["payloads"]["failed"] for a in report["arms"])
    if not ok or lost:
        print(f"pd-middleware ab: exactness {'PASS' if ok else 'FAIL'}, lost payloads {lost}", file=sys.stderr)
        return 1
    return 0
