"""A live A/B whose arms mix recompute with shipped strategies and one-hot, on one decode.

:class:`ArmedSource` is the :class:`~.sources.ProposalSource` of a config whose
``[[arms]]`` hold a synthesizer that needs the engine's draft head (``recompute``) beside
shipped ones (``sparse``, ``full_distribution``, ``one_hot``...). It holds two sources
and splits every prebuilt batch between them by each request's arm:

- the **shipped** source (:class:`~.sources.InBandSource` or
  :class:`~.sources.SideChannelSource`): the prefill ships its row as for any live A/B;
  the decode's pipeline routes each row to its arm (``ab_split``) and the arm's
  synthesizer builds the proposal (the shipped q with the prefill's X, or the one-hot at
  X). In that pipeline the recompute arm's synthesizer is replaced by ``one_hot``
  (:func:`shipped_config`): its rows are routed and counted there like any arm's, and
  what it attaches is never handed to the verifier;
- the **recompute** source (:class:`~.recompute.RecomputeSource`), built from the
  recompute arm's synthesizer alone: for the rows of the recompute arm only, it
  recomputes q' with the decode's draft head, redraws X' ~ q', agrees across the TP
  ranks and writes X', q'(X') into the requests (:meth:`RecomputeSource.prepare
  <.recompute.RecomputeSource.prepare>` on :class:`BatchRows`, the batch restricted to
  those rows).

Every arm stays exact: each row's X is handed with the law it was drawn from (a
recomputed row: X' ~ q' with q'; a shipped row: the prefill's X ~ q with q; a one-hot
row: δ_X at X; a recompute row that falls back: δ at its X).

**The split is a function of the request alone**, the same on every TP rank: a row's arm
is the routing hook's answer for the request id the pipeline routes it under (the decimal
bootstrap room, :func:`~.common.room_key`; SGLang's ``rid`` without one). ``ab_split``
hashes that id, so every rank computes the same recompute rows and enters the recompute
vote (a collective over exactly those rows) with the same batch. A routing hook used
with a recompute arm must therefore route by the request id alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from ...core._errors import ConfigError
from ...core.contracts import ReceiveContext
from ...core.payload import Payload
from .common import ATTACH_ATTR, LOCAL_PROVENANCE, RequestProposal, room_key
from .proposer import request_tokens
from .recompute import Prepared, RecomputeSource
from .sources import ProposalSource

logger = logging.getLogger("pd_middleware.integrations.sglang")

#: The synthesizer standing in for the recompute arm in the shipped pipeline.
PLACEHOLDER = "one_hot"


def recompute_arms(config: Any, needs: Any) -> list[str]:
    """Names of the config's arms whose synthesizer needs the draft head (``needs(ref)``)."""
    return [a.name for a in config.arms if needs(a.synthesizer)]


def shipped_config(config: Any, arm: str) -> Any:
    """``config`` with arm ``arm``'s synthesizer replaced by :data:`PLACEHOLDER` (the pipeline's copy)."""
    from ...config import PluginRef

    arms = [
        msgspec.structs.replace(a, synthesizer=PluginRef(name=PLACEHOLDER)) if a.name == arm else a for a in config.arms
    ]
    return msgspec.structs.replace(config, arms=arms)


def recompute_config(config: Any, arm: str) -> Any:
    """``config`` as the recompute source reads it: no arms, arm ``arm``'s synthesizer."""
    ref = next(a.synthesizer for a in config.arms if a.name == arm)
    return msgspec.structs.replace(config, arms=[], synthesizer=ref)


@dataclass
class BatchRows:
    """A prebuilt batch restricted to the rows ``index``: what the sources read of SGLang's
    ``ScheduleBatch`` (``reqs``, ``seq_lens``, ``model_config`` and ``sampling_info``'s
    ``temperatures``/``sampling_seed``/``top_ks``), each sliced to those rows."""

    reqs: list[Any]
    seq_lens: Any
    model_config: Any
    sampling_info: Any

    @classmethod
    def of(cls, batch: Any, index: list[int]) -> BatchRows:
        idx = torch.tensor(index, dtype=torch.int64)

        def rows(t: Any) -> Any:
            return t[idx.to(t.device)] if isinstance(t, torch.Tensor) else t

        si = getattr(batch, "sampling_info", None)
        sampling = _Sampling(
            rows(getattr(si, "temperatures", None)),
            rows(getattr(si, "sampling_seed", None)),
            rows(getattr(si, "top_ks", None)),
        )
        reqs = batch.reqs
        return cls([reqs[i] for i in index], rows(getattr(batch, "seq_lens", None)), batch.model_config, sampling)


@dataclass
class _Sampling:
    temperatures: Any
    sampling_seed: Any
    top_ks: Any


@dataclass
class Split:
    """One batch's split: ``mine`` (the recompute arm's rows, in batch order), ``others``,
    and what each source prepared for its rows."""

    mine: list[int]
    others: list[int]
    recomputed: Prepared | None = None
    shipped: Any = None
    arms: list[str | None] = field(default_factory=list)


class ArmedSource(ProposalSource):
    """A live A/B with a recompute arm (see the module docstring).

    ``shipped``: the channel's source, built from :func:`shipped_config`; ``recompute``:
    the recompute source, built from :func:`recompute_config`; ``arm``: the recompute
    arm's name.
    """

    def __init__(self, shipped: ProposalSource, recompute: RecomputeSource, arm: str) -> None:
        self.shipped = shipped
        self.recompute = recompute
        self.arm = arm
        self.name = shipped.name
        self.features = shipped.features | recompute.features
        # A retracted request that comes back (ProposalSource.returned) is counted once, in
        # the shipped arms' part, whichever arm it had: neither source prepares it again.
        self.events = shipped.events
        self._router: Any = None

    @property
    def proposer(self) -> Any:
        """The shipped arms' pipeline proposer."""
        return getattr(self.shipped, "proposer", None)

    @property
    def channel(self) -> Any:
        """The in-band channel of the shipped arms, or None (side channel)."""
        return getattr(self.shipped, "channel", None)

    def attach(self, inst: Any) -> None:
        super().attach(inst)
        self.shipped.attach(inst)
        self.recompute.attach(inst)

    def bind(self, facts: Any, scheduler: Any) -> None:
        self.shipped.bind(facts, scheduler)
        if facts.role == "decode":
            self.recompute.bind(facts, scheduler)

    def hold(self, keys: list[tuple[str | None, int | None]]) -> list[bool] | None:
        # Every arm's request awaits its shipped row on the side channel: the prefill ships
        # each one, and the shipped pipeline routes it.
        return self.shipped.hold(keys)

    def on_commit(self, queue: Any, decode_req: Any, group: Any) -> None:
        self.shipped.on_commit(queue, decode_req, group)

    # -- the split -----------------------------------------------------------------------
    def router(self) -> Any:
        """The pipeline's routing hook (``routes_arms``), found once."""
        if self._router is None:
            hooks = self.proposer.middleware.pipeline.hook_objects
            found = [h for h in hooks if getattr(h, "routes_arms", False)]
            if not found:  # install() refuses [[arms]] without one: never on a server
                raise ConfigError("[[arms]] with a recompute arm needs a routing hook (ab_split)", path="hooks")
            self._router = found[0]
        return self._router

    def arm_of(self, req: Any) -> str:
        """The arm of ``req``: the routing hook's answer for the request id the pipeline
        routes it under (the same on every rank: a function of the request alone)."""
        room = getattr(req, "bootstrap_room", None)
        rid = room_key(room) if room is not None else str(getattr(req, "rid", "local"))
        # The id alone decides (the module docstring): the rest is a valid stand-in, so that
        # a request whose X is out of range (its row falls back later) is still routed.
        payload = Payload(
            request_id=rid, draft_tokens=(0,), draft_probs=(1.0,), vocab_size=1, provenance=LOCAL_PROVENANCE
        )
        ctx = ReceiveContext()
        self.router().on_receive(payload, ctx)
        return ctx.arm

    def prepare(self, batch: Any) -> Split:
        arms = [self.arm_of(r) for r in batch.reqs]
        mine = [i for i, a in enumerate(arms) if a == self.arm]
        others = [i for i, a in enumerate(arms) if a != self.arm]
        split = Split(mine, others, arms=list(arms))
        if others:
            split.shipped = self.shipped.prepare(batch if not mine else BatchRows.of(batch, others))
        if mine:
            # Every rank holds the same rows (the split is a function of the request): the
            # recompute vote inside is entered by every rank with the same batch.
            rows = batch if not others else BatchRows.of(batch, mine)
            split.recomputed = self.recompute.prepare(rows)
            self._attach(rows.reqs, split.recomputed)
        return split

    def _attach(self, reqs: list[Any], prepared: Prepared | None) -> None:
        """The recompute rows' record (``req.pd_middleware``): their arm, for the live A/B
        counter, and whether X' was kept (``recompute``) or the one-hot at X (``recompute:fallback``)."""
        agreed = prepared.agreed.tolist() if prepared is not None else [False] * len(reqs)
        for req, ok in zip(reqs, agreed):
            tokens = request_tokens(req, 1)
            setattr(
                req,
                ATTACH_ATTR,
                RequestProposal(tokens, None, self.arm, "recompute" if ok else "recompute:fallback", True),
            )

    def propose(self, batch: Any, state: Any, topk_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
        if not isinstance(state, Split):
            return super().propose(batch, state, topk_index, vocab_size)
        if not state.mine:
            return self.shipped.propose(batch, state.shipped, topk_index, vocab_size)
        if not state.others:
            return self.recompute.propose(batch, state.recomputed, topk_index, vocab_size)
        out = torch.empty((*topk_index.shape, int(vocab_size)), dtype=torch.float32, device=topk_index.device)
        for rows, source, prepared in (
            (state.others, self.shipped, state.shipped),
            (state.mine, self.recompute, state.recomputed),
        ):
            idx = torch.tensor(rows, dtype=torch.int64, device=topk_index.device)
            out[idx] = source.propose(BatchRows.of(batch, rows), prepared, topk_index[idx], vocab_size)
        return out

    def parts(self) -> dict[str, dict[str, int]]:
        return {**self.shipped.parts(), **self.recompute.parts()}

    def close(self) -> None:
        self.shipped.close()
        self.recompute.close()
