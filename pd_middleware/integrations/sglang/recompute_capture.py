"""Decode-only recompute at scheduler start: the decode's draft head captured, checked and bound.

:func:`capture` runs once, when the decode's scheduler starts
(:meth:`~.recompute.RecomputeSource.bind`): it finds SGLang's draft model, builds
:class:`~.draft_head.SGLangDraftHead` on it inside SGLang's draft TP context
(:func:`_draft_scope`), offers SGLang's seeded ``fast_sample`` as the draw
(:func:`_sglang_draw`), and binds the source. The ``recompute`` feature's rows of the
versioned table (:mod:`.patching`), every SGLang symbol recompute reads, are declared here
(:data:`FEATURE`; :mod:`.recompute` registers it), next to the adapters that give every
release the same call: ``draft_tp_context`` entered from what each release's draft worker
holds (:func:`_enter_by`), ``fast_sample`` before 0.5.23 (no seed: :func:`_unseeded`, the
drop-in's seeded inverse-CDF draw instead), and ``LogitsProcessor``'s internals the head reads.

Where recompute runs, and what is refused here (with the checks of :mod:`.startup` and
:mod:`.draft_head`; ``docs/sglang.md``): the builder runs on the scheduler thread
(``Scheduler.get_new_prebuilt_batch`` -> ``process_prebuilt``). A head with no collective
(TP 1, or DP attention with ``--enable-dp-lm-head`` at attention-TP 1) is safe there. A
vocab-parallel head (TP > 1) all-gathers its logits (over the attention-TP group with
``--enable-dp-lm-head`` at attention TP > 1): every TP rank of a node builds the same
prebuilt batch at the same point of its event loop (SGLang's transfer polls are
all-reduced over the TP group), and under the overlap scheduler the head is issued on the
scheduler's forward stream (:mod:`.ordering`), so its gather sits between the forward in
flight and the next in one stream's order on every rank. A draft whose LogitsProcessor
gathers hidden states over every DP rank (DP attention without ``--enable-dp-lm-head``,
for a draft that shares the target's layout) is refused: DP ranks' prebuilt batches are
not synchronised. A token map that is not the identity, a draft vocabulary whose width is
not the target's, and a quantised or LoRA ``lm_head`` (:func:`~.draft_head.check_servable`)
are refused too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ...core._errors import ConfigError, PluginError
from .draft_head import SGLangDraftHead, copy_without_softcap, find_draft_model
from .ordering import forward_order
from .patching import (
    LOGITS_MODULE,
    SCHEDULER_MODULE,
    SPEC_UTILS_MODULE,
    WORKER_MODULE,
    Feature,
    Symbols,
    read,
)
from .startup import check_placement, check_token_map, check_width, draft_worker_of, token_map_of

if TYPE_CHECKING:
    from .recompute import RecomputeSource

logger = logging.getLogger("pd_middleware.integrations.sglang")

LP = f"{LOGITS_MODULE}.LogitsProcessor"
FAST_SAMPLE = f"{SPEC_UTILS_MODULE}.fast_sample"
DRAFT_TP_CONTEXT = f"{SPEC_UTILS_MODULE}.draft_tp_context"


def capture(source: RecomputeSource, scheduler: Any, *, vocab_size: int, num_steps: int, rs: bool) -> None:
    """At scheduler start (decode): find the draft model, check it and its placement, bind."""
    model = find_draft_model(scheduler)
    if model is None:
        raise ConfigError(
            'synthesizer = "recompute" needs the decode\'s EAGLE draft worker (scheduler.draft_worker), and this '
            "scheduler has none (no speculative algorithm, or not the last pipeline stage); use a shipped strategy",
            path="synthesizer",
        )
    symbols = source.inst.symbols if source.inst is not None else Symbols()
    worker = draft_worker_of(scheduler)
    if type(worker).__name__ == "EagleDraftWorker":
        symbols.check_instance(worker, f"{WORKER_MODULE}.EagleDraftWorker")
    if type(scheduler).__name__ == "Scheduler":
        symbols.check_instance(scheduler, f"{SCHEDULER_MODULE}.Scheduler")
    hot = token_map_of(worker)
    check_token_map(hot, vocab_size)
    head: SGLangDraftHead | None
    try:
        head = SGLangDraftHead(
            model, vocab_size, hot_token_id=hot, scope=_draft_scope(worker, symbols), symbols=symbols
        )
    except PluginError as exc:
        logger.warning("pd-middleware recompute: %s; every request falls back to one-hot (counted)", exc)
        head = None
    if head is not None:
        symbols.check_instance(head.lp, LP)
        check_width(head)
        overlap = bool(getattr(scheduler, "enable_overlap", False))
        check_placement(head.lp, enable_overlap=overlap, forward_stream=getattr(scheduler, "forward_stream", None))
        head.order = forward_order(scheduler, gathers=bool(getattr(head.lp, "do_tensor_parallel_all_gather", False)))
    source.bind_head(
        head,
        vocab_size=vocab_size,
        num_steps=num_steps,
        rejection_sampling=rs,
        group=getattr(scheduler, "attn_tp_cpu_group", None),
        draw=_sglang_draw(symbols, head),
    )
    logger.info(
        "pd-middleware recompute active on the decode: draft %s, V=%d, S=%d, X' drawn by %s, head issued on %s",
        head.arch if head is not None else type(model).__name__,
        vocab_size,
        num_steps,
        source.sampler,
        "the forward stream" if head is not None and head.order.active else "the scheduler's stream",
    )


def _draft_scope(worker: Any, symbols: Symbols) -> Callable[[], Any]:
    """SGLang's draft TP context for ``worker`` (a no-op without one). The table's row for
    the release adapts ``draft_tp_context`` to ``enter(worker)``: each release enters it
    from what its draft worker holds (:func:`_enter_by`)."""
    enter = symbols.get(DRAFT_TP_CONTEXT)
    if enter is None or worker is None:
        return contextlib.nullcontext

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        with enter(worker):
            yield

    return scope


def _enter_by(how: Callable[[Any, Any], Any]) -> Callable[[Any], Any]:
    """A ``draft_tp_context`` row's adapter: ``enter(worker)`` = ``how(draft_tp_context, worker)``,
    a no-op for a worker without the attribute the release enters by (a stand-in)."""

    def adapt(ctx: Any) -> Callable[[Any], Any]:
        def enter(worker: Any) -> Any:
            try:
                return how(ctx, worker)
            except AttributeError:
                return contextlib.nullcontext()

        return enter

    return adapt


def _by_layout(ctx: Any, worker: Any) -> Any:
    # 0.5.23: the worker's resolved DraftParallelLayout (None: no draft TP group of its own).
    layout = worker.parallel_layout
    return contextlib.nullcontext() if layout is None else ctx(layout)


def _by_owns_attention(ctx: Any, worker: Any) -> Any:
    # 0.5.22: draft_tp_context(owns_attention), as the worker enters it.
    return ctx(worker.draft_owns_attention)


def _by_worker_context(ctx: Any, worker: Any) -> Any:
    # 0.5.21: the worker's own draft_tp_context (SGLang's, or an empty context without DP
    # attention) on its draft runner's TP group, with its attention ownership.
    return worker.draft_tp_context(worker.draft_runner.tp_group, owns_attention=worker.draft_owns_attention)


def _by_worker_group(ctx: Any, worker: Any) -> Any:
    # 0.5.18-0.5.20: the worker's own draft_tp_context on its draft runner's TP group.
    return worker.draft_tp_context(worker.draft_runner.tp_group)


def _unseeded(fast_sample: Any) -> None:
    """``fast_sample`` before 0.5.23 takes no seed: it cannot give every rank the same X'.
    None: the drop-in draws X' with its seeded inverse-CDF draw (same law, rank-agreed)."""
    return None


def _sglang_draw(symbols: Symbols, head: SGLangDraftHead | None) -> Any:
    """SGLang's seeded ``fast_sample`` as a :data:`~pd_middleware.decode.recompute.Draw`, probed once on
    the head's device; None where it cannot run (sgl-kernel without its CPU ops: logged)."""
    fast_sample = symbols.get(FAST_SAMPLE)
    if fast_sample is None or head is None:
        return None

    def sglang_draw(probs: torch.Tensor, s: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out: tuple[torch.Tensor, torch.Tensor] = fast_sample(probs, 1, sampling_seed=s, positions=pos)
        return out

    try:
        one = torch.ones(1, dtype=torch.int64, device=head.device)
        sglang_draw(torch.full((1, 2), 0.5, device=head.device), one, one)
    except (ImportError, AttributeError, RuntimeError, NotImplementedError) as exc:
        # A probe: ImportError without sgl-kernel, AttributeError/RuntimeError where its
        # package is present but its CPU ops (murmur_hash32_cpu) are not built.
        logger.warning(
            "pd-middleware recompute: SGLang's seeded fast_sample is unavailable on %s (%s); drawing X' "
            "with the seeded inverse-CDF draw of pd_middleware.decode.recompute instead (same law, rank-agreed)",
            head.device,
            exc,
        )
        return None
    return sglang_draw


#: The ``recompute`` feature's rows: every SGLang symbol recompute reads, per release.
#: Registered by :mod:`.recompute` (the table lists features in their modules' import order).
FEATURE = Feature(
    "recompute",
    (
        read(
            SPEC_UTILS_MODULE,
            "fast_sample",
            ("probs", "num_samples", "sampling_seed", "positions", "draft_step"),
            since="0.5.23",
        ),
        read(SPEC_UTILS_MODULE, "fast_sample", ("probs", "num_samples"), until="0.5.22", adapt=_unseeded),
        read(SPEC_UTILS_MODULE, "draft_tp_context", ("layout",), since="0.5.23", adapt=_enter_by(_by_layout)),
        read(
            SPEC_UTILS_MODULE,
            "draft_tp_context",
            ("owns_attention",),
            since="0.5.22",
            until="0.5.22",
            adapt=_enter_by(_by_owns_attention),
        ),
        read(
            SPEC_UTILS_MODULE,
            "draft_tp_context",
            ("tp_group", "owns_attention"),
            since="0.5.21",
            until="0.5.21",
            adapt=_enter_by(_by_worker_context),
        ),
        read(SPEC_UTILS_MODULE, "draft_tp_context", ("tp_group",), until="0.5.20", adapt=_enter_by(_by_worker_group)),
        read(LOGITS_MODULE, "fused_softcap"),
        read(
            LOGITS_MODULE,
            "LogitsProcessor._compute_lm_head",
            ("self", "hidden_states", "lm_head", "embedding_bias", "out"),
            since="0.5.23",
        ),
        read(
            LOGITS_MODULE,
            "LogitsProcessor._compute_lm_head",
            ("self", "hidden_states", "lm_head", "embedding_bias"),
            until="0.5.22",
        ),
        read(LOGITS_MODULE, "LogitsProcessor._gather_attn_tp_logits", ("self", "logits")),
        read(
            LOGITS_MODULE,
            "LogitsProcessor._copy_logits_to_buffer",
            ("self", "logits", "logits_metadata", "use_buffer", "softcap"),
            since="0.5.22",
        ),
        read(
            LOGITS_MODULE,
            "LogitsProcessor._copy_logits_to_buffer",
            ("self", "logits", "logits_metadata", "use_buffer"),
            until="0.5.21",
            adapt=copy_without_softcap,
        ),
        *(
            read(LOGITS_MODULE, f"LogitsProcessor.{name}", instance=True)
            for name in (
                "_logits_gatherer",
                "logit_scale",
                "do_tensor_parallel_all_gather",
                "do_tensor_parallel_all_gather_dp_attn",
                "use_attn_tp_group",
                "final_logit_softcapping",
                "vocab_size",
            )
        ),
        read(WORKER_MODULE, "EagleDraftWorker.parallel_layout", instance=True, since="0.5.23"),
        read(WORKER_MODULE, "EagleDraftWorker.draft_owns_attention", instance=True, since="0.5.21", until="0.5.22"),
        read(WORKER_MODULE, "EagleDraftWorker.draft_tp_context", instance=True, until="0.5.21"),
        read(WORKER_MODULE, "EagleDraftWorker.hot_token_id", instance=True),
        read(WORKER_MODULE, "EagleDraftWorker.draft_runner", instance=True),
        # Where a gathering head is issued under the overlap scheduler (ordering.py).
        read(SCHEDULER_MODULE, "Scheduler.forward_stream", instance=True),
    ),
    lambda plan: "recompute" in plan.features,
    summary="decode-only recompute: the draft head's logits, a seeded rank-agreed draw of X', the draft TP context",
)
