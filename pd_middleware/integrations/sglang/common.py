"""What every room of the SGLang drop-in shares: request identity, probes, the batch in scope.

Nothing here reads SGLang: these are the conventions the rooms agree on.

- :func:`room_key`: the request id a bootstrap room travels under; :func:`life_of`: which
  life of it (SGLang serves a room again after a retraction's rebootstrap);
- :func:`is_probe`: SGLang's own warmups and health checks, never counted;
- :data:`LOCAL_PROVENANCE`: how X was drawn when only SGLang's own fields are known;
- :class:`RequestProposal` (``req.pd_middleware``): what the decode attached to a request;
- :func:`one_hot_at` and :func:`check_proposal`: the exact fallback proposal, built here
  (never SGLang's own ``pd_first_draft_proposal``, which a server may have made inert),
  and the shape SGLang expects back;
- :class:`Scope`: "the batch being built" (or drafted), one ContextVar per use with one
  convention: :meth:`Scope.enter` inside a ``with``, :meth:`Scope.get` is None outside.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import torch

from ...core.payload import Provenance

#: Req attribute holding the :class:`RequestProposal`.
ATTACH_ATTR = "pd_middleware"

# Provenance of a payload built on the decode from SGLang's fields: SGLang's prefill
# draws X ~ q under rejection sampling and does not send q, so nothing but one-hot
# is exact for it (the synthesizers' provenance guard enforces that).
LOCAL_PROVENANCE = Provenance(rule="sampled", temperature=1.0, sampled_from=None)

#: SGLang's own warmup and health-check requests (``entrypoints/http_server.py``) carry
#: this fake bootstrap host; health checks also a ``HEALTH_CHECK`` rid prefix.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


def is_probe(req: Any) -> bool:
    """Whether ``req`` is SGLang's warmup or health check, not a user request (never counted)."""
    if getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST:
        return True
    rid = getattr(req, "rid", None)
    return isinstance(rid, str) and rid.startswith(HEALTH_CHECK_RID_PREFIX)


@overload
def room_key(room: None) -> None: ...
@overload
def room_key(room: int) -> str: ...
@overload
def room_key(room: Any) -> str | None: ...
def room_key(room: Any) -> str | None:
    """The request id a bootstrap room travels under: its decimal string (None stays None)."""
    if room is None:
        return None
    return str(int(room))


#: Req attribute (decode): the life (:func:`life_of`) of the transfer that last committed.
LIFE_ATTR = "pd_middleware_life"


def life_of(req: Any) -> int | None:
    """Which life of its room ``req`` is: the tokens the prefill runs for it,
    ``len(origin_input_ids) + len(output_ids)`` (None when either is missing).

    On a prefill this is the draw's position (:func:`~.prefill.draw_position`), read before
    SGLang appends the first token. On a decode it is the same number read before the
    transfer commits: a fresh request has no output yet; a rebootstrapped one (the same Req,
    retracted) sends the prompt plus its output so far as the prefill's new prompt, so each
    life has its own, longer, number."""
    ids = getattr(req, "origin_input_ids", None)
    out = getattr(req, "output_ids", None)
    if ids is None or out is None:
        return None
    return len(ids) + len(out)


@dataclass(slots=True)
class RequestProposal:
    """What the decode attached to one request (``req.pd_middleware``).

    ``tokens``: the S draft tokens the proposal is for; ``proposal``: the descriptor
    handed to the assembler (set to None once the first draft input is built, so a
    dense row does not live as long as the request); ``arm``: the A/B arm the pipeline
    routed it to (``default`` without A/B; None when even the local payload failed);
    ``reason``: ``prefill`` when the prefill's proposal is used; ``no_distribution``
    when the prefill's row carried X only (one-hot); ``local`` when no row or payload
    was involved; ``recompute`` when the decode redrew X' from its own q'; else the
    fallback reason (``not_sent``, ``overflow``, ``digest``, ``token_mismatch``,
    ``rank_mismatch``, ``failed:<stage>``...); ``used``: the first draft input was built
    from it.
    """

    tokens: tuple[int, ...]
    proposal: Any
    arm: str | None
    reason: str
    used: bool = False


def one_hot_at(topk_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 (b, n, V) one-hot at X (clamped into [0, V)) on X's device, built here: it
    never depends on SGLang's own ``pd_first_draft_proposal``. Exact for any X in range."""
    x = topk_index.to(torch.int64).clamp(0, int(vocab_size) - 1)
    out = torch.zeros((*x.shape, int(vocab_size)), dtype=torch.float32, device=x.device)
    return out.scatter_(-1, x.unsqueeze(-1), 1.0)


def check_proposal(out: Any, topk_index: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless ``out`` is what SGLang expects: float32 (b, n, V) on X's device."""
    want = (*topk_index.shape, int(vocab_size))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        raise ValueError(f"proposal shape {getattr(out, 'shape', None)}, expected {want}")
    if out.dtype != torch.float32 or out.device != topk_index.device:
        raise ValueError(f"proposal is {out.dtype} on {out.device}, expected float32 on {topk_index.device}")


T = TypeVar("T")


class Scope(Generic[T]):
    """What a wrapper puts in scope for the SGLang calls it wraps (a ContextVar: correct
    even with two schedulers on two threads). ``get()`` is None outside :meth:`enter`."""

    def __init__(self, name: str) -> None:
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(name, default=None)

    @contextlib.contextmanager
    def enter(self, value: T) -> Iterator[T]:
        token = self._var.set(value)
        try:
            yield value
        finally:
            self._var.reset(token)

    def get(self) -> T | None:
        return self._var.get()
