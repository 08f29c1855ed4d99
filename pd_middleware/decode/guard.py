"""The provenance guard: a shipped proposal reaches the verifier only when it is exact.

A proposal q' other than one-hot is exact only if X was drawn from exactly q'
(``docs/strategies.md``). The payload's :class:`~pd_middleware.core.payload.Provenance`
says how X was drawn; the guard compares it with the attached encoding and, when they
do not match, tells the synthesizer to fall back to the one-hot proposal at X, which is
exact for any drafting rule. The verifier therefore never sees a biased pair.

Fallback reasons, checked in this order:

- ``greedy``: X was the argmax, not a draw (sending q would collapse the output
  toward the argmax);
- ``no_proposal``: the prefill sent no distribution;
- ``encoding_mismatch:<encoding id>``: the synthesizer cannot hand over this encoding;
- ``not_sampled_from_sent``: X was drawn from another law than the one sent (the
  draft softmax, an fp32 row when bf16 was sent, an untruncated row when top-k was sent).

After the law is decoded, two checks on the fp32 numbers the assembler will write at
each X_s (:meth:`~pd_middleware.core.proposal.SparseProposal.values_at`), not on a float64
stand-in (a floor of 1e-46 is 0.0 in fp32):

- ``token_outside_proposal``: q'(X_s) is not > 0, so X was not drawn from q' (and the
  verifier, which accepts X outright when q'(X) = 0, would be biased);
- ``q_above_one``: q'(X_s) > 1 (possible only by rounding a renormalised single-entry
  law); SGLang's kernel rejects X unless 0 < q'(X) <= 1, so that pair would be biased;
- ``declared_q_mismatch``: the payload's declared ``draft_probs[s]`` differs from
  q'(X_s) by more than the encoding's precision (:data:`DECLARED_RTOL` plus the
  renormalisation the decode applied), so X and the proposal did not come from one
  draw.

Every fallback is counted per reason (``.counts``, and ``Metrics.fallbacks`` once
:meth:`ProvenanceGuard.attach_metrics` was called) and logged once per reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..core.events import Events
from ..core.metrics import Metrics
from ..core.payload import DenseEncoding, Payload
from ..core.proposal import DenseProposal, OneHotProposal, SparseProposal

if TYPE_CHECKING:
    from ..core.contracts import PluginContext

logger = logging.getLogger("pd_middleware.decode.guard")

_WHY: dict[str, str] = {
    "greedy": "X was drafted greedily, so only the one-hot proposal is exact",
    "no_proposal": "the prefill sent no proposal distribution",
    "encoding_mismatch": "this synthesizer cannot hand over the attached encoding",
    "not_sampled_from_sent": "X was not sampled from the distribution that was sent",
    "token_outside_proposal": "the sent distribution gives X zero probability, so X was not drawn from it",
    "q_above_one": "the sent distribution gives X a probability above 1, which SGLang's kernel rejects outright",
    "declared_q_mismatch": "the declared q(X) does not match the sent distribution at X, so they come from different draws",
}

#: Relative precision of a declared q(X) against the decoded row, by wire dtype: two
#: units in the last place of the dtype the row travelled in (the prefill may declare
#: its fp32 value before rounding it to the wire). The guard adds each step's
#: |1 - scale|, the renormalisation the decode applied to the received values.
DECLARED_RTOL: dict[str, float] = {"fp32": 2.0**-22, "bf16": 2.0**-7, "fp16": 2.0**-10}

# Absolute slack for values below fp32's normal range, where relative precision ends.
_DECLARED_ATOL = 2.0**-126


class ProvenanceGuard:
    """Decides, per payload, whether a synthesizer may hand over the attached proposal.

    ``synthesizer``: the owner's name (for logs). ``accepts``: encoding ids the owner
    can reproduce exactly (``dense-bf16``, ``sparse-fp16``...). ``metrics``: optional
    receive-path counters whose ``fallbacks`` Counter is incremented too.

    ``unsafe_disable_guard=True`` is for negative-control tests only: it skips the
    provenance checks (``greedy``, ``not_sampled_from_sent``) so a test can show the
    bias they prevent. Payloads the owner physically cannot use (``no_proposal``,
    ``encoding_mismatch``) still fall back. Never set it in a deployment; it is not a
    config option on purpose.
    """

    def __init__(
        self,
        synthesizer: str,
        accepts: Iterable[str],
        *,
        metrics: Metrics | None = None,
        unsafe_disable_guard: bool = False,
    ) -> None:
        self.synthesizer = synthesizer
        self.accepts = frozenset(accepts)
        self.unsafe_disable_guard = bool(unsafe_disable_guard)
        # Keys are the bare reasons, mirrored unprefixed into Metrics.fallbacks.
        self.events = Events("guard", metrics=metrics, logger=logger)
        self.counts: Counter[str] = self.events.counts
        if self.unsafe_disable_guard:
            logger.warning(
                "provenance guard of %r is DISABLED (unsafe_disable_guard=True): biased "
                "proposals can reach the verifier; this is for negative-control tests only",
                synthesizer,
            )

    @property
    def metrics(self) -> Metrics | None:
        m: Metrics | None = self.events.metrics
        return m

    def attach_metrics(self, metrics: Metrics) -> None:
        """Also count fallbacks into ``metrics.fallbacks`` (keyed by reason)."""
        self.events.attach_metrics(metrics)

    def check(self, payload: Payload) -> str | None:
        """``None`` if the attached proposal may be handed over, else the fallback reason."""
        prov = payload.provenance
        enc = payload.proposal
        bypass = self.unsafe_disable_guard
        if prov.rule == "greedy" and not bypass:
            return "greedy"
        if enc is None:
            return "no_proposal"
        eid = enc.encoding_id
        if eid not in self.accepts:
            return f"encoding_mismatch:{eid}"
        if prov.sampled_from != eid and not bypass:
            return "not_sampled_from_sent"
        return None

    def fallback(self, payload: Payload, reason: str) -> OneHotProposal:
        """Count ``reason``, log it the first time, and return the one-hot proposal at X."""
        self.events.count(
            reason,
            fallback=True,
            log=lambda: (
                f"synthesizer {self.synthesizer!r} falls back to one-hot for request {payload.request_id!r}: "
                f"{reason} ({_WHY.get(reason.split(':', 1)[0], reason)}); further fallbacks for this reason "
                "are counted, not logged"
            ),
        )
        return OneHotProposal(payload.draft_tokens)

    def check_law(self, payload: Payload, law: DenseProposal | SparseProposal) -> str | None:
        """The fallback reason the decoded ``law`` calls for at X, or ``None``.

        ``token_outside_proposal`` if some q'(X_s) is not > 0 in fp32 (X drawn from
        the law cannot have probability 0 under it); ``q_above_one`` if some q'(X_s) > 1
        (SGLang's kernel would reject X outright); ``declared_q_mismatch`` if some
        declared q(X_s) misses q'(X_s) by more than the encoding's precision. Both read
        the fp32 numbers the assembler writes (``law.values_at``): one gather per step
        for a dense law, one vectorised comparison over the listed entries for a sparse
        one. Skipped entirely under ``unsafe_disable_guard``.
        """
        if self.unsafe_disable_guard:  # negative-control tests must be able to see the bias
            return None
        toks = payload.draft_tokens
        q = law.values_at(toks)
        for v in q:
            if not v > 0.0:  # also true for NaN
                return "token_outside_proposal"
            if v > 1.0:
                # SGLang's rejection kernel rejects X unless 0 < q'(X) <= 1 (rounding can put
                # a renormalised single-entry law one ulp above 1): one-hot is exact instead.
                return "q_above_one"
        enc = payload.proposal
        scale: Sequence[float]
        if isinstance(law, DenseProposal):
            rtol = (
                DECLARED_RTOL.get(enc.dtype, DECLARED_RTOL["fp32"])
                if type(enc) is DenseEncoding
                else DECLARED_RTOL["fp32"]
            )
            scale = law.scale.tolist()
        else:
            rtol = DECLARED_RTOL.get(getattr(enc, "value_dtype", "fp32"), DECLARED_RTOL["fp32"])
            scale = law.scale or (1.0,) * len(toks)
        for declared, v, sc in zip(payload.draft_probs, q, scale):
            if not abs(declared - v) <= (rtol + abs(1.0 - sc)) * v + _DECLARED_ATOL:
                return "declared_q_mismatch"
        return None

    def screen(self, payload: Payload) -> OneHotProposal | None:
        """One call for the hot path: the one-hot fallback if needed, else ``None``."""
        reason = self.check(payload)
        if reason is None:
            return None
        return self.fallback(payload, reason)


class GuardedSynthesizer:
    """Base of the synthesizers that hand a *shipped* law to the verifier.

    Subclasses set ``name`` (for logs), ``accepts`` (encoding ids they reproduce exactly)
    and ``decode_law(encoding, num_steps, vocab_size, request_id=...)`` (validating, e.g.
    :func:`~pd_middleware.sampling.encodings.dense_law`). ``synthesize`` then does, per payload:
    deployment fit (vocab, steps), ``None`` with rejection sampling off, the provenance
    guard, the law, and the checks at X (:meth:`ProvenanceGuard.check_law`); every
    fallback is one-hot and counted.

    ``unsafe_disable_guard`` (keyword, not a config option) is for negative-control
    tests only; see :class:`ProvenanceGuard`.
    """

    name: str = "guarded"
    accepts: tuple[str, ...] = ()
    # Set by each subclass (``staticmethod(sparse_law)``...); checked in __init__.
    decode_law: Callable[..., DenseProposal | SparseProposal]

    def __init__(self, options: object, context: PluginContext, *, unsafe_disable_guard: bool = False) -> None:
        self.vocab_size = context.vocab_size
        self.num_steps = context.num_steps
        self.enabled = context.rejection_sampling
        self.guard = ProvenanceGuard(self.name, self.accepts, unsafe_disable_guard=unsafe_disable_guard)
        if not callable(getattr(self, "decode_law", None)):
            raise TypeError(
                f"{type(self).__name__} must define decode_law(encoding, num_steps, vocab_size, *, request_id)"
            )

    def synthesize(self, payload: Payload) -> DenseProposal | SparseProposal | OneHotProposal | None:
        """The payload's validated law, a one-hot fallback, or ``None`` with rejection
        sampling off. Raises ValidationError naming the bad field."""
        payload.check_fits(self.vocab_size, self.num_steps)
        if not self.enabled:
            return None
        fallback = self.guard.screen(payload)
        if fallback is not None:
            return fallback
        law = self.decode_law(payload.proposal, self.num_steps, self.vocab_size, request_id=payload.request_id)
        # X drawn from the law has positive probability under it, and the prefill
        # declared that probability; if either fails, only one-hot is exact.
        reason = self.guard.check_law(payload, law)
        return law if reason is None else self.guard.fallback(payload, reason)
