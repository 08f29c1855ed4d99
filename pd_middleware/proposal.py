"""Proposal descriptors: what a synthesizer attaches to a payload, per request.

A descriptor is cheap: a one-hot proposal is just its token ids, a sparse one its
indices and values. Only the :class:`~pd_middleware.assembler.ProposalAssembler`
turns descriptors into the V-wide FP32 tensor the verifier reads, by scatter into a
persistent buffer. ``to_dense`` exists for tests and reference code, never for the hot
path.

S below is the number of draft steps of the request (1 for single-layer EAGLE).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import msgspec

if TYPE_CHECKING:
    import torch


class OneHotProposal(msgspec.Struct, frozen=True):
    """q' = delta at each draft token: exact for any drafting rule.

    ``tokens``: S token ids, one per step.
    """

    tokens: tuple[int, ...]

    @property
    def num_steps(self) -> int:
        return len(self.tokens)

    def to_dense(self, vocab_size: int) -> "torch.Tensor":
        """(S, V) float32 one-hot rows (reference use only)."""
        import torch

        out = torch.zeros(len(self.tokens), vocab_size, dtype=torch.float32)
        out[torch.arange(len(self.tokens)), torch.tensor(self.tokens)] = 1.0
        return out


class SparseProposal(msgspec.Struct, frozen=True, eq=False):
    """Listed entries per step plus a uniform floor for the unlisted tokens.

    ``lengths``: S entry counts; ``indices``: int64 (sum(lengths),) token ids;
    ``values``: float32 (sum(lengths),) probabilities, already normalised;
    ``floor``: S values, the probability of each *unlisted* token of that step
    (0.0 for plain top-k/top-p).
    """

    lengths: tuple[int, ...]
    indices: "torch.Tensor"
    values: "torch.Tensor"
    floor: tuple[float, ...]

    @property
    def num_steps(self) -> int:
        return len(self.lengths)

    def to_dense(self, vocab_size: int) -> "torch.Tensor":
        """(S, V) float32 rows (reference use only)."""
        import torch

        s = len(self.lengths)
        out = torch.tensor(self.floor, dtype=torch.float32).view(s, 1).repeat(1, vocab_size)
        steps = torch.repeat_interleave(torch.arange(s), torch.tensor(self.lengths))
        out[steps, self.indices] = self.values
        return out


class DenseProposal(msgspec.Struct, frozen=True, eq=False):
    """A full row per step: the law is ``probs.float() * scale[:, None]``.

    ``probs``: (S, V) tensor of fp32, bf16 or fp16, possibly a zero-copy view of a
    receive slot; ``scale``: float32 (S,) renormalisation factors.
    """

    probs: "torch.Tensor"
    scale: "torch.Tensor"

    @property
    def num_steps(self) -> int:
        return int(self.probs.shape[0])

    def to_dense(self, vocab_size: int) -> "torch.Tensor":
        """(S, V) float32 rows (reference use only)."""
        assert self.probs.shape[1] == vocab_size
        return self.probs.float() * self.scale.view(-1, 1)


Proposal = Union[OneHotProposal, SparseProposal, DenseProposal]
