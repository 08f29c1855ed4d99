"""SGLang prefill side: publish each finished request's proposal, keyed by bootstrap room.

:class:`ProposalPublisher` is engine-agnostic: give it the draft distributions of a
batch of finished requests and their bootstrap rooms; it samples through the configured
encoder (which draws X from exactly the law it will send), ships one
:class:`~pd_middleware.Payload` per request through a
:class:`~pd_middleware.transport.PrefillSender` (request id = the room as a decimal
string) and returns the encoded batch. **The caller must then hand the decode the
encoder's X** (``tokens``) and q'(X) (``token_probs``) instead of its own draw: the
shipped proposal is exact only for the X that was drawn from it. The decode checks it
and falls back to one-hot when the tokens differ.

:func:`wrap_process_batch_result` builds the AROUND wrapper of SGLang's
``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill``: the method
that copies ``next_draft_input.topk_p/topk_index`` into ``req.output_topk_p`` /
``req.output_topk_index`` for finished requests, right before ``send_kv_chunk`` writes
them into the PD metadata buffers. Before calling it, the wrapper publishes the
``draft_probs`` rows of the requests that finish in this batch and overwrites their
``topk_index[:, 0]`` / ``topk_p[:, 0]`` with the encoder's draw, so SGLang's own
metadata carries it.

Multi-layer EAGLE is not published: step k+1 of SGLang's chain was drafted from its own
X_k, so redrawing X_k through an encoder would make the later steps' q wrong. Those
batches are counted (``skipped:multi_layer``) and the decode answers one-hot (exact).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from .._errors import ConfigError, PDMiddlewareError
from ..contracts import EncodedBatch
from ..payload import Payload
from .sglang_decode import room_key

logger = logging.getLogger("pd_middleware.integrations.sglang")


class ProposalPublisher:
    """Prefill side: encode draft distributions and send them, keyed by bootstrap room.

    ``encoder``: a :class:`~pd_middleware.ProposalEncoder`; ``sender``: a connected
    :class:`~pd_middleware.transport.PrefillSender`, or a zero-argument callable
    returning one (connected lazily on first publish, so a prefill may start before its
    decode); ``vocab_size``: V; ``seed``: of the encoder's sampler (CPU generator).
    """

    def __init__(
        self,
        encoder: Any,
        sender: Any,
        *,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        self.encoder = encoder
        self._sender = sender
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.counts: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls, config: Any, sender: Any, *, arm: str | None = None, registry: Any = None, seed: int = 0
    ) -> "ProposalPublisher":
        """A publisher with the config's top-level ``[encoder]``, or arm ``arm``'s encoder.

        In a live A/B (``ab_split``) leave ``arm`` unset: the prefill sends one encoding
        to every arm (the richest one), and each arm's synthesizer uses it or falls back
        to one-hot; an arm's own ``encoder`` is for the offline ``pd-middleware ab`` job.
        """
        import msgspec

        from ..config import Config, load_config
        from ..middleware import build_encoders

        cfg = config if isinstance(config, Config) else load_config(config)
        if arm is None:
            enc = build_encoders(msgspec.structs.replace(cfg, arms=[]), registry)["default"]
        else:
            encoders = build_encoders(cfg, registry)
            if arm not in encoders:
                raise ConfigError(f"no arm named {arm!r}; arms: {sorted(encoders)}", path="arms")
            enc = encoders[arm]
        return cls(enc, sender, vocab_size=cfg.model.vocab_size, seed=seed)

    @property
    def sender(self) -> Any:
        if callable(self._sender) and not hasattr(self._sender, "send"):
            self._sender = self._sender()
        return self._sender

    def publish(
        self,
        rooms: Sequence[Any],
        draft_probs: torch.Tensor,
        temperature: float | Sequence[float] | torch.Tensor = 1.0,
    ) -> EncodedBatch:
        """Encode and send one batch; returns the encoder's output (X is ``tokens``).

        ``rooms``: B bootstrap rooms (ints) or request ids; ``draft_probs``: float
        (B, V) or (B, S, V) draft probabilities after temperature, any device;
        ``temperature``: one value, or B values (recorded in the provenance; requests
        are encoded in groups of equal temperature). A request whose send fails is
        counted (``send_failed:<error>``) and logged once per error; the decode then
        falls back to one-hot for it. Encoder errors raise.
        """
        probs = draft_probs.detach().to("cpu", torch.float32)
        b = probs.shape[0]
        if len(rooms) != b:
            raise ValueError(f"{len(rooms)} rooms for {b} rows of draft_probs")
        temps = _temperatures(temperature, b)
        with self._lock:
            enc, provs = self._encode(probs, temps)
            sender = self.sender
            rows_t, rows_p = enc.tokens.tolist(), enc.token_probs.tolist()
            for i, room in enumerate(rooms):
                payload = Payload(
                    request_id=room_key(room) if isinstance(room, int) else str(room),
                    draft_tokens=tuple(rows_t[i]),
                    draft_probs=tuple(min(1.0, max(0.0, p)) for p in rows_p[i]),
                    vocab_size=self.vocab_size,
                    provenance=provs[i],
                    proposal=enc.proposals[i],
                )
                try:
                    sender.send(payload)
                    self.counts["published"] += 1
                except PDMiddlewareError as exc:
                    key = f"send_failed:{type(exc).__name__}"
                    self.counts[key] += 1
                    if key not in self._logged:
                        self._logged.add(key)
                        logger.warning("publishing request %s failed (%s); the decode will use one-hot", room, exc)
        return enc

    def _encode(self, probs: torch.Tensor, temps: list[float]) -> tuple[EncodedBatch, list[Any]]:
        """Encode in groups of equal temperature; returns the batch and each request's provenance."""
        groups: dict[float, list[int]] = {}
        for i, t in enumerate(temps):
            groups.setdefault(t, []).append(i)
        b = probs.shape[0]
        if len(groups) == 1:
            e = self.encoder.encode(probs, temperature=temps[0], generator=self.generator)
            return e, [e.provenance] * b
        tokens: torch.Tensor | None = None
        token_probs: torch.Tensor | None = None
        proposals: list[Any] = [None] * b
        provs: list[Any] = [None] * b
        for t, idx in groups.items():
            e = self.encoder.encode(probs[idx], temperature=t, generator=self.generator)
            if tokens is None:
                tokens = e.tokens.new_empty((b, e.tokens.shape[1]))
                token_probs = e.token_probs.new_empty((b, e.tokens.shape[1]))
            tokens[idx] = e.tokens
            token_probs[idx] = e.token_probs  # type: ignore[index]
            for j, i in enumerate(idx):
                proposals[i] = e.proposals[j]
                provs[i] = e.provenance
        return EncodedBatch(tokens, token_probs, proposals, provs[0]), provs  # type: ignore[arg-type]


def _temperatures(temperature: Any, b: int) -> list[float]:
    if isinstance(temperature, torch.Tensor):
        vals = temperature.detach().to("cpu", torch.float64).reshape(-1).tolist()
    elif isinstance(temperature, (int, float)):
        vals = [float(temperature)] * b
    else:
        vals = [float(t) for t in temperature]
    if len(vals) == 1 and b != 1:
        vals = vals * b
    if len(vals) != b:
        raise ValueError(f"{len(vals)} temperatures for {b} requests")
    return vals


def _finishing(req: Any) -> bool:
    # Mirrors the loop of process_batch_result_disagg_prefill: a request whose last
    # chunk ran in this batch (inflight_middle_chunks <= 0) and that is not aborted.
    if getattr(req, "inflight_middle_chunks", 0) > 0:
        return False
    return getattr(req, "to_finish", None) is None and getattr(req, "discard_output_reason", None) is None


def wrap_process_batch_result(original: Callable[..., Any], get_publisher: Callable[[], Any]) -> Callable[..., Any]:
    """AROUND wrapper of ``process_batch_result_disagg_prefill(self, batch, result)``."""

    def process_batch_result_disagg_prefill(self: Any, batch: Any, result: Any) -> Any:
        publisher = get_publisher()
        draft_input = getattr(result, "next_draft_input", None)
        q = getattr(draft_input, "draft_probs", None)
        if publisher is not None and q is not None:
            _publish_batch(publisher, batch, draft_input, q)
        return original(self, batch, result)

    process_batch_result_disagg_prefill.__wrapped__ = original  # type: ignore[attr-defined]
    process_batch_result_disagg_prefill.__pd_middleware__ = True  # type: ignore[attr-defined]
    return process_batch_result_disagg_prefill


def _publish_batch(publisher: ProposalPublisher, batch: Any, draft_input: Any, q: torch.Tensor) -> None:
    if q.dim() == 3 and q.shape[1] != 1:
        publisher.counts["skipped:multi_layer"] += 1
        return
    rows = [i for i, req in enumerate(batch.reqs) if _finishing(req) and getattr(req, "bootstrap_room", None) is not None]
    if not rows:
        return
    q2 = q.reshape(q.shape[0], -1)[rows]
    sampling = getattr(batch, "sampling_info", None)
    temps = getattr(sampling, "temperatures", None)
    temperature: Any = temps.reshape(-1)[rows] if isinstance(temps, torch.Tensor) else 1.0
    enc = publisher.publish([batch.reqs[i].bootstrap_room for i in rows], q2, temperature)
    # SGLang's metadata must carry the encoder's X: the shipped q' is exact only for it.
    idx = torch.tensor(rows, device=draft_input.topk_index.device)
    draft_input.topk_index[idx, 0] = enc.tokens[:, 0].to(draft_input.topk_index.device, draft_input.topk_index.dtype)
    draft_input.topk_p[idx, 0] = enc.token_probs[:, 0].to(draft_input.topk_p.device, draft_input.topk_p.dtype)
