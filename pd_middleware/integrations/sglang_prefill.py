"""SGLang prefill side: encode each finished request's proposal and hand it on.

:class:`ProposalPublisher` is engine-agnostic: give it the draft distributions of a
batch of finished requests and their bootstrap rooms; it samples through the
configured encoder (which draws X from exactly the law it will send) and builds one
:class:`~pd_middleware.Payload` per request (request id = the room as a decimal
string). Where the payload goes is the publisher's ``sink``:

- the metadata channel (``[sglang].channel = "metadata"``): staged on the request
  (``req.pd_middleware_row``) and written by SGLang's own ``set_buf`` into the
  request's proposal row (:mod:`.sglang_metadata`);
- the side channel: sent through a :class:`~pd_middleware.transport.PrefillSender`.

**Each request draws from its own generator, seeded from (``seed``, room)**, not from
one per-process generator: every prefill TP rank that writes a request's row (several
do under MHA TP) writes identical bytes, given identical draft distributions, which is
what SGLang's own TP sampling relies on too. **The caller must then hand the decode
the encoder's X** (``tokens``) and q'(X) (``token_probs``) instead of its own draw:
the shipped proposal is exact only for the X that was drawn from it. The decode checks
it and falls back to one-hot when the tokens differ.

:func:`wrap_process_batch_result` builds the AROUND wrapper of SGLang's
``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill``: the method
that copies ``next_draft_input.topk_p/topk_index`` into ``req.output_topk_p`` /
``req.output_topk_index`` for finished requests, right before ``send_kv_chunk`` writes
them into the PD metadata buffers. Before calling it, the wrapper encodes the
``draft_probs`` rows of the requests that finish in this batch and overwrites their
``topk_index[:, 0]`` / ``topk_p[:, 0]`` with the encoder's draw, so SGLang's own
metadata carries it.

Multi-layer EAGLE is not published: step k+1 of SGLang's chain was drafted from its own
X_k inside the draft loop, so redrawing X_k here would make the later steps' q wrong
(docs/sglang.md, "Multi-layer"). Those batches are counted (``skipped:multi_layer``)
and the decode answers one-hot (exact).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import ConfigError, PDMiddlewareError
from ..contracts import EncodedBatch
from ..payload import Payload
from .sglang_decode import room_key
from .sglang_patch import _mark

logger = logging.getLogger("pd_middleware.integrations.sglang")


def room_seed(seed: int, room: Any, salt: str = "") -> int:
    """The generator seed of one request: a 63-bit digest of (``seed``, room, ``salt``), equal on every rank.

    ``salt``: SGLang's request id (``req.rid``, the same on every TP rank and new for every
    request), so a client that reuses a ``bootstrap_room`` does not get the same draw twice.
    """
    raw = f"{int(seed)}:{room}:{salt}".encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8, person=b"pd-mw-draw").digest(), "little") >> 1


class ProposalPublisher:
    """Prefill side: encode draft distributions per request and hand each payload to a sink.

    ``encoder``: a :class:`~pd_middleware.ProposalEncoder`; ``sender``: a connected
    :class:`~pd_middleware.transport.PrefillSender`, or a zero-argument callable
    returning one (connected lazily on first publish, so a prefill may start before its
    decode), or None with ``stage`` given; ``stage(req_or_room, payload)``: the
    metadata channel's sink (the wrapper passes SGLang's Req); ``vocab_size``: V;
    ``seed``: mixed with each request's room into its generator's seed.
    """

    def __init__(
        self,
        encoder: Any,
        sender: Any = None,
        *,
        vocab_size: int,
        seed: int = 0,
        stage: Callable[[Any, Payload | None], None] | None = None,
    ) -> None:
        if (sender is None) == (stage is None):
            raise ValueError("give exactly one of sender (side channel) and stage (metadata channel)")
        self.encoder = encoder
        self._sender = sender
        self.stage = stage
        self.vocab_size = vocab_size
        self.seed = seed
        self.counts: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        config: Any,
        sender: Any = None,
        *,
        arm: str | None = None,
        registry: Any = None,
        seed: int | None = None,
        stage: Callable[[Any, Payload | None], None] | None = None,
        vocab_size: int | None = None,
        num_steps: int | None = None,
    ) -> ProposalPublisher:
        """A publisher with the config's top-level ``[encoder]``, or arm ``arm``'s encoder.

        In a live A/B (``ab_split``) leave ``arm`` unset: the prefill sends one encoding
        to every arm (the richest one), and each arm's synthesizer uses it or falls back
        to one-hot; an arm's own ``encoder`` is for the offline ``pd-middleware ab`` job.
        ``vocab_size``/``num_steps``: the engine's shapes (ConfigError when the config
        declares others); default: the config's. ``seed``: default ``[sglang].seed``.
        """
        import msgspec

        from ..config import Config, load_config
        from ..middleware import build_encoders

        cfg = config if isinstance(config, Config) else load_config(config)
        if vocab_size is not None or num_steps is not None:
            model = cfg.model.with_shapes(
                vocab_size if vocab_size is not None else cfg.model.vocab_size,
                num_steps if num_steps is not None else cfg.model.num_steps,
                engine="SGLang",
            )
            cfg = msgspec.structs.replace(cfg, model=model)
        if arm is None:
            enc = build_encoders(msgspec.structs.replace(cfg, arms=[]), registry)["default"]
        else:
            encoders = build_encoders(cfg, registry)
            if arm not in encoders:
                raise ConfigError(f"no arm named {arm!r}; arms: {sorted(encoders)}", path="arms")
            enc = encoders[arm]
        return cls(
            enc, sender, vocab_size=cfg.model.vocab_size, seed=cfg.sglang.seed if seed is None else seed, stage=stage
        )

    @property
    def sender(self) -> Any:
        if callable(self._sender) and not hasattr(self._sender, "send"):
            self._sender = self._sender()
        return self._sender

    def encode(
        self,
        rooms: Sequence[Any],
        draft_probs: torch.Tensor,
        temperature: float | Sequence[float] | torch.Tensor = 1.0,
        salts: Sequence[str] | None = None,
    ) -> tuple[EncodedBatch, list[Payload]]:
        """Encode one batch, each request from its own (seed, room) generator.

        ``rooms``: B bootstrap rooms (ints) or request ids; ``draft_probs``: float
        (B, V) or (B, S, V) draft probabilities after temperature, any device;
        ``temperature``: one value or B values (recorded in each provenance);
        ``salts``: B per-request strings mixed into the seed (SGLang's ``rid``). Returns the batch (X is ``tokens``) and one payload per request. Encoder errors raise.
        """
        probs = draft_probs.detach().to("cpu", torch.float32)
        b = probs.shape[0]
        if len(rooms) != b:
            raise ValueError(f"{len(rooms)} rooms for {b} rows of draft_probs")
        temps = _temperatures(temperature, b)
        encs = [
            self.encoder.encode(
                probs[i : i + 1],
                temperature=temps[i],
                generator=torch.Generator().manual_seed(
                    room_seed(self.seed, rooms[i], salts[i] if salts is not None else "")
                ),
            )
            for i in range(b)
        ]
        tokens = torch.cat([e.tokens for e in encs])
        token_probs = torch.cat([e.token_probs for e in encs])
        rows_t, rows_p = tokens.tolist(), token_probs.tolist()
        payloads = [
            Payload(
                request_id=room_key(room) if isinstance(room, int) else str(room),
                draft_tokens=tuple(rows_t[i]),
                draft_probs=tuple(min(1.0, max(0.0, p)) for p in rows_p[i]),
                vocab_size=self.vocab_size,
                provenance=encs[i].provenance,
                proposal=encs[i].proposals[0],
            )
            for i, room in enumerate(rooms)
        ]
        batch = EncodedBatch(tokens, token_probs, [e.proposals[0] for e in encs], encs[0].provenance)
        return batch, payloads

    def deliver(self, targets: Sequence[Any], payloads: Sequence[Payload]) -> None:
        """Hand already-encoded payloads to the sink (``targets``: what ``stage`` receives)."""
        with self._lock:
            if self.stage is not None:
                for target, payload in zip(targets, payloads):
                    self.stage(target, payload)
                self.counts["staged"] += len(payloads)
                return
            sender = self.sender
            for payload in payloads:
                try:
                    sender.send(payload)
                    self.counts["published"] += 1
                except PDMiddlewareError as exc:
                    key = f"send_failed:{type(exc).__name__}"
                    self.counts[key] += 1
                    if key not in self._logged:
                        self._logged.add(key)
                        logger.warning(
                            "publishing request %s failed (%s); the decode will use one-hot", payload.request_id, exc
                        )

    def publish(
        self,
        rooms: Sequence[Any],
        draft_probs: torch.Tensor,
        temperature: float | Sequence[float] | torch.Tensor = 1.0,
        targets: Sequence[Any] | None = None,
    ) -> EncodedBatch:
        """Encode one batch (:meth:`encode`) and hand each payload to the sink; returns the batch.

        ``targets``: what ``stage`` receives per request (SGLang's Reqs; default the
        rooms). A request whose send fails is counted (``send_failed:<error>``) and
        logged once per error; the decode then falls back to one-hot for it.
        """
        salts = [str(getattr(t, "rid", "")) for t in targets] if targets is not None else None
        enc, payloads = self.encode(rooms, draft_probs, temperature, salts)
        self.deliver(targets if targets is not None else rooms, payloads)
        return enc


def _stage_bare(publisher: ProposalPublisher, batch: Any, draft_input: Any) -> None:
    """Stage SGLang's own chain (X, q(X)) with no distribution for each finishing request."""
    from .sglang_decode import _LOCAL_PROVENANCE

    assert publisher.stage is not None
    tokens = draft_input.topk_index.detach().to("cpu").tolist()
    probs = draft_input.topk_p.detach().to("cpu", torch.float32).clamp(0.0, 1.0).tolist()
    for i, req in enumerate(batch.reqs):
        room = getattr(req, "bootstrap_room", None)
        if room is None or not _finishing(req):
            continue
        publisher.stage(
            req,
            Payload(
                request_id=room_key(room) or "",
                draft_tokens=tuple(tokens[i]),
                draft_probs=tuple(probs[i]),
                vocab_size=publisher.vocab_size,
                provenance=_LOCAL_PROVENANCE,
            ),
        )


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
        if publisher is not None:
            # Nothing staged by an earlier batch (a request requeued without a q) may be
            # written next to this batch's X.
            _unstage(publisher, batch)
        if publisher is not None and q is not None:
            try:
                _publish_batch(publisher, batch, draft_input, q)
            except Exception as exc:
                _unstage(publisher, batch)
                key = f"publish_failed:{type(exc).__name__}"
                publisher.counts[key] += 1
                if key not in publisher._logged:
                    publisher._logged.add(key)
                    logger.error("pd-middleware could not encode a batch (%s); those requests get one-hot", exc)
        return original(self, batch, result)

    return _mark(process_batch_result_disagg_prefill, original)


def _unstage(publisher: ProposalPublisher, batch: Any) -> None:
    if publisher.stage is not None:
        for req in batch.reqs:
            publisher.stage(req, None)


def _publish_batch(publisher: ProposalPublisher, batch: Any, draft_input: Any, q: torch.Tensor) -> None:
    if q.dim() == 3 and q.shape[1] != 1:
        # Multi-layer: the chain was drawn step by step inside SGLang's draft loop
        # (.sglang_chain) when its patches are active; stage those S-step payloads.
        chained = getattr(draft_input, "pd_middleware_payloads", None)
        if chained is not None and len(chained) == len(batch.reqs):
            pairs = [
                (req, chained[i])
                for i, req in enumerate(batch.reqs)
                if _finishing(req) and getattr(req, "bootstrap_room", None) is not None and chained[i] is not None
            ]
            publisher.deliver([r for r, _ in pairs], [p for _, p in pairs])
            publisher.counts["chain:published"] += len(pairs)
            return
        # Otherwise SGLang's own chain stands (see the module docstring). On the
        # metadata channel its X still travels in a row without a distribution, so the
        # decode tells "no distribution" from "no drop-in".
        publisher.counts["skipped:multi_layer"] += 1
        if publisher.stage is not None:
            _stage_bare(publisher, batch, draft_input)
        return
    rows = [
        i for i, req in enumerate(batch.reqs) if _finishing(req) and getattr(req, "bootstrap_room", None) is not None
    ]
    if not rows:
        return
    q2 = q.reshape(q.shape[0], -1)[rows]
    sampling = getattr(batch, "sampling_info", None)
    temps = getattr(sampling, "temperatures", None)
    temperature: Any = temps.reshape(-1)[rows] if isinstance(temps, torch.Tensor) else 1.0
    reqs = [batch.reqs[i] for i in rows]
    enc = publisher.publish([r.bootstrap_room for r in reqs], q2, temperature, targets=reqs)
    # SGLang's metadata must carry the encoder's X: the shipped q' is exact only for it.
    idx = torch.tensor(rows, device=draft_input.topk_index.device)
    draft_input.topk_index[idx, 0] = enc.tokens[:, 0].to(draft_input.topk_index.device, draft_input.topk_index.dtype)
    draft_input.topk_p[idx, 0] = enc.token_probs[:, 0].to(draft_input.topk_p.device, draft_input.topk_p.dtype)
