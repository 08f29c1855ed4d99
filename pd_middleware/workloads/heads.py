"""Workload draft heads: the ``draft_head`` capability of the ``pd-middleware ab`` job.

A workload's draft model is not a neural network, but it is a function of a state: the
``ngram`` draft is a bigram model whose state is the previous token; a ``synthetic``
context is fixed by the run's seed and the request index. The job's prefill writes
each request's state (:attr:`~pd_middleware.workloads.WorkloadBatch.draft_state`) into
the first 8 bytes of the hidden state it ships (:func:`write_state`), and
:class:`WorkloadDraftHead` reads it back and returns the draft logits of that state, so
the ``recompute`` synthesizer recomputes q' on the decode from the hidden state alone,
as it does from a real draft head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: Bytes of the hidden state that carry the draft state (one little-endian int64).
STATE_BYTES = 8


def write_state(hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``hidden`` (B, H) with each row's first 8 bytes set to ``state`` (int64 (B,)), in place."""
    import torch

    raw = hidden.view(torch.uint8).view(hidden.shape[0], -1)
    if raw.shape[1] < STATE_BYTES:
        raise ValueError(f"a hidden row of {raw.shape[1]} bytes cannot hold the {STATE_BYTES}-byte draft state")
    raw[:, :STATE_BYTES] = state.to(torch.int64).contiguous().view(torch.uint8).view(-1, STATE_BYTES)
    return hidden


def read_state(hidden: torch.Tensor) -> torch.Tensor:
    """int64 (B,): the draft state written by :func:`write_state` (any dtype, same bytes)."""
    import torch

    raw = hidden.contiguous().view(torch.uint8).view(hidden.shape[0], -1)
    return raw[:, :STATE_BYTES].contiguous().view(torch.int64).view(-1)


class WorkloadDraftHead:
    """A :class:`~pd_middleware.core.draft_head.DraftHead` over a workload's draft rows.

    ``rows(state)``: float (n, V) draft probabilities q for int64 (n,) states; the head's
    logits are log q in fp32 (softmax(log q) = q up to fp32 rounding: the workload's
    numerics). Runs on CPU.
    """

    device = "cpu"

    def __init__(self, rows: Callable[[torch.Tensor], torch.Tensor], vocab_size: int, hidden_size: int) -> None:
        self._rows = rows
        self.vocab_size = int(vocab_size)
        self.hidden_size = int(hidden_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be (B, {self.hidden_size}), got {tuple(hidden.shape)}")
        return self._rows(read_state(hidden)).float().log()
