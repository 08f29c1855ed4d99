"""SGLang decode side: the proposal of a PD decode's first verify, built by the middleware.

Two pieces, both engine-agnostic apart from the attribute names they read from
SGLang's ``ScheduleBatch``/``Req``:

- :class:`ProposalStore`: the outcomes a :class:`~pd_middleware.transport.DecodeReceiver`
  delivered, keyed by request id, which is the prefill's ``bootstrap_room`` as a
  decimal string (the publisher uses the same key). Drained from the receiver on the
  scheduler thread at lookup time, so no extra thread is needed. Bounded in count and
  age; evicted deliveries release their receive slot.
- :class:`DecodeProposer`: given SGLang's batch and the received draft tokens
  ``topk_index`` (b, n), returns ``draft_probs`` (b, n, V) float32 on
  ``topk_index.device``, the layout of SGLang's ``pd_first_draft_proposal`` (SGLang
  itself slices ``[:, 0]`` for single-layer EAGLE).

Per request, the proposal is the one the configured synthesizer attached to the payload
the prefill published for that bootstrap room, when one arrived and its draft tokens are
exactly the tokens SGLang received. Otherwise the request is run through the same
pipeline as a local payload built from SGLang's own fields, which ships no distribution,
so every synthesizer answers one-hot (exact for any drafting rule). Each such case is
counted in ``counts`` and in ``Metrics.fallbacks`` (``sglang:missing``,
``sglang:token_mismatch``, ``sglang:failed:<reason>``).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Callable, Sequence

import torch

from .._errors import ConfigError
from ..payload import Payload, Provenance
from ..pipeline import Delivery, Failure
from ..proposal import OneHotProposal

# Provenance of a payload built on the decode from SGLang's fields: SGLang's prefill
# draws X ~ q under rejection sampling and does not send q, so nothing but one-hot
# is exact for it (the synthesizers' provenance guard enforces that).
_LOCAL_PROVENANCE = Provenance(rule="sampled", temperature=1.0, sampled_from=None)


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
    """

    def __init__(
        self,
        receiver: Any = None,
        *,
        capacity: int = 65536,
        ttl_s: float = 300.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if capacity < 1 or ttl_s <= 0:
            raise ValueError("capacity must be >= 1 and ttl_s > 0")
        self.receiver = receiver
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, tuple[float, Delivery | Failure]] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, outcome: Delivery | Failure) -> None:
        """Keep one outcome under its request id (a newer one replaces and releases an older)."""
        rid = outcome.request_id
        if rid is None:  # a wire failure that could not name its request: nothing to key
            return
        stamp = outcome.received_at if isinstance(outcome, Delivery) else self._clock()
        with self._lock:
            old = self._items.pop(rid, None)
            self._items[rid] = (stamp, outcome)
            over = len(self._items) - self.capacity
            dropped = [self._items.popitem(last=False)[1][1] for _ in range(max(0, over))]
        if old is not None:
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
        return None if item is None else item[1]

    def clear(self) -> None:
        """Drop (and release) everything."""
        with self._lock:
            items = list(self._items.values())
            self._items.clear()
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
                dropped.append(o)
        for o in dropped:
            _release(o)
            self.evicted["ttl"] += 1


def _release(outcome: Delivery | Failure) -> None:
    if isinstance(outcome, Delivery):
        outcome.release()


class DecodeProposer:
    """Builds SGLang's first-verify ``draft_probs`` from a :class:`DecodeMiddleware`.

    ``middleware``: the decode middleware (pipeline + assembler + metrics);
    ``store``: where published payloads arrive, or None when the prefill publishes
    nothing (one-hot deployments).
    """

    def __init__(self, middleware: Any, store: ProposalStore | None = None) -> None:
        self.middleware = middleware
        self.store = store
        self.config = middleware.config
        self.counts: Counter[str] = Counter()

    def _count(self, reason: str) -> None:
        self.counts[f"fallback:{reason}"] += 1
        self.middleware.metrics.fallbacks[f"sglang:{reason}"] += 1

    def propose(self, batch: Any, topk_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``draft_probs`` for ``batch``: float32 (b, n, V) on ``topk_index.device``.

        ``topk_index``: int64 (b, n), the draft tokens SGLang received (n = 1 single
        layer, ``num_steps`` multi-layer). Raises ConfigError when the config's
        vocab, step count or rejection-sampling flag disagrees with SGLang's.
        """
        cfg = self.config
        b, n = int(topk_index.shape[0]), int(topk_index.shape[1])
        if vocab_size != cfg.model.vocab_size:
            raise ConfigError(
                f"SGLang's target vocab is {vocab_size}, the config says {cfg.model.vocab_size}",
                path="model.vocab_size",
            )
        if n != cfg.model.num_steps:
            raise ConfigError(
                f"SGLang sends {n} draft token(s) per request, the config says num_steps = {cfg.model.num_steps}"
                " (1 for single-layer EAGLE, speculative_num_steps for multi-layer)",
                path="model.num_steps",
            )
        if not cfg.decode.rejection_sampling:
            raise ConfigError(
                "SGLang runs with --speculative-use-rejection-sampling but the config turns it off",
                path="decode.rejection_sampling",
            )
        reqs = batch.reqs
        if len(reqs) != b:
            raise ValueError(f"batch has {len(reqs)} requests but topk_index has {b} rows")
        if self.store is not None:
            self.store.pump()
        proposals: list[Any] = []
        used: list[Delivery] = []
        for req in reqs:
            proposal, delivery = self._one(req, n, vocab_size)
            proposals.append(proposal)
            if delivery is not None:
                used.append(delivery)
        self.counts["batches"] += 1
        self.counts["requests"] += b
        try:
            return self._assemble(proposals, n, vocab_size, topk_index.device)
        finally:
            # The assembler copied every value; the receive slots may be reused now.
            for d in used:
                d.release()

    def _one(self, req: Any, n: int, vocab: int) -> tuple[Any, Delivery | None]:
        # SGLang's own CPU rows (16-wide metadata rows on a real decode): no device sync.
        tokens = tuple(int(t) for t in torch.as_tensor(req.output_topk_index[:n]).tolist())
        rid = room_key(getattr(req, "bootstrap_room", None))
        outcome = self.store.take(rid) if self.store is not None else None
        if isinstance(outcome, Delivery):
            if outcome.payload.draft_tokens == tokens and outcome.proposal is not None:
                self.counts["proposal:prefill"] += 1
                return outcome.proposal, outcome
            # The payload's X is not what SGLang will verify: its q says nothing about it.
            outcome.release()
            self._count("token_mismatch")
        elif isinstance(outcome, Failure):
            self._count(f"failed:{outcome.key}")
        elif self.store is not None:
            self._count("missing")
        return self._local(req, rid, tokens, vocab), None

    def _local(self, req: Any, rid: str | None, tokens: tuple[int, ...], vocab: int) -> Any:
        """Run SGLang's own fields through the pipeline (the configured synthesizer)."""
        probs = torch.as_tensor(req.output_topk_p[: len(tokens)], dtype=torch.float32).clamp(0.0, 1.0).tolist()
        payload = Payload(
            request_id=rid if rid is not None else str(getattr(req, "rid", "local")),
            draft_tokens=tokens,
            draft_probs=tuple(probs),
            vocab_size=vocab,
            provenance=_LOCAL_PROVENANCE,
        )
        out = self.middleware.receive(payload)
        if isinstance(out, Failure) or out.proposal is None:
            # Never hand SGLang a hole: one-hot at X is exact whatever went wrong.
            self._count(f"local:{out.key}" if isinstance(out, Failure) else "local:none")
            return OneHotProposal(tokens)
        self.counts["proposal:local"] += 1
        return out.proposal

    def _assemble(self, proposals: Sequence[Any], n: int, vocab: int, device: torch.device) -> torch.Tensor:
        # A fresh tensor, like SGLang's own function: SGLang keeps draft_probs past the
        # next prebuilt batch (merge_batch, the overlap relay), so a view of the
        # assembler's rotating buffer could be overwritten under it. Chunks of
        # max_batch let any batch size through.
        asm = self.middleware.assembler
        out = torch.empty((len(proposals), n, vocab), dtype=torch.float32, device=device)
        step = asm.max_batch
        for start in range(0, len(proposals), step):
            view = asm.build(proposals[start : start + step])
            assert view is not None  # every entry is a proposal (rejection sampling is on)
            out[start : start + view.shape[0]].copy_(view.view(view.shape[0], n, vocab))
        return out
