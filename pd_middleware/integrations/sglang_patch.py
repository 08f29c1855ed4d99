"""Every SGLang symbol the drop-in touches, in one table, and the wrappers that go around them.

The shape is SGLang's own ``HookRegistry`` (``sglang/srt/plugins/hook_registry.py``): a
dotted target, a hook type (AROUND, REPLACE, or READ for a symbol we only call), and who
registered it. The strictness is ours: :func:`resolve` checks every target of every wanted
:class:`Feature` for presence and signature before :func:`apply` patches anything, and a
failure raises :class:`~pd_middleware.PluginError` naming the target (HookRegistry's
``apply_hooks`` logs a failure and goes on; a server that asked for the drop-in must not
run without it). Each applied patch is logged once in HookRegistry's own line format
(:func:`announce`), so operators find it beside other plugins' hooks.

**The table** is :data:`FEATURES`, one :class:`Feature` per part of the drop-in; each
names its targets, when it is wanted, and when it is applied:

- ``decode``: the PD decode's first draft input (always; with ``synthesizer = "recompute"``
  its wrappers are :mod:`.sglang_recompute`'s);
- ``prefill``: the prefill's batch result, where each finishing request is encoded (both
  channels; not for the decode-only recompute, ``channel = "none"``);
- ``metadata``: the in-band row in SGLang's PD metadata buffers (``channel = "metadata"``);
- ``scheduler``: the scheduler-start hook (unless the harness passes ``EngineFacts``);
- ``live_ab``: the first-verify counter per arm (only with ``[[arms]]``);
- ``chain``: the multi-layer prefill's per-step draw (checked at install, applied when a
  prefill starts with S > 1).

**Adding a feature** (another module, e.g. a decode-side recompute): build its
:class:`Target` entries with their wrapper factories and call :func:`register_feature`
at import time, before :func:`~pd_middleware.integrations.sglang.install` runs. Its
``wanted(plan)`` decides per installation; its wrappers get ``(original, installation)``.
Its stand-in modules for tests go in ``SGLangModules(extra={module_name: module})``.

**Every per-batch wrapper is guarded** (:class:`Guard`): an exception in our code is
counted (``guard:<wrapper>:<error>``, also ``Metrics.fallbacks['sglang:guard:...']``),
logged once, and SGLang gets its own result for that batch (its one-hot proposal, its
own X). Only startup (the scheduler hook and the layout self-check) raises, on purpose.
"""

from __future__ import annotations

import contextvars
import enum
import importlib
import importlib.metadata
import inspect
import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from .._errors import PDMiddlewareError, PluginError

logger = logging.getLogger("pd_middleware.integrations.sglang")

#: The distribution and entry-point name SGLang's plugin loader knows the drop-in by.
PLUGIN_NAME = "pd_middleware"
DIST_NAME = "pd-middleware"

# The SGLang modules the table's targets live in (one name per module, used everywhere).
BUILDER_MODULE = "sglang.srt.speculative.eagle_disaggregation"
PREFILL_MODULE = "sglang.srt.disaggregation.prefill"
UTILS_MODULE = "sglang.srt.disaggregation.utils"
DECODE_QUEUE_MODULE = "sglang.srt.disaggregation.decode"
MOONCAKE_MODULE = "sglang.srt.disaggregation.mooncake.conn"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
MULTI_LAYER_MODULE = "sglang.srt.speculative.multi_layer_eagle_worker_v2"
PROCESSOR_MODULE = "sglang.srt.managers.scheduler_components.batch_result_processor"


class Hook(enum.Enum):
    """HookRegistry's hook types that the drop-in uses, plus READ (called, never patched)."""

    AROUND = "around"  # our wrapper calls SGLang's original
    REPLACE = "replace"  # our function stands in; SGLang's original is its fallback
    READ = "read"  # a symbol the drop-in calls or relies on; checked, not patched


@dataclass(frozen=True)
class Target:
    """One SGLang symbol: ``module`` + ``attr`` (dotted inside it), its expected parameter
    names (None: presence only), the hook type and the wrapper factory
    ``wrap(original, installation) -> replacement`` (None for READ)."""

    module: str
    attr: str
    params: tuple[str, ...] | None
    hook: Hook
    wrap: Callable[[Any, Any], Any] | None = None

    @property
    def path(self) -> str:
        return f"{self.module}.{self.attr}"


@dataclass(frozen=True)
class Plan:
    """What one installation wants: ``channel``, the config, the install options."""

    channel: str
    config: Any
    options: Any


@dataclass(frozen=True)
class Feature:
    """A part of the drop-in: its targets, whether a :class:`Plan` wants it, and when it is
    applied (``install``, or ``multi_layer_prefill``: when a prefill starts with S > 1)."""

    name: str
    targets: tuple[Target, ...]
    wanted: Callable[[Plan], bool]
    applied: str = "install"


@dataclass
class Patch:
    """One applied (or ready) patch: restore by ``setattr(owner, name, original)``."""

    target: Target
    owner: Any
    name: str
    original: Any  # as stored on the owner (a classmethod object stays one)
    replacement: Any = None


@dataclass(frozen=True)
class SGLangModules:
    """The SGLang modules to patch; a field left None is imported (the real SGLang),
    unless ``only_given`` is set, in which case that module's features are not patched
    at all (tests with stand-ins for part of SGLang). ``extra``: stand-ins by module
    name for modules without a field (features registered by other modules)."""

    builder: ModuleType | None = None  # BUILDER_MODULE
    prefill: ModuleType | None = None  # PREFILL_MODULE
    utils: ModuleType | None = None  # UTILS_MODULE (MetadataBuffers)
    transfer: ModuleType | None = None  # DECODE_QUEUE_MODULE (DecodeTransferQueue)
    mooncake: ModuleType | None = None  # MOONCAKE_MODULE
    scheduler: ModuleType | None = None  # SCHEDULER_MODULE (Scheduler)
    multi_layer: ModuleType | None = None  # MULTI_LAYER_MODULE
    processor: ModuleType | None = None  # PROCESSOR_MODULE (live A/B)
    only_given: bool = False
    extra: Mapping[str, ModuleType] = field(default_factory=dict)

    def given(self, name: str) -> ModuleType | None:
        slot = _SLOTS.get(name)
        mod = getattr(self, slot) if slot is not None else None
        return mod if mod is not None else self.extra.get(name)


_SLOTS = {
    BUILDER_MODULE: "builder",
    PREFILL_MODULE: "prefill",
    UTILS_MODULE: "utils",
    DECODE_QUEUE_MODULE: "transfer",
    MOONCAKE_MODULE: "mooncake",
    SCHEDULER_MODULE: "scheduler",
    MULTI_LAYER_MODULE: "multi_layer",
    PROCESSOR_MODULE: "processor",
}


def detect_version() -> str:
    """The installed SGLang version (package metadata; no import). PluginError if absent."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise PluginError("SGLang is not installed (no 'sglang' distribution found)", plugin="sglang") from None


def import_module(name: str) -> ModuleType:
    """Import an SGLang module; PluginError naming it when that fails (any exception)."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # an engine's import can fail with anything
        raise PluginError(f"cannot import {name}: {type(exc).__name__}: {exc}", plugin="sglang") from None


def module_for(name: str, mods: SGLangModules) -> ModuleType | None:
    """The module ``name``: the stand-in given, else imported (None under ``only_given``)."""
    given = mods.given(name)
    if given is not None:
        return given
    return None if mods.only_given else import_module(name)


def resolve(target: Target, module: ModuleType, where: str | None = None) -> Patch:
    """Find ``target`` in ``module`` and check it; raises PluginError naming the target.

    Checks: every attribute on the path exists; a callable target is callable, not
    already ours, and has exactly the expected parameter names.
    """
    path = where or f"{module.__name__}.{target.attr}"
    owner: Any = module
    *parents, name = target.attr.split(".")
    for k, part in enumerate(parents):
        owner = getattr(owner, part, None)
        if owner is None:
            prefix = ".".join([module.__name__, *parents[: k + 1]])
            raise PluginError(
                f"{prefix} not found (target {path}); this SGLang version is not supported", plugin="sglang"
            )
    raw = owner.__dict__.get(name) if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name, None)
    if raw is None:
        raise PluginError(f"{path} not found; this SGLang version is not supported", plugin="sglang")
    if target.params is not None:
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        if not callable(fn):
            raise PluginError(f"{path} is not callable", plugin="sglang")
        if getattr(fn, "__pd_middleware__", False):
            raise PluginError(f"{path} is already patched by pd-middleware", plugin="sglang")
        try:
            params = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError) as exc:
            raise PluginError(f"cannot read the signature of {path}: {exc}", plugin="sglang") from None
        if params != target.params:
            raise PluginError(
                f"{path} has parameters {params}, expected {target.params}; SGLang changed this "
                "function and the drop-in would not know what it passes",
                plugin="sglang",
            )
    return Patch(target, owner, name, raw)


def callable_of(patch: Patch) -> Any:
    """The original as a plain callable (a classmethod's function)."""
    raw = patch.original
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


def mark(fn: Callable[..., Any], original: Any) -> Callable[..., Any]:
    """Mark ``fn`` as our wrapper of ``original`` (what the "already patched" check reads)."""
    fn.__wrapped__ = original  # type: ignore[attr-defined]  # functools.wraps' attribute
    fn.__pd_middleware__ = True  # type: ignore[attr-defined]  # our marker: "already patched"
    return fn


def build(patch: Patch, inst: Any) -> Patch:
    """Make ``patch``'s replacement with its target's wrapper (marked, classmethods kept)."""
    wrap = patch.target.wrap
    assert wrap is not None
    fn = mark(wrap(callable_of(patch), inst), callable_of(patch))
    patch.replacement = classmethod(fn) if isinstance(patch.original, classmethod) else fn
    return patch


def apply(patches: list[Patch]) -> None:
    for p in patches:
        setattr(p.owner, p.name, p.replacement)


def hook_source() -> str:
    """Who registered the hooks, in HookRegistry's words (``plugin=..., dist=...``)."""
    try:
        from sglang.srt.plugins.hook_registry import _current_plugin_source

        src = _current_plugin_source.get()
        if src is not None:
            plugin, dist = src.plugin_name, src.dist_name
            return f"plugin={plugin}, dist={dist}" if dist else f"plugin={plugin}"
    except ImportError:
        pass
    return f"plugin={PLUGIN_NAME}, dist={DIST_NAME}"


def announce(patches: list[Patch], source: str) -> None:
    """Log each patch once, in HookRegistry's format (``Applied 1 hook(s) to <target> (from: ...)``)."""
    for p in patches:
        logger.info("Applied 1 hook(s) to %s (from: %s) [%s]", p.target.path, source, p.target.hook.value)


# --------------------------------------------------------------------- the guard


class Guard:
    """Counts and logs (once per key) a failure of our code inside a per-batch wrapper."""

    def __init__(self, metrics: Any = None) -> None:
        self.metrics = metrics
        self.counts: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def failed(self, where: str, exc: BaseException | str, fallback: str = "SGLang's own result") -> None:
        why = exc if isinstance(exc, str) else type(exc).__name__
        key = f"guard:{where}:{why}"
        with self._lock:
            self.counts[key] += 1
            first = key not in self._logged
            self._logged.add(key)
        if self.metrics is not None:
            self.metrics.fallbacks[f"sglang:{key}"] += 1
        if first:
            logger.error(
                "pd-middleware %s failed (%s); %s is used for this batch (logged once; counted as %s)",
                where,
                exc,
                fallback,
                key,
            )


# --------------------------------------------------------------------- decode builder

# The batch whose first draft input SGLang is building (set by the build wrapper, read by
# the proposal replacement). A ContextVar: correct even with two schedulers on two threads.
_current_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("pd_middleware_sglang_batch", default=None)


def wrap_build(build_fn: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    if inst.recompute is not None:
        # Decode-only recompute: the same target, the recompute step before SGLang's body.
        from .sglang_recompute import wrap_build as recompute_build

        return recompute_build(build_fn, inst)

    def build_eagle_disagg_draft_input(batch: Any, last_tokens_tensor: Any, future_map: Any) -> Any:
        token = _current_batch.set(batch)
        try:
            return build_fn(batch, last_tokens_tensor, future_map)
        finally:
            _current_batch.reset(token)

    return build_eagle_disagg_draft_input


def wrap_proposal(first: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    if inst.recompute is not None:
        from .sglang_recompute import wrap_proposal as recompute_proposal

        return recompute_proposal(first, inst)

    def pd_first_draft_proposal(topk_index: Any, vocab_size: int) -> Any:
        batch = _current_batch.get()
        if batch is None:
            # Called from somewhere other than the PD first draft input: not ours.
            return first(topk_index, vocab_size)
        try:
            out = inst.proposer.propose(batch, topk_index, vocab_size)
            check_proposal(out, topk_index, vocab_size)
            return out
        except Exception as exc:
            inst.guard.failed("propose", exc, "SGLang's one-hot proposal")
            return sglang_one_hot(first, topk_index, vocab_size, inst.guard)

    return pd_first_draft_proposal


def check_proposal(out: Any, topk_index: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless ``out`` is what SGLang expects: float32 (b, n, V) on X's device."""
    want = (*topk_index.shape, int(vocab_size))
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        raise ValueError(f"proposal shape {getattr(out, 'shape', None)}, expected {want}")
    if out.dtype != torch.float32 or out.device != topk_index.device:
        raise ValueError(f"proposal is {out.dtype} on {out.device}, expected float32 on {topk_index.device}")


def sglang_one_hot(first: Callable[..., Any], topk_index: torch.Tensor, vocab_size: int, guard: Guard) -> Any:
    """SGLang's own one-hot; if even that fails (X outside [0, V)), a one-hot at X clamped into range."""
    try:
        return first(topk_index, vocab_size)
    except Exception as exc:
        guard.failed("propose_fallback", exc, "a one-hot at X clamped into [0, V)")
        x = topk_index.to(torch.int64).clamp(0, int(vocab_size) - 1)
        out = torch.zeros((*x.shape, int(vocab_size)), dtype=torch.float32, device=x.device)
        return out.scatter_(-1, x.unsqueeze(-1), 1.0)


# --------------------------------------------------------------------- prefill


def wrap_prefill_result(original: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    from .sglang_prefill import publish_batch, unstage

    def process_batch_result_disagg_prefill(self: Any, batch: Any, result: Any) -> Any:
        publisher = inst.publisher
        if publisher is not None:
            try:
                # SGLang's own first step: the forward's results are on the host only after it.
                copy_done = getattr(result, "copy_done", None)
                if copy_done is not None:
                    copy_done.synchronize()
                # Nothing staged by an earlier batch may be written next to this batch's X.
                unstage(publisher, batch)
            except Exception as exc:
                inst.guard.failed("prefill", exc, "SGLang's own X")
            else:
                # Never raises: a failure is agreed across ranks and leaves SGLang's X.
                publish_batch(
                    publisher,
                    batch,
                    getattr(result, "next_draft_input", None),
                    group=rank_group(getattr(self, "attn_tp_cpu_group", None), inst),
                    guard=inst.guard,
                )
        return original(self, batch, result)

    return process_batch_result_disagg_prefill


def rank_group(group: Any, inst: Any) -> Any:
    """``group`` (the CPU group of the ranks that run the same batch: SGLang's attention TP)
    when it has more than one rank and the installation's rank agreement is on, else None."""
    if not getattr(inst, "rank_agreement", True) or group is None:
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return None
    return group


# --------------------------------------------------------------------- metadata channel


def wrap_metadata_init(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        inst.channel.allocate(self)  # startup: a non-CPU buffer is a ConfigError, on purpose

    return __init__


def wrap_buf_infos(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def get_buf_infos(self: Any) -> Any:
        return inst.channel.append_info(self, orig(self))

    return get_buf_infos


def wrap_set_buf(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def set_buf(self: Any, req: Any) -> Any:
        out = orig(self, req)
        try:
            inst.channel.write(self, req)
        except Exception as exc:
            inst.guard.failed("set_buf", exc, "an unwritten row (the decode answers one-hot)")
        return out

    return set_buf


def wrap_clear_slot(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def clear_slot(self: Any, idx: int) -> Any:
        out = orig(self, idx)
        try:
            inst.channel.clear(self, idx)
        except Exception as exc:
            inst.guard.failed("clear_slot", exc, "the row as it was (its room no longer matches)")
        return out

    return clear_slot


def wrap_commit(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    from .sglang_decode import agree_on_x

    def _commit_transfer_to_req(self: Any, decode_req: Any) -> Any:
        out = orig(self, decode_req)
        # Every rank, for every committed request, before anything may return early: the
        # X canary is a collective.
        # (``gloo_group`` is SGLang's attention-TP CPU group, the one its metadata gate uses.)
        agreed = agree_on_x(inst, decode_req.req, rank_group(getattr(self, "gloo_group", None), inst))
        if agreed is not None:
            return out  # the ranks disagreed on X: one-hot at the agreed X is attached
        try:
            inst.channel.commit(self, decode_req, getattr(inst, "is_fake_transfer", None))
        except Exception as exc:
            inst.guard.failed("commit", exc, "a one-hot proposal")
        return out

    return _commit_transfer_to_req


def wrap_registration(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def build_receiver_registration_message(self: Any) -> Any:
        msg = orig(self)
        try:
            return [*msg, inst.channel.registration_frame()]
        except Exception as exc:
            inst.guard.failed("registration", exc, "a registration without our frame (the prefill rejects it)")
            return msg

    return build_receiver_registration_message


def wrap_from_zmq(func: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    from .sglang_metadata import LAYOUT_ATTR, layout_of

    def from_zmq(cls: Any, msg: Any) -> Any:
        info = func(cls, msg)
        try:
            layout = layout_of(msg)
        except Exception as exc:
            inst.guard.failed("from_zmq", exc, "no layout (the session is rejected)")
            layout = None
        setattr(info, LAYOUT_ATTR, layout)
        return info

    return from_zmq


def wrap_validate(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def _validate_peer_state_layout(self: Any, registration_info: Any) -> Any:
        fully_checked, mismatch = orig(self, registration_info)
        if mismatch is None:
            try:
                mismatch = inst.channel.validate(self, registration_info)
            except Exception as exc:
                inst.guard.failed("validate_peer", exc, "rejecting the session")
                mismatch = f"pd-middleware could not check the decode's proposal rows: {exc}"
        return fully_checked, mismatch

    return _validate_peer_state_layout


def read_fake_transfer(fn: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    """READ target: the installation keeps SGLang's ``_is_fake_transfer`` (checked here)."""
    inst.is_fake_transfer = fn
    return fn


# --------------------------------------------------------------------- scheduler start


def wrap_scheduler_init(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def init_disaggregation(self: Any) -> Any:
        # Startup: every failure stops the scheduler (SGLang then stops the server), with
        # the reason. A server that is not a PD prefill or decode is refused here too.
        from .sglang_startup import facts_from_scheduler

        try:
            inst.activate(facts_from_scheduler(self), scheduler=self)
        except PDMiddlewareError:
            raise
        except Exception as exc:
            raise PluginError(f"pd-middleware could not start on this scheduler: {type(exc).__name__}: {exc}") from exc
        out = orig(self)
        inst.self_check()
        return out

    return init_disaggregation


# --------------------------------------------------------------------- live A/B


def wrap_first_verify(original: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    recorder = inst.recorder

    def _resolve_spec_v2_tokens(self: Any, result: Any, batch: Any) -> Any:
        try:
            before = recorder.before(batch)
        except Exception as exc:
            inst.guard.failed("first_verify", exc, "no A/B record")
            before = []
        out = original(self, result, batch)
        try:
            recorder.after(batch, result, before)
        except Exception as exc:
            inst.guard.failed("first_verify", exc, "no A/B record")
        return out

    return _resolve_spec_v2_tokens


# --------------------------------------------------------------------- multi-layer chain


def wrap_extend_for_prefill(extend: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    from .sglang_chain import finish_chain, open_chain

    def _draft_extend_for_prefill(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        token = None
        try:
            token = open_chain(inst.publisher, batch)
        except Exception as exc:
            inst.guard.failed("chain", exc, "SGLang's own chain")
        if token is None:
            return extend(self, batch, *args, **kwargs)
        out = None
        try:
            out = extend(self, batch, *args, **kwargs)
        finally:
            try:
                finish_chain(token, out)
            except Exception as exc:
                inst.guard.failed("chain", exc, "SGLang's own chain (X only)")
        return out

    return _draft_extend_for_prefill


def wrap_sample(sample: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    from .sglang_chain import draw_step

    def sample_draft_proposal(next_token_logits: Any, temperatures: Any, top_ks: Any = None, **kwargs: Any) -> Any:
        probs, topk_p, topk_index = sample(next_token_logits, temperatures, top_ks, **kwargs)
        if top_ks is not None:
            return probs, topk_p, topk_index  # greedy rows: SGLang's
        try:
            got = draw_step(int(kwargs.get("draft_step", 0)), probs, topk_p, topk_index)
        except Exception as exc:
            inst.guard.failed("chain_step", exc, "SGLang's own draw (the chain is sent X only)")
            from .sglang_chain import break_chain

            break_chain()
            return probs, topk_p, topk_index
        return got if got is not None else (probs, topk_p, topk_index)

    return sample_draft_proposal


# --------------------------------------------------------------------- the table

BUILD_PARAMS = ("batch", "last_tokens_tensor", "future_map")
PROPOSAL_PARAMS = ("topk_index", "vocab_size")
PREFILL_PARAMS = ("self", "batch", "result")
SAMPLE_PARAMS = ("next_token_logits", "temperatures", "top_ks", "sampling_seed", "positions", "draft_step")
EXTEND_PARAMS = ("self", "batch", "target_hidden_states", "next_token_ids", "kv_loc_plan")
RESOLVE_PARAMS = ("self", "result", "batch")

_T = Target
FEATURES: dict[str, Feature] = {}


def register_feature(feature: Feature) -> None:
    """Add a feature to :data:`FEATURES` (ValueError when its name or a patched target is taken)."""
    if feature.name in FEATURES:
        raise ValueError(f"feature {feature.name!r} is already registered")
    taken = {t.path: f.name for f in FEATURES.values() for t in f.targets if t.hook is not Hook.READ}
    for t in feature.targets:
        if t.hook is not Hook.READ and t.path in taken:
            raise ValueError(f"{t.path} is already patched by feature {taken[t.path]!r}")
    FEATURES[feature.name] = feature


register_feature(
    Feature(
        "decode",
        (
            _T(BUILDER_MODULE, "build_eagle_disagg_draft_input", BUILD_PARAMS, Hook.AROUND, wrap_build),
            _T(BUILDER_MODULE, "pd_first_draft_proposal", PROPOSAL_PARAMS, Hook.REPLACE, wrap_proposal),
        ),
        lambda plan: True,
    )
)
register_feature(
    Feature(
        "prefill",
        (
            _T(
                PREFILL_MODULE,
                "SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill",
                PREFILL_PARAMS,
                Hook.AROUND,
                wrap_prefill_result,
            ),
        ),
        lambda plan: plan.channel != "none",
    )
)
register_feature(
    Feature(
        "metadata",
        (
            _T(UTILS_MODULE, "MetadataBuffers.__init__", None, Hook.AROUND, wrap_metadata_init),
            _T(UTILS_MODULE, "MetadataBuffers.get_buf_infos", ("self",), Hook.AROUND, wrap_buf_infos),
            _T(UTILS_MODULE, "MetadataBuffers.set_buf", ("self", "req"), Hook.AROUND, wrap_set_buf),
            _T(UTILS_MODULE, "MetadataBuffers.clear_slot", ("self", "idx"), Hook.AROUND, wrap_clear_slot),
            _T(UTILS_MODULE, "_is_fake_transfer", ("req",), Hook.READ, read_fake_transfer),
            _T(
                DECODE_QUEUE_MODULE,
                "DecodeTransferQueue._commit_transfer_to_req",
                ("self", "decode_req"),
                Hook.AROUND,
                wrap_commit,
            ),
            _T(
                MOONCAKE_MODULE,
                "MooncakeKVManager.build_receiver_registration_message",
                ("self",),
                Hook.AROUND,
                wrap_registration,
            ),
            _T(MOONCAKE_MODULE, "KVArgsRegisterInfo.from_zmq", ("cls", "msg"), Hook.AROUND, wrap_from_zmq),
            _T(
                MOONCAKE_MODULE,
                "MooncakeKVManager._validate_peer_state_layout",
                ("self", "registration_info"),
                Hook.AROUND,
                wrap_validate,
            ),
        ),
        lambda plan: plan.channel == "metadata",
    )
)
register_feature(
    Feature(
        "scheduler",
        (_T(SCHEDULER_MODULE, "Scheduler.init_disaggregation", ("self",), Hook.AROUND, wrap_scheduler_init),),
        lambda plan: plan.options.facts is None and plan.options.hook_scheduler,
    )
)
register_feature(
    Feature(
        "live_ab",
        (
            _T(
                PROCESSOR_MODULE,
                "SchedulerBatchResultProcessor._resolve_spec_v2_tokens",
                RESOLVE_PARAMS,
                Hook.AROUND,
                wrap_first_verify,
            ),
        ),
        lambda plan: bool(plan.config.arms),
    )
)
register_feature(
    Feature(
        "chain",
        (
            _T(MULTI_LAYER_MODULE, "sample_draft_proposal", SAMPLE_PARAMS, Hook.REPLACE, wrap_sample),
            _T(
                MULTI_LAYER_MODULE,
                "MultiLayerEagleDraftWorker._draft_extend_for_prefill",
                EXTEND_PARAMS,
                Hook.AROUND,
                wrap_extend_for_prefill,
            ),
        ),
        lambda plan: plan.channel != "none",
        applied="multi_layer_prefill",
    )
)


def resolve_features(plan: Plan, mods: SGLangModules) -> dict[str, list[Patch]]:
    """Every wanted feature's targets, resolved and checked; patches nothing.

    A target whose module is not given under ``only_given`` is left out. Raises
    PluginError naming the first target that is missing or changed.
    """
    out: dict[str, list[Patch]] = {}
    for feat in FEATURES.values():
        if not feat.wanted(plan):
            continue
        found = []
        for t in feat.targets:
            mod = module_for(t.module, mods)
            if mod is not None:  # None: a module not given under only_given (a test's stand-ins)
                found.append(resolve(t, mod))
        if found:
            out[feat.name] = found
    return out
