"""Multi-layer EAGLE on the prefill: draw each chain step from the law that will be sent.

SGLang 0.5.23's multi-layer prefill
(``multi_layer_eagle_worker_v2.MultiLayerEagleDraftWorker._draft_extend_for_prefill``)
drafts the chain step by step: step k calls the module's ``sample_draft_proposal(logits,
temperatures, top_ks=None, *, sampling_seed, positions, draft_step=k)``, which returns
(q_k, q_k(X_k), X_k), and X_k is fed into step k+1. So q_{k+1} is conditioned on the X_k
drawn here, and an exact S-step proposal must draw X_k from the encoded q'_k *inside* the
loop; redrawing the chain afterwards would pair q_{k+1} with another prefix.

The two patches (targets in :mod:`.sglang_patch`'s table, feature ``chain``, applied
when a prefill starts with S > 1) call this module:

- the AROUND wrapper of ``_draft_extend_for_prefill`` opens a :class:`ChainDraw` for
  the batch (:func:`open_chain`: its requests' bootstrap rooms, temperatures and rids)
  in a ContextVar, and :func:`finish_chain` leaves the finished S-step payloads on the
  returned draft input (``next_draft_input.pd_middleware_payloads``: one per batch row,
  or None);
- the REPLACE of ``sample_draft_proposal`` calls SGLang's function for q_k, then
  :func:`draw_step` encodes each row's q_k with the configured encoder from a generator
  seeded from (seed, room, rid:k), and returns SGLang's q_k with the encoder's q'_k(X_k)
  and X_k. Outside a ChainDraw (the decode's own drafting) it is SGLang's.

The prefill wrapper (:func:`~.sglang_prefill.publish_batch`) then publishes those
payloads instead of encoding again. Each step is exact given the accepted prefix, so the
chain is. A step that fails (:func:`break_chain`) leaves SGLang's draw for it and every
later step, and the batch is sent X only.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from ..payload import DenseEncoding, Payload, SparseEncoding
from .sglang_decode import room_key
from .sglang_prefill import room_seed

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
    # A step failed or was SGLang's own: the chain is no longer the encoder's throughout.
    broken: bool = False

    def draw(self, step: int, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Encode step ``step`` of every row of ``probs`` (b, V); returns (q'(X) (b, 1), X (b, 1)) on CPU.

        None when the batch's rows are not its requests (padding): SGLang's draw stands.
        """
        b = probs.shape[0]
        if self.broken or b != len(self.rooms) or step != len(self.steps):
            self.broken = True
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
            if room is None or not self.steps or self.broken:
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


def open_chain(publisher: Any, batch: Any) -> contextvars.Token[ChainDraw | None] | None:
    """Start drawing ``batch``'s chain through ``publisher`` (None: no publisher yet)."""
    if publisher is None:
        return None
    temps = getattr(getattr(batch, "sampling_info", None), "temperatures", None)
    n = len(batch.reqs)
    tl = temps.detach().to("cpu", torch.float64).reshape(-1).tolist() if isinstance(temps, torch.Tensor) else [1.0] * n
    chain = ChainDraw(
        publisher,
        [getattr(r, "bootstrap_room", None) for r in batch.reqs],
        (tl * n)[:n] if len(tl) == 1 else tl,
        [str(getattr(r, "rid", "")) for r in batch.reqs],
    )
    return _chain.set(chain)


def finish_chain(token: contextvars.Token[ChainDraw | None], out: Any) -> None:
    """Close the chain opened by :func:`open_chain`; leave its payloads on ``out``."""
    chain = _chain.get()
    _chain.reset(token)
    if chain is not None and out is not None and (len(chain.steps) > 1 or chain.broken):
        setattr(out, PAYLOADS_ATTR, chain.payloads())


def break_chain() -> None:
    """Mark the open chain as not the encoder's (a step kept SGLang's draw)."""
    chain = _chain.get()
    if chain is not None:
        chain.broken = True


def draw_step(
    step: int, probs: torch.Tensor, topk_p: torch.Tensor, topk_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Inside an open chain: SGLang's q_k with the encoder's q'_k(X_k) and X_k (None: SGLang's draw stands)."""
    chain = _chain.get()
    if chain is None:
        return None  # not the PD prefill chain
    got = chain.draw(step, probs)
    if got is None:
        chain.publisher.counts["chain:padded_batch"] += 1
        return None
    p, x = got
    return probs, p.to(topk_p.device, topk_p.dtype), x.to(topk_index.device, topk_index.dtype)
