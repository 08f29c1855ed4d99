"""SGLang decode-only recompute: the decode recomputes the first proposal with its own draft head.

Chosen when the configured synthesizer declares that it needs the engine's draft head
(``PluginSpec.needs`` holds ``draft_head``; the core ``recompute`` synthesizer does), the
drop-in runs on the **decode only**; the prefill runs plain SGLang (no row, no handshake
frame, no prefill patch). SGLang's prefill ships the draft model's hidden state at the
last position (``EAGLEWorkerV2._draft_extend_for_prefill`` returns
``hidden_states=logits_output.hidden_states``); the decode's builder reads it as
``req.hidden_states_tensor``. Before SGLang's ``build_eagle_disagg_draft_input`` runs,
:class:`RecomputeSource` computes, for the whole prebuilt batch (``CHUNK_ROWS`` rows at a
time), with the synthesizer's own law and draw (:meth:`~pd_middleware.decode.recompute.RecomputeSynthesizer.recompute`):

- q' = softmax(logits / T) with logits from :class:`~.draft_head.SGLangDraftHead`, the decode's own
  draft model with what its ``LogitsProcessor`` applies, run inside SGLang's draft TP
  context (``draft_tp_context(draft_worker.parallel_layout)``, as SGLang wraps every draft
  call), so its vocab-parallel gather uses the group SGLang uses for this draft;
- X' drawn from q' by the engine's seeded sampler, offered to the synthesizer as its
  ``seeded_draw`` capability: from 0.5.23 SGLang's ``fast_sample(q', sampling_seed,
  positions=seq_lens)`` (before, its ``fast_sample`` takes no seed, and X' is the drop-in's
  seeded inverse-CDF draw: same law, rank-agreed), seeded by the request's sampling seed
  (``--enable-deterministic-inference``), or without
  one by a seed derived from its bootstrap room, so every TP rank draws the same X'.
  ``seq_lens`` of the prebuilt batch is the prompt length, the position the prefill drew
  its own X at, with the draft stream's salt and draft step 0: the very stream aggregated
  serving draws this token from, kept apart from the verify's coins by SGLang's domain
  separation. Where SGLang's sampler cannot run (sgl-kernel without its CPU ops) the
  synthesizer's own seeded draw is used (logged); a greedy row proposes its argmax;

then **the ranks agree** (:func:`~.agreement.agree`) per request on (ok, X', the
prefill's X): a request that any rank could not serve, or whose X' differs between
ranks, falls back on every rank to the exact one-hot at the same X (the smallest
prefill X any rank holds). A failure on one rank is its vote; the head's gathers (one a
chunk) still run on every rank, on the same bytes (:class:`~.draft_head.SGLangDraftHead`): every step
before the gather (reading the batch, copying it to the head's device:
:meth:`RecomputeSource._inputs`) runs inside the vote, and a rank whose step failed runs
the head on blank inputs of the same shapes (where even those fail, an OOM, on rows
without features, which the head refuses before any kernel), then votes "not ok".
Everything that can fail on one rank runs before the vote (:meth:`RecomputeSource._stage`);
after it a rank only assigns what it staged. Each per-rank step is a method of its own (``_hidden``,
``_inputs``, ``_stage``; the head's ``_local``), so a deployment's fault injection wraps
one without reaching into the vote (the server tier's does: ``docs/server.md``). X' and q'(X') are written into each agreed request's
``output_topk_index``/``output_topk_p`` (the fields the builder reads), and q' itself
is the builder's ``pd_first_draft_proposal``. All of it happens inside the original builder's
call, so **before** ``future_map.stash`` copies the draft input under the overlap
scheduler.

This module is the source, per batch. At scheduler start :func:`~.recompute_capture.capture`
finds the draft model, checks it and where its gather runs (what is refused, and why:
:mod:`.recompute_capture`), and binds the source; the head adapter is :mod:`.draft_head`,
the placement and width checks are :mod:`.startup`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ...core._errors import ConfigError, ValidationError
from ...core.draft_head import DRAFT_HEAD
from ...core.events import Events
from ...decode.recompute import SEEDED_DRAW, Recomputed, RecomputeSynthesizer, seed_from_room
from .agreement import NEUTRAL, Verdict, agree, group_of
from .common import is_probe, one_hot_at
from .draft_head import SGLangDraftHead
from .patching import register_feature
from .proposer import request_tokens
from .recompute_capture import FEATURE, capture
from .sources import ProposalSource

logger = logging.getLogger("pd_middleware.integrations.sglang")


@dataclass
class Staged:
    """What one rank writes after the vote, built before it (:meth:`RecomputeSource._stage`):
    ``rec`` the batch's q' and X'; ``x`` int64 (B, 1) the builder's X' (a draft id under a
    token map); ``p`` float32 (B, 1) q'(X'); ``valid`` bool (B,); all on CPU."""

    rec: Recomputed
    x: torch.Tensor
    p: torch.Tensor
    valid: torch.Tensor


@dataclass
class _HeadInputs:
    """What the head and the draw read for one batch, on the head's device: ``hidden``
    (B, H) in the head's dtype; ``temperatures`` (B, 1) or (B,); ``seeds``, ``positions``
    int64 (B,); ``greedy`` bool (B,) or None."""

    hidden: torch.Tensor
    temperatures: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    greedy: torch.Tensor | None


@dataclass
class Prepared:
    """One batch's recompute: ``rec`` (q', X', q'(X')) and ``agreed`` bool (B,), the rows
    every rank serves with q'; the others verify the one-hot at the X the builder reads."""

    rec: Recomputed
    agreed: torch.Tensor
    user: torch.Tensor  # the rows counted: SGLang's probes apart


class _Unknown:
    """Offered as ``draft_head`` when the engine's draft model is not in the table: the
    synthesizer builds, and every batch falls back to one-hot, counted ``unknown_head``."""


class RecomputeSource(ProposalSource):
    """The decode's recompute step for SGLang prebuilt batches (see the module docstring).

    ``synth``: the configured synthesizer, built with SGLang's head (:meth:`bind_head`);
    None until the scheduler starts, when every batch falls back to one-hot (counted
    ``unknown_head``). ``group``: the CPU group of the ranks that build the same batch
    (SGLang's attention TP), None for one rank. ``counts``: ``batches``,
    ``recomputed`` (requests), ``fallback:<reason>``.
    """

    name = "none"
    features = frozenset({"recompute"})

    def __init__(self, config: Any, registry: Any = None, metrics: Any = None) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.synth: RecomputeSynthesizer | None = None
        self.head: SGLangDraftHead | None = None
        self.num_steps = 1
        self.group: Any = None
        self.tp_rank = 0
        self.events = Events("recompute", logger=logger)
        self.counts = self.events.counts
        #: Which sampler draws X' (set at bind): SGLang's seeded fast_sample, or the core's.
        self.sampler = ""

    # -- scheduler start ---------------------------------------------------------------
    def bind(self, facts: Any, scheduler: Any) -> None:
        """Scheduler start: the decode captures its draft head (a prefill has nothing to do)."""
        if facts.role == "prefill":
            logger.info("pd-middleware recompute is decode-only: nothing to do on this prefill")
            return
        if facts.num_steps > 1:
            logger.warning(
                "pd-middleware recompute: a %d-step multi-layer chain cannot be recomputed (steps 1..S-1 "
                "were drawn on the prefill given X); every request falls back to one-hot, counted. "
                "Use a shipped strategy (configs/multi_layer.yaml) for chains",
                facts.num_steps,
            )
        self.tp_rank = int(getattr(facts, "tp_rank", 0))
        if scheduler is not None:
            capture(
                self, scheduler, vocab_size=facts.vocab_size, num_steps=facts.num_steps, rs=facts.rejection_sampling
            )

    def bind_head(
        self,
        head: Any,
        *,
        vocab_size: int,
        num_steps: int,
        rejection_sampling: bool,
        group: Any = None,
        draw: Any = None,
    ) -> None:
        """Build the synthesizer for the engine; ``head`` None: unknown head (every batch
        falls back); ``group``: the ranks' agreement group; ``draw``: the engine's seeded
        sampler (None: the synthesizer's own)."""
        from ...config import resolve_plugins
        from ...core.contracts import PluginContext
        from ...registry import default_registry

        reg = self.registry if self.registry is not None else default_registry()
        resolved = resolve_plugins(self.config, reg, None, sides=("decode",))
        r = resolved.synthesizers["default"]
        caps: dict[str, Any] = {DRAFT_HEAD: head if head is not None else _Unknown()}
        if draw is not None:
            caps[SEEDED_DRAW] = draw
        ctx = PluginContext(
            vocab_size=vocab_size,
            num_steps=num_steps,
            rejection_sampling=rejection_sampling,
            device=str(getattr(head, "device", "cpu")),
            capabilities=caps,
        )
        synth = reg.build(r.spec, r.options, ctx, r.key)
        if not callable(getattr(synth, "recompute", None)) or not callable(getattr(synth, "unusable", None)):
            raise ConfigError(
                f"synthesizer {r.spec.name!r} needs the draft head but has no recompute()/unusable() "
                "(pd_middleware.decode.recompute.RecomputeSynthesizer's batch form)",
                path=r.key,
            )
        if self.metrics is not None:
            synth.guard.attach_metrics(self.metrics)
        self.synth, self.head, self.num_steps = synth, head, num_steps
        self.group = group_of(group, self.inst.rank_agreement if self.inst is not None else True)
        self.sampler = "sglang.fast_sample" if draw is not None else "pd_middleware.inverse_cdf"

    # -- per batch ---------------------------------------------------------------------
    def _fallback(self, reason: str, n: int) -> None:
        if n <= 0:
            return
        self.events.count(f"fallback:{reason}", n)
        if self.synth is not None:
            self.synth.count(reason, n)

    def prepare(self, batch: Any) -> Prepared | None:
        """Recompute q' and X' for ``batch``, agree across the ranks, and write X', q'(X')
        into the agreed requests' fields. None: every request keeps its X, one-hot."""
        reqs = list(batch.reqs)
        b = len(reqs)
        self.events.count("batches")
        if b == 0:
            return None
        user = self._user_rows(reqs)
        synth, head = self.synth, self.head
        # Batch-wide decisions from the engine's fixed shapes: the same on every rank.
        if synth is None or head is None:
            self._fallback("unknown_head", int(user.sum()))
            return None
        reason = synth.unusable(
            num_steps=self.num_steps, vocab_size=int(batch.model_config.vocab_size), hidden_size=head.hidden_size
        )
        if reason is not None:
            self._fallback(reason, int(user.sum()))
            return None
        seen: dict[str, Any] = {}
        verdict = agree(b, 2, lambda: self._votes(batch, reqs, seen), self.group)
        return self._settle(reqs, verdict, seen, user)

    def _user_rows(self, reqs: list[Any]) -> torch.Tensor:
        """bool (B,): the rows that are user requests. SGLang's warmups and health checks
        (a fake transfer: their hidden state is whatever the metadata slot last held) are
        served like the rest but counted apart, ``probe``, never as recomputed or fallen back."""
        try:
            user = torch.tensor([not is_probe(r) for r in reqs], dtype=torch.bool)
        except Exception as exc:  # never a reason to skip the vote: every row is counted as a user row
            events = self.inst.events if self.inst is not None else self.events
            events.failed("recompute_rows", exc, "every row of the batch counted as a user request")
            return torch.ones(len(reqs), dtype=torch.bool)
        probes = int((~user).sum())
        if probes:
            self.events.count("probe", probes)
        return user

    def _votes(self, batch: Any, reqs: list[Any], seen: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (ok (B,), [X', prefill X] (B, 2)), with everything the write after the
        vote assigns staged in ``seen``; raises for a failure of this rank's own (its vote).

        The head's gathers (one a chunk of rows: ``head_probs``) are entered whatever
        happened before them: every step that reads the batch or moves it to the head's
        device runs in one ``try`` (:meth:`_inputs`); a failure there leaves the head inputs
        of the same shapes (:meth:`_blank`), or, where even those fail (an OOM on this
        rank), rows without features (:func:`_featureless`); the head and its gathers run on
        those, and the first failure is raised after them. Nothing else runs between the
        vote's start and them."""
        assert self.synth is not None and self.head is not None
        b = len(reqs)
        failed: BaseException | None = None
        try:
            # Where a fallen-back row's agreed X is written after the vote (no allocation there).
            seen["spare"] = torch.empty((b, 1), dtype=torch.int64)
            seen["x"] = torch.tensor([request_tokens(r, 1)[0] for r in reqs], dtype=torch.int64)
            inputs = self._inputs(batch, reqs)
        except Exception as exc:  # this rank votes "not ok", after the head's gather
            failed = exc
            try:
                inputs = self._blank(b)
            except Exception as blank_exc:  # raising here would skip the gather its peers wait in
                seen["blank_failed"] = blank_exc  # counted after the vote (_settle)
                inputs = _featureless(b)
        # The head (and its gather) runs whatever happened above.
        try:
            rec = self.synth.recompute(
                inputs.hidden,
                temperatures=inputs.temperatures,
                seeds=inputs.seeds,
                positions=inputs.positions,
                greedy=inputs.greedy,
            )
        except Exception:
            if failed is None:
                raise
        if failed is not None:
            raise failed  # this rank's own failure, not the head's on rows without features
        tokens = rec.tokens
        if self.head.draft_id_of is not None:
            tokens = self.head.draft_id_of[tokens]  # the builder's X is a draft id: SGLang maps it through the map
        staged = self._stage(rec, tokens)
        seen["staged"] = staged
        return staged.valid, torch.stack([staged.x[:, 0], seen["x"]], 1)

    def _inputs(self, batch: Any, reqs: list[Any]) -> _HeadInputs:
        """The head's and the draw's inputs for ``batch``, on the head's device: every read of
        the batch that can fail on one rank, in one place (:meth:`_votes` runs it in its try)."""
        assert self.head is not None
        device = self.head.device
        hidden = self._hidden(reqs)
        si = batch.sampling_info
        seeds = si.sampling_seed
        if seeds is None:
            # Without --enable-deterministic-inference SGLang has no seed: derive it from the room,
            # the same on every TP rank (rooms are unique per request).
            seeds = seed_from_room([int(getattr(r, "bootstrap_room", 0) or 0) for r in reqs])
        top_ks = getattr(si, "top_ks", None)
        return _HeadInputs(
            hidden,
            temperatures=si.temperatures.to(device),
            seeds=seeds.to(device),
            positions=batch.seq_lens.to(device),
            greedy=(top_ks <= 1).to(device) if top_ks is not None else None,
        )

    def _blank(self, b: int) -> _HeadInputs:
        """Head inputs of the shapes :meth:`_inputs` gives, for a rank whose own failed: the
        head runs its own part as its peers do, and its gather sees the bytes a real batch of
        ``b`` rows sends (what is drawn is discarded). It allocates on the head's device, so
        it can fail where :func:`_featureless` cannot."""
        assert self.head is not None
        head = self.head
        zeros = torch.zeros(b, dtype=torch.int64, device=head.device)
        return _HeadInputs(
            torch.zeros((b, head.hidden_size), dtype=head.dtype, device=head.device),
            temperatures=torch.ones((b, 1), dtype=torch.float32, device=head.device),
            seeds=zeros,
            positions=zeros,
            greedy=None,
        )

    def _stage(self, rec: Recomputed, tokens: torch.Tensor) -> Staged:
        """What the write after the vote assigns, as CPU tensors, with q''s width checked:
        the device-to-host copies and the checks that could fail on one rank run here,
        before the vote, where a failure is this rank's vote."""
        assert self.head is not None
        b, width = len(rec), self.head.vocab_size
        if tuple(rec.probs.shape) != (b, width):
            # Never after the startup checks (the head's width is the target's); the shapes
            # are the same on every rank, so every rank votes the same: no row keeps X'.
            raise _Shape(
                f"the recomputed q' is {tuple(rec.probs.shape)}, the builder reads ({b}, {width})", field="draft_probs"
            )
        return Staged(
            rec,
            x=tokens.to("cpu", torch.int64).reshape(b, 1).clone(),
            p=rec.token_probs.to("cpu", torch.float32).reshape(b, 1).clone(),
            valid=rec.valid.to("cpu", torch.bool).reshape(b).clone(),
        )

    def _hidden(self, reqs: list[Any]) -> torch.Tensor:
        assert self.head is not None
        hidden_list = [getattr(r, "hidden_states_tensor", None) for r in reqs]
        if any(h is None for h in hidden_list):
            raise _NoHidden("a request arrived without the prefill's hidden state", field="hidden_states_tensor")
        hidden = torch.stack([torch.as_tensor(h).reshape(-1) for h in hidden_list]).to(self.head.device)
        if hidden.shape[1] != self.head.hidden_size:
            raise _Shape(
                f"hidden states of width {hidden.shape[1]}, the draft head reads {self.head.hidden_size}",
                field="hidden_states_tensor",
            )
        return hidden

    def _settle(self, reqs: list[Any], verdict: Verdict, seen: dict[str, Any], user: torch.Tensor) -> Prepared | None:
        """Apply the verdict; after the vote nothing can fail on one rank alone. Agreed rows
        get the staged X' and q'(X'), a fallen-back row the agreed prefill X (the smallest any
        rank holds) where this rank's differs: assignments of CPU tensors :meth:`_votes`
        staged. Then the counts (``user``: the rows counted, :meth:`_user_rows`)."""
        staged: Staged | None = seen.get("staged")
        agreed = verdict.ok & (verdict.lo[:, 0] == verdict.hi[:, 0]) & (verdict.lo[:, 0] != NEUTRAL)
        if staged is None:  # this rank's own vote failed (its ok is False on every row already)
            agreed = torch.zeros_like(agreed)
        x_agreed = verdict.lo[:, 1]
        mine = seen.get("x")
        spare = seen.get("spare")
        if spare is None:  # votes() failed at its first line: nothing of this batch was built
            spare = torch.empty((len(reqs), 1), dtype=torch.int64)
        for i in (~agreed).nonzero().view(-1).tolist():
            # Every rank verifies the same X: the smallest any rank holds (they all hold it normally).
            if x_agreed[i] != NEUTRAL and (mine is None or int(mine[i]) != int(x_agreed[i])):
                spare[i, 0] = x_agreed[i]
                reqs[i].output_topk_index = spare[i]
        state: Prepared | None = None
        if staged is not None and bool(agreed.any()):
            for i in agreed.nonzero().view(-1).tolist():
                reqs[i].output_topk_index = staged.x[i]
                reqs[i].output_topk_p = staged.p[i]
            state = Prepared(staged.rec, agreed, user)
        events = self.inst.events if self.inst is not None else self.events
        try:
            blank_failed = seen.get("blank_failed")
            if blank_failed is not None:
                events.failed("recompute_blank", blank_failed, "the head's gathers on rows without features")
            self._count(verdict, staged, agreed, user)
        except Exception as exc:  # counting never changes what this rank hands SGLang after the vote
            events.failed("recompute_count", exc, "the batch as agreed (its counts are lost)")
        return state

    def _count(self, verdict: Verdict, staged: Staged | None, agreed: torch.Tensor, user: torch.Tensor) -> None:
        self.events.count("recomputed", int((agreed & user).sum()))
        n_bad = int((~agreed & user).sum())
        if n_bad == 0:
            return
        err = verdict.error
        events = self.inst.events if self.inst is not None else self.events
        if verdict.failed is not None:
            events.failed("recompute_agreement", verdict.failed, "the prefill's X with a one-hot proposal")
            self._fallback("agreement_failed", n_bad)
        elif err is not None:
            reason = "no_hidden" if isinstance(err, _NoHidden) else "shape" if isinstance(err, _Shape) else "failed"
            if reason == "failed":
                events.failed("recompute", err, "the prefill's X with a one-hot proposal (on every rank)")
            self._fallback(reason, n_bad)
        else:
            valid = staged.valid if staged is not None else torch.zeros_like(agreed)
            invalid = int((~valid & user).sum())
            peer = int((valid & ~verdict.ok & user).sum())
            differs = n_bad - invalid - peer
            if invalid:
                self._fallback("invalid_row", invalid)
            if peer:
                self._fallback("peer_failed", peer)
            if differs:
                self._fallback("rank_mismatch", differs)

    def propose(self, batch: Any, state: Any, topk_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(b, 1, V) q' for the builder, in q' itself: agreed rows kept, the others the one-hot at X."""
        if not isinstance(state, Prepared):
            return one_hot_at(topk_index, vocab_size)
        q = state.rec.probs.to(device=topk_index.device, dtype=torch.float32)
        if q.shape != (topk_index.shape[0], vocab_size) or topk_index.shape[1] != 1:
            # SGLang's own shapes differ from the head's (refused at startup): the agreed rows
            # hold X' and verify the one-hot at X' (exact); counted as such, once.
            self._fallback("propose_shape", int((state.agreed & state.user).sum()))
            return one_hot_at(topk_index, vocab_size)
        rows = (~state.agreed).nonzero().view(-1).to(q.device)
        x = topk_index[rows, 0].to(torch.int64).clamp(0, vocab_size - 1)  # one_hot_at's X
        q.index_fill_(0, rows, 0.0)[rows, x] = 1.0
        return q.unsqueeze(1)

    def parts(self) -> dict[str, dict[str, int]]:
        return {"recompute": dict(self.counts)}


def _featureless(b: int) -> _HeadInputs:
    """Head inputs of ``b`` rows and no features, on the CPU (nothing on the head's device),
    for a rank whose blank inputs failed too. The head refuses their width before any kernel
    and gathers zeros of its peers' dtype and width (:meth:`.SGLangDraftHead.logits`)."""
    zeros = torch.zeros(b, dtype=torch.int64)
    return _HeadInputs(torch.empty((b, 0)), temperatures=torch.ones((b, 1)), seeds=zeros, positions=zeros, greedy=None)


class _NoHidden(ValidationError):
    """A request of the batch arrived without the prefill's hidden state (fallback ``no_hidden``)."""


class _Shape(ValidationError):
    """The hidden states are not the draft head's width (fallback ``shape``)."""


# After the modules this one imports (sources' "decode"): the table's order, as before the split.
register_feature(FEATURE)
