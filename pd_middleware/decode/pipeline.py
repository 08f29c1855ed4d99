"""The decode-side receive pipeline: hook chain, then one synthesizer per arm.

Resolved once from config into a flat tuple of ``(name, bound method)`` pairs, so the
per-payload work is a plain loop. Every payload ends as exactly one :class:`Delivery`
or :class:`Failure`; a hook or synthesizer that raises fails only that payload.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..core._errors import ValidationError
from ..core.contracts import ReceiveContext
from ..core.metrics import Metrics
from ..core.payload import Payload
from ..core.proposal import Proposal, RecomputedProposal


class Delivery(NamedTuple):
    """A payload ready for the scheduler, with the proposal its arm attached.

    Call :meth:`release` once the batch that used it has been built (frees the receive
    slot holding its bulk tensors, if any).

    A ``NamedTuple`` rather than a frozen dataclass on purpose: one is built per
    payload, and a frozen dataclass's ``__init__`` (an ``object.__setattr__`` per
    field) cost more than the whole rest of :meth:`ReceivePipeline.process`
    (``benchmarks/hooks.py``, docs/performance.md). Immutable all the same.
    """

    payload: Payload
    proposal: Proposal | None
    arm: str
    received_at: float
    releaser: Callable[[], None] | None = None
    # Identity of the prefill that sent it: the authenticated CURVE key's allowlist name,
    # else the hello name (unauthenticated); None outside the transport.
    peer: str | None = None

    @property
    def request_id(self) -> str:
        return self.payload.request_id

    @property
    def draft_tokens(self) -> tuple[int, ...]:
        """The draft tokens the verifier must verify with this proposal: X' when the
        decode redrew them (a :class:`~pd_middleware.core.proposal.RecomputedProposal`),
        else the prefill's X."""
        p = self.proposal
        return p.tokens if type(p) is RecomputedProposal else self.payload.draft_tokens

    def release(self) -> None:
        if self.releaser is not None:
            self.releaser()


@dataclass(frozen=True, slots=True)
class Failure:
    """A payload that will not reach the scheduler, and why.

    ``stage`` is where it failed (``wire``, ``transfer``, ``hook:<name>``,
    ``synthesizer:<name>``), ``field`` the offending field when known. ``request_id``
    is set only when the failing message came from the authenticated peer that owns that
    id: a message refused before authentication, or for another peer's id (``wire:peer``),
    a duplicate or a replay, leaves it None (the id it claimed is in ``reason``), so a
    store keyed by request id never lets one peer's message fail another's request.
    ``peer``: the sending prefill's identity when known.
    """

    request_id: str | None
    stage: str
    reason: str
    field: str | None = None
    arm: str | None = None
    peer: str | None = None

    @property
    def key(self) -> str:
        """Counter key: ``stage`` or ``stage:field``."""
        return f"{self.stage}:{self.field}" if self.field else self.stage


# Builds a Delivery without the keyword/default handling of its generated __new__.
_new_tuple = tuple.__new__


class ReceivePipeline:
    """Runs the hook chain and the arm's synthesizer on each payload.

    ``hooks``: ordered ``(name, hook)`` pairs; ``synthesizers``: arm name ->
    ``(plugin name, synthesizer)``. With a single arm it is named ``default``.
    """

    def __init__(
        self,
        hooks: Sequence[tuple[str, Any]],
        synthesizers: Mapping[str, tuple[str, Any]],
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not synthesizers:
            raise ValueError("a pipeline needs at least one synthesizer")
        self.metrics = metrics if metrics is not None else Metrics()
        self._hooks = tuple((f"hook:{n}", h.on_receive) for n, h in hooks)
        self._synth = {arm: (f"synthesizer:{n}", s.synthesize) for arm, (n, s) in synthesizers.items()}
        self.hook_objects = tuple(h for _, h in hooks)
        self.synthesizer_objects = {arm: s for arm, (_, s) in synthesizers.items()}
        self._clock = clock

    @property
    def arms(self) -> tuple[str, ...]:
        return tuple(self._synth)

    def fail(self, failure: Failure) -> Failure:
        """Count a failure raised before the pipeline ran (wire, transfer)."""
        self.metrics.received += 1
        self.metrics.record_failure(failure.key, failure.arm)
        return failure

    def process(
        self,
        payload: Payload,
        context: ReceiveContext | None = None,
        releaser: Callable[[], None] | None = None,
    ) -> Delivery | Failure:
        """Run one payload through hooks and synthesis; never raises for bad payloads.

        On failure ``releaser`` is called at once (the slot is free again).
        """
        m = self.metrics
        m.received += 1
        ctx = context if context is not None else ReceiveContext(received_at=self._clock())
        stage = "hook"
        try:
            for stage, hook in self._hooks:  # noqa: B007  # `stage` names the failing hook in the except below
                replaced = hook(payload, ctx)
                if replaced is not None:
                    payload = replaced
            arm = ctx.arm
            try:
                stage, synth = self._synth[arm]
            except KeyError:  # a subscript is cheaper than .get() on the hot path
                stage = "route"
                raise ValidationError(f"unknown A/B arm {arm!r}", field="arm", request_id=payload.request_id) from None
            proposal = synth(payload)
        except Exception as exc:
            if releaser is not None:
                releaser()
            f = Failure(
                request_id=payload.request_id,
                stage=stage,
                reason=f"{type(exc).__name__}: {exc}",
                field=getattr(exc, "field", None),
                arm=ctx.arm,
                peer=ctx.peer,
            )
            m.record_failure(f.key, ctx.arm)
            return f
        m.delivered += 1
        if ctx.received_at:  # 0.0: a caller's context without an arrival stamp
            m.receive_to_delivery.observe(self._clock() - ctx.received_at)
        per_arm = m.arm_delivered
        try:
            per_arm[arm] += 1
        except KeyError:  # first delivery of this arm
            per_arm[arm] = 1
        return _new_tuple(Delivery, (payload, proposal, arm, ctx.received_at, releaser, ctx.peer))

    def close(self) -> None:
        """Close plugins that hold resources (e.g. a trace recorder's file)."""
        for obj in (*self.hook_objects, *self.synthesizer_objects.values()):
            close = getattr(obj, "close", None)
            if callable(close):
                close()
