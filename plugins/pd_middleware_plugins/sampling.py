"""Prefill-side encoders that ship no distribution: ``greedy`` and ``softmax``.

Both send X (and q(X)) only, so the decode can use nothing but the one-hot proposal,
which is exact for any drafting rule (``docs/strategies.md``):

- ``greedy``: X = argmax q; acceptance p(argmax q). Provenance ``rule="greedy"``.
- ``softmax``: X ~ q, SGLang's prefill behaviour under rejection sampling; acceptance
  Σ q·p. Provenance ``rule="sampled"``, ``sampled_from=None`` (q was not sent).
"""

from __future__ import annotations

import torch

from pd_middleware import EncodedBatch, PluginContext, PluginSpec, Provenance
from pd_middleware.core.contracts import NoOptions
from pd_middleware.sampling.encodings import encoder_input, sample_law


class GreedyEncoder:
    """X = argmax of each step's row; ``token_probs`` is 1.0 (X's law is a point mass)."""

    def __init__(self, options: NoOptions, context: PluginContext) -> None:
        self.vocab_size = context.vocab_size

    def encode(
        self,
        probs: torch.Tensor,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> EncodedBatch:
        """``probs``: float (B, [S,] V); returns tokens int64 (B, S) on its device. No randomness is used."""
        rows = encoder_input(probs)
        tokens = rows.argmax(dim=-1)
        return EncodedBatch(
            tokens=tokens,
            token_probs=torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device),
            proposals=[None] * rows.shape[0],
            provenance=Provenance(rule="greedy", temperature=temperature),
        )


class SoftmaxEncoder:
    """X ~ q per step (float64 inverse CDF at ``uniforms``, or seeded by ``generator``); q is not sent."""

    def __init__(self, options: NoOptions, context: PluginContext) -> None:
        self.vocab_size = context.vocab_size

    def encode(
        self,
        probs: torch.Tensor,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> EncodedBatch:
        """``probs``: float (B, [S,] V) after temperature; returns tokens int64 (B, S) on its device."""
        rows = encoder_input(probs)
        b, s, v = rows.shape
        flat = rows.reshape(b * s, v)
        tokens = sample_law(flat, generator, uniforms)
        token_probs = flat.gather(1, tokens.view(-1, 1)).float().view(b, s)
        return EncodedBatch(
            tokens=tokens.view(b, s),
            token_probs=token_probs,
            proposals=[None] * b,
            provenance=Provenance(rule="sampled", temperature=temperature, sampled_from=None),
        )


GREEDY = PluginSpec(
    name="greedy",
    kind="encoder",
    factory=GreedyEncoder,
    summary="prefill: X = argmax q, no distribution sent (only one-hot is exact)",
)

SOFTMAX = PluginSpec(
    name="softmax",
    kind="encoder",
    factory=SoftmaxEncoder,
    summary="prefill: X ~ softmax(logits/T), no distribution sent (SGLang's behaviour)",
)
