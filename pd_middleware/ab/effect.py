"""Honest effect size: what a shipped proposal buys over a whole response.

The proposal a prefill ships only affects each request's *first* verify (its first
position for single-layer EAGLE, the received chain for multi-layer). Every later
verify uses proposals drafted on the decode node, identical across arms. So an arm's
whole difference is ``E1``, the expected committed tokens of that first verify, and it
is diluted over the response:

- a later verify of a k-step chain with per-step acceptance a commits on average
  ``(1 - a^(k+1)) / (1 - a)`` tokens (accepted prefix plus the bonus/correction);
- a response of T tokens then needs ``1 + max(0, T - E1) / E_later`` verifies.
"""

from __future__ import annotations

from dataclasses import dataclass


def later_tokens_per_verify(acceptance: float, num_steps: int) -> float:
    """Mean committed tokens of a k-step chain verify with i.i.d. per-step acceptance a."""
    if not 0.0 <= acceptance < 1.0:
        raise ValueError(f"acceptance must be in [0, 1), got {acceptance}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return (1.0 - acceptance ** (num_steps + 1)) / (1.0 - acceptance)


@dataclass(frozen=True, slots=True)
class ResponseEffect:
    """Per-arm effect over one response of ``response_tokens`` tokens."""

    first_verify_tokens: float
    """E1: mean committed tokens of the first verify (accepted drafts + 1)."""
    later_tokens_per_verify: float
    """Mean committed tokens of every later verify (same for all arms)."""
    verifies_per_response: float
    """Expected verify steps to produce the response."""

    def as_dict(self) -> dict[str, float]:
        return {
            "first_verify_tokens": round(self.first_verify_tokens, 5),
            "later_tokens_per_verify": round(self.later_tokens_per_verify, 5),
            "verifies_per_response": round(self.verifies_per_response, 5),
        }


def response_effect(
    first_verify_tokens: float, *, response_tokens: int, later_acceptance: float, num_steps: int
) -> ResponseEffect:
    """The :class:`ResponseEffect` of an arm whose first verify commits ``E1`` tokens."""
    later = later_tokens_per_verify(later_acceptance, num_steps)
    rest = max(0.0, response_tokens - first_verify_tokens)
    return ResponseEffect(first_verify_tokens, later, 1.0 + rest / later)
