"""SGLang decode side: the proposal of a PD decode's first verify, built by the middleware.

Engine-agnostic apart from the attribute names it reads from SGLang's
``ScheduleBatch``/``Req``:

- :class:`RequestProposal`: what the decode attached to a request (``req.pd_middleware``):
  its arm, the proposal handed to the verifier and why (``reason``). Attached when the
  request's PD transfer commits (metadata channel), read when SGLang builds the first
  draft input, and left on the request for per-arm accounting.
- :class:`ProposalStore`: the side channel's outcomes by request id (the prefill's
  ``bootstrap_room`` as a decimal string), drained from a
  :class:`~pd_middleware.transport.DecodeReceiver` on the scheduler thread.
- :class:`DecodeProposer`: given SGLang's batch and the received draft tokens
  ``topk_index`` (b, n), returns ``draft_probs`` (b, n, V) float32 on
  ``topk_index.device``, the layout of SGLang's ``pd_first_draft_proposal``. It serves
  whatever (V, n) SGLang hands it: one middleware per shape, built on first use from
  the config with the shape filled in (:meth:`ModelConfig.with_shapes
  <pd_middleware.config.ModelConfig.with_shapes>`, which refuses a config that
  declares another value).

Per request, the proposal is the one the configured synthesizer attached to the
payload the prefill sent, when one arrived and its draft tokens are exactly the tokens
SGLang received. Otherwise the request is run through the same pipeline as a local
payload built from SGLang's own fields, which ships no distribution, so every
synthesizer answers one-hot (exact for any drafting rule). Each such case is counted
in ``counts`` and in ``Metrics.fallbacks`` (``sglang:<reason>``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from .._errors import ConfigError
from ..inband import RowFault
from ..metrics import Metrics
from ..payload import Payload, Provenance
from ..pipeline import Delivery, Failure
from ..proposal import OneHotProposal

logger = logging.getLogger("pd_middleware.integrations.sglang")

# Provenance of a payload built on the decode from SGLang's fields: SGLang's prefill
# draws X ~ q under rejection sampling and does not send q, so nothing but one-hot
# is exact for it (the synthesizers' provenance guard enforces that).
LOCAL_PROVENANCE = Provenance(rule="sampled", temperature=1.0, sampled_from=None)

#: Neutral element of the X canary's MIN (a rank with no X for a request).
_NEUTRAL = torch.iinfo(torch.int64).max

#: Req attribute holding the :class:`RequestProposal`.
ATTACH_ATTR = "pd_middleware"

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


@dataclass(slots=True)
class RequestProposal:
    """What the decode attached to one request (``req.pd_middleware``).

    ``tokens``: the S draft tokens the proposal is for; ``proposal``: the descriptor
    handed to the assembler (set to None once the first draft input is built, so a
    dense row does not live as long as the request); ``arm``: the A/B arm the pipeline
    routed it to (``default`` without A/B; None when even the local payload failed);
    ``reason``: ``prefill`` when the prefill's proposal is used; ``no_distribution``
    when the prefill's row carried X only (one-hot); ``local`` when no row or payload
    was involved; else the fallback reason (``not_sent``, ``overflow``, ``digest``,
    ``token_mismatch``, ``failed:<stage>``...); ``used``: the first draft input was
    built from it.
    """

    tokens: tuple[int, ...]
    proposal: Any
    arm: str | None
    reason: str
    used: bool = False


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


class ProposalStore:
    """Received outcomes by request id, fed by an optional receiver.

    ``receiver``: anything with ``drain() -> list[Delivery | Failure]`` (a started
    :class:`~pd_middleware.transport.DecodeReceiver`), or None to feed it with
    :meth:`put` only. ``capacity``: most outcomes kept; ``ttl_s``: an outcome older
    than this (by ``clock``, the receiver's ``time.perf_counter`` stamps) is dropped,
    so a request aborted between prefill and decode does not hold a receive slot.
    ``max_bytes``: most bytes the kept Deliveries may hold (hidden states and proposal
    tensors); a Delivery past it is released and kept as a ``store:bytes`` Failure
    instead (counted in ``refused["bytes"]``), so its request falls back with a reason.
    The receiver's own ``max_queued_inline_bytes`` counts until release as well, so a
    store fed by a receiver also holds the receiver back.
    """

    def __init__(
        self,
        receiver: Any = None,
        *,
        capacity: int = 65536,
        ttl_s: float = 300.0,
        max_bytes: int = 1 << 30,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if capacity < 1 or ttl_s <= 0 or max_bytes < 1:
            raise ValueError("capacity and max_bytes must be >= 1 and ttl_s > 0")
        self.receiver = receiver
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0  # held by the kept Deliveries (under _lock)
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, Delivery | Failure]] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted: Counter[str] = Counter()
        # Outcomes put() would not keep: failure_over_delivery, other_peer, bytes.
        self.refused: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, outcome: Delivery | Failure) -> None:
        """Keep one outcome under its request id.

        A newer outcome replaces (and releases) an older one, except that a Failure never
        replaces a Delivery, and an outcome from another peer never replaces one: those
        are refused (counted in ``refused`` by reason; a refused Delivery is released),
        so one peer's message can neither evict nor impersonate another's request.
        """
        rid = outcome.request_id
        if rid is None:  # a wire failure that could not name its request: nothing to key
            return
        stamp = outcome.received_at if isinstance(outcome, Delivery) else self._clock()
        refused = ""
        over_budget: Delivery | None = None
        with self._lock:
            old = self._items.get(rid)
            if old is not None:
                refused = _refusal(old[1], outcome)
            if not refused:
                if isinstance(outcome, Delivery):
                    size = _held_bytes(outcome)
                    freed = _held_bytes(old[1]) if old is not None else 0
                    if self.bytes - freed + size > self.max_bytes:
                        over_budget = outcome
                        outcome = Failure(
                            rid,
                            "store",
                            f"ProposalStore holds {self.bytes} of max_bytes={self.max_bytes}: "
                            f"a delivery of {size} bytes would pass it",
                            field="bytes",
                            peer=outcome.peer,
                        )
                self._items.pop(rid, None)
                if old is not None:
                    self.bytes -= _held_bytes(old[1])
                self._items[rid] = (stamp, outcome)
                self.bytes += _held_bytes(outcome)
            over = len(self._items) - self.capacity
            dropped = [self._pop_oldest() for _ in range(max(0, over))]
        if over_budget is not None:
            over_budget.release()
            self.refused["bytes"] += 1
        if refused:
            _release(outcome)
            self.refused[refused] += 1
        elif old is not None:
            _release(old[1])
            self.evicted["replaced"] += 1
        for o in dropped:
            _release(o)
            self.evicted["capacity"] += 1

    def pump(self) -> int:
        """Move everything the receiver holds now into the store; returns how many."""
        if self.receiver is None:
            return 0
        got = self.receiver.drain()
        for o in got:
            self.put(o)
        self._expire()
        return len(got)

    def take(self, request_id: str | None) -> Delivery | Failure | None:
        """Remove and return the outcome of ``request_id``, or None if none arrived."""
        if request_id is None:
            return None
        with self._lock:
            item = self._items.pop(request_id, None)
            if item is not None:
                self.bytes -= _held_bytes(item[1])
        return None if item is None else item[1]

    def _pop_oldest(self) -> Delivery | Failure:
        o = self._items.popitem(last=False)[1][1]
        self.bytes -= _held_bytes(o)
        return o

    def clear(self) -> None:
        """Drop (and release) everything."""
        with self._lock:
            items = list(self._items.values())
            self._items.clear()
            self.bytes = 0
        for _, o in items:
            _release(o)

    def _expire(self) -> None:
        limit = self._clock() - self.ttl_s
        dropped = []
        with self._lock:
            while self._items:
                rid, (stamp, o) = next(iter(self._items.items()))
                if stamp >= limit:
                    break
                del self._items[rid]
                self.bytes -= _held_bytes(o)
                dropped.append(o)
        for o in dropped:
            _release(o)
            self.evicted["ttl"] += 1


def _refusal(old: Delivery | Failure, new: Delivery | Failure) -> str:
    """Why ``new`` may not replace ``old`` under the same request id ("" when it may)."""
    if isinstance(old, Delivery) and not isinstance(new, Delivery):
        return "failure_over_delivery"
    if old.peer is not None and new.peer != old.peer:
        return "other_peer"
    return ""


def _held_bytes(outcome: Delivery | Failure) -> int:
    """Bytes a kept outcome holds: a Delivery's hidden state and proposal tensors."""
    if not isinstance(outcome, Delivery):
        return 0
    hidden = outcome.payload.hidden
    n = hidden.nbytes if isinstance(hidden, memoryview) else len(hidden)
    p = outcome.proposal
    for name in ("indices", "values", "probs", "scale"):
        t = getattr(p, name, None)
        if isinstance(t, torch.Tensor):
            n += t.nelement() * t.element_size()
    return n


def _release(outcome: Delivery | Failure) -> None:
    if isinstance(outcome, Delivery):
        outcome.release()


class DecodeProposer:
    """Builds SGLang's first-verify ``draft_probs`` through the middleware.

    ``config``: the :class:`~pd_middleware.config.Config` (shape keys optional);
    ``store``: the side channel's :class:`ProposalStore`, or None; ``registry``,
    ``metrics``: shared by the middleware of every shape.
    """

    def __init__(
        self, config: Any, store: ProposalStore | None = None, *, registry: Any = None, metrics: Metrics | None = None
    ) -> None:
        self.config = config
        self.store = store
        self.registry = registry
        self.metrics = metrics if metrics is not None else Metrics()
        self.counts: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._by_shape: dict[tuple[int, int], Any] = {}
        self._assemblers: dict[tuple[int, str], Any] = {}
        self.bound: tuple[int, int] | None = None
        # Metric exporters shared by every shape's middleware (the [metrics] endpoint,
        # the live A/B recorder and SGLang /metrics mirror): stopped by close().
        self.exporters: list[Any] = []

    def middleware_for(self, vocab_size: int, num_steps: int) -> Any:
        """The :class:`~pd_middleware.DecodeMiddleware` for (V, S), built once.

        Raises ConfigError naming both values when the config declares another V or S,
        or turns rejection sampling off (SGLang builds a proposal only with it on).
        """
        key = (int(vocab_size), int(num_steps))
        mw = self._by_shape.get(key)
        if mw is None:
            import msgspec

            from ..middleware import DecodeMiddleware

            if not self.config.decode.rejection_sampling:
                raise ConfigError(
                    "SGLang runs with --speculative-use-rejection-sampling but the config turns it off",
                    path="decode.rejection_sampling",
                )
            model = self.config.model.with_shapes(key[0], key[1], engine="SGLang")
            cfg = msgspec.structs.replace(self.config, model=model)
            mw = DecodeMiddleware.from_config(cfg, self.registry, self.metrics, serve_metrics=False)
            self._by_shape[key] = mw
        return mw

    def bind(self, vocab_size: int, num_steps: int) -> Any:
        """Build (at scheduler start) the middleware of the engine's shape; it becomes :attr:`middleware`."""
        mw = self.middleware_for(vocab_size, num_steps)
        self.bound = (int(vocab_size), int(num_steps))
        return mw

    @property
    def middleware(self) -> Any:
        """The bound shape's middleware (else the config's declared or default shape)."""
        if self.bound is not None:
            return self._by_shape[self.bound]
        m = self.config.model
        return self.middleware_for(m.vocab_size, m.num_steps)

    def close(self) -> None:
        """Stop the exporters and close every shape's middleware (plugins' resources)."""
        exporters, self.exporters = self.exporters, []
        for e in exporters:
            e.stop()
        for mw in self._by_shape.values():
            mw.close()

    def _count(self, reason: str) -> None:
        self.counts[f"fallback:{reason}"] += 1
        self.metrics.fallbacks[f"sglang:{reason}"] += 1

    def report(self, reason: str, message: str) -> None:
        """Count ``fallback:<reason>`` and log ``message`` once per reason (an operator's line)."""
        self._count(reason)
        if reason not in self._logged:
            self._logged.add(reason)
            logger.error("%s (logged once; counted as fallback:%s)", message, reason)

    # -- every decode rank: the X canary at transfer commit ----------------------------
    def agree(self, req: Any, group: Any, guard: Any = None) -> tuple[int, ...] | None:
        """Compare this request's X across the ranks of ``group`` (SGLang's attention-TP CPU
        group); a collective, so every rank calls it for every committed request.

        Returns None when the ranks agree (or ``group`` is None). Otherwise every rank
        adopts the smallest X seen, writes it into ``req.output_topk_index`` (what SGLang
        verifies), attaches a one-hot proposal for it (exact: a one-hot proposal is exact
        for any X chosen before the verify), counts ``fallback:rank_mismatch``, logs once,
        and returns that X.
        """
        if group is None:
            return None
        n = self.bound[1] if self.bound is not None else 1
        mine = torch.full((2 * n,), _NEUTRAL, dtype=torch.int64)
        try:
            if getattr(req, "finished_reason", None) is None:
                x = torch.tensor(_tokens(req, n), dtype=torch.int64)
                if x.numel() == n:
                    mine = torch.cat([x, -x])
        except Exception:  # no readable X on this rank: it takes part without a say
            pass
        try:
            import torch.distributed as dist

            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
        except Exception as exc:
            if guard is not None:
                guard.failed("x_canary", exc, "no cross-rank check for this request")
            return None
        lo, hi = mine[:n], -mine[n:]
        if bool((lo == _NEUTRAL).any()) or bool((lo == hi).all()):
            return None  # agreed (or no rank had an X)
        agreed = tuple(int(t) for t in lo.tolist())
        try:
            row = req.output_topk_index
            row[:n] = torch.tensor(agreed, dtype=row.dtype)
            setattr(req, ATTACH_ATTR, RequestProposal(agreed, OneHotProposal(agreed), None, "rank_mismatch"))
        except Exception as exc:
            if guard is not None:
                guard.failed("x_canary", exc, "this rank's own X")
            return None
        self.report(
            "rank_mismatch",
            f"pd-middleware: decode ranks received different X for request room={getattr(req, 'bootstrap_room', None)} "
            f"(smallest {list(agreed)}, largest {hi.tolist()}); every rank verifies the smallest with a one-hot proposal",
        )
        return agreed

    # -- metadata channel: at transfer commit -----------------------------------------
    def on_row(self, req: Any, got: Payload | RowFault) -> None:
        """Attach ``req.pd_middleware`` from the request's in-band row (decode, every rank)."""
        if self.bound is None:
            raise ConfigError("the decode's shapes were not bound at scheduler start", path="model")
        vocab, n = self.bound
        mw = self._by_shape[self.bound]
        tokens = _tokens(req, n)
        if is_probe(req):
            # SGLang's warmup or health check: exact one-hot, kept out of every counter.
            self.counts["probe"] += 1
            setattr(req, ATTACH_ATTR, RequestProposal(tokens, OneHotProposal(tokens), None, "probe"))
            return
        if isinstance(got, RowFault):
            reason = got.reason
        elif got.draft_tokens != tokens:
            # The row's X is not what SGLang will verify: its q says nothing about it.
            reason = "token_mismatch"
        else:
            out = mw.receive(got)
            if isinstance(out, Delivery) and out.proposal is not None:
                # A row without a distribution (SGLang's own multi-layer chain) is X only.
                why = "prefill" if got.proposal is not None else "no_distribution"
                self.counts[f"attached:{why}"] += 1
                setattr(req, ATTACH_ATTR, RequestProposal(tokens, out.proposal, out.arm, why))
                return
            reason = f"failed:{out.key}" if isinstance(out, Failure) else "failed:none"
        self._count(reason)
        proposal, arm = self._local(mw, req, room_key(getattr(req, "bootstrap_room", None)), tokens, vocab)
        setattr(req, ATTACH_ATTR, RequestProposal(tokens, proposal, arm, reason))

    # -- the builder ------------------------------------------------------------------
    def propose(self, batch: Any, topk_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``draft_probs`` for ``batch``: float32 (b, n, V) on ``topk_index.device``.

        ``topk_index``: int64 (b, n), the draft tokens SGLang received (n = 1 single
        layer, ``num_steps`` multi-layer). Raises ConfigError when the config declares
        another V or n, or turns rejection sampling off.
        """
        b, n = int(topk_index.shape[0]), int(topk_index.shape[1])
        mw = self.middleware_for(vocab_size, n)
        reqs = batch.reqs
        if len(reqs) != b:
            raise ValueError(f"batch has {len(reqs)} requests but topk_index has {b} rows")
        if self.store is not None:
            self.store.pump()
        proposals: list[Any] = []
        used: list[Delivery] = []
        for req in reqs:
            proposal, delivery = self._one(mw, req, n, vocab_size)
            proposals.append(proposal)
            if delivery is not None:
                used.append(delivery)
        self.counts["batches"] += 1
        self.counts["requests"] += b
        try:
            return self._assemble(mw, proposals, n, vocab_size, topk_index.device)
        finally:
            # The assembler copied every value; the receive slots may be reused now.
            for d in used:
                d.release()

    def _one(self, mw: Any, req: Any, n: int, vocab: int) -> tuple[Any, Delivery | None]:
        tokens = _tokens(req, n)
        att = getattr(req, ATTACH_ATTR, None)
        if is_probe(req):
            if not isinstance(att, RequestProposal):
                self.counts["probe"] += 1
                setattr(req, ATTACH_ATTR, RequestProposal(tokens, None, None, "probe", True))
            else:
                att.proposal, att.used = None, True
            return OneHotProposal(tokens), None
        if isinstance(att, RequestProposal) and att.proposal is not None and att.tokens == tokens:
            # A fallback row's one-hot was counted as proposal:local by _local in on_row:
            # each request is counted once.
            if att.reason == "prefill":
                self.counts["proposal:prefill"] += 1
            elif att.reason == "no_distribution":
                self.counts["proposal:local"] += 1
            proposal = att.proposal
            att.proposal, att.used = None, True
            return proposal, None
        rid = room_key(getattr(req, "bootstrap_room", None))
        if isinstance(att, RequestProposal) and att.proposal is not None:
            self._count("token_mismatch")
        outcome = self.store.take(rid) if self.store is not None else None
        if isinstance(outcome, Delivery):
            if outcome.payload.draft_tokens == tokens and outcome.proposal is not None:
                self.counts["proposal:prefill"] += 1
                setattr(req, ATTACH_ATTR, RequestProposal(tokens, None, outcome.arm, "prefill", True))
                return outcome.proposal, outcome
            outcome.release()
            self._count("token_mismatch")
        elif isinstance(outcome, Failure):
            self._count(f"failed:{outcome.key}")
        elif self.store is not None:
            self._count("missing")
        proposal, arm = self._local(mw, req, rid, tokens, vocab)
        if not isinstance(att, RequestProposal):
            setattr(req, ATTACH_ATTR, RequestProposal(tokens, None, arm, "local", True))
        return proposal, None

    def _local(self, mw: Any, req: Any, rid: str | None, tokens: tuple[int, ...], vocab: int) -> tuple[Any, str | None]:
        """Run SGLang's own fields through the pipeline (the configured synthesizer)."""
        probs = torch.as_tensor(req.output_topk_p[: len(tokens)], dtype=torch.float32).clamp(0.0, 1.0).tolist()
        payload = Payload(
            request_id=rid if rid is not None else str(getattr(req, "rid", "local")),
            draft_tokens=tokens,
            draft_probs=tuple(probs),
            vocab_size=vocab,
            provenance=LOCAL_PROVENANCE,
        )
        out = mw.receive(payload)
        if isinstance(out, Failure) or out.proposal is None:
            # Never hand SGLang a hole: one-hot at X is exact whatever went wrong.
            self._count(f"local:{out.key}" if isinstance(out, Failure) else "local:none")
            return OneHotProposal(tokens), out.arm
        self.counts["proposal:local"] += 1
        return out.proposal, out.arm

    def _assemble(self, mw: Any, proposals: Sequence[Any], n: int, vocab: int, device: torch.device) -> torch.Tensor:
        # A fresh tensor, like SGLang's own function: SGLang keeps draft_probs past the
        # next prebuilt batch (merge_batch, the overlap relay), so a view of the
        # assembler's rotating buffer could be overwritten under it. build_fresh writes
        # each row once into a new tensor, built on topk_index's device (SGLang builds
        # there too), so there is neither a copy out of a persistent buffer nor a
        # host-to-device copy of the (b, n, V) result (benchmarks/sglang_inband.py).
        out: torch.Tensor | None = self._assembler_on(mw, device).build_fresh(proposals)
        assert out is not None  # every entry is a proposal (rejection sampling is on)
        return out.view(len(proposals), n, vocab)

    def _assembler_on(self, mw: Any, device: torch.device) -> Any:
        """``mw``'s assembler if it builds on ``device`` (``[decode].device``), else one bound
        to ``device``, made once (its persistent buffer is one row: build_fresh never uses it)."""
        if mw.assembler.device == device:
            return mw.assembler
        key = (id(mw), str(device))
        asm = self._assemblers.get(key)
        if asm is None:
            from ..assembler import ProposalAssembler

            asm = ProposalAssembler(mw.assembler.vocab_size, mw.assembler.num_steps, 1, device=device)
            self._assemblers[key] = asm
        return asm


def _tokens(req: Any, n: int) -> tuple[int, ...]:
    # SGLang's own CPU rows (16-wide metadata rows on a real decode): no device sync.
    row = req.output_topk_index
    if type(row) is torch.Tensor and row.dtype is torch.int64 and row.ndim == 1:
        # The whole 16-wide row as Python ints, then the first n: slicing the tensor
        # first costs more than the list (about 1.5 us a request on CPU, twice a request).
        return tuple(row.tolist()[:n])
    return tuple(int(t) for t in torch.as_tensor(row[:n]).tolist())


def agree_on_x(inst: Any, req: Any, group: Any) -> tuple[int, ...] | None:
    """The decode's X canary for one committed request (:meth:`DecodeProposer.agree`)."""
    proposer: DecodeProposer = inst.proposer
    return proposer.agree(req, group, getattr(inst, "guard", None))
