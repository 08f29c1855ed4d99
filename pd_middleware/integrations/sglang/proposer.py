"""The decode's proposals through the middleware pipeline (the in-band and side channels).

:class:`DecodeProposer`, given SGLang's batch and the received draft tokens ``topk_index``
(b, n), returns ``draft_probs`` (b, n, V) float32 on ``topk_index.device``, the layout of
SGLang's ``pd_first_draft_proposal``. It serves whatever (V, n) SGLang hands it: one
middleware per shape, built on first use from the config with the shape filled in
(:meth:`ModelConfig.with_shapes <pd_middleware.config.ModelConfig.with_shapes>`, which
refuses a config that declares another value).

Per request, the proposal is the one the configured synthesizer attached to the payload
the prefill sent, when one arrived and its draft tokens are exactly the tokens SGLang
received. Otherwise the request is run through the same pipeline as a local payload built
from SGLang's own fields, which ships no distribution, so every synthesizer answers
one-hot (exact for any drafting rule). Each such case is counted in ``counts`` and in
``Metrics.fallbacks`` (``sglang:<reason>``). Engine-agnostic apart from the attribute
names it reads from SGLang's ``ScheduleBatch``/``Req``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from ...codecs.inband import RowFault
from ...core._errors import ConfigError
from ...core.events import Events
from ...core.metrics import Metrics
from ...core.payload import Payload
from ...core.proposal import OneHotProposal
from ...decode.pipeline import Delivery, Failure
from .common import ATTACH_ATTR, LIFE_ATTR, LOCAL_PROVENANCE, RequestProposal, is_probe, room_key
from .store import ProposalStore

logger = logging.getLogger("pd_middleware.integrations.sglang")


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
        # Events of this part: `fallback:<reason>` mirrored as `sglang:<reason>`.
        self.events = Events("decode", source="sglang", metrics=self.metrics, logger=logger)
        self.counts: Counter[str] = self.events.counts
        self._by_shape: dict[tuple[int, int], Any] = {}
        self._assemblers: dict[tuple[int, str], Any] = {}
        self.bound: tuple[int, int] | None = None

    def middleware_for(self, vocab_size: int, num_steps: int) -> Any:
        """The :class:`~pd_middleware.DecodeMiddleware` for (V, S), built once.

        Raises ConfigError naming both values when the config declares another V or S,
        or turns rejection sampling off (SGLang builds a proposal only with it on).
        """
        key = (int(vocab_size), int(num_steps))
        mw = self._by_shape.get(key)
        if mw is None:
            import msgspec

            from ...middleware import DecodeMiddleware

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
        """Close every shape's middleware (plugins' resources)."""
        for mw in self._by_shape.values():
            mw.close()

    def _count(self, reason: str) -> None:
        self.events.count(f"fallback:{reason}", fallback=True)

    def report(self, reason: str, message: str) -> None:
        """Count ``fallback:<reason>`` and log ``message`` once per reason (an operator's line)."""
        self.events.count(f"fallback:{reason}", fallback=True, log=message, level=logging.ERROR)

    # -- metadata channel: at transfer commit -----------------------------------------
    def on_row(self, req: Any, got: Payload | RowFault) -> None:
        """Attach ``req.pd_middleware`` from the request's in-band row (decode, every rank)."""
        if self.bound is None:
            raise ConfigError("the decode's shapes were not bound at scheduler start", path="model")
        vocab, n = self.bound
        mw = self._by_shape[self.bound]
        tokens = request_tokens(req, n)
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
        tokens = request_tokens(req, n)
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
        store = self.store
        outcome = store.take(rid) if store is not None else None
        life = getattr(req, LIFE_ATTR, None)  # set by the side channel's wait, before the commit
        if isinstance(outcome, Delivery):
            got = outcome.payload.life
            if got is not None and life is not None and got != life:
                # Another life's payload (a request served again): its q is not the law of
                # this life's X, even when the tokens agree.
                outcome.release()
                self._count("other_life")
                store.built(rid, life)  # type: ignore[union-attr]  # an outcome came from it
            elif outcome.payload.draft_tokens == tokens and outcome.proposal is not None:
                self.counts["proposal:prefill"] += 1
                setattr(req, ATTACH_ATTR, RequestProposal(tokens, None, outcome.arm, "prefill", True))
                return outcome.proposal, outcome
            else:
                outcome.release()
                self._count("token_mismatch")
        elif isinstance(outcome, Failure):
            self._count(f"failed:{outcome.key}")
        elif store is not None:
            self._count("missing")
            store.built(rid, life)  # its payload, should it come now, is released at once
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
            from ...decode.assembler import ProposalAssembler

            asm = ProposalAssembler(mw.assembler.vocab_size, mw.assembler.num_steps, 1, device=device)
            self._assemblers[key] = asm
        return asm


def request_tokens(req: Any, n: int) -> tuple[int, ...]:
    """The first ``n`` draft tokens SGLang holds for ``req`` (``req.output_topk_index``)."""
    # SGLang's own CPU rows (16-wide metadata rows on a real decode): no device sync.
    row = req.output_topk_index
    if type(row) is torch.Tensor and row.dtype is torch.int64 and row.ndim == 1:
        # The whole 16-wide row as Python ints, then the first n: slicing the tensor
        # first costs more than the list (about 1.5 us a request on CPU, twice a request).
        return tuple(row.tolist()[:n])
    return tuple(int(t) for t in torch.as_tensor(row[:n]).tolist())
