"""Multi-layer EAGLE on the prefill: draw each chain step from the law that will be sent.

SGLang 0.5.23's multi-layer prefill
(``multi_layer_eagle_worker_v2.MultiLayerEagleDraftWorker._draft_extend_for_prefill``)
drafts the chain step by step: step k calls the module's ``sample_draft_proposal(logits,
temperatures, top_ks=None, *, sampling_seed, positions, draft_step=k)``, which returns
(q_k, q_k(X_k), X_k), and X_k is fed into step k+1. So q_{k+1} is conditioned on the X_k
drawn here, and an exact S-step proposal must draw X_k from the encoded q'_k *inside* the
loop; redrawing the chain afterwards would pair q_{k+1} with another prefix.

The two patches (feature ``chain`` of the table, declared at the end of this module,
applied when a prefill starts with S > 1):

- the AROUND wrapper of ``_draft_extend_for_prefill`` puts a :class:`ChainDraw` for the
  batch in scope (:func:`chain_for`: its requests' bootstrap rooms, temperatures, rids
  and draw positions), and leaves the finished S-step payloads on the returned draft input
  (``next_draft_input.pd_middleware_payloads``: one per batch row, or None);
- the REPLACE of ``sample_draft_proposal`` calls SGLang's function for q_k, then
  :func:`draw_step` encodes the batch's q_k with the configured encoder, in one call
  where q_k lives, each row from its uniform of (seed, room, rid:k, position)
  (:mod:`pd_middleware.sampling.draws`; the position, the request's ``seq_len``, keeps a
  rebootstrapped request's steps off its earlier life's uniforms), and returns SGLang's
  q_k with the encoder's q'_k(X_k) and X_k. Outside a ChainDraw (the decode's own drafting) it is SGLang's. X_k stays on
  the device: our code reads nothing back until the loop ends, so the chain syncs the
  device only where the encoder must read its rows to pack them (``sparse``, ``full``).

The prefill wrapper (:func:`~.prefill.publish_batch`) then publishes those
payloads instead of encoding again. Each step is exact given the accepted prefix, so the
chain is. A step that fails leaves SGLang's draw for it and every
later step, and the batch is sent X only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from ...core.payload import DenseEncoding, Payload, SparseEncoding
from .common import Scope, room_key
from .patching import MULTI_LAYER_MODULE, Feature, Hook, Target, register_feature
from .prefill import PAYLOADS_ATTR, draw_keys

#: The batch whose chain the prefill is drafting (set by the extend wrapper).
CHAIN: Scope[ChainDraw] = Scope("pd_middleware_sglang_chain")


@dataclass
class ChainDraw:
    """One batch's chain draws: per step, (X (b,), q'(X) (b,), b encodings, b provenances)."""

    publisher: Any
    rooms: list[Any]
    temperatures: list[float]
    # Per-row SGLang request ids, mixed into each draw's uniforms (pd_middleware.sampling.draws).
    salts: list[str] = field(default_factory=list)
    # Per-row draw positions (prefill.draw_position: the request's seq_len), mixed in too,
    # so a rebootstrapped request (same rid and room) never redraws with an earlier life's uniform.
    positions: list[int | None] = field(default_factory=list)
    steps: list[tuple[torch.Tensor, torch.Tensor, list[Any], list[Any]]] = field(default_factory=list)
    # A step failed or was SGLang's own: the chain is no longer the encoder's throughout.
    broken: bool = False

    def draw(self, step: int, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Encode step ``step`` of every row of ``probs`` (b, V), in one encoder call where
        ``probs`` lives; returns (q'(X) (b, 1), X (b, 1)) where the encoder left them.

        None when the batch's rows are not its requests (padding): SGLang's draw stands.
        Nothing is read back to the host here: the payloads are built once, after the
        loop (:meth:`payloads`).
        """
        b = probs.shape[0]
        if self.broken or b != len(self.rooms) or step != len(self.steps):
            self.broken = True
            return None
        salts = [f"{self.salts[i] if i < len(self.salts) else ''}:{step}" for i in range(b)]
        positions = [self.positions[i] if i < len(self.positions) else None for i in range(b)]
        x, p, proposals, provenances = self.publisher.encode_rows(
            self.rooms, probs.detach(), self.temperatures, salts, positions
        )
        x, p = x.reshape(b), p.reshape(b).clamp(0.0, 1.0)
        self.steps.append((x, p, proposals, provenances))
        return p.view(b, 1), x.view(b, 1)

    def payloads(self) -> list[Payload | None]:
        """One S-step payload per row (None for a row without a bootstrap room)."""
        if not self.steps or self.broken:
            return [None] * len(self.rooms)
        s = len(self.steps)
        # One host copy of the whole chain's X and q'(X) (X < 2**53 is exact in float64).
        both = torch.cat(
            [
                torch.stack([st[0] for st in self.steps], 1).double(),
                torch.stack([st[1] for st in self.steps], 1).double(),
            ],
            1,
        ).cpu()
        xs, ps = both[:, :s].to(torch.int64).tolist(), both[:, s:].tolist()
        out: list[Payload | None] = []
        for i, room in enumerate(self.rooms):
            if room is None:
                out.append(None)
                continue
            out.append(
                Payload(
                    request_id=room_key(room) or "",
                    draft_tokens=tuple(xs[i]),
                    draft_probs=tuple(float(v) for v in ps[i]),
                    vocab_size=self.publisher.vocab_size,
                    provenance=self.steps[0][3][i],
                    proposal=join_steps([st[2][i] for st in self.steps]),
                    life=self.positions[i] if i < len(self.positions) else None,
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


def chain_for(publisher: Any, batch: Any) -> ChainDraw:
    """A chain draw for ``batch`` through ``publisher``: its rooms, temperatures, rids and draw positions."""
    temps = getattr(getattr(batch, "sampling_info", None), "temperatures", None)
    n = len(batch.reqs)
    tl = temps.detach().to("cpu", torch.float64).reshape(-1).tolist() if isinstance(temps, torch.Tensor) else [1.0] * n
    salts, positions = draw_keys(batch.reqs)
    return ChainDraw(
        publisher,
        [getattr(r, "bootstrap_room", None) for r in batch.reqs],
        (tl * n)[:n] if len(tl) == 1 else tl,
        salts,
        positions,
    )


def finish(chain: ChainDraw, out: Any) -> None:
    """Leave ``chain``'s payloads on the draft input ``out`` (a chain of more than one step, or broken)."""
    if out is not None and (len(chain.steps) > 1 or chain.broken):
        setattr(out, PAYLOADS_ATTR, chain.payloads())


def draw_step(
    step: int | None, probs: torch.Tensor, topk_p: torch.Tensor, topk_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Inside a chain in scope: SGLang's q_k with the encoder's q'_k(X_k) and X_k (None: SGLang's draw stands).
    ``step`` None (a caller that passes no ``draft_step``, up to SGLang 0.5.22): the chain's next step."""
    chain = CHAIN.get()
    if chain is None:
        return None  # not the PD prefill chain
    got = chain.draw(len(chain.steps) if step is None else step, probs)
    if got is None:
        chain.publisher.events.count("chain:padded_batch")
        return None
    p, x = got
    return probs, p.to(topk_p.device, topk_p.dtype), x.to(topk_index.device, topk_index.dtype)


# --------------------------------------------------------------------- the feature


def wrap_extend_for_prefill(extend: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def _draft_extend_for_prefill(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        chain = None
        try:
            chain = chain_for(inst.publisher, batch) if inst.publisher is not None else None
        except Exception as exc:
            inst.events.failed("chain", exc, "SGLang's own chain")
        if chain is None:
            return extend(self, batch, *args, **kwargs)
        out = None
        with CHAIN.enter(chain):
            try:
                out = extend(self, batch, *args, **kwargs)
            finally:
                try:
                    finish(chain, out)
                except Exception as exc:
                    inst.events.failed("chain", exc, "SGLang's own chain (X only)")
        return out

    return _draft_extend_for_prefill


def wrap_sample(sample: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def sample_draft_proposal(next_token_logits: Any, temperatures: Any, top_ks: Any = None, **kwargs: Any) -> Any:
        # top_ks only when given: up to 0.5.20 SGLang's function takes (logits, temperatures).
        args = (next_token_logits, temperatures) if top_ks is None else (next_token_logits, temperatures, top_ks)
        probs, topk_p, topk_index = sample(*args, **kwargs)
        if top_ks is not None:
            return probs, topk_p, topk_index  # greedy rows: SGLang's
        try:
            step = kwargs.get("draft_step")
            got = draw_step(None if step is None else int(step), probs, topk_p, topk_index)
        except Exception as exc:
            inst.events.failed("chain_step", exc, "SGLang's own draw (the chain is sent X only)")
            chain = CHAIN.get()
            if chain is not None:
                chain.broken = True  # a step kept SGLang's draw: the chain is not the encoder's
            return probs, topk_p, topk_index
        return got if got is not None else (probs, topk_p, topk_index)

    return sample_draft_proposal


register_feature(
    Feature(
        "chain",
        (
            Target(
                MULTI_LAYER_MODULE,
                "sample_draft_proposal",
                ("next_token_logits", "temperatures", "top_ks", "sampling_seed", "positions", "draft_step"),
                Hook.REPLACE,
                wrap_sample,
                since="0.5.23",
            ),
            # Before 0.5.23 no seed, positions or step (the chain counts its steps); no top_ks up to 0.5.20.
            Target(
                MULTI_LAYER_MODULE,
                "sample_draft_proposal",
                ("next_token_logits", "temperatures", "top_ks"),
                Hook.REPLACE,
                wrap_sample,
                since="0.5.21",
                until="0.5.22",
            ),
            Target(
                MULTI_LAYER_MODULE,
                "sample_draft_proposal",
                ("next_token_logits", "temperatures"),
                Hook.REPLACE,
                wrap_sample,
                until="0.5.20",
            ),
            Target(
                MULTI_LAYER_MODULE,
                "MultiLayerEagleDraftWorker._draft_extend_for_prefill",
                ("self", "batch", "target_hidden_states", "next_token_ids", "kv_loc_plan"),
                Hook.AROUND,
                wrap_extend_for_prefill,
                since="0.5.22",
            ),
            Target(
                MULTI_LAYER_MODULE,
                "MultiLayerEagleDraftWorker._draft_extend_for_prefill",
                ("self", "batch", "target_hidden_states", "next_token_ids"),
                Hook.AROUND,
                wrap_extend_for_prefill,
                until="0.5.21",
            ),
        ),
        lambda plan: "prefill" in plan.features,
        applied="multi_layer_prefill",
        summary="the multi-layer prefill's per-step draw from the encoded law (applied when S > 1)",
    )
)
