"""Patching SGLang: which modules, signature checks, and the decode builder's wrappers.

Shared by :mod:`.sglang` (install/uninstall) and :mod:`.sglang_installation`
(patches applied at activation). Every wrapper carries ``__wrapped__`` (the original)
and ``__pd_middleware__`` (our marker, so installing twice is refused).
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .._errors import PluginError
from .sglang_decode import DecodeProposer

DECODE_MODULE = "sglang.srt.speculative.eagle_disaggregation"
PREFILL_MODULE = "sglang.srt.disaggregation.prefill"
PREFILL_CLASS = "SchedulerDisaggregationPrefillMixin"
UTILS_MODULE = "sglang.srt.disaggregation.utils"
TRANSFER_MODULE = "sglang.srt.disaggregation.decode"
MOONCAKE_MODULE = "sglang.srt.disaggregation.mooncake.conn"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"

# Parameter names the adapter relies on; anything else means SGLang changed under us.
BUILD_PARAMS = ("batch", "last_tokens_tensor", "future_map")
PROPOSAL_PARAMS = ("topk_index", "vocab_size")
PREFILL_PARAMS = ("self", "batch", "result")
SAMPLE_PARAMS = ("next_token_logits", "temperatures", "top_ks", "sampling_seed", "positions", "draft_step")
EXTEND_PARAMS = ("self", "batch", "target_hidden_states", "next_token_ids", "kv_loc_plan")
METADATA_PARAMS = {
    "set_buf": ("self", "req"),
    "clear_slot": ("self", "idx"),
    "get_buf_infos": ("self",),
}


@dataclass(frozen=True)
class SGLangModules:
    """The SGLang modules to patch; a field left None is imported (the real SGLang),
    unless ``only_given`` is set, in which case it is not patched at all (tests with
    stand-ins for part of SGLang)."""

    builder: ModuleType | None = None  # sglang.srt.speculative.eagle_disaggregation
    prefill: ModuleType | None = None  # sglang.srt.disaggregation.prefill
    utils: ModuleType | None = None  # sglang.srt.disaggregation.utils (MetadataBuffers)
    transfer: ModuleType | None = None  # sglang.srt.disaggregation.decode (DecodeTransferQueue)
    mooncake: ModuleType | None = None  # sglang.srt.disaggregation.mooncake.conn
    scheduler: ModuleType | None = None  # sglang.srt.managers.scheduler (Scheduler)
    multi_layer: ModuleType | None = None  # sglang.srt.speculative.multi_layer_eagle_worker_v2
    processor: ModuleType | None = None  # ...managers.scheduler_components.batch_result_processor (live A/B)
    only_given: bool = False


# The batch whose first draft input SGLang is building (set by the build wrapper,
# read by the proposal replacement). A ContextVar rather than a global: correct even
# if two schedulers ever share a process on different threads.
_current_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("pd_middleware_sglang_batch", default=None)


def detect_version() -> str:
    """The installed SGLang version (package metadata; no import). PluginError if absent."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise PluginError("SGLang is not installed (no 'sglang' distribution found)", plugin="sglang") from None


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise PluginError(f"cannot import {name}: {exc}", plugin="sglang") from None


def _check_signature(owner: Any, attr: str, expected: tuple[str, ...], where: str) -> Callable[..., Any]:
    fn: object = getattr(owner, attr, None)
    if fn is None:
        raise PluginError(f"{where}.{attr} not found; this SGLang version is not supported", plugin="sglang")
    if not callable(fn):
        raise PluginError(f"{where}.{attr} is not callable", plugin="sglang")
    if getattr(fn, "__pd_middleware__", False):
        raise PluginError(f"{where}.{attr} is already patched by pd-middleware", plugin="sglang")
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"cannot read the signature of {where}.{attr}: {exc}", plugin="sglang") from None
    if params != expected:
        raise PluginError(
            f"{where}.{attr} has parameters {params}, expected {expected}; SGLang changed this "
            "function and the adapter would not know what it passes",
            plugin="sglang",
        )
    return fn


def _mark(fn: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as our wrapper of ``original`` (what the "already patched" check reads)."""
    fn.__wrapped__ = original  # type: ignore[attr-defined]  # functools.wraps' attribute, set by hand
    fn.__pd_middleware__ = True  # type: ignore[attr-defined]  # our marker: "already patched"
    return fn


def _wrap_build(build: Callable[..., Any]) -> Callable[..., Any]:
    def build_eagle_disagg_draft_input(batch: Any, last_tokens_tensor: Any, future_map: Any) -> Any:
        token = _current_batch.set(batch)
        try:
            return build(batch, last_tokens_tensor, future_map)
        finally:
            _current_batch.reset(token)

    return _mark(build_eagle_disagg_draft_input, build)


def _wrap_proposal(first: Callable[..., Any], proposer: DecodeProposer) -> Callable[..., Any]:
    def pd_first_draft_proposal(topk_index: Any, vocab_size: int) -> Any:
        batch = _current_batch.get()
        if batch is None:
            # Called from somewhere other than the PD first draft input: not ours.
            return first(topk_index, vocab_size)
        return proposer.propose(batch, topk_index, vocab_size)

    return _mark(pd_first_draft_proposal, first)


def _wrap_build_post_hoc(build: Callable[..., Any], proposer: DecodeProposer) -> Callable[..., Any]:
    """Older SGLang: attach the proposal after the call (and into the overlap relay)."""

    def build_eagle_disagg_draft_input(batch: Any, last_tokens_tensor: Any, future_map: Any) -> Any:
        spec_info = build(batch, last_tokens_tensor, future_map)
        if not proposer.config.decode.rejection_sampling or getattr(spec_info, "draft_probs", None) is not None:
            return spec_info
        topk_index = spec_info.topk_index
        q = proposer.propose(batch, topk_index, batch.model_config.vocab_size)
        if q.shape[1] == 1:
            q = q[:, 0]
        spec_info.draft_probs = q
        if getattr(batch, "enable_overlap", False):
            buf = getattr(future_map, "draft_probs_buf", None)
            if buf is None:
                raise PluginError(
                    "this SGLang's overlap relay carries no draft_probs; run the decode with "
                    "--disable-overlap-schedule",
                    plugin="sglang",
                )
            buf[spec_info.future_indices] = q
        return spec_info

    return _mark(build_eagle_disagg_draft_input, build)


def _module(given: ModuleType | None, name: str, mods: SGLangModules) -> ModuleType | None:
    if given is not None:
        return given
    return None if mods.only_given else _import(name)
