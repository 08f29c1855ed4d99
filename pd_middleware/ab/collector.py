"""Files each arm's outcomes into batches and assembles each batch once it is complete.

Request ids are ``"<arm>/<index>"``; request ``index`` belongs to batch ``index //
batch_size``. A batch of one arm is assembled (through the middleware's assembler) as
soon as every one of its requests has an outcome, delivered or failed, so batch
formation never waits for another arm or for verification.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.contracts import ReceiveContext
from ..core.payload import Payload
from ..decode.pipeline import Delivery, Failure
from ..evaluation.stats import LogHistogram


class RouteByRequestId:
    """Receive hook of the offline job: the arm is the request id's prefix ``<arm>/``."""

    routes_arms = True

    def on_receive(self, payload: Payload, context: ReceiveContext) -> None:
        context.arm = payload.request_id.split("/", 1)[0]


@dataclass
class FailureTally:
    """Failures of one kind (``stage`` or ``stage:field``): how many, and the first reason."""

    count: int = 0
    first_error: str = ""
    first_request: str = ""


@dataclass
class ArmStats:
    """Everything measured for one arm, filled by the collector and the verifier."""

    name: str
    synthesizer: str
    encoder: str
    encoder_options: dict[str, Any]
    exactness: Any
    delivered: int = 0
    failed: int = 0
    failures: dict[str, FailureTally] = field(default_factory=dict)
    first_accepted: int = 0
    verified: int = 0
    accepted_sum: int = 0
    expected_first_sum: float = 0.0
    exact_first_sum: float = 0.0
    full_bound_sum: float = 0.0
    # Receive-to-batch latency, ms: fixed memory, quantiles within 1% (stats.LogHistogram).
    latency_ms: LogHistogram = field(default_factory=LogHistogram)
    first_t: float | None = None
    last_t: float | None = None

    def record_failure(self, failure: Failure) -> None:
        self.failed += 1
        tally = self.failures.setdefault(failure.key, FailureTally())
        if tally.count == 0:
            tally.first_error, tally.first_request = failure.reason, failure.request_id or ""
        tally.count += 1


@dataclass
class Assembled:
    """One arm's share of a batch, assembled as soon as it was complete."""

    rows: list[int]
    tokens: Any
    draft_probs: Any
    # Per row, what X was drawn from, for the paired exact expectation:
    # "law" (X ~ the q' handed over), "sampled" (X ~ the draft q, one-hot q'),
    # "greedy" (X = argmax q, one-hot q').
    kinds: tuple[str, ...] = ()


def draw_kind(d: Delivery) -> str:
    """How X relates to the q' this delivery hands the verifier (see ``Assembled.kinds``)."""
    from ..core.proposal import OneHotProposal

    if d.payload.provenance.rule == "greedy":
        return "greedy"
    return "sampled" if isinstance(d.proposal, OneHotProposal) else "law"


@dataclass(frozen=True)
class BatchPlan:
    """How the job's requests are cut into batches (the same cut on both sides)."""

    arm_names: tuple[str, ...]
    requests: int
    batch_size: int

    @property
    def batches(self) -> int:
        return (self.requests + self.batch_size - 1) // self.batch_size

    def size(self, k: int) -> int:
        """Requests in batch ``k`` (the last one may be short)."""
        return min(self.batch_size, self.requests - k * self.batch_size)


class Collector:
    """Buckets outcomes per ``(arm, batch)`` and hands complete, assembled batches over.

    ``assemble`` turns a batch's deliveries into its ``draft_probs`` (a view the next
    call may overwrite: the collector copies it).
    """

    def __init__(
        self, plan: BatchPlan, stats: dict[str, ArmStats], assemble: Callable[[Sequence[Delivery]], Any]
    ) -> None:
        self.plan = plan
        self.stats = stats
        self._assemble = assemble
        self._buckets: dict[tuple[str, int], list[Delivery | Failure]] = {}
        self.ready: dict[tuple[str, int], Assembled] = {}
        self.cpu_s = 0.0  # thread CPU seconds spent closing and assembling batches

    def add(self, item: Delivery | Failure) -> None:
        """File one outcome; assemble its bucket once complete."""
        rid = item.request_id or ""
        arm, _, idx = rid.partition("/")
        if arm not in self.stats or not idx.isdigit() or int(idx) >= self.plan.requests:
            return  # not ours (cannot happen with the embedded prefill); counted by the receiver
        k = int(idx) // self.plan.batch_size
        bucket = self._buckets.setdefault((arm, k), [])
        bucket.append(item)
        if len(bucket) == self.plan.size(k):
            del self._buckets[(arm, k)]
            t0 = time.thread_time()
            self.ready[(arm, k)] = self._close(arm, k, bucket)
            self.cpu_s += time.thread_time() - t0

    def batch_ready(self, k: int) -> bool:
        """Whether every arm's share of batch ``k`` is assembled."""
        return all((a, k) in self.ready for a in self.plan.arm_names)

    def take(self, k: int) -> dict[str, Assembled]:
        """Every arm's share of batch ``k`` (call once :meth:`batch_ready`)."""
        return {a: self.ready.pop((a, k)) for a in self.plan.arm_names}

    def fail_missing(self, from_batch: int, upto: int | None = None) -> None:
        """Batches ``from_batch`` .. ``upto - 1`` (default: the last) were sent and acknowledged
        and nothing more arrives: fail what is missing, never drop it."""
        b = self.plan.batch_size
        end = self.plan.batches if upto is None else min(upto, self.plan.batches)
        for arm in self.plan.arm_names:
            for k in range(from_batch, end):
                if (arm, k) in self.ready:
                    continue
                have = {x.request_id for x in self._buckets.get((arm, k), [])}
                for i in range(self.plan.size(k)):
                    rid = f"{arm}/{k * b + i}"
                    if rid not in have:
                        self.add(Failure(rid, "transfer", "never arrived at the decode", arm=arm))

    def _close(self, arm: str, k: int, bucket: list[Delivery | Failure]) -> Assembled:
        import torch

        st = self.stats[arm]
        bucket.sort(key=lambda x: int((x.request_id or "").partition("/")[2]))
        deliveries: list[Delivery] = []
        rows: list[int] = []
        for x in bucket:
            if isinstance(x, Failure):
                st.record_failure(x)
            else:
                deliveries.append(x)
                rows.append(int(x.request_id.partition("/")[2]) - k * self.plan.batch_size)
        if not deliveries:
            return Assembled([], None, None)
        draft = self._assemble(deliveries)
        t_batch = time.perf_counter()
        for d in deliveries:
            st.latency_ms.add((t_batch - d.received_at) * 1e3)
        st.first_t = min(d.received_at for d in deliveries) if st.first_t is None else st.first_t
        st.last_t = t_batch
        # X' where the decode redrew it (recompute), else the prefill's X.
        tokens = torch.tensor([d.draft_tokens for d in deliveries], dtype=torch.int64)
        kinds = tuple(draw_kind(d) for d in deliveries)
        # The view is reused by the next build: keep a copy for the verifier.
        out = Assembled(rows, tokens, draft.clone(), kinds)
        for d in deliveries:
            d.release()
        st.delivered += len(deliveries)
        return out
