"""The ``min_prob_one_hot`` synthesizer: one-hot q', refusing improbable drafts.

Decode side, once per payload after the hooks, on the receiving thread. The proposal
is the one-hot row at each drafted token, which is exact for any drafting rule (the
committed token has law p whatever X's law was). A payload whose drafted token had
probability below ``min_draft_prob`` under the draft model is refused: it fails with a
:class:`~pd_middleware.ValidationError` naming ``draft_probs``, and only that request
fails (the engine falls back for it).
"""

from __future__ import annotations

import msgspec

from pd_middleware import (
    OneHotProposal,
    OptionValueError,
    Payload,
    PluginContext,
    PluginSpec,
    ValidationError,
)


class MinProbOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of ``min_prob_one_hot``."""

    # Refuse a payload when any drafted token's draft probability is below this.
    min_draft_prob: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_draft_prob < 1.0:
            raise OptionValueError("min_draft_prob", f"must be in [0, 1), got {self.min_draft_prob}")


class MinProbOneHot:
    """One-hot proposal per request (one row per draft step)."""

    def __init__(self, options: MinProbOptions, context: PluginContext) -> None:
        self.floor = options.min_draft_prob
        self.vocab_size = context.vocab_size
        self.num_steps = context.num_steps
        self.enabled = context.rejection_sampling

    def synthesize(self, payload: Payload) -> OneHotProposal | None:
        payload.check_fits(self.vocab_size, self.num_steps)  # V and S as configured, or a ValidationError
        low = min(payload.draft_probs, default=1.0)
        if low < self.floor:
            raise ValidationError(
                f"drafted token probability {low:.3g} is below min_draft_prob {self.floor}",
                field="draft_probs",
                request_id=payload.request_id,
            )
        return OneHotProposal(payload.draft_tokens) if self.enabled else None


SYNTHESIZER = PluginSpec(
    name="min_prob_one_hot",
    kind="synthesizer",
    factory=MinProbOneHot,
    options=MinProbOptions,
    summary="example: exact one-hot proposal that refuses drafts below a probability floor",
)
