"""Where a decode's first-verify proposal comes from: one role with a lifecycle.

Every installation has exactly one :class:`ProposalSource`, chosen once from the config
by :func:`source_for`, and the drop-in's wrappers call it the same way whatever it is
(no ``if kind == ...`` at a call site). Its methods are the lifecycle points, each with a
no-op default (vLLM's ``KVConnectorBase_V1`` has this shape):

- :meth:`~ProposalSource.bind` (both roles, scheduler start, before SGLang allocates its
  buffers): take the engine's shapes and build what the role needs (the decode's
  middleware, the prefill's publisher, the side channel's receiver, the draft head);
- :meth:`~ProposalSource.on_commit` (decode, every TP rank, when a request's PD transfer
  commits; the in-band channel only): agree on X across the ranks, read the request's row;
- :meth:`~ProposalSource.prepare` (decode, scheduler thread, inside SGLang's
  ``build_eagle_disagg_draft_input`` before its body): per prebuilt batch; what it
  returns is in scope for the proposal;
- :meth:`~ProposalSource.propose` (decode, the same call, when SGLang asks its
  ``pd_first_draft_proposal``): the (b, n, V) float32 proposal;
- :meth:`~ProposalSource.returned` (decode, the same call, before ``prepare``): how many
  requests of the batch came back without a new transfer (a retraction SGLang resumed,
  :func:`returning`); they are left out of ``prepare``/``propose`` and verify the
  one-hot at their X;
- :meth:`~ProposalSource.close` (uninstall).

The sources:

- :class:`InBandSource` (``[sglang].channel = "metadata"``, the default for shipped laws):
  the prefill's row rides SGLang's PD metadata (:mod:`.metadata`);
- :class:`SideChannelSource` (``channel = "sidechannel"``): the middleware's own transport;
- :class:`~.recompute.RecomputeSource`: decode-only; chosen when the configured
  synthesizer declares it needs the engine's draft head (the ``draft_head`` capability,
  :mod:`pd_middleware.core.draft_head`), never by its name.

The feature ``decode`` of the table (the builder and its proposal) is declared here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...core._errors import ConfigError, ExactnessError
from ...core.draft_head import DRAFT_HEAD
from .agreement import NEUTRAL, agree, group_of
from .arrivals import wait_on
from .common import ATTACH_ATTR, RequestProposal, Scope, check_proposal, one_hot_at
from .patching import BUILDER_MODULE, Feature, Hook, Target, register_feature
from .prefill import ProposalPublisher
from .proposer import DecodeProposer, request_tokens
from .store import ArrivalWait, ProposalStore

logger = logging.getLogger("pd_middleware.integrations.sglang")

ENV_DECODE_ADDRESS = "PD_MIDDLEWARE_DECODE_ADDRESS"


class ProposalSource:
    """The decode's source of first-verify proposals (see the module docstring).

    ``name``: the channel it uses (``metadata``, ``sidechannel``, ``none``);
    ``features``: the table's features it needs beyond ``decode`` (``metadata``,
    ``prefill``, ``recompute``). ``inst``: the installation, set by :meth:`attach`.
    """

    name = "none"
    features: frozenset[str] = frozenset()
    inst: Any = None
    #: This source's counters part (:class:`~pd_middleware.core.events.Events`), or None.
    events: Any = None

    def attach(self, inst: Any) -> None:
        """Install time: the installation this source serves (its events, symbols, options)."""
        self.inst = inst

    def bind(self, facts: Any, scheduler: Any) -> None:
        """Scheduler start (both roles; ``scheduler`` None in a harness that passes facts)."""

    def on_commit(self, queue: Any, decode_req: Any, group: Any) -> None:
        """Decode, every rank: a request's PD transfer committed (in-band channel only)."""

    def prepare(self, batch: Any) -> Any:
        """Decode: the prebuilt ``batch``'s first draft input is about to be built."""
        return None

    def hold(self, keys: list[tuple[str | None, int | None]]) -> list[bool] | None:
        """Decode, in SGLang's transfer poll (:mod:`.arrivals`), per request whose KV
        transfer is done, ``(request id, life)``: whether it still waits for something
        this source needs (None: nothing is awaited)."""
        return None

    def propose(self, batch: Any, state: Any, topk_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Decode: float32 (b, n, V) for SGLang's ``pd_first_draft_proposal``; ``state``:
        what :meth:`prepare` returned for this batch."""
        return one_hot_at(topk_index, vocab_size)

    def parts(self) -> dict[str, dict[str, int]]:
        """This source's counters by part (SGLang's ``integration_events``)."""
        return {}

    def returned(self, n: int) -> None:
        """Decode, in the builder: ``n`` requests of the batch came back without a new
        transfer (a retraction SGLang resumed). They are never handed to :meth:`prepare`
        or :meth:`propose`; each verifies the one-hot at its X. Counted once each,
        ``retracted``, in this source's part."""
        if self.events is not None:
            self.events.count(
                "retracted",
                n,
                log=(
                    "pd-middleware: a retracted request came back through SGLang's first-draft builder; it "
                    "verifies the one-hot at its X (exact), its proposal is neither rebuilt nor counted again"
                ),
                level=logging.INFO,
            )

    def close(self) -> None:
        """Uninstall: release what :meth:`bind` made."""


class PipelineSource(ProposalSource):
    """A shipped law, through the middleware's pipeline on the decode (:class:`DecodeProposer`)
    and a :class:`ProposalPublisher` on the prefill; the two channels differ in transport."""

    features = frozenset({"prefill"})

    def __init__(self, proposer: DecodeProposer) -> None:
        self.proposer = proposer
        self.events = proposer.events

    def propose(self, batch: Any, state: Any, topk_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return self.proposer.propose(batch, topk_index, vocab_size)

    def bind(self, facts: Any, scheduler: Any) -> None:
        if facts.role == "decode":
            self.proposer.bind(facts.vocab_size, facts.num_steps)
            self._bind_decode(facts)
        elif self.inst.publisher is None:
            self.inst.publisher = self._publisher(facts)

    def _bind_decode(self, facts: Any) -> None:
        pass

    def _publisher(self, facts: Any) -> ProposalPublisher:
        raise NotImplementedError

    def parts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {"decode": dict(self.proposer.counts)}
        if self.inst.publisher is not None:
            out["prefill"] = dict(self.inst.publisher.counts)
        return out

    def close(self) -> None:
        self.proposer.close()


class InBandSource(PipelineSource):
    """The prefill's row rides SGLang's own PD metadata transfer (:class:`~.metadata.MetadataChannel`)."""

    name = "metadata"
    features = frozenset({"prefill", "metadata"})

    def __init__(self, proposer: DecodeProposer, channel: Any) -> None:
        super().__init__(proposer)
        self.channel = channel
        channel.on_row = proposer.on_row

    def bind(self, facts: Any, scheduler: Any) -> None:
        self.channel.bind(facts.vocab_size, facts.num_steps)
        super().bind(facts, scheduler)

    def _publisher(self, facts: Any) -> ProposalPublisher:
        return ProposalPublisher.from_config(
            self.inst.config,
            stage=self.channel.stage,
            vocab_size=facts.vocab_size,
            num_steps=facts.num_steps,
            registry=self.inst.options.registry,
        )

    def on_commit(self, queue: Any, decode_req: Any, group: Any) -> None:
        # Every rank, for every committed request, before anything may return early: the
        # X agreement is a collective.
        if self.agree_on_x(decode_req.req, group_of(group, self.inst.rank_agreement)):
            return  # the ranks disagreed on X: one-hot at the agreed X is attached
        try:
            self.channel.commit(queue, decode_req, self.inst.is_fake_transfer)
        except Exception as exc:
            self.inst.events.failed("commit", exc, "a one-hot proposal")

    def agree_on_x(self, req: Any, group: Any) -> bool:
        """The X canary: compare this request's X across the ranks of ``group``.

        Returns False when the ranks agree (or ``group`` is None). Otherwise every rank
        adopts the smallest X seen, writes it into ``req.output_topk_index`` (what SGLang
        verifies), attaches a one-hot proposal for it (exact: a one-hot proposal is exact
        for any X chosen before the verify), counts ``fallback:rank_mismatch``, logs once,
        and returns True. A rank with no readable X takes part without a say.
        """
        if group is None:
            return False
        n = self.proposer.bound[1] if self.proposer.bound is not None else 1

        def votes() -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.full((1, n), NEUTRAL, dtype=torch.int64)
            if getattr(req, "finished_reason", None) is None:
                mine = torch.tensor(request_tokens(req, n), dtype=torch.int64)
                if mine.numel() == n:
                    x[0] = mine
            return torch.ones(1, dtype=torch.bool), x

        verdict = agree(1, n, votes, group)
        if verdict.failed is not None:
            self.inst.events.failed("x_canary", verdict.failed, "no cross-rank check for this request")
            return False
        lo, hi = verdict.lo[0], verdict.hi[0]
        if bool((lo == NEUTRAL).any()) or bool((lo == hi).all()):
            return False  # agreed (or no rank had an X)
        agreed = tuple(int(t) for t in lo.tolist())
        try:
            row = req.output_topk_index
            row[:n] = torch.tensor(agreed, dtype=row.dtype)
            setattr(req, ATTACH_ATTR, RequestProposal(agreed, _one_hot_descriptor(agreed), None, "rank_mismatch"))
        except Exception as exc:
            self.inst.events.failed("x_canary", exc, "this rank's own X")
            return False
        self.proposer.report(
            "rank_mismatch",
            f"pd-middleware: decode ranks received different X for request room={getattr(req, 'bootstrap_room', None)} "
            f"(smallest {list(agreed)}, largest {hi.tolist()}); every rank verifies the smallest with a one-hot proposal",
        )
        return True

    def parts(self) -> dict[str, dict[str, int]]:
        return {**super().parts(), "inband": dict(self.channel.counts)}


def _one_hot_descriptor(tokens: tuple[int, ...]) -> Any:
    from ...core.proposal import OneHotProposal

    return OneHotProposal(tokens)


class SideChannelSource(PipelineSource):
    """The prefill's payloads go through the middleware's own transport: a receiver on the
    decode's TP rank 0 (or the one given at install), a sender on the prefill."""

    name = "sidechannel"
    features = frozenset({"prefill", "arrival_wait"})
    #: The bounded wait for each request's payload (:mod:`.arrivals`), on the receiving rank.
    arrivals: ArrivalWait | None = None

    def _bind_decode(self, facts: Any) -> None:
        inst = self.inst
        if inst.receiver is None and self.proposer.store is None and facts.tp_rank == 0:
            from ...transport import open_receiver

            inst.receiver = open_receiver(inst.config.transport, self.proposer.middleware.pipeline)
            self.proposer.store = ProposalStore(inst.receiver)
            logger.info("pd-middleware decode receiver listening on %s", inst.receiver.address)
        if self.proposer.store is not None and self.arrivals is None:
            wait_s = inst.config.sglang.sidechannel_wait_s
            self.arrivals = wait_on(self.proposer.store, inst.receiver, wait_s, self.proposer.events)

    def hold(self, keys: list[tuple[str | None, int | None]]) -> list[bool] | None:
        return None if self.arrivals is None else self.arrivals.hold(keys)

    def _publisher(self, facts: Any) -> ProposalPublisher:
        addr = os.environ.get(ENV_DECODE_ADDRESS)
        if not addr:
            raise ConfigError(
                f'[sglang].channel = "sidechannel" on a prefill needs {ENV_DECODE_ADDRESS}=tcp://host:port',
                path="sglang.channel",
            )
        from ...transport import open_sender

        cfg = self.inst.config
        return ProposalPublisher.from_config(
            cfg,
            lambda: open_sender(cfg.transport, addr, name=f"sglang-prefill-{os.getpid()}"),
            vocab_size=facts.vocab_size,
            num_steps=facts.num_steps,
            registry=self.inst.options.registry,
        )


def needs_draft_head(config: Any, registry: Any) -> bool:
    """Whether the config's decode synthesizer declares it needs the engine's draft head
    (``PluginSpec.needs`` holds ``draft_head``): such a synthesizer recomputes on the
    decode alone. Resolved from the registry, never from the plugin's name."""
    spec = registry.get("synthesizer", config.synthesizer.name)
    return DRAFT_HEAD in tuple(getattr(spec, "needs", ()))


# --------------------------------------------------------------------- the decode feature


@dataclass
class Building:
    """The prebuilt batch whose first draft input SGLang is building, and what its source
    prepared. ``fresh``: the positions of the requests the source serves (None: all of
    them); the others came back through the builder (:func:`returning`)."""

    batch: Any
    state: Any
    fresh: list[int] | None = None
    #: The builder's own ``get_spec`` (its module's global: the settings the builder reads), or None.
    read_spec: Any = None


#: Set by the builder's wrapper, read by the proposal's replacement within the same call.
BUILDING: Scope[Building] = Scope("pd_middleware_sglang_building")

#: Req attribute: the ``output_topk_index`` row object its first draft input was built from.
BUILT_ATTR = "pd_middleware_built"


def returning(reqs: Any) -> list[bool]:
    """Per request of a prebuilt batch: whether it comes back through the builder without a
    new transfer. SGLang's transfer commit gives each transfer a new ``output_topk_index``
    row object (ours are written into it in place), and a retracted decode request keeps
    its row when SGLang resumes it (``resume_retracted_reqs`` puts it back in the waiting
    queue, and ``process_prebuilt`` builds its first draft input again). So the row the
    first build saw (:data:`BUILT_ATTR`), still there, is a return; a rebootstrapped
    request (a new transfer) is fresh. Every TP rank builds the same batches from the same
    commits, so every rank finds the same returns (the recompute vote relies on it)."""
    out = []
    for req in reqs:
        try:  # never raises (wrap_build relies on it): a field that cannot be read is a fresh row
            row = getattr(req, "output_topk_index", None)
            out.append(row is not None and getattr(req, BUILT_ATTR, None) is row)
        except Exception:
            out.append(False)
    return out


class BatchRows:
    """Rows ``rows`` of SGLang's prebuilt ``batch``, as a source reads a batch: ``reqs``,
    ``seq_lens`` and every per-request tensor of ``sampling_info`` (first dimension B)
    are those rows; every other attribute is the batch's.

    Building one cannot fail (``reqs``: the batch's list, already read; ``rows`` index it):
    ``seq_lens`` and ``sampling_info`` are sliced when read, inside the source's own
    guarded steps (its vote, for the recompute source), never before them."""

    def __init__(self, batch: Any, rows: list[int], reqs: list[Any] | None = None) -> None:
        self._batch, self._rows = batch, rows
        self._all = list(batch.reqs) if reqs is None else reqs
        self.reqs = [self._all[i] for i in rows]

    @property
    def seq_lens(self) -> Any:
        return _take(getattr(self._batch, "seq_lens", None), self._rows, len(self._all))

    @property
    def sampling_info(self) -> Any:
        info = getattr(self._batch, "sampling_info", None)
        return None if info is None else _Rows(info, self._rows, len(self._all))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)


class _Rows:
    def __init__(self, obj: Any, rows: list[int], b: int) -> None:
        self._obj, self._rows, self._b = obj, rows, b

    def __getattr__(self, name: str) -> Any:
        return _take(getattr(self._obj, name), self._rows, self._b)


def _take(value: Any, rows: list[int], b: int) -> Any:
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == b:
        return value[torch.tensor(rows, dtype=torch.long, device=value.device)]
    return value


def wrap_build(build: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    """``build_eagle_disagg_draft_input``: the source prepares the batch inside the call
    (before SGLang's body, so before the overlap scheduler's stash copies the draft input).

    A request that comes back without a new transfer (:func:`returning`: a retraction
    SGLang resumed) is left out of the source's batch: it keeps its X and verifies the
    one-hot at it (exact; recomputing it would redraw X from a hidden state of another
    position, and the shipped proposal was consumed at its first build), counted once
    (``retracted``, :meth:`ProposalSource.returned`). Guarded: a failure of ``prepare``
    is counted (``guard:prepare:<error>``) and the batch keeps the prefill's X with the
    drop-in's one-hot proposal (exact for any X).
    """

    def build_eagle_disagg_draft_input(batch: Any, last_tokens_tensor: Any, future_map: Any) -> Any:
        # Nothing before the source's prepare may fail on one TP rank alone: a rank that
        # skipped it would skip the recompute head's gather, a collective every rank must
        # enter (recompute.py's vote). The split reads attributes only (returning: it
        # cannot raise) and BatchRows only stores the rows (its slicing runs when the
        # source reads them, inside the source's vote); counting is guarded on its own.
        fresh: list[int] | None = None
        state = None
        try:
            reqs = list(batch.reqs)  # SGLang's plain list: the same on every rank
        except Exception as exc:
            inst.events.failed("prepare", exc, "the prefill's X with a one-hot proposal")
            reqs = None
        if reqs is not None:
            back = returning(reqs)
            if any(back):
                fresh = [i for i, r in enumerate(back) if not r]
                try:
                    inst.source.returned(len(back) - len(fresh))
                except Exception as exc:
                    inst.events.failed("returned", exc, "the returned requests not counted")
            try:
                if fresh != []:
                    state = inst.source.prepare(batch if fresh is None else BatchRows(batch, fresh, reqs))
            except Exception as exc:
                inst.events.failed("prepare", exc, "the prefill's X with a one-hot proposal")
                state = None
        read_spec = getattr(build, "__globals__", {}).get("get_spec")  # what the builder itself reads
        with BUILDING.enter(Building(batch, state, fresh, read_spec)):
            out = build(batch, last_tokens_tensor, future_map)
        for req in batch.reqs:  # the row each request's first draft input was built from
            try:
                setattr(req, BUILT_ATTR, req.output_topk_index)
            except Exception as exc:  # a request that takes no attribute: never a return
                inst.events.failed("build_mark", exc, "no retraction check for that request")
        return out

    return build_eagle_disagg_draft_input


def proposal_for(inst: Any, building: Building, topk_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The source's (b, n, V) proposal for the batch being built, at the builder's X.

    Guarded like every per-batch wrapper: a failure gives the drop-in's one-hot at the X
    the builder read (counted). Returned requests (retractions SGLang resumed) get the
    one-hot at their X."""
    try:
        fresh = building.fresh
        if fresh is None:
            whole: torch.Tensor = inst.source.propose(building.batch, building.state, topk_index, vocab_size)
            check_proposal(whole, topk_index, vocab_size)
            return whole
        out = one_hot_at(topk_index, vocab_size)
        if fresh:
            rows = torch.tensor(fresh, dtype=torch.long, device=topk_index.device)
            sub = topk_index[rows]
            got = inst.source.propose(BatchRows(building.batch, fresh), building.state, sub, vocab_size)
            check_proposal(got, sub, vocab_size)
            out[rows] = got
        return out
    except Exception as exc:
        inst.events.failed("propose", exc, "a one-hot proposal at the builder's X")
        return one_hot_at(topk_index, vocab_size)


def wrap_proposal(first: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    """``pd_first_draft_proposal`` (SGLang 0.5.22 on): the source's proposal for the batch
    being built (:func:`proposal_for`; never SGLang's own function inside the build, which a
    server may have made inert). Called from anywhere but the PD first draft input, it is SGLang's.
    """

    def pd_first_draft_proposal(topk_index: Any, vocab_size: int) -> Any:
        building = BUILDING.get()
        if building is None:
            return first(topk_index, vocab_size)  # not the PD first draft input: not ours
        return proposal_for(inst, building, topk_index, vocab_size)

    return pd_first_draft_proposal


def wrap_draft_input(cls: Any, inst: Any) -> Callable[..., Any]:
    """The builder module's ``EagleDraftInput`` up to SGLang 0.5.21, whose builder never sets
    ``draft_probs`` (the seed's TypeError on the eager draft path, a zero or stale proposal
    under graph replay). Inside the drop-in's builder wrapper (:data:`BUILDING`) it constructs
    SGLang's class with ``draft_probs`` = the source's proposal (:func:`proposal_for`): (b, V)
    for single-layer EAGLE, (b, S, V) for a multi-layer chain, as 0.5.22's builder shapes
    SGLang's own. Set at construction, so the proposal is in the draft input before the
    overlap scheduler's stash (``RelayPayload.from_draft_input``): a proposal attached after
    the builder returns would be replaced by the relay's buffer rows there. Without
    rejection sampling (a greedy verify) no proposal is set, as on 0.5.22. Anywhere else,
    SGLang's class unchanged.

    Where the settings the builder reads cannot be read (its ``get_spec``, the batch's model
    config; counted ``guard:draft_input:<error>``), the draft input still gets a proposal,
    never none (:func:`unread_proposal`): the one-hot at X, exact for any drafting rule."""

    def EagleDraftInput(*args: Any, **kwargs: Any) -> Any:  # stands in for SGLang's class
        building = BUILDING.get()
        if building is None or kwargs.get("draft_probs") is not None or "topk_index" not in kwargs:
            return cls(*args, **kwargs)
        topk_index = kwargs["topk_index"]
        try:
            spec = building.read_spec()
            rs, multi = bool(spec.speculative_use_rejection_sampling), bool(spec.enable_multi_layer_eagle)
            vocab_size = int(building.batch.model_config.vocab_size)
        except Exception as exc:
            inst.events.failed("draft_input", exc, "the one-hot at X (exact for any drafting rule)")
            kwargs["draft_probs"] = unread_proposal(inst, building, topk_index)
            return cls(*args, **kwargs)
        if rs:
            probs = proposal_for(inst, building, topk_index, vocab_size)
            kwargs["draft_probs"] = probs if multi else probs[:, 0]
        return cls(*args, **kwargs)

    return EagleDraftInput


def unread_proposal(inst: Any, building: Building, topk_index: torch.Tensor) -> torch.Tensor | None:
    """The proposal of a draft input whose builder settings could not be read: the one-hot
    at X (``topk_index``, (b, n)), float32 on X's device, shaped by what the scheduler's start
    read of the same settings (``inst.facts``: V, S, rejection sampling), which nothing of
    this batch can have broken. Without those (an installation never activated), V is the
    batch's model config's and a chain is n > 1 (top-k 1: SGLang's rejection sampling
    refuses any other top-k for a chain, and the drop-in for any draft).

    The one-hot is exact whatever X's drafting rule, so attaching it when rejection sampling
    is unknown is safe: on 0.5.18-0.5.21 SGLang reads ``draft_probs`` only under rejection
    sampling (the draft step's stack, the graph runner's buffer, allocated only then, and
    the verify, which uses zeros otherwise); a greedy verify carries it unread. None (no
    proposal, as SGLang's builder sets) only where the start read says rejection sampling
    is off. Raises :class:`~pd_middleware.core._errors.ExactnessError` where V cannot be
    read at all: without a proposal the eager draft step raises the seed's TypeError and a
    graph replay verifies a stale one (an inexact law), so the batch is refused instead."""
    facts = inst.facts
    if facts is not None:
        if not facts.rejection_sampling:
            return None
        vocab_size, chain = int(facts.vocab_size), int(facts.num_steps) > 1
    else:
        try:
            vocab_size = int(building.batch.model_config.vocab_size)
        except Exception as exc:
            raise ExactnessError(
                "pd-middleware cannot shape the first draft input's proposal: the builder's settings and the "
                f"batch's vocabulary are unreadable ({type(exc).__name__}: {exc}) and the scheduler's start read "
                "none; SGLang's draft input without a proposal would verify a stale one under graph replay",
                reason="draft_input_unshaped",
            ) from exc
        chain = int(topk_index.shape[1]) > 1
    probs = one_hot_at(topk_index, vocab_size)
    return probs if chain else probs[:, 0]


register_feature(
    Feature(
        "decode",
        (
            Target(
                BUILDER_MODULE,
                "build_eagle_disagg_draft_input",
                ("batch", "last_tokens_tensor", "future_map"),
                Hook.AROUND,
                wrap_build,
            ),
            Target(
                BUILDER_MODULE,
                "pd_first_draft_proposal",
                ("topk_index", "vocab_size"),
                Hook.REPLACE,
                wrap_proposal,
                since="0.5.22",
            ),
            # Up to 0.5.21 the builder sets no proposal: the draft input it constructs gets the source's.
            Target(BUILDER_MODULE, "EagleDraftInput", None, Hook.REPLACE, wrap_draft_input, until="0.5.21"),
            # The settings the builder reads (rejection sampling, multi-layer), read as it reads them.
            Target(BUILDER_MODULE, "get_spec", (), Hook.READ, until="0.5.21"),
        ),
        lambda plan: True,
        summary="the PD decode's first draft input and its proposal: the source's",
    )
)
