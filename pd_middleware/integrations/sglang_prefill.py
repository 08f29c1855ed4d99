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

**Each request's draws are a function of (``seed``, room, rid) alone**
(:func:`~pd_middleware.draws.request_uniforms`: counter-based uniforms, not one
per-process generator), so every prefill TP rank that writes a request's row (several
do under MHA TP) draws the same X, given identical draft distributions, whatever the
batch around it. The batch is encoded in one call where the draft rows live; nothing
V-wide reaches the host unless the encoder ships V-wide rows (``full``). That is not
taken on trust: :func:`publish_batch` all-reduces, per batch,
whether each rank encoded each request and which X it drew, and publishes a request only
when all agree. **The caller must hand the decode the encoder's X** (``tokens``) and
q'(X) (``token_probs``) instead of its own draw: the shipped proposal is exact only for
the X that was drawn from it. The decode checks it and falls back to one-hot when the
tokens differ.

:func:`publish_batch` is what the AROUND wrapper of SGLang's
``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill``
(:mod:`.sglang_patch`) runs before SGLang's method, after ``copy_done``: that method
copies ``next_draft_input.topk_p/topk_index`` into ``req.output_topk_p`` /
``req.output_topk_index`` for finished requests, right before ``send_kv_chunk`` writes
them into the PD metadata buffers, so overwriting ``topk_index[:, 0]`` /
``topk_p[:, 0]`` with the encoder's draw makes SGLang's own metadata carry it.

Multi-layer EAGLE is published when the chain patches are active (:mod:`.sglang_chain`
draws each step inside SGLang's draft loop, so step k+1 is conditioned on the encoded
X_k). Without them SGLang's own chain stands and is sent X only (counted
``skipped:multi_layer``; the decode answers one-hot, exact).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import ConfigError, PDMiddlewareError
from ..contracts import EncodedBatch
from ..draws import encode_requests, takes_uniforms
from ..payload import Payload
from .sglang_decode import LOCAL_PROVENANCE, is_probe, room_key

logger = logging.getLogger("pd_middleware.integrations.sglang")


class ProposalPublisher:
    """Prefill side: encode draft distributions per request and hand each payload to a sink.

    ``encoder``: a :class:`~pd_middleware.ProposalEncoder`; ``sender``: a connected
    :class:`~pd_middleware.transport.PrefillSender`, or a zero-argument callable
    returning one (connected lazily on first publish, so a prefill may start before its
    decode), or None with ``stage`` given; ``stage(req_or_room, payload)``: the
    metadata channel's sink (the wrapper passes SGLang's Req); ``vocab_size``: V;
    ``seed``: mixed with each request's room and rid into its uniforms (:mod:`pd_middleware.draws`).
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
        self.logged: set[str] = set()
        self._lock = threading.Lock()
        self._connector: threading.Thread | None = None
        self._connect_lock = threading.Lock()
        self._closed = threading.Event()
        # A factory's sender is ours to close; a connected one handed in stays the caller's.
        self._owns_sender = sender is not None and not hasattr(sender, "send")
        self._uniform_check: tuple[Any, bool] = (None, False)

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

    #: Connect attempts of a lazily connected sender, and the longest pause between two.
    CONNECT_ATTEMPTS = 120
    CONNECT_BACKOFF_MAX_S = 15.0

    @property
    def sender(self) -> Any:
        """The connected sender, or None while a lazy one is connecting (off this thread)."""
        s = self._sender
        if s is None or hasattr(s, "send"):
            return s
        with self._connect_lock:
            if self._connector is None:
                self._connector = threading.Thread(
                    target=self._connect, args=(s,), name="pd-middleware-sidechannel-connect", daemon=True
                )
                self._connector.start()
        return None

    def _connect(self, factory: Callable[[], Any]) -> None:
        # Off the scheduler thread: a decode that is not up yet costs the prefill nothing
        # but X-only requests (counted send_failed:not_connected), never a blocked batch.
        pause = 0.5
        for attempt in range(1, self.CONNECT_ATTEMPTS + 1):
            try:
                sender = factory()
            except Exception as exc:
                if attempt == 1:
                    logger.warning(
                        "pd-middleware side channel: cannot connect yet (%s); retrying in the background", exc
                    )
                if self._closed.wait(pause):
                    return
                pause = min(pause * 2, self.CONNECT_BACKOFF_MAX_S)
                continue
            if self._closed.is_set():
                sender.close()
                return
            self._sender = sender
            logger.info("pd-middleware side channel connected after %d attempt(s)", attempt)
            return
        logger.error(
            "pd-middleware side channel: gave up connecting after %d attempts; every request is sent X only",
            self.CONNECT_ATTEMPTS,
        )

    def close(self) -> None:
        """Stop a background connect and close the sender this publisher opened."""
        self._closed.set()
        s = self._sender
        if s is not None and hasattr(s, "send") and self._owns_sender:
            s.close()

    def encode(
        self,
        rooms: Sequence[Any],
        draft_probs: torch.Tensor,
        temperature: float | Sequence[float] | torch.Tensor = 1.0,
        salts: Sequence[str] | None = None,
    ) -> tuple[EncodedBatch, list[Payload]]:
        """Encode one batch; each request's draws come from (seed, room, salt) alone (salt: SGLang's rid).

        ``rooms``: B bootstrap rooms (ints) or request ids; ``draft_probs``: float
        (B, V) or (B, S, V) draft probabilities after temperature, any device;
        ``temperature``: one value or B values (recorded in each provenance);
        ``salts``: B per-request strings mixed into the seed (SGLang's ``rid``).

        The encoder runs where ``draft_probs`` lives, once per distinct temperature, with
        the batch's uniforms (:func:`~pd_middleware.draws.request_uniforms`); nothing
        V-wide is copied to the host unless the encoder itself ships V-wide rows. An
        encoder without a ``uniforms`` parameter is called per request on a host copy,
        with a generator seeded from :func:`room_seed`. Returns the batch (X is
        ``tokens``, on the host) and one payload per request. Encoder errors raise.
        """
        probs = draft_probs.detach()
        b = probs.shape[0]
        if len(rooms) != b:
            raise ValueError(f"{len(rooms)} rooms for {b} rows of draft_probs")
        if salts is not None and len(salts) != b:
            raise ValueError(f"{len(salts)} salts for {b} rows of draft_probs")
        temps = _temperatures(temperature, b)
        tokens, token_probs, proposals, provenances = self.encode_rows(rooms, probs, temps, salts)
        # One host copy of X and q'(X) for the whole batch (X < 2**53 is exact in float64).
        steps = tokens.shape[1]
        both = torch.cat([tokens.double(), token_probs.double()], 1).cpu()
        tokens, token_probs = both[:, :steps].to(torch.int64), both[:, steps:].float()
        rows_t, rows_p = tokens.tolist(), token_probs.tolist()
        payloads = [
            Payload(
                request_id=room_key(room) if isinstance(room, int) else str(room),
                draft_tokens=tuple(rows_t[i]),
                draft_probs=tuple(min(1.0, max(0.0, p)) for p in rows_p[i]),
                vocab_size=self.vocab_size,
                provenance=provenances[i],
                proposal=proposals[i],
            )
            for i, room in enumerate(rooms)
        ]
        return EncodedBatch(tokens, token_probs, proposals, provenances[0]), payloads

    def _takes_uniforms(self) -> bool:
        # One call per batch with per-request uniforms, or the legacy call per request;
        # looked up once per encoder (the attribute may be replaced).
        enc = self.encoder
        if self._uniform_check[0] is not enc:
            self._uniform_check = (enc, takes_uniforms(enc))
            if not self._uniform_check[1]:
                logger.warning(
                    "pd-middleware encoder %s.encode has no `uniforms` parameter: each request is encoded "
                    "alone, on a host copy of its draft row (slower; see docs/plugins.md)",
                    type(enc).__name__,
                )
        return self._uniform_check[1]

    def encode_rows(
        self, rooms: Sequence[Any], probs: torch.Tensor, temps: Sequence[float], salts: Sequence[str] | None
    ) -> tuple[torch.Tensor, torch.Tensor, list[Any], list[Any]]:
        """The encoder's draws for B rows (:func:`~pd_middleware.draws.encode_requests`):
        X and q'(X) stay where the encoder left them, so the multi-layer chain feeds X to
        the next step without a host copy."""
        return encode_requests(self.encoder, self.seed, rooms, probs, temps, salts, batched=self._takes_uniforms())

    def deliver(self, targets: Sequence[Any], payloads: Sequence[Payload]) -> None:
        """Hand already-encoded payloads to the sink (``targets``: what ``stage`` receives)."""
        with self._lock:
            if self.stage is not None:
                for target, payload in zip(targets, payloads):
                    self.stage(target, payload)
                # SGLang's warmups and health checks are staged like any request (their
                # row is harmless) but counted apart, as the decode does.
                probes = sum(1 for t in targets[: len(payloads)] if is_probe(t))
                self.counts["staged"] += len(payloads) - probes
                if probes:
                    self.counts["probe"] += probes
                return
            sender = self.sender
            if sender is None:
                self._note("send_failed:not_connected", len(payloads), "the side channel is not connected yet")
                return
            for payload in payloads:
                try:
                    sender.send(payload)
                    self.counts["published"] += 1
                except PDMiddlewareError as exc:
                    self._note(f"send_failed:{type(exc).__name__}", 1, f"request {payload.request_id}: {exc}")

    def _note(self, key: str, n: int, detail: str) -> None:
        self.counts[key] += n
        if key not in self.logged:
            self.logged.add(key)
            logger.warning(
                "publishing failed (%s); the decode will use one-hot (logged once; counted as %s)", detail, key
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


def unstage(publisher: ProposalPublisher, batch: Any) -> None:
    """Clear what an earlier batch staged on ``batch``'s requests (metadata channel)."""
    if publisher.stage is not None:
        for req in batch.reqs:
            publisher.stage(req, None)


#: Neutral element of the agreement's MIN (a rank with nothing to say for a request).
_NEUTRAL = torch.iinfo(torch.int64).max


def publish_batch(
    publisher: ProposalPublisher, batch: Any, draft_input: Any, *, group: Any = None, guard: Any = None
) -> None:
    """Encode one prefill batch's finishing requests and give SGLang the encoder's X; never raises.

    ``draft_input``: SGLang's ``result.next_draft_input`` (``draft_probs``, ``topk_index``,
    ``topk_p``), after ``copy_done``; ``group``: the CPU group of the ranks that run this
    batch (SGLang's attention TP), or None for one rank; ``guard``: counts our failures.

    Every rank that runs the batch must hand the decode the same X for a request (under
    TP, the sharded target forward embeds each rank's own X). So, per batch:

    1. each rank encodes the finishing requests (each request's draws from (seed, room,
       rid) alone); a failure here is this rank's alone;
    2. every rank, always, takes part in one all-reduce (MIN) of [encoded OK, X, -X]
       per request over ``group``;
    3. a request whose ranks all encoded, and all drew the same X, gets it: ``topk_index``
       / ``topk_p`` are overwritten and its payload is staged or sent. Any other request
       keeps SGLang's own X, sent without a distribution (the decode answers one-hot),
       counted ``agreement:<why>`` (``local_failed``, ``peer_failed``, ``x_differs``) and
       logged once.

    Multi-layer EAGLE: with the chain patches (:mod:`.sglang_chain`) the S-step payloads
    were drawn inside SGLang's draft loop and X is already the encoder's; they are
    published the same way. Without them (a step failed, a padded batch) SGLang's own
    chain stands and is sent X only.
    """
    q = getattr(draft_input, "draft_probs", None)
    if q is None:
        return
    rows = [
        i for i, req in enumerate(batch.reqs) if _finishing(req) and getattr(req, "bootstrap_room", None) is not None
    ]
    if not rows:
        return
    try:
        own = draft_input.topk_index[rows].detach().to("cpu", torch.int64)
        steps = int(own.shape[1]) if q.dim() == 3 and q.shape[1] != 1 else 1
        own = own[:, :steps]
    except Exception as exc:  # SGLang's own X unreadable: nothing to agree on, SGLang's stands
        _failed(guard, "prefill", exc)
        return
    local = None
    try:
        local = _encode_rows(publisher, batch, draft_input, q, rows, steps)
    except Exception as exc:
        _failed(guard, "prefill_encode", exc)
    why = _agree(local, own, group, guard)
    try:
        _finish(publisher, batch, draft_input, rows, own, local, why)
    except Exception as exc:
        _failed(guard, "prefill_publish", exc)


def _failed(guard: Any, where: str, exc: BaseException) -> None:
    if guard is not None:
        guard.failed(where, exc, "SGLang's own X (the decode answers one-hot)")
    else:
        logger.error("pd-middleware %s failed (%s); SGLang's own X is used", where, exc)


def _encode_rows(
    publisher: ProposalPublisher, batch: Any, draft_input: Any, q: torch.Tensor, rows: list[int], steps: int
) -> tuple[torch.Tensor, torch.Tensor, list[Payload | None]]:
    """This rank's (X (r, S), q'(X) (r, S), payloads) for ``rows``; payloads[i] None: X only."""
    reqs = [batch.reqs[i] for i in rows]
    if steps > 1:
        from .sglang_chain import PAYLOADS_ATTR

        chained = getattr(draft_input, PAYLOADS_ATTR, None)
        if chained is None or len(chained) != len(batch.reqs):
            # No chain drawn by the drop-in (its patches off, a padded batch, a failed
            # step): SGLang's own chain stands, sent X only.
            publisher.counts["skipped:multi_layer"] += 1
            chained = [None] * len(batch.reqs)
        got = [chained[i] for i in rows]
        x = draft_input.topk_index[rows, :steps].detach().to("cpu", torch.int64)
        p = draft_input.topk_p[rows, :steps].detach().to("cpu", torch.float32)
        publisher.counts["chain:published"] += sum(g is not None for g in got)
        return x, p, list(got)
    q2 = q.reshape(q.shape[0], -1)[rows]
    temps = getattr(getattr(batch, "sampling_info", None), "temperatures", None)
    temperature: Any = temps.reshape(-1)[rows] if isinstance(temps, torch.Tensor) else 1.0
    salts = [str(getattr(r, "rid", "")) for r in reqs]
    enc, payloads = publisher.encode([r.bootstrap_room for r in reqs], q2, temperature, salts)
    return enc.tokens.to(torch.int64), enc.token_probs, list(payloads)


def _agree(
    local: tuple[torch.Tensor, torch.Tensor, list[Payload | None]] | None,
    own: torch.Tensor,
    group: Any,
    guard: Any,
) -> list[str]:
    """Per request, why it is not published ("" when every rank encoded it with one X)."""
    r, steps = own.shape
    if local is None:
        mine = ["local_failed"] * r
        x, ok = own, torch.zeros(r, dtype=torch.int64)
    else:
        mine = ["" if p is not None else "x_only" for p in local[2]]
        x = local[0].reshape(r, steps)
        ok = torch.tensor([0 if m else 1 for m in mine], dtype=torch.int64)
    if group is None:
        return mine
    flat = torch.cat([ok, x.reshape(-1), -x.reshape(-1)])
    try:
        import torch.distributed as dist

        dist.all_reduce(flat, op=dist.ReduceOp.MIN, group=group)
    except Exception as exc:  # the group itself failed: publish nothing
        _failed(guard, "prefill_agreement", exc)
        return [m or "agreement_failed" for m in mine]
    n = r * steps
    same = (flat[r : r + n].reshape(r, steps) == -flat[r + n :].reshape(r, steps)).all(dim=1).tolist()
    all_ok = flat[:r].tolist()
    return [m or ("peer_failed" if not a else "" if eq else "x_differs") for m, a, eq in zip(mine, all_ok, same)]


def _finish(
    publisher: ProposalPublisher,
    batch: Any,
    draft_input: Any,
    rows: list[int],
    own: torch.Tensor,
    local: tuple[torch.Tensor, torch.Tensor, list[Payload | None]] | None,
    why: list[str],
) -> None:
    reqs = [batch.reqs[i] for i in rows]
    pub = [j for j, w in enumerate(why) if not w]
    if local is not None and pub:
        tokens, probs, payloads = local
        if own.shape[1] == 1:
            # SGLang's metadata must carry the encoder's X: the shipped q' is exact only for it.
            dev = draft_input.topk_index.device
            idx = torch.tensor([rows[j] for j in pub], device=dev)
            sel = torch.tensor(pub)
            draft_input.topk_index[idx, 0] = tokens[sel, 0].to(dev, draft_input.topk_index.dtype)
            draft_input.topk_p[idx, 0] = probs[sel, 0].to(draft_input.topk_p.device, draft_input.topk_p.dtype)
        publisher.deliver([reqs[j] for j in pub], [p for j in pub if (p := payloads[j]) is not None])
    bare = [j for j, w in enumerate(why) if w]
    if not bare:
        return
    for reason in sorted({why[j] for j in bare} - {"x_only"}):
        _count_once(publisher, f"agreement:{reason}", sum(why[j] == reason for j in bare))
    # SGLang's own X, without a distribution, so the decode tells "X only" from "no drop-in".
    p_own = draft_input.topk_p[[rows[j] for j in bare]].detach().to("cpu", torch.float32).clamp(0.0, 1.0)
    publisher.deliver(
        [reqs[j] for j in bare],
        [
            Payload(
                request_id=room_key(reqs[j].bootstrap_room) or "",
                draft_tokens=tuple(own[j].tolist()),
                draft_probs=tuple(p_own[k, : own.shape[1]].tolist()),
                vocab_size=publisher.vocab_size,
                provenance=LOCAL_PROVENANCE,
            )
            for k, j in enumerate(bare)
        ],
    )


def _count_once(publisher: ProposalPublisher, key: str, n: int) -> None:
    publisher.counts[key] += n
    with publisher._lock:
        first = key not in publisher.logged
        publisher.logged.add(key)
    if first:
        logger.error(
            "pd-middleware prefill ranks did not all publish the same X for %d request(s) (%s): every rank "
            "keeps SGLang's own X and the decode answers one-hot (logged once; counted as %s)",
            n,
            key,
            key,
        )
