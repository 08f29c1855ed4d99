"""SGLang decode-only recompute: the decode recomputes the first proposal with its own draft head.

With ``synthesizer = "recompute"`` the drop-in runs on the **decode only**; the prefill
runs plain SGLang (no row, no handshake frame, no prefill patch). SGLang's prefill ships
the draft model's hidden state at the last position (``EAGLEWorkerV2._draft_extend_for_prefill``
returns ``hidden_states=logits_output.hidden_states``); the decode's builder reads it as
``req.hidden_states_tensor``. Before SGLang's ``build_eagle_disagg_draft_input`` runs,
:class:`DecodeRecompute` computes, for the whole prebuilt batch at once:

- q' = ``sampling_softmax(logits / T)`` (SGLang's ``renorm_draft_probs``) with logits from
  :class:`SGLangDraftHead`, the decode's own draft model with what its ``LogitsProcessor``
  applies;
- X' = SGLang's ``fast_sample(q', sampling_seed, positions=seq_lens)``: seeded by the
  request's sampling seed, or without one by a seed derived from its bootstrap room, so
  every TP rank draws the same X'; a greedy row (``top_k <= 1``) proposes its argmax;

and writes X' and q'(X') into each request's ``output_topk_index``/``output_topk_p`` (the
fields the builder reads), then hands q' as the builder's ``pd_first_draft_proposal``.
All of it happens inside the original builder's call, so **before** ``future_map.stash``
copies the draft input under the overlap scheduler.

Where it runs, and what is refused at startup (:func:`check_placement`,
``docs/sglang.md``): the builder runs on the scheduler thread
(``Scheduler.get_new_prebuilt_batch`` -> ``process_prebuilt``). A head with no collective
(TP 1, or DP attention with ``--enable-dp-lm-head`` at attention-TP 1) is safe there,
with or without overlap and draft CUDA graphs (the head runs outside them). A
vocab-parallel head (TP > 1) all-gathers its logits: from the scheduler thread that is
only safe with ``--disable-overlap-schedule`` (no forward in flight; every TP rank of a
node builds the same prebuilt batch in the same order, since SGLang's transfer polls are
all-reduced over the TP group), so it is refused with overlap on. DP attention without
``--enable-dp-lm-head`` gathers hidden states over every DP rank, whose prebuilt batches
are not synchronised: refused.

:data:`ARCHITECTURES` is the table of DESIGN section 10, read in SGLang 0.5.23's model
code: which hidden state the prefill ships, and so what the head applies to it.
"""

from __future__ import annotations

import contextvars
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._errors import ConfigError, PluginError
from ..draft_head import DRAFT_HEAD
from ..recompute import Recomputed, RecomputeSynthesizer, draw_proposal, inverse_cdf, seed_from_room

if TYPE_CHECKING:
    from .sglang_installation import Installation

logger = logging.getLogger("pd_middleware.integrations.sglang")


@dataclass(frozen=True)
class HeadRule:
    """How one draft architecture turns the shipped hidden state into logits.

    ``norm``: attribute path of the norm applied before ``lm_head`` (None: ``lm_head(h)``);
    ``normed_if``: a config flag under which the shipped h is already normed;
    ``shipped``: what the prefill ships (for the docs and error messages).
    """

    norm: str | None
    normed_if: str | None
    shipped: str


#: Draft architectures the head knows (SGLang 0.5.23; checked at startup).
ARCHITECTURES: dict[str, HeadRule] = {
    # llama_eagle3.py LlamaModel.forward: `_, aux = self.norm(hidden, residual)`; aux (the
    # pre-norm residual sum) is captured unless config.norm_output.
    "LlamaForCausalLMEagle3": HeadRule("model.norm", "norm_output", "pre-norm residual sum"),
    # llama_eagle.py: the layer output goes to the LogitsProcessor unnormed.
    "LlamaForCausalLMEagle": HeadRule(None, None, "layer output, no final norm"),
    # deepseek_nextn.py: hidden_states after shared_head.norm go to the LogitsProcessor.
    "DeepseekV3ForCausalLMNextN": HeadRule(None, None, "after shared_head.norm"),
    # qwen3_next_mtp.py: the model's output, after its final norm.
    "Qwen3NextForCausalLMMTP": HeadRule(None, None, "after the final norm"),
}


def _attr(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


class SGLangDraftHead:
    """The decode's draft model as a :class:`~pd_middleware.draft_head.DraftHead`.

    ``model``: the draft model (``scheduler.draft_worker.draft_worker.draft_runner.model``);
    ``vocab_size``: the target's V. Applies, in ``LogitsProcessor._get_logits``' order:
    the architecture's norm (:data:`ARCHITECTURES`), ``_compute_lm_head`` (quantised and
    LoRA heads included), ``logit_scale``, the TP gather, the slice to the vocab and the
    fp32 cast (``_copy_logits_to_buffer``), softcapping; then scatters through
    ``hot_token_id`` into target ids. Raises PluginError for an unknown architecture.
    """

    def __init__(self, model: Any, vocab_size: int) -> None:
        arch = type(model).__name__
        rule = ARCHITECTURES.get(arch)
        if rule is None:
            raise PluginError(
                f"draft model {arch} is not in the recompute head table ({', '.join(ARCHITECTURES)})", plugin="sglang"
            )
        self.model = model
        self.arch = arch
        self.lp = model.logits_processor
        self.lm_head = model.lm_head
        cfg = getattr(model, "config", None)
        normed = rule.normed_if is not None and bool(getattr(cfg, rule.normed_if, False))
        self.norm: Callable[[torch.Tensor], torch.Tensor] | None = (
            None if rule.norm is None or normed else _attr(model, rule.norm)
        )
        self.vocab_size = int(vocab_size)
        weight = getattr(self.lm_head, "weight", None)
        self.hidden_size = int(getattr(cfg, "hidden_size", 0) or (weight.shape[1] if weight is not None else 0))
        self.dtype = weight.dtype if weight is not None else torch.bfloat16
        self.device = weight.device if weight is not None else torch.device("cpu")
        hot = getattr(model, "hot_token_id", None)
        self.hot_token_id: torch.Tensor | None = None
        self.draft_id_of: torch.Tensor | None = None
        if hot is not None:
            hot = hot.to(self.device, torch.int64)
            if hot.numel() != self.vocab_size:
                # SGLang refuses this under rejection sampling (eagle_worker_v2.py, draft vocab != target).
                raise PluginError(f"hot_token_id maps {hot.numel()} draft ids, target V={vocab_size}", plugin="sglang")
            self.hot_token_id = hot
            inv = torch.empty_like(hot)
            inv[hot] = torch.arange(hot.numel(), device=hot.device)
            self.draft_id_of = inv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 (B, V) target-vocab logits for ``hidden`` (B, H)."""
        lp = self.lp
        with torch.no_grad():
            h = hidden.to(self.device, self.dtype)
            if self.norm is not None:
                h = self.norm(h)
            logits = lp._compute_lm_head(h, self.lm_head)
            if lp.logit_scale is not None:
                logits.mul_(lp.logit_scale)
            if lp.do_tensor_parallel_all_gather:
                # Placement checked at startup (check_placement): no forward in flight.
                logits = lp._gather_attn_tp_logits(logits) if lp.use_attn_tp_group else lp._logits_gatherer(logits)
            cap = lp.final_logit_softcapping
            fuse = bool(cap) and logits.is_cuda and logits.dtype in (torch.float16, torch.bfloat16)
            logits = lp._copy_logits_to_buffer(logits, None, use_buffer=False, softcap=cap if fuse else None)
            if cap and not fuse:
                if logits.is_cuda:  # SGLang's in-place Triton kernel, as LogitsProcessor on CUDA
                    from sglang.srt.layers.logits_processor import fused_softcap

                    fused_softcap(logits, cap)
                else:  # the CPU/NPU formula of LogitsProcessor._get_logits
                    logits = cap * torch.tanh(logits / cap)
            if self.hot_token_id is not None:
                logits = torch.empty_like(logits).scatter_(1, self.hot_token_id.expand_as(logits), logits)
        out: torch.Tensor = logits
        return out


def find_draft_model(scheduler: Any) -> Any:
    """The decode's draft model: ``scheduler.draft_worker`` (EAGLEWorkerV2) -> ``draft_worker``
    (its EagleDraftWorker) -> ``draft_runner`` (ModelRunner) -> ``model``; None when absent
    (no speculative worker, or not the last PP stage)."""
    worker = getattr(scheduler, "draft_worker", None)
    inner = getattr(worker, "draft_worker", None) if worker is not None else None
    runner = getattr(inner, "draft_runner", None) if inner is not None else None
    if runner is None and worker is not None:
        runner = getattr(worker, "draft_runner", None)
    return getattr(runner, "model", None) if runner is not None else None


def check_placement(lp: Any, *, enable_overlap: bool) -> None:
    """Refuse (ConfigError) the setups where the head cannot run from the scheduler thread."""
    if getattr(lp, "do_tensor_parallel_all_gather_dp_attn", False):
        raise ConfigError(
            'synthesizer = "recompute" under DP attention needs --enable-dp-lm-head: without it the draft head '
            "gathers hidden states over every DP rank, whose prebuilt batches are not synchronised",
            path="synthesizer",
        )
    if getattr(lp, "do_tensor_parallel_all_gather", False) and enable_overlap:
        raise ConfigError(
            'synthesizer = "recompute" with a vocab-parallel draft head (TP > 1) all-gathers its logits from the '
            "scheduler thread, which is unsafe while an overlapped forward is in flight: run the decode with "
            "--disable-overlap-schedule, or use a shipped strategy (configs/sparse_floor.toml)",
            path="synthesizer",
        )


# The prebuilt batch's recomputed proposal, set by the build wrapper and read by the
# pd_first_draft_proposal replacement within the same builder call.
# _OUTSIDE: no builder call in progress; None: in the builder, the batch fell back.
_OUTSIDE: Any = object()
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("pd_middleware_recompute", default=_OUTSIDE)


def one_hot_at(topk_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 (b, n, V) one-hot at X (clamped into [0, V)), built here: it never depends on
    SGLang's own ``pd_first_draft_proposal`` (exact for any X)."""
    x = topk_index.to(torch.int64).clamp(0, int(vocab_size) - 1)
    out = torch.zeros((*x.shape, int(vocab_size)), dtype=torch.float32, device=x.device)
    return out.scatter_(-1, x.unsqueeze(-1), 1.0)


class DecodeRecompute:
    """The decode's recompute step for SGLang prebuilt batches.

    ``synth``: the configured :class:`~pd_middleware.recompute.RecomputeSynthesizer`,
    built with SGLang's head (:meth:`bind`); None until the scheduler starts, when every
    batch falls back to one-hot (counted ``unknown_head``). ``fast_sample``/``softmax``:
    SGLang's ``spec_utils.fast_sample`` and ``sampling_softmax``, injected.
    ``counts``: ``batches``, ``recomputed`` (requests), ``fallback:<reason>``.
    """

    def __init__(self, config: Any, registry: Any = None, metrics: Any = None) -> None:
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.synth: RecomputeSynthesizer | None = None
        self.head: SGLangDraftHead | None = None
        self.num_steps = 1
        self.counts: Counter[str] = Counter()
        self._fast_sample: Any = None
        self._softmax: Any = None
        #: Which sampler draws X' (set at the first batch): SGLang's seeded fast_sample, or the core's.
        self.sampler = ""

    def bind(self, head: SGLangDraftHead | None, *, vocab_size: int, num_steps: int, rejection_sampling: bool) -> None:
        """Build the synthesizer for the engine (scheduler start); ``head`` None: unknown head."""
        from ..config import resolve_plugins
        from ..contracts import PluginContext
        from ..registry import default_registry

        reg = self.registry if self.registry is not None else default_registry()
        resolved = resolve_plugins(self.config, reg, None, sides=("decode",))
        r = resolved.synthesizers["default"]
        ctx = PluginContext(
            vocab_size=vocab_size,
            num_steps=num_steps,
            rejection_sampling=rejection_sampling,
            device=str(head.device) if head is not None else "cpu",
            capabilities={DRAFT_HEAD: head if head is not None else _UNKNOWN_HEAD},
        )
        synth = reg.build(r.spec, r.options, ctx, r.key)
        if not isinstance(synth, RecomputeSynthesizer):
            raise ConfigError(f"expected the recompute synthesizer, got {r.spec.name!r}", path=r.key)
        if self.metrics is not None:
            synth.guard.attach_metrics(self.metrics)
        self.synth, self.head, self.num_steps = synth, head, num_steps

    def _sglang_ops(self, device: torch.device) -> tuple[Any, Any]:
        """SGLang's ``fast_sample`` (seeded) and ``sampling_softmax``, probed once on ``device``.

        The seeded ``fast_sample`` hashes with ``murmur_hash32``, which on CPU needs
        sgl-kernel's CPU build; where that is missing the draw is the core's seeded
        inverse-CDF draw (:func:`~pd_middleware.recompute.inverse_cdf`): the same
        law, the same on every rank, another random stream than the prefill's (logged).
        """
        if self._fast_sample is None:
            from sglang.srt.speculative.spec_utils import fast_sample, sampling_softmax

            def sglang_draw(
                probs: torch.Tensor, s: torch.Tensor, pos: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
                out: tuple[torch.Tensor, torch.Tensor] = fast_sample(probs, 1, sampling_seed=s, positions=pos)
                return out

            try:
                one = torch.ones(1, dtype=torch.int64, device=device)
                sglang_draw(torch.full((1, 2), 0.5, device=device), one, one)
                self._fast_sample, self.sampler = sglang_draw, "sglang.fast_sample"
            except (ImportError, AttributeError, RuntimeError, NotImplementedError) as exc:
                # A probe: ImportError without sgl-kernel, AttributeError/RuntimeError where its
                # package is present but its CPU ops (murmur_hash32_cpu) are not built.
                logger.warning(
                    "pd-middleware recompute: SGLang's seeded fast_sample is unavailable on %s (%s); drawing X' "
                    "with the seeded inverse-CDF draw of pd_middleware.recompute instead (same law, rank-agreed)",
                    device,
                    exc,
                )
                self._fast_sample, self.sampler = inverse_cdf, "pd_middleware.inverse_cdf"
            self._softmax = sampling_softmax
        return self._fast_sample, self._softmax

    def _fallback(self, reason: str, n: int) -> None:
        self.counts[f"fallback:{reason}"] += n
        if self.synth is not None:
            self.synth.count(reason, n)

    def prepare(self, batch: Any) -> Recomputed | None:
        """Recompute q' and X' for ``batch`` and write X', q'(X') into its requests' fields.

        Returns the :class:`~pd_middleware.recompute.Recomputed` the proposal
        replacement hands over, or None (every request keeps the prefill's X, one-hot).
        """
        reqs = list(batch.reqs)
        b = len(reqs)
        self.counts["batches"] += 1
        if b == 0:
            return None
        synth = self.synth
        if synth is None or self.head is None:
            self._fallback("unknown_head", b)
            return None
        hidden_list = [getattr(r, "hidden_states_tensor", None) for r in reqs]
        if any(h is None for h in hidden_list):
            self._fallback("no_hidden", b)
            return None
        hidden = torch.stack([torch.as_tensor(h).reshape(-1) for h in hidden_list]).to(self.head.device)
        reason = synth.unusable(
            num_steps=self.num_steps, vocab_size=int(batch.model_config.vocab_size), hidden_size=int(hidden.shape[1])
        )
        if reason is not None:
            self._fallback(reason, b)
            return None
        draw, softmax = self._sglang_ops(hidden.device)
        si = batch.sampling_info
        seeds = si.sampling_seed
        if seeds is None:
            # Without --enable-deterministic-inference SGLang has no seed: derive it from the room,
            # the same on every TP rank (rooms are unique per request).
            seeds = seed_from_room([int(getattr(r, "bootstrap_room", 0) or 0) for r in reqs]).to(hidden.device)
        top_ks = getattr(si, "top_ks", None)
        greedy = (top_ks <= 1).to(hidden.device) if top_ks is not None else None

        with torch.no_grad():
            logits = self.head.logits(hidden)
            probs = softmax(logits, temperatures=si.temperatures.to(logits.device))
            rec = draw_proposal(probs, seeds=seeds, positions=batch.seq_lens, greedy=greedy, draw=draw)
        valid = rec.valid.tolist()
        n_bad = valid.count(False)
        if n_bad:
            self._fallback("invalid_row", n_bad)
        tokens = rec.tokens
        if self.head.draft_id_of is not None:
            tokens = self.head.draft_id_of[tokens]  # SGLang maps topk_index through hot_token_id itself
        toks, tps = tokens.cpu().tolist(), rec.token_probs.float().cpu().tolist()
        for i, r in enumerate(reqs):
            if valid[i]:
                r.output_topk_index = torch.tensor([toks[i]], dtype=torch.int64)
                r.output_topk_p = torch.tensor([tps[i]], dtype=torch.float32)
        self.counts["recomputed"] += b - n_bad
        return rec

    def proposal(self, rec: Recomputed, topk_index: torch.Tensor, vocab_size: int, first: Any) -> torch.Tensor:
        """(b, 1, V) q' for the builder: recomputed rows where valid, else SGLang's one-hot at X."""
        q = rec.probs.to(device=topk_index.device, dtype=torch.float32)
        one_hot = one_hot_at(topk_index, vocab_size)
        if q.shape != (topk_index.shape[0], vocab_size) or topk_index.shape[1] != 1:
            self._fallback("shape", int(topk_index.shape[0]))
            return one_hot
        out: torch.Tensor = torch.where(rec.valid.to(q.device).view(-1, 1), q, one_hot[:, 0]).unsqueeze(1)
        return out


class _UnknownHead:
    """Offered as ``draft_head`` when the engine's draft model is not in the table: the
    synthesizer builds, and every batch falls back to one-hot, counted ``unknown_head``."""


_UNKNOWN_HEAD = _UnknownHead()


def wrap_build(build: Callable[..., Any], inst: Installation) -> Callable[..., Any]:
    """``build_eagle_disagg_draft_input``: recompute first, inside the call (before the stash).

    Guarded: a failure of the recompute step is counted (``guard:recompute:<error>``) and
    the batch keeps the prefill's X with SGLang's one-hot proposal (exact for any X).
    """
    recompute = inst.recompute
    assert recompute is not None

    def build_eagle_disagg_draft_input(batch: Any, last_tokens_tensor: Any, future_map: Any) -> Any:
        try:
            rec = recompute.prepare(batch)
        except Exception as exc:
            inst.guard.failed("recompute", exc, "the prefill's X with SGLang's one-hot proposal")
            rec = None
        token = _current.set(rec)
        try:
            return build(batch, last_tokens_tensor, future_map)
        finally:
            _current.reset(token)

    return build_eagle_disagg_draft_input


def wrap_proposal(first: Callable[..., Any], inst: Installation) -> Callable[..., Any]:
    """``pd_first_draft_proposal``: q' of the batch being built, else SGLang's one-hot.

    Guarded like every per-batch wrapper: a failure gives SGLang's one-hot at the X the
    builder read (X' where the recompute step wrote it: one-hot is exact for any X).
    """
    from .sglang_patch import check_proposal

    recompute = inst.recompute
    assert recompute is not None

    def pd_first_draft_proposal(topk_index: Any, vocab_size: int) -> Any:
        rec = _current.get()
        if rec is _OUTSIDE:
            return first(topk_index, vocab_size)  # not the PD first draft input: not ours
        if rec is None:  # the batch fell back (counted): one-hot at the builder's X
            return one_hot_at(topk_index, vocab_size)
        try:
            out = recompute.proposal(rec, topk_index, vocab_size, first)
            check_proposal(out, topk_index, vocab_size)
            return out
        except Exception as exc:
            inst.guard.failed("recompute_proposal", exc, "a one-hot proposal at the builder's X")
            return one_hot_at(topk_index, vocab_size)

    return pd_first_draft_proposal


def capture(recompute: DecodeRecompute, scheduler: Any, *, vocab_size: int, num_steps: int, rs: bool) -> None:
    """At scheduler start (decode): find the draft model, check the placement, bind."""
    model = find_draft_model(scheduler)
    if model is None:
        raise ConfigError(
            'synthesizer = "recompute" needs the decode\'s EAGLE draft worker (scheduler.draft_worker), and this '
            "scheduler has none (no speculative algorithm, or not the last pipeline stage); use a shipped strategy",
            path="synthesizer",
        )
    head: SGLangDraftHead | None
    try:
        head = SGLangDraftHead(model, vocab_size)
    except PluginError as exc:
        logger.warning("pd-middleware recompute: %s; every request falls back to one-hot (counted)", exc)
        head = None
    if head is not None:
        check_placement(head.lp, enable_overlap=bool(getattr(scheduler, "enable_overlap", False)))
    recompute.bind(head, vocab_size=vocab_size, num_steps=num_steps, rejection_sampling=rs)
    logger.info(
        "pd-middleware recompute active on the decode: draft %s, V=%d, S=%d",
        head.arch if head is not None else type(model).__name__,
        vocab_size,
        num_steps,
    )


def uses_recompute(config: Any) -> bool:
    """Whether the config's decode synthesizer is ``recompute`` (the decode-only drop-in)."""
    return bool(config.synthesizer.name == "recompute" and not config.arms)


def activate_recompute(inst: Installation, facts: Any, scheduler: Any) -> None:
    """Scheduler start with ``synthesizer = "recompute"``: the decode captures its draft head.

    ``scheduler`` None (a harness that passes EngineFacts): the head is bound later with
    :func:`capture`. A prefill has nothing to do (decode-only).
    """
    rc = inst.recompute
    assert rc is not None
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
    if scheduler is not None:
        capture(rc, scheduler, vocab_size=facts.vocab_size, num_steps=facts.num_steps, rs=facts.rejection_sampling)
