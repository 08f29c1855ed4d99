"""Proposal descriptors: what a synthesizer attaches to a payload, per request.

A descriptor is cheap: a one-hot proposal is just its token ids, a sparse one its
indices and values. Only the :class:`~pd_middleware.decode.assembler.ProposalAssembler`
turns descriptors into the V-wide FP32 tensor the verifier reads, by scatter into a
persistent buffer. ``to_dense`` exists for tests and reference code, never for the hot
path.

Each descriptor also answers :meth:`values_at`: the fp32 number the assembler will
write at each draft token, which is what the verifier reads as q'(X). The guard's
support and declared-q(X) checks run on those numbers, not on a float64 stand-in.

S below is the number of draft steps of the request (1 for single-layer EAGLE).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np

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

    def values_at(self, tokens: tuple[int, ...]) -> list[float]:
        """q'(tokens[s]) per step as the assembler writes it: 1.0 at the proposal's own
        token, 0.0 elsewhere."""
        return [1.0 if t == x else 0.0 for t, x in zip(self.tokens, tokens, strict=True)]

    def to_dense(self, vocab_size: int) -> torch.Tensor:
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
    (0.0 for plain top-k/top-p), each exactly representable in fp32 (the number the
    assembler writes); ``scale``: S factors the decode applied to the received values
    to normalise them (empty when unknown), for consistency checks.
    """

    lengths: tuple[int, ...]
    indices: torch.Tensor
    values: torch.Tensor
    floor: tuple[float, ...]
    scale: tuple[float, ...] = ()

    @property
    def num_steps(self) -> int:
        return len(self.lengths)

    def values_at(self, tokens: tuple[int, ...]) -> list[float]:
        """q'(tokens[s]) per step as the assembler writes it: the listed fp32 value when
        step s lists the token (a listed value overrides the floor), else the floor.

        One vectorised comparison per step over its entries; no V-wide row.
        """
        idx = self.indices.numpy()
        vals = self.values.numpy()
        out: list[float] = []
        start = 0
        for n, x, f in zip(self.lengths, tokens, self.floor, strict=True):
            hit = idx[start : start + n] == x
            j = int(hit.argmax())
            out.append(float(np.float32(vals[start + j])) if hit[j] else float(np.float32(f)))
            start += n
        return out

    def to_dense(self, vocab_size: int) -> torch.Tensor:
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

    probs: torch.Tensor
    scale: torch.Tensor

    @property
    def num_steps(self) -> int:
        return int(self.probs.shape[0])

    def values_at(self, tokens: tuple[int, ...]) -> list[float]:
        """q'(tokens[s]) per step as the assembler writes it: the received value widened
        to fp32, times the fp32 scale (one rounding, as in the assembler's ``mul_``)."""
        import torch

        rows = torch.arange(len(tokens))
        picked = self.probs[rows, torch.tensor(tokens, dtype=torch.int64)].float()
        return (picked * self.scale.float()).tolist()

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """(S, V) float32 rows (reference use only)."""
        assert self.probs.shape[1] == vocab_size
        return self.probs.float() * self.scale.view(-1, 1)


class RecomputedProposal(DenseProposal, frozen=True, eq=False):
    """q' recomputed on the decode, with the token X' drawn from exactly q'.

    A :class:`DenseProposal` (``probs`` fp32 (S, V), ``scale`` ones) that also carries
    ``tokens``, the S draft tokens drawn from it: the verifier must verify *these*, not
    the prefill's X (``docs/strategies.md``, recompute). Made only by
    :meth:`pd_middleware.decode.recompute.Recomputed.proposal`; ``__post_init__`` refuses a
    token outside q' or a q'(X') above 1.
    """

    tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for v in DenseProposal.values_at(self, self.tokens):
            if not 0.0 < v <= 1.0:
                from ._errors import ExactnessError

                raise ExactnessError(
                    f"recomputed q'(X') = {v} is outside (0, 1]: X' was not drawn from q'", reason="recompute_guard"
                )


Proposal = OneHotProposal | SparseProposal | DenseProposal | RecomputedProposal
