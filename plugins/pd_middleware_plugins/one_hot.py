"""The ``one_hot`` synthesizer: q' = delta at each draft token. The default.

Exact for any drafting rule (sampled, greedy, anything independent of the verify
coin): given X = x, x is accepted with probability p(x), and otherwise the residual is
p with x removed, so the committed token has law p whatever law X had
(``docs/strategies.md``). Acceptance at that position is p(X).

It attaches a :class:`~pd_middleware.core.proposal.OneHotProposal` (the token ids) and
never builds a V-wide row; the assembler scatters the ones. With rejection sampling
off it attaches nothing.
"""

from __future__ import annotations

from pd_middleware import OneHotProposal, Payload, PluginContext, PluginSpec
from pd_middleware.core.contracts import NoOptions


class OneHotSynthesizer:
    """Decode side: one-hot proposal per request (one row per draft step)."""

    def __init__(self, options: NoOptions, context: PluginContext) -> None:
        self.vocab_size = context.vocab_size
        self.num_steps = context.num_steps
        self.enabled = context.rejection_sampling

    def synthesize(self, payload: Payload) -> OneHotProposal | None:
        payload.check_fits(self.vocab_size, self.num_steps)
        if not self.enabled:
            return None
        return OneHotProposal(payload.draft_tokens)


SYNTHESIZER = PluginSpec(
    name="one_hot",
    kind="synthesizer",
    factory=OneHotSynthesizer,
    summary="exact one-hot proposal at each draft token (default; exact for any drafting rule)",
)
