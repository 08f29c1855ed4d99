"""SGLang prefill side: encode each finished request's proposal and hand it on.

:class:`ProposalPublisher` is engine-agnostic: give it the draft distributions of a
batch of finished requests and their bootstrap rooms; it samples through the
configured encoder (which draws X from exactly the law it will send) and builds one
:class:`~pd_middleware.Payload` per request (request id = the room as a decimal
string). A greedy request (``top_k <= 1``) is proposed as SGLang proposes it: X = argmax q,
sent X only with a greedy provenance (:func:`greedy_rows`). Where the payload goes is the
publisher's ``sink``:

- the metadata channel (``[sglang].channel = "metadata"``): staged on the request
  (``req.pd_middleware_row``) and written by SGLang's own ``set_buf`` into the
  request's proposal row (:mod:`.metadata`);
- the side channel: sent through a :class:`~pd_middleware.transport.PrefillSender`.

**Each request's draws are a function of (``seed``, room, rid, position) alone**
(:func:`~pd_middleware.sampling.draws.request_uniforms`: counter-based uniforms, not one
per-process generator; the position is the request's ``seq_len`` at the draw,
:func:`draw_position`, which a rebootstrap after SGLang's retract-mode pause changes, so
a request's lives never share a uniform), so every prefill TP rank that writes a request's row (several
do under MHA TP) draws the same X, given identical draft distributions, whatever the
batch around it. The batch is encoded in one call where the draft rows live; nothing
V-wide reaches the host unless the encoder ships V-wide rows (``full``). That is not
taken on trust: :func:`publish_batch` agrees, per batch, across the ranks
(:func:`~.agreement.agree`) on whether each rank encoded each request and which X it
drew, and publishes a request only when all agree. **The caller must hand the decode
the encoder's X** (``tokens``) and q'(X) (``token_probs``) instead of its own draw: the
shipped proposal is exact only for the X that was drawn from it. The decode checks it
and falls back to one-hot when the tokens differ.

The feature ``prefill`` of the table (declared at the end of this module) is the AROUND
wrapper of SGLang's
``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill``: before
SGLang's method it runs :func:`publish_batch`, after ``copy_done``. That method copies
``next_draft_input.topk_p/topk_index`` into ``req.output_topk_p`` /
``req.output_topk_index`` for finished requests, right before ``send_kv_chunk`` writes
them into the PD metadata buffers, so overwriting ``topk_index[:, 0]`` / ``topk_p[:, 0]``
with the encoder's draw makes SGLang's own metadata carry it.

Multi-layer EAGLE is published when the chain patches are active (:mod:`.chain` draws
each step inside SGLang's draft loop, so step k+1 is conditioned on the encoded X_k).
Without them SGLang's own chain stands and is sent X only (counted
``skipped:multi_layer``; the decode answers one-hot, exact).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core._errors import ConfigError, PDMiddlewareError
from ...core.contracts import EncodedBatch
from ...core.events import Events
from ...core.payload import Payload, Provenance
from ...sampling.draws import encode_requests, takes_uniforms
from .agreement import NEUTRAL, Verdict, agree, group_of
from .common import LOCAL_PROVENANCE, is_probe, life_of, room_key
from .patching import PREFILL_MODULE, Feature, Hook, Target, register_feature

logger = logging.getLogger("pd_middleware.integrations.sglang")

#: Draft-input attribute the multi-layer chain leaves its finished payloads under
#: (one per batch row; :mod:`.chain`).
PAYLOADS_ATTR = "pd_middleware_payloads"


class ProposalPublisher:
    """Prefill side: encode draft distributions per request and hand each payload to a sink.

    ``encoder``: a :class:`~pd_middleware.ProposalEncoder`; ``sender``: a connected
    :class:`~pd_middleware.transport.PrefillSender`, or a zero-argument callable
    returning one (connected lazily on first publish, so a prefill may start before its
    decode), or None with ``stage`` given; ``stage(req_or_room, payload)``: the
    metadata channel's sink (the wrapper passes SGLang's Req); ``vocab_size``: V;
    ``seed``: mixed with each request's room, rid and position into its uniforms
    (:mod:`pd_middleware.sampling.draws`).
    """

    def __init__(
        self,
        encoder: Any,
        sender: Any = None,
        *,
        vocab_size: int,
        seed: int = 0,
        stage: Callable[[Any, Payload | None], None] | None = None,
        num_steps: int = 1,
    ) -> None:
        if (sender is None) == (stage is None):
            raise ValueError("give exactly one of sender (side channel) and stage (metadata channel)")
        self.encoder = encoder
        self._sender = sender
        self.stage = stage
        self.vocab_size = vocab_size
        self.num_steps = num_steps
        self.seed = seed
        self.events = Events("prefill", logger=logger)
        self.counts: Counter[str] = self.events.counts
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

        from ...config import Config, load_config
        from ...middleware import build_encoders

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
            enc,
            sender,
            vocab_size=cfg.model.vocab_size,
            seed=cfg.sglang.seed if seed is None else seed,
            stage=stage,
            num_steps=cfg.model.num_steps,
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
        positions: Sequence[int | None] | None = None,
        greedy: Sequence[bool] | None = None,
    ) -> tuple[EncodedBatch, list[Payload]]:
        """Encode one batch; each request's draws come from (seed, room, salt, position) alone
        (salt: SGLang's rid; position: its ``seq_len`` at the draw).

        ``rooms``: B bootstrap rooms (ints) or request ids; ``draft_probs``: float
        (B, V) or (B, S, V) draft probabilities after temperature, any device;
        ``temperature``: one value or B values (recorded in each provenance);
        ``salts``: B per-request strings mixed into the seed (SGLang's ``rid``);
        ``positions``: B draw positions (:func:`draw_position`; None, or a None entry:
        left out of the key), so a rebootstrapped request draws from a fresh uniform;
        ``greedy``: B flags (None: none), the requests proposed as SGLang proposes a greedy
        one (:func:`greedy_rows`): X = argmax q, sent X only with a greedy provenance, so the
        decode verifies the one-hot at X, the only exact proposal for an argmax.

        The encoder runs where ``draft_probs`` lives, once per distinct temperature, with
        the batch's uniforms (:func:`~pd_middleware.sampling.draws.request_uniforms`); nothing
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
        if positions is not None and len(positions) != b:
            raise ValueError(f"{len(positions)} positions for {b} rows of draft_probs")
        if greedy is not None and len(greedy) != b:
            raise ValueError(f"{len(greedy)} greedy flags for {b} rows of draft_probs")
        temps = _temperatures(temperature, b)
        argmax = [i for i in range(b) if greedy is not None and greedy[i]]
        if argmax:
            tokens, token_probs, proposals, provenances = self._encode_greedy(
                argmax, rooms, probs, temps, salts, positions
            )
        else:
            tokens, token_probs, proposals, provenances = self.encode_rows(rooms, probs, temps, salts, positions)
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
                # The life the decode binds it to: the draw's position (None: unkeyed).
                life=None if positions is None else positions[i],
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
        self,
        rooms: Sequence[Any],
        probs: torch.Tensor,
        temps: Sequence[float],
        salts: Sequence[str] | None,
        positions: Sequence[int | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[Any], list[Any]]:
        """The encoder's draws for B rows (:func:`~pd_middleware.sampling.draws.encode_requests`):
        X and q'(X) stay where the encoder left them, so the multi-layer chain feeds X to
        the next step without a host copy."""
        return encode_requests(
            self.encoder, self.seed, rooms, probs, temps, salts, batched=self._takes_uniforms(), positions=positions
        )

    def _encode_greedy(
        self,
        argmax: list[int],
        rooms: Sequence[Any],
        probs: torch.Tensor,
        temps: Sequence[float],
        salts: Sequence[str] | None,
        positions: Sequence[int | None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[Any], list[Any]]:
        """:meth:`encode_rows` where rows ``argmax`` are greedy: each of those gets X = argmax of
        each step's row, q'(X) = 1 (X's law is a point mass, the one-hot the decode verifies), no
        proposal and a greedy provenance; the other rows are encoded as they would be in any
        batch (their draws are keyed on the request, never on its row)."""
        b = probs.shape[0]
        steps = probs.shape[1] if probs.dim() == 3 else 1
        tokens = torch.empty((b, steps), dtype=torch.int64, device=probs.device)
        token_probs = torch.ones((b, steps), dtype=torch.float32, device=probs.device)
        proposals: list[Any] = [None] * b
        provenances: list[Any] = [Provenance(rule="greedy", temperature=temps[i]) for i in range(b)]
        rows = torch.tensor(argmax, device=probs.device)
        tokens[rows] = probs.index_select(0, rows).reshape(len(argmax), steps, -1).argmax(-1)
        greedy = set(argmax)
        drawn = [i for i in range(b) if i not in greedy]
        if drawn:
            sub = torch.tensor(drawn, device=probs.device)
            t, p, props, provs = self.encode_rows(
                [rooms[i] for i in drawn],
                probs.index_select(0, sub),
                [temps[i] for i in drawn],
                None if salts is None else [salts[i] for i in drawn],
                None if positions is None else [positions[i] for i in drawn],
            )
            tokens[sub] = t.to(probs.device, torch.int64)
            token_probs[sub] = p.to(probs.device, torch.float32)
            for j, i in enumerate(drawn):
                proposals[i], provenances[i] = props[j], provs[j]
        self.events.count("greedy", len(argmax))
        return tokens, token_probs, proposals, provenances

    def deliver(self, targets: Sequence[Any], payloads: Sequence[Payload]) -> None:
        """Hand already-encoded payloads to the sink (``targets``: what ``stage`` receives)."""
        with self._lock:
            if self.stage is not None:
                for target, payload in zip(targets, payloads):
                    self.stage(target, payload)
                # SGLang's warmups and health checks are staged like any request (their
                # row is harmless) but counted apart, as the decode does.
                probes = sum(1 for t in targets[: len(payloads)] if is_probe(t))
                self.events.count("staged", len(payloads) - probes)
                self.events.count("probe", probes)
                return
            sender = self.sender
            if sender is None:
                self._note("send_failed:not_connected", len(payloads), "the side channel is not connected yet")
                return
            for payload in payloads:
                try:
                    sender.send(payload)
                    self.events.count("published")
                except PDMiddlewareError as exc:
                    self._note(f"send_failed:{type(exc).__name__}", 1, f"request {payload.request_id}: {exc}")

    def _note(self, key: str, n: int, detail: str) -> None:
        self.events.count(key, n, log=lambda: f"publishing failed ({detail}); the decode will use one-hot")

    def publish(
        self,
        rooms: Sequence[Any],
        draft_probs: torch.Tensor,
        temperature: float | Sequence[float] | torch.Tensor = 1.0,
        targets: Sequence[Any] | None = None,
        positions: Sequence[int | None] | None = None,
        greedy: Sequence[bool] | None = None,
    ) -> EncodedBatch:
        """Encode one batch (:meth:`encode`) and hand each payload to the sink; returns the batch.

        ``targets``: what ``stage`` receives per request (SGLang's Reqs; default the
        rooms); each Req's rid and position key its draws (``positions``, default
        :func:`draw_position` of each target); ``greedy``: as for :meth:`encode`. A request
        whose send fails is counted (``send_failed:<error>``) and logged once per error;
        the decode then falls back to one-hot for it.
        """
        salts = None
        if targets is not None:
            salts, keyed = draw_keys(targets)
            positions = keyed if positions is None else positions
        enc, payloads = self.encode(rooms, draft_probs, temperature, salts, positions, greedy)
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


class DrawPositionError(PDMiddlewareError):
    """A Req (it has a ``bootstrap_room``) without ``origin_input_ids`` / ``output_ids``:
    its draw cannot be keyed on its position (another SGLang renamed them). Raised, never
    keyed without the position: that would reuse a rebootstrapped request's uniform."""


def draw_position(req: Any) -> int | None:
    """The position a request's draw is keyed on: its ``seq_len`` at the draw, the tokens the
    prefill ran (``len(origin_input_ids) + len(output_ids)``).

    The same on every rank (each holds the same Req), and it is what differs between a
    request's lives: SGLang's rebootstrap after a retract-mode pause sends the prompt plus
    the output so far as the new prompt, with the same rid and room.

    A Req (a target with a ``bootstrap_room``) that lacks either field raises
    :class:`DrawPositionError`: in the prefill wrapper that is this rank's "not ok" vote
    (the batch goes X-only, counted ``guard:prefill_encode:DrawPositionError``), in the
    chain SGLang's own chain (``guard:chain:DrawPositionError``). None (the draw keyed on
    (seed, room, rid) alone) only for a target that is no Req: a room or a stand-in
    without a room, as a benchmark or a harness passes.
    """
    position = life_of(req)  # the one formula, shared with the decode's life of a request
    if position is None and getattr(req, "bootstrap_room", None) is not None:
        missing = [n for n in ("origin_input_ids", "output_ids") if getattr(req, n, None) is None]
        raise DrawPositionError(
            f"request {getattr(req, 'rid', '?')} has no {' / '.join(missing)}: its draw cannot be keyed on "
            "its position (this SGLang names the Req's fields otherwise); sent X only"
        )
    return position


def draw_keys(reqs: Sequence[Any]) -> tuple[list[str], list[int | None]]:
    """Per request: (salt, position) of its draw key, the rid and :func:`draw_position`
    (raises :class:`DrawPositionError` as it does). The one place every caller (the
    prefill's encoder, its chain, the harness) builds a Req's key."""
    return [str(getattr(r, "rid", "")) for r in reqs], [draw_position(r) for r in reqs]


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


def _encode_rows(
    publisher: ProposalPublisher, batch: Any, draft_input: Any, q: torch.Tensor, rows: list[int], steps: int
) -> tuple[torch.Tensor, torch.Tensor, list[Payload | None]]:
    """This rank's (X (r, S), q'(X) (r, S), payloads) for ``rows``; payloads[i] None: X only."""
    reqs = [batch.reqs[i] for i in rows]
    if steps > 1:
        chained = getattr(draft_input, PAYLOADS_ATTR, None)
        if chained is None or len(chained) != len(batch.reqs):
            # No chain drawn by the drop-in (its patches off, a padded batch, a failed
            # step): SGLang's own chain stands, sent X only.
            publisher.events.count("skipped:multi_layer")
            chained = [None] * len(batch.reqs)
        got = [chained[i] for i in rows]
        x = draft_input.topk_index[rows, :steps].detach().to("cpu", torch.int64)
        p = draft_input.topk_p[rows, :steps].detach().to("cpu", torch.float32)
        publisher.events.count("chain:published", sum(g is not None for g in got))
        return x, p, list(got)
    q2 = q.reshape(q.shape[0], -1)[rows]
    info = getattr(batch, "sampling_info", None)
    temps = getattr(info, "temperatures", None)
    temperature: Any = temps.reshape(-1)[rows] if isinstance(temps, torch.Tensor) else 1.0
    salts, positions = draw_keys(reqs)
    greedy = greedy_rows(info, rows)
    enc, payloads = publisher.encode([r.bootstrap_room for r in reqs], q2, temperature, salts, positions, greedy)
    return enc.tokens.to(torch.int64), enc.token_probs, list(payloads)


def greedy_rows(sampling_info: Any, rows: list[int]) -> list[bool] | None:
    """Per row of ``rows``: whether SGLang proposes that request's first draft token greedily,
    its ``top_k <= 1`` (SamplingParams rewrites temperature 0 to temperature 1 with top-k 1;
    SGLang's ``sample_draft_proposal`` proposes such a row's argmax since 0.5.21). None where
    the batch carries no per-request ``top_ks`` (every row then drawn from its law).

    Such a row's X is the argmax, so the only exact proposal for it is the one-hot at X
    (``docs/strategies.md``: an argmax X verified against the softmax q is biased); sent X
    only with a greedy provenance, the decode verifies that one-hot. The verify renormalises
    a top-k 1 request's target to its argmax, so X is accepted exactly when it is the
    target's argmax, as in aggregated serving, instead of with probability q(X)."""
    top_ks = getattr(sampling_info, "top_ks", None)
    if not isinstance(top_ks, torch.Tensor):
        return None
    flags: list[bool] = (top_ks.reshape(-1)[rows] <= 1).tolist()
    return flags


@dataclass
class _Batch:
    """One prefill batch as this rank sees it (filled in by :func:`_votes`)."""

    rows: list[int] = field(default_factory=list)  # finishing requests with a room
    own: torch.Tensor | None = None  # SGLang's own X of those rows (r, S), on the host
    local: tuple[torch.Tensor, torch.Tensor, list[Payload | None]] | None = None
    encode_error: BaseException | None = None
    draft_input: Any = None


def publish_batch(publisher: ProposalPublisher, batch: Any, result: Any, *, group: Any, events: Events) -> None:
    """Encode one prefill batch's finishing requests and give SGLang the encoder's X; never raises.

    ``result``: SGLang's batch result (``copy_done``, ``next_draft_input`` with
    ``draft_probs``, ``topk_index``, ``topk_p``); ``group``: the CPU group of the ranks
    that run this batch (SGLang's attention TP), or None for one rank; ``events``: counts
    our failures (the installation's guard part).

    Every rank that runs the batch must hand the decode the same X for a request (under
    TP, the sharded target forward embeds each rank's own X). So, per batch with any
    request in it (the same on every rank), every rank, always:

    1. waits for ``copy_done``, clears what an earlier batch staged on these requests,
       reads SGLang's own X and encodes the finishing requests (each request's draws from
       (seed, room, rid, position) alone); **any failure here is this rank's "not ok" vote**;
    2. takes part in the one agreement all-reduce (:func:`~.agreement.agree`) of
       [encoded OK, X] per request;
    3. a request whose ranks all encoded, and all drew the same X, gets it: ``topk_index``
       / ``topk_p`` are overwritten and its payload is staged or sent. Any other request
       keeps SGLang's own X, sent without a distribution (the decode answers one-hot),
       counted ``agreement:<why>`` (``local_failed``, ``peer_failed``, ``x_differs``,
       ``agreement_failed``) and logged once.
    """
    n = len(batch.reqs)
    if n == 0:
        return
    steps = publisher.num_steps
    seen = _Batch()
    verdict = agree(n, steps, lambda: _votes(publisher, batch, result, steps, seen), group)
    if verdict.error is not None:
        events.failed("prefill", verdict.error, "SGLang's own X (the decode answers one-hot)")
    if seen.encode_error is not None:
        events.failed("prefill_encode", seen.encode_error, "SGLang's own X (the decode answers one-hot)")
    if verdict.failed is not None:
        events.failed("prefill_agreement", verdict.failed, "SGLang's own X (the decode answers one-hot)")
    if not seen.rows or seen.own is None:
        return
    try:
        _finish(publisher, batch, seen, _reasons(seen, verdict))
    except Exception as exc:
        events.failed("prefill_publish", exc, "SGLang's own X (the decode answers one-hot)")


def _votes(
    publisher: ProposalPublisher, batch: Any, result: Any, steps: int, seen: _Batch
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's votes over every request of the batch: (ok (n,), X (n, S))."""
    n = len(batch.reqs)
    ok = torch.zeros(n, dtype=torch.bool)
    x = torch.full((n, steps), NEUTRAL, dtype=torch.int64)
    # SGLang's own first step: the forward's results are on the host only after it.
    copy_done = getattr(result, "copy_done", None)
    if copy_done is not None:
        copy_done.synchronize()
    # Nothing staged by an earlier batch may be written next to this batch's X.
    unstage(publisher, batch)
    draft_input = getattr(result, "next_draft_input", None)
    q = getattr(draft_input, "draft_probs", None)
    rows = [
        i for i, req in enumerate(batch.reqs) if _finishing(req) and getattr(req, "bootstrap_room", None) is not None
    ]
    if q is None or draft_input is None or not rows:
        return ok, x
    seen.draft_input = draft_input
    seen.own = draft_input.topk_index[rows].detach().to("cpu", torch.int64)[:, :steps]
    seen.rows = rows
    try:
        seen.local = _encode_rows(publisher, batch, draft_input, q, rows, steps)
    except Exception as exc:  # encoding failed here: this rank votes "not ok" with SGLang's X
        seen.encode_error = exc
        x[rows] = seen.own
        return ok, x
    tokens, _, payloads = seen.local
    x[rows] = tokens.reshape(len(rows), steps).to("cpu", torch.int64)
    ok[rows] = torch.tensor([p is not None for p in payloads], dtype=torch.bool)
    return ok, x


def _reasons(seen: _Batch, verdict: Verdict) -> list[str]:
    """Per finishing row, why it is not published ("" when every rank encoded it with one X)."""
    idx = torch.tensor(seen.rows)
    ok, same = verdict.ok[idx].tolist(), verdict.same[idx].tolist()
    out = []
    for j in range(len(seen.rows)):
        if verdict.failed is not None:
            out.append("agreement_failed")
        elif seen.local is None:
            out.append("local_failed")
        elif seen.local[2][j] is None:
            out.append("x_only")
        elif not ok[j]:
            out.append("peer_failed")
        else:
            out.append("" if same[j] else "x_differs")
    return out


def _finish(publisher: ProposalPublisher, batch: Any, seen: _Batch, why: list[str]) -> None:
    rows, own, draft_input = seen.rows, seen.own, seen.draft_input
    assert own is not None
    reqs = [batch.reqs[i] for i in rows]
    pub = [j for j, w in enumerate(why) if not w]
    if seen.local is not None and pub:
        tokens, probs, payloads = seen.local
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
        k = sum(why[j] == reason for j in bare)
        publisher.events.count(
            f"agreement:{reason}",
            k,
            log=(
                f"pd-middleware prefill ranks did not all publish the same X for {k} request(s) "
                f"(agreement:{reason}): every rank keeps SGLang's own X and the decode answers one-hot"
            ),
            level=logging.ERROR,
        )
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
                life=life_of(reqs[j]),
            )
            for k, j in enumerate(bare)
        ],
    )


# --------------------------------------------------------------------- the feature


def wrap_prefill_result(original: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def process_batch_result_disagg_prefill(self: Any, batch: Any, result: Any) -> Any:
        publisher = inst.publisher
        if publisher is not None:
            # Never raises: a failure on this rank is its vote in the agreement, and SGLang's X stands.
            group = group_of(getattr(self, "attn_tp_cpu_group", None), inst.rank_agreement)
            publish_batch(publisher, batch, result, group=group, events=inst.events)
        return original(self, batch, result)

    return process_batch_result_disagg_prefill


register_feature(
    Feature(
        "prefill",
        (
            Target(
                PREFILL_MODULE,
                "SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill",
                ("self", "batch", "result"),
                Hook.AROUND,
                wrap_prefill_result,
            ),
        ),
        lambda plan: "prefill" in plan.features,
        summary="the prefill's batch result: each finishing request encoded, agreed across ranks",
    )
)
