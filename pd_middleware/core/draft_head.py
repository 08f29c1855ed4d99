"""The ``draft_head`` engine capability: the decode's own draft head, as a function.

A :class:`DraftHead` maps the draft model's hidden state at a request's last position to
the draft logits over the **target** vocabulary, batched, on the engine's device. The
``recompute`` synthesizer (:mod:`pd_middleware.decode.recompute`) asks for it through
:attr:`~pd_middleware.core.contracts.PluginSpec.needs`; the engine offers it in
:attr:`~pd_middleware.core.contracts.PluginContext.capabilities` under :data:`DRAFT_HEAD`:

- the SGLang decode, from its EAGLE worker's draft model, applying what SGLang's
  ``LogitsProcessor`` applies (:mod:`pd_middleware.integrations.sglang.draft_head`);
- the ``pd-middleware ab`` job, from its workload (:mod:`pd_middleware.workloads.heads`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

#: The capability's name in ``PluginContext.capabilities`` and ``PluginSpec.needs``.
DRAFT_HEAD = "draft_head"


@runtime_checkable
class DraftHead(Protocol):
    """Hidden states -> draft logits over the target vocabulary.

    **Decode side.** ``logits`` runs once per chunk of up to ``CHUNK_ROWS`` rows
    (:mod:`pd_middleware.decode.recompute`) of a batch of requests fresh from PD, on the
    thread that builds the batch's first draft input (the SGLang scheduler thread, or the
    A/B job's receive thread); it runs on the engine's device and does not block beyond
    the device work it enqueues. An engine whose head needs collectives (a vocab-parallel
    ``lm_head`` under TP > 1) must only offer it where every rank calls it in the same
    order (``docs/sglang.md``); the synthesizer calls it for every chunk of a batch, even
    after one failed, so ranks holding the same batch call it the same number of times.
    """

    vocab_size: int
    """V: the width of the logits, the target vocabulary."""
    hidden_size: int
    """H: the width of the hidden states it reads."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 (B, V) logits from ``hidden`` (B, H) of any float dtype, on the head's
        device. Raises ValueError on a shape it cannot read."""
        ...
