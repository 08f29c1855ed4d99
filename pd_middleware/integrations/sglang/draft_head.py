"""The decode's SGLang draft model as a :class:`~pd_middleware.core.draft_head.DraftHead`.

Decode-only recompute (:mod:`.recompute`) needs the draft's logits for the hidden state
SGLang's prefill ships. :class:`SGLangDraftHead` computes them from the decode's own draft
model with what that model's ``LogitsProcessor`` applies, in its order, and scatters them
into target ids through the draft's token map. What it cannot serve it refuses when it is
built, at scheduler start (:func:`check_servable`: a quantised or a LoRA ``lm_head``).

:data:`ARCHITECTURES` is the table of DESIGN section 10, read in SGLang 0.5.23's model
code: which hidden state the prefill ships, and so what the head applies to it.
:func:`find_draft_model` finds the model on a scheduler.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...core._errors import ConfigError, PluginError, ValidationError
from .ordering import UNORDERED, ForwardOrder
from .patching import LOGITS_MODULE, Symbols
from .startup import draft_worker_of

FUSED_SOFTCAP = f"{LOGITS_MODULE}.fused_softcap"
COPY_LOGITS = f"{LOGITS_MODULE}.LogitsProcessor._copy_logits_to_buffer"


def copy_without_softcap(copy: Any) -> Callable[..., Any]:
    """The ``_copy_logits_to_buffer`` row's adapter up to SGLang 0.5.21, whose copy takes no
    ``softcap``: the copy (slice to the vocab, fp32), then the softcap by the CPU/NPU formula
    of ``LogitsProcessor._get_logits`` (those releases cap after the copy themselves)."""

    def copy_logits(self: Any, logits: Any, logits_metadata: Any, use_buffer: bool = True, softcap: Any = None) -> Any:
        out = copy(self, logits, logits_metadata, use_buffer)
        return out if not softcap else softcap * torch.tanh(out / softcap)

    return copy_logits


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


#: The lm_head quant methods under which SGLang's ``_compute_lm_head`` runs a plain matmul
#: of the float weight (``logits_processor._UNQUANTIZED_LM_HEAD_METHODS``, SGLang 0.5.23).
UNQUANTIZED_METHODS = frozenset({"UnquantizedEmbeddingMethod", "UnquantizedLinearMethod", "PackWeightMethod"})
#: The weight dtypes the head runs (the hidden state is cast to the weight's dtype).
FLOAT_WEIGHTS = (torch.float16, torch.bfloat16, torch.float32)


def check_servable(lm_head: Any) -> torch.Tensor:
    """The draft's ``lm_head`` weight, once the heads recompute cannot serve are refused
    (ConfigError, naming the flag or the quantisation):

    - a LoRA-wrapped head (what ``_compute_lm_head`` tells by ``set_lora``/``apply_lora``;
      ``--lora-target-modules`` with ``lm_head``): its forward reads the adapters of the
      forward batch in flight, which the scheduler thread's prebuilt batch is not;
    - a quantised head: a quant method other than SGLang's unquantised ones, a weight that
      is not fp16/bf16/fp32, or no weight at all (GGUF): the head casts the hidden state
      to the weight's dtype and multiplies, so it would be garbage or fail on every batch.
    """
    head = type(lm_head).__name__
    if hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"):
        raise ConfigError(
            f'synthesizer = "recompute" cannot serve a LoRA draft lm_head ({head}): its forward applies the '
            "adapters of the forward batch in flight, not those of the batch being built. Leave lm_head out of "
            "--lora-target-modules, or use a shipped strategy (configs/sparse_floor.toml)",
            path="synthesizer",
        )
    method = getattr(lm_head, "quant_method", None)
    name = type(method).__name__ if method is not None else None
    weight = getattr(lm_head, "weight", None)
    dtype = getattr(weight, "dtype", None)
    if (name is not None and name not in UNQUANTIZED_METHODS) or weight is None or dtype not in FLOAT_WEIGHTS:
        config = getattr(lm_head, "quant_config", None)
        get_name = getattr(config, "get_name", None)
        quant = get_name() if callable(get_name) else "unknown quantization"
        raise ConfigError(
            f'synthesizer = "recompute" cannot serve a quantised draft lm_head ({head}: {quant}, {name}, weight '
            f"{dtype}): it runs the head's plain matmul of a float weight. Serve the draft unquantised "
            "(--speculative-draft-model-quantization unquant), or use a shipped strategy (configs/sparse_floor.toml)",
            path="synthesizer",
        )
    out: torch.Tensor = weight
    return out


class SGLangDraftHead:
    """The decode's draft model as a :class:`~pd_middleware.core.draft_head.DraftHead`.

    ``model``: the draft model (``scheduler.draft_worker.draft_worker.draft_runner.model``);
    ``vocab_size``: the target's V; ``hot_token_id``: the draft's token map (draft id ->
    target id: the worker's or the model's), None for none; ``scope``: a context manager
    factory the head runs in (SGLang's draft TP context); ``symbols``: the table's READ
    targets (``fused_softcap``); ``order``: where the head's work is issued (the
    scheduler's forward stream under the overlap scheduler when the head gathers,
    :mod:`.ordering`; none by default; set by the scheduler-start capture). Applies, in
    ``LogitsProcessor._get_logits``' order: the architecture's norm (:data:`ARCHITECTURES`), ``_compute_lm_head``, ``logit_scale``,
    the TP gather, the slice to the vocab and the fp32 cast (``_copy_logits_to_buffer``),
    softcapping; then scatters through the token map into target ids. Raises PluginError
    for an unknown architecture, ConfigError for a LoRA or quantised lm_head
    (:func:`check_servable`).

    **The gather runs on every rank, always, on the same bytes**: a failure of this rank's
    part before it (hidden states of another width, refused before any kernel, or its norm
    or matmul) is remembered, the gather runs on zeros of the
    dtype and width a real output of this part had at construction (``out_dtype``,
    ``local_width``: fp32 under ``--enable-fp32-lm-head`` whatever the weight's dtype),
    and the failure is raised after it, so no rank leaves the others waiting in the
    collective or hands them another byte count.
    """

    def __init__(
        self,
        model: Any,
        vocab_size: int,
        *,
        hot_token_id: torch.Tensor | None = None,
        scope: Callable[[], Any] = contextlib.nullcontext,
        symbols: Symbols | None = None,
        order: ForwardOrder = UNORDERED,
    ) -> None:
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
        self.scope = scope
        self.order = order
        self.symbols = symbols if symbols is not None else Symbols()
        cfg = getattr(model, "config", None)
        normed = rule.normed_if is not None and bool(getattr(cfg, rule.normed_if, False))
        self.norm: Callable[[torch.Tensor], torch.Tensor] | None = (
            None if rule.norm is None or normed else _attr(model, rule.norm)
        )
        self.vocab_size = int(vocab_size)
        weight = check_servable(self.lm_head)
        self.hidden_size = int(getattr(cfg, "hidden_size", 0) or weight.shape[1])
        self.dtype = weight.dtype
        self.device = weight.device
        hot = hot_token_id if hot_token_id is not None else getattr(model, "hot_token_id", None)
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
        # What this rank hands the gather, from a real output of its part (one zero row):
        # a rank whose part fails enters the gather with zeros of exactly this dtype and
        # width, the bytes its peers send (under --enable-fp32-lm-head a bf16 head's
        # output is fp32). Rank-local, no collective.
        with torch.no_grad(), self.scope():
            out = self._local(torch.zeros((1, self.hidden_size), dtype=self.dtype, device=self.device))
        self.out_dtype: torch.dtype = out.dtype
        self.local_width = int(out.shape[1])

    @property
    def logits_width(self) -> int:
        """The width of the draft's logits after the gather and the slice: its LogitsProcessor's vocab."""
        return int(getattr(self.lp, "vocab_size", self.local_width))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 (B, V) target-vocab logits for ``hidden`` (B, H)."""
        lp = self.lp
        b = hidden.shape[0]
        # Under the overlap scheduler a gathering head runs on the forward stream, in the
        # scheduler's program order (the same on every rank): ordering.py.
        with torch.no_grad(), self.order() as ordered, self.scope():
            failed: BaseException | None = None
            try:
                if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
                    # Refused before any kernel: a rank's stand-in rows without features
                    # (recompute's _featureless) still gather zeros below.
                    raise ValidationError(
                        f"the draft head reads (B, {self.hidden_size}) hidden states, got {tuple(hidden.shape)}",
                        field="hidden",
                    )
                logits = self._local(hidden)
                if logits.dtype != self.out_dtype or tuple(logits.shape) != (b, self.local_width):
                    raise ValidationError(
                        f"the draft head's output is {logits.dtype} {tuple(logits.shape)}, at startup it was "
                        f"{self.out_dtype} ({b}, {self.local_width})",
                        field="logits",
                    )
            except Exception as exc:  # this rank's part failed: the gather below still runs, on the same bytes
                failed = exc
                logits = torch.zeros((b, self.local_width), dtype=self.out_dtype, device=self.device)
            if lp.do_tensor_parallel_all_gather:
                # Placement checked at startup (check_placement): without the overlap
                # scheduler no forward is in flight; with it, self.order issues this on the
                # forward stream, after the forward in flight and before the next.
                logits = lp._gather_attn_tp_logits(logits) if lp.use_attn_tp_group else lp._logits_gatherer(logits)
            if failed is not None:
                raise failed
            logits = ordered.keep(self._finish(logits))
        out: torch.Tensor = logits
        return out

    def _local(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's part, before the gather: the norm, ``_compute_lm_head``, ``logit_scale``."""
        lp = self.lp
        h = hidden.to(self.device, self.dtype)
        if self.norm is not None:
            h = self.norm(h)
        logits: torch.Tensor = lp._compute_lm_head(h, self.lm_head)
        if lp.logit_scale is not None:
            logits.mul_(lp.logit_scale)
        return logits

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        lp = self.lp
        cap = lp.final_logit_softcapping
        fuse = bool(cap) and logits.is_cuda and logits.dtype in (torch.float16, torch.bfloat16)
        copy = self.symbols.get(COPY_LOGITS)  # the release's row, adapted to take softcap
        if copy is not None:
            logits = copy(lp, logits, None, use_buffer=False, softcap=cap if fuse else None)
        else:  # stand-ins without the table's symbols
            logits = lp._copy_logits_to_buffer(logits, None, use_buffer=False, softcap=cap if fuse else None)
        if cap and not fuse:
            if logits.is_cuda:  # SGLang's in-place Triton kernel, as LogitsProcessor on CUDA
                self.symbols[FUSED_SOFTCAP](logits, cap)
            else:  # the CPU/NPU formula of LogitsProcessor._get_logits
                logits = cap * torch.tanh(logits / cap)
        if self.hot_token_id is not None:
            logits = torch.empty_like(logits).scatter_(1, self.hot_token_id.expand_as(logits), logits)
        return logits


def find_draft_model(scheduler: Any) -> Any:
    """The decode's draft model: ``scheduler.draft_worker`` (EAGLEWorkerV2) -> ``draft_worker``
    (its EagleDraftWorker) -> ``draft_runner`` (ModelRunner) -> ``model``; None when absent
    (no speculative worker, or not the last PP stage)."""
    worker = getattr(scheduler, "draft_worker", None)
    inner = draft_worker_of(scheduler)
    runner = getattr(inner, "draft_runner", None) if inner is not None else None
    if runner is None and worker is not None:
        runner = getattr(worker, "draft_runner", None)
    return getattr(runner, "model", None) if runner is not None else None
