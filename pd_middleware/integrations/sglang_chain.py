"""Multi-layer EAGLE on the prefill: draw each chain step from the law that will be sent.

SGLang 0.5.23's multi-layer prefill
(``multi_layer_eagle_worker_v2.MultiLayerEagleDraftWorker._draft_extend_for_prefill``)
drafts the chain step by step: step k calls the module's ``sample_draft_proposal(logits,
temperatures, top_ks=None, *, sampling_seed, positions, draft_step=k)``, which returns
(q_k, q_k(X_k), X_k), and X_k is fed into step k+1. So q_{k+1} is conditioned on the X_k
drawn here, and an exact S-step proposal must draw X_k from the encoded q'_k *inside* the
loop; redrawing the chain afterwards would pair q_{k+1} with another prefix.

:func:`chain_patches` returns two patches of that module:

- ``_draft_extend_for_prefill`` is wrapped to open a :class:`ChainDraw` for the batch
  (its requests' bootstrap rooms and temperatures) in a ContextVar, and to leave the
  finished S-step payloads on the returned draft input
  (``next_draft_input.pd_middleware_payloads``: one per batch row, or None);
- ``sample_draft_proposal`` is replaced: while a ChainDraw is open it calls SGLang's
  function for q_k, then encodes each row's q_k with the configured encoder from a
  generator seeded from (seed, room, k), and returns SGLang's q_k with the encoder's
  q'_k(X_k) and X_k. Outside a ChainDraw (the decode's own drafting) it is SGLang's.

The prefill wrapper (:mod:`.sglang_prefill`) then stages those payloads instead of
encoding again. Each step is exact given the accepted prefix, so the chain is.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from ..payload import DenseEncoding, Payload, SparseEncoding
from .sglang_decode import room_key
from .sglang_prefill import room_seed

MULTI_LAYER_MODULE = "sglang.srt.speculative.multi_layer_eagle_worker_v2"
WORKER_CLASS = "MultiLayerEagleDraftWorker"
#: Draft-input attribute the finished payloads are left under (one per batch row).
PAYLOADS_ATTR = "pd_middleware_payloads"

_chain: contextvars.ContextVar[ChainDraw | None] = contextvars.ContextVar("pd_middleware_sglang_chain", default=None)


@dataclass
class ChainDraw:
    """One batch's chain draws: per row, the per-step (X, q'(X), encoding, provenance)."""

    publisher: Any
    rooms: list[Any]
    temperatures: list[float]
    # Per-row SGLang request ids, mixed into each draw's seed (see room_seed).
    salts: list[str] = field(default_factory=list)
    steps: list[list[tuple[int, float, Any, Any]]] = field(default_factory=list)

    def draw(self, step: int, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Encode step ``step`` of every row of ``probs`` (b, V); returns (q'(X) (b, 1), X (b, 1)) on CPU.

        None when the batch's rows are not its requests (padding): SGLang's draw stands.
        """
        b = probs.shape[0]
        if b != len(self.rooms) or step != len(self.steps):
            return None
        rows = probs.detach().to("cpu", torch.float32)
        got: list[tuple[int, float, Any, Any]] = []
        for i, room in enumerate(self.rooms):
            salt = f"{self.salts[i] if i < len(self.salts) else ''}:{step}"
            g = torch.Generator().manual_seed(room_seed(self.publisher.seed, room, salt))
            e = self.publisher.encoder.encode(rows[i : i + 1], temperature=self.temperatures[i], generator=g)
            got.append(
                (int(e.tokens[0, 0]), min(1.0, max(0.0, float(e.token_probs[0, 0]))), e.proposals[0], e.provenance)
            )
        self.steps.append(got)
        x = torch.tensor([[t[0]] for t in got], dtype=torch.int64)
        p = torch.tensor([[t[1]] for t in got], dtype=torch.float32)
        return p, x

    def payloads(self) -> list[Payload | None]:
        """One S-step payload per row (None for a row without a bootstrap room)."""
        out: list[Payload | None] = []
        for i, room in enumerate(self.rooms):
            if room is None or not self.steps:
                out.append(None)
                continue
            per = [s[i] for s in self.steps]
            out.append(
                Payload(
                    request_id=room_key(room) or "",
                    draft_tokens=tuple(t[0] for t in per),
                    draft_probs=tuple(t[1] for t in per),
                    vocab_size=self.publisher.vocab_size,
                    provenance=per[0][3],
                    proposal=join_steps([t[2] for t in per]),
                )
            )
        return out


def join_steps(encodings: list[Any]) -> Any:
    """One S-step encoding from S one-step encodings of one kind (None if any is None)."""
    if any(e is None for e in encodings):
        return None
    first = encodings[0]
    if type(first) is DenseEncoding:
        return DenseEncoding(dtype=first.dtype, data=b"".join(bytes(e.data) for e in encodings))
    if type(first) is SparseEncoding:
        return msgspec.structs.replace(
            first,
            lengths=tuple(n for e in encodings for n in e.lengths),
            indices=b"".join(bytes(e.indices) for e in encodings),
            values=b"".join(bytes(e.values) for e in encodings),
            tail_mass=tuple(t for e in encodings for t in (e.tail_mass or (0.0,) * len(e.lengths))),
            bucket_counts=tuple(c for e in encodings for c in e.bucket_counts),
        )
    raise TypeError(f"unknown encoding {type(first).__name__}")


def chain_patches(module: Any, get_publisher: Callable[[], Any]) -> list[tuple[Any, str, Any, Any]]:
    """(owner, attribute, original, replacement) for ``module`` (SGLang's multi-layer worker)."""
    worker = getattr(module, WORKER_CLASS)
    extend = worker._draft_extend_for_prefill
    sample = module.sample_draft_proposal

    def _draft_extend_for_prefill(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        publisher = get_publisher()
        if publisher is None:
            return extend(self, batch, *args, **kwargs)
        temps = getattr(getattr(batch, "sampling_info", None), "temperatures", None)
        n = len(batch.reqs)
        tl = (
            temps.detach().to("cpu", torch.float64).reshape(-1).tolist()
            if isinstance(temps, torch.Tensor)
            else [1.0] * n
        )
        chain = ChainDraw(
            publisher,
            [getattr(r, "bootstrap_room", None) for r in batch.reqs],
            (tl * n)[:n] if len(tl) == 1 else tl,
            [str(getattr(r, "rid", "")) for r in batch.reqs],
        )
        token = _chain.set(chain)
        try:
            out = extend(self, batch, *args, **kwargs)
        finally:
            _chain.reset(token)
        if out is not None and len(chain.steps) > 1:
            setattr(out, PAYLOADS_ATTR, chain.payloads())
        return out

    def sample_draft_proposal(next_token_logits: Any, temperatures: Any, top_ks: Any = None, **kwargs: Any) -> Any:
        probs, topk_p, topk_index = sample(next_token_logits, temperatures, top_ks, **kwargs)
        chain = _chain.get()
        if chain is None or top_ks is not None:
            return probs, topk_p, topk_index  # not the PD prefill chain (or greedy rows): SGLang's
        got = chain.draw(int(kwargs.get("draft_step", 0)), probs)
        if got is None:
            publisher = chain.publisher
            publisher.counts["chain:padded_batch"] += 1
            return probs, topk_p, topk_index
        p, x = got
        return probs, p.to(topk_p.device, topk_p.dtype), x.to(topk_index.device, topk_index.dtype)

    for fn, orig in ((_draft_extend_for_prefill, extend), (sample_draft_proposal, sample)):
        fn.__wrapped__ = orig  # type: ignore[union-attr]  # functools.wraps' attribute, set by hand
        fn.__pd_middleware__ = True  # type: ignore[union-attr]  # our "already patched" marker
    return [
        (worker, "_draft_extend_for_prefill", extend, _draft_extend_for_prefill),
        (module, "sample_draft_proposal", sample, sample_draft_proposal),
    ]
