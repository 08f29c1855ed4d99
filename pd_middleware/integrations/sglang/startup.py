"""What the SGLang drop-in checks when a scheduler starts, before SGLang allocates anything.

:class:`EngineFacts` is everything the drop-in needs to know about the running engine,
read once from the scheduler (:func:`facts_from_scheduler`: SGLang's runtime context
and the scheduler's model config) or built by hand in a harness that runs SGLang's
transfer classes without a scheduler. :func:`check` compares them with the config and
raises :class:`~pd_middleware.ConfigError` naming the flag or key to change, so a
misconfigured node stops at startup instead of failing on its first batch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...core._errors import ConfigError, PDMiddlewareError, PluginError
from .patching import (
    HOOKS_MODULE,
    RUNTIME_MODULE,
    SCHEDULER_MODULE,
    WORKER_MODULE,
    Feature,
    Hook,
    Symbols,
    Target,
    read,
    register_feature,
)

logger = logging.getLogger("pd_middleware.integrations.sglang")

GET_SPEC = f"{RUNTIME_MODULE}.get_spec"
GET_DISAGG = f"{RUNTIME_MODULE}.get_disagg"
GET_PARALLEL = f"{RUNTIME_MODULE}.get_parallel"
GET_OBSERVABILITY = f"{RUNTIME_MODULE}.get_observability"

#: SGLang's switch of the staging-buffer path (MHA, prefill and decode attention TP differ).
STAGING_ENV = "SGLANG_DISAGG_STAGING_BUFFER"

#: SGLang speculative algorithms whose PD first draft input goes through
#: ``build_eagle_disagg_draft_input`` (EAGLE family). ``NEXTN`` (MTP) is not listed: SGLang
#: resolves it to EAGLE before a scheduler starts (``arg_groups/speculative_hook.py``).
EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """The engine as the drop-in sees it.

    ``role``: ``--disaggregation-mode`` (``prefill``, ``decode`` or ``null``);
    ``vocab_size``: the target model's V; ``num_steps``: draft tokens per request in
    the PD metadata (1 single-layer EAGLE, ``--speculative-num-steps`` multi-layer);
    ``algorithm``: ``--speculative-algorithm`` (None: off); ``topk``:
    ``--speculative-eagle-topk``; ``rejection_sampling``:
    ``--speculative-use-rejection-sampling``; ``backend``:
    ``--disaggregation-transfer-backend``; ``tp_rank``: this scheduler's TP rank.

    SGLang's settings under which its PD transfer does not move every entry it registers
    (the draft-KV attach refuses ``"all_steps"`` under any of them): ``pp_size``: this
    node's pipeline stages (each stage registers its own layers' pools); ``staging``:
    ``SGLANG_DISAGG_STAGING_BUFFER`` (the staging path gathers the primary draft pool
    only); ``host_receive``: ``--disaggregation-decode-host-receive-threshold`` below 1
    (the decode receives into host buffers that mirror SGLang's list).
    """

    role: Literal["prefill", "decode", "null"]
    vocab_size: int
    num_steps: int
    algorithm: str | None
    topk: int
    rejection_sampling: bool
    backend: str = "mooncake"
    tp_rank: int = 0
    pp_size: int = 1
    staging: bool = False
    host_receive: bool = False


def facts_from_scheduler(scheduler: Any, symbols: Symbols) -> EngineFacts:
    """Read :class:`EngineFacts` from a starting SGLang ``Scheduler`` (SGLang's runtime
    context, through the table's READ targets, and the scheduler's model config)."""
    spec, disagg = symbols[GET_SPEC](), symbols[GET_DISAGG]()
    # Read, not defaulted: an SGLang without the flag is another SGLang (AttributeError
    # stops the scheduler, naming it).
    multi = bool(spec.enable_multi_layer_eagle)
    steps = int(spec.speculative_num_steps or 1) if multi else 1
    mode = disagg.disaggregation_mode
    parallel = symbols[GET_PARALLEL]()
    # Defaulted: releases before 0.5.21 have no host receive (nor the flag).
    threshold = getattr(disagg, "disaggregation_decode_host_receive_threshold", None)
    return EngineFacts(
        role=str(getattr(mode, "value", mode)),  # type: ignore[arg-type]  # checked by check()
        vocab_size=int(scheduler.model_config.vocab_size),
        num_steps=steps,
        algorithm=spec.speculative_algorithm,
        topk=int(spec.speculative_eagle_topk or 1),
        rejection_sampling=bool(spec.speculative_use_rejection_sampling),
        backend=str(disagg.disaggregation_transfer_backend),
        tp_rank=int(parallel.tp_rank),
        pp_size=int(parallel.pp_size),
        staging=os.environ.get(STAGING_ENV, "").strip().lower() in ("1", "true", "yes", "y"),
        host_receive=threshold is not None and float(threshold) < 1,
    )


def check(config: Any, facts: EngineFacts, channel: str) -> None:
    """Raise ConfigError unless ``config`` and ``channel`` can serve this engine.

    Checks: a PD role; an EAGLE-family algorithm with top-k 1; rejection sampling on
    in SGLang and in the config; V and S equal to any the config declares; the
    metadata channel on the Mooncake backend; the side channel at TP rank 0 only
    (its single receiver/publisher would not see other ranks' requests).
    """
    if facts.role not in ("prefill", "decode"):
        raise ConfigError(
            f"PD_MIDDLEWARE_CONFIG is set but this server runs --disaggregation-mode {facts.role}; "
            "the drop-in serves PD prefill and decode nodes only (unset it here)"
        )
    if facts.algorithm not in EAGLE_ALGORITHMS:
        raise ConfigError(
            f"--speculative-algorithm is {facts.algorithm}; the drop-in serves {'/'.join(EAGLE_ALGORITHMS)} "
            "(the PD first draft input of build_eagle_disagg_draft_input)"
        )
    if facts.topk != 1:
        raise ConfigError(f"--speculative-eagle-topk is {facts.topk}; rejection-sampling PD proposals need top-k 1")
    if not facts.rejection_sampling:
        raise ConfigError(
            "SGLang runs without --speculative-use-rejection-sampling: no draft_probs is ever built, "
            "so the middleware would do nothing; add the flag on both nodes or unset PD_MIDDLEWARE_CONFIG"
        )
    if not config.decode.rejection_sampling:
        raise ConfigError(
            "SGLang runs with --speculative-use-rejection-sampling but the config turns it off",
            path="decode.rejection_sampling",
        )
    config.model.with_shapes(facts.vocab_size, facts.num_steps, engine="SGLang")
    if channel == "metadata" and facts.backend != "mooncake":
        raise ConfigError(
            f'[sglang].channel = "metadata" is verified on the mooncake transfer backend only, this server runs '
            f'--disaggregation-transfer-backend {facts.backend}; use channel = "sidechannel"',
            path="sglang.channel",
        )
    if channel == "sidechannel" and facts.tp_rank != 0 and not _one_hot(config):
        raise ConfigError(
            f'[sglang].channel = "sidechannel" publishes through one receiver per node (TP rank 0); TP rank '
            f'{facts.tp_rank} would not see the payloads: use channel = "metadata" with TP > 1',
            path="sglang.channel",
        )


def _one_hot(config: Any) -> bool:
    names = {config.synthesizer.name, *(a.synthesizer.name for a in config.arms)}
    return names == {"one_hot"}


# ----------------------------------------------------------------------- layout self-check

#: What the metadata channel relies on in SGLang's ``MetadataBuffers`` (field, width, dtype).
LAYOUT = (
    ("output_topk_index", 16, torch.int64),  # X in columns < 15, our binding tag in column 15
    ("output_topk_p", 16, torch.float32),
    ("bootstrap_room", 8, None),
)


def check_layout(buffers_cls: Any, channel: Any) -> None:
    """Build a two-row ``MetadataBuffers`` (the patched class) and check what the channel relies on.

    The widths and dtypes of :data:`LAYOUT`; our buffer allocated; ``get_buf_infos``
    returning three lists of one length, SGLang's ``output_topk_index`` among them with
    its row size, our buffer LAST with ours, every list entry two rows of its item size.
    Raises PluginError naming the field that differs.
    """
    from .metadata import BUFFER_ATTR  # deferred: the channel's module imports this one's neighbours

    bufs = buffers_cls(2, 8, torch.float32, 16)

    def fail(what: str, got: Any, want: Any) -> PluginError:
        return PluginError(
            f"SGLang's MetadataBuffers.{what} is {got}, the metadata channel needs {want}; this SGLang's PD "
            'metadata layout changed: stop, or use [sglang].channel = "sidechannel"',
            plugin="sglang",
        )

    for name, width, dtype in LAYOUT:
        t = getattr(bufs, name, None)
        if not isinstance(t, torch.Tensor):
            raise fail(name, type(t).__name__, "a tensor")
        if tuple(t.shape) != (2, width):
            raise fail(f"{name}.shape", tuple(t.shape), (2, width))
        if dtype is not None and t.dtype != dtype:
            raise fail(f"{name}.dtype", t.dtype, dtype)
    ours = bufs.__dict__.get(BUFFER_ATTR)
    if not isinstance(ours, torch.Tensor) or tuple(ours.shape) != (2, channel.capacity_bytes):
        raise fail(BUFFER_ATTR, getattr(ours, "shape", None), (2, channel.capacity_bytes))
    infos = bufs.get_buf_infos()
    if not (isinstance(infos, tuple) and len(infos) == 3 and len({len(x) for x in infos}) == 1):
        raise fail("get_buf_infos()", "not three lists of one length", "(ptrs, data_lens, item_lens)")
    ptrs, data_lens, item_lens = (list(x) for x in infos)
    topk = bufs.output_topk_index
    if topk.data_ptr() not in ptrs:
        raise fail("get_buf_infos() ptrs", "without output_topk_index", "output_topk_index among them")
    at = ptrs.index(topk.data_ptr())
    if item_lens[at] != topk[0].nbytes:
        raise fail("get_buf_infos() item_lens[output_topk_index]", item_lens[at], topk[0].nbytes)
    if ptrs[-1] != ours.data_ptr() or item_lens[-1] != channel.capacity_bytes:
        raise fail("get_buf_infos() last entry", (ptrs[-1], item_lens[-1]), "the proposal buffer")
    bad = [i for i, (d, n) in enumerate(zip(data_lens, item_lens)) if d != 2 * n]
    if bad:
        raise fail(f"get_buf_infos() entry {bad[0]}", (data_lens[bad[0]], item_lens[bad[0]]), "2 rows of item_len")


def registration_frames() -> list[bytes]:
    """A decode registration message as SGLang 0.5.23's ``build_receiver_registration_message``
    lays it out (20 frames, no state, no staging)."""
    return [
        b"None",
        b"127.0.0.1",
        b"17000",
        b"127.0.0.1:17001",
        struct.pack("2Q", 4096, 8192),
        struct.pack("3Q", 12288, 16384, 20480),
        b"",
        b"1",
        b"2",
        b"64",
        b"",
        b"",
        b"",
        b"",
        b"",
        b"",
        b"1",
        b"0",
        b"",
        struct.pack("2Q", 64, 64),
    ]


def check_registration(info_cls: Any, channel: Any) -> None:
    """Round-trip ``KVArgsRegisterInfo.from_zmq`` (ours around SGLang's) on a registration
    with and without our trailing frame: every SGLang field must be the same both ways, and
    our layout must come back. Raises PluginError naming the field."""
    from .registration import LAYOUT_ATTR

    frames = registration_frames()
    try:
        plain = info_cls.from_zmq(frames)
        ours = info_cls.from_zmq([*frames, channel.registration_frame()])
    except Exception as exc:
        raise PluginError(
            f"SGLang's KVArgsRegisterInfo.from_zmq no longer parses a 0.5.23 registration ({type(exc).__name__}: "
            f"{exc}); the metadata channel's layout frame cannot be carried",
            plugin="sglang",
        ) from exc
    names = [f.name for f in dataclasses.fields(plain)] if dataclasses.is_dataclass(plain) else list(vars(plain))
    for name in names:
        a, b = getattr(plain, name, None), getattr(ours, name, None)
        eq: Any = a == b
        same = bool(eq.all()) if hasattr(eq, "all") else bool(eq)
        if not same:
            raise PluginError(
                f"SGLang's KVArgsRegisterInfo.from_zmq reads the drop-in's trailing registration frame into "
                f"{name} ({a!r} without it, {b!r} with it); this SGLang added a frame: the metadata channel "
                'cannot run on it (use [sglang].channel = "sidechannel")',
                plugin="sglang",
            )
    if getattr(ours, LAYOUT_ATTR, None) != channel.describe() or getattr(plain, LAYOUT_ATTR, 0) is not None:
        raise PluginError(
            f"KVArgsRegisterInfo.{LAYOUT_ATTR} did not round-trip: got {getattr(ours, LAYOUT_ATTR, None)!r}, "
            f"sent {channel.describe()!r}",
            plugin="sglang",
        )


# ----------------------------------------------------------------------- recompute's draft head: placement, width


def check_placement(lp: Any, *, enable_overlap: bool, forward_stream: Any = None) -> None:
    """Refuse (ConfigError) the setups where decode-only recompute's draft head cannot run
    from the scheduler thread; ``lp``: the draft's ``LogitsProcessor``; ``forward_stream``:
    the scheduler's ``forward_stream`` (None: it has none).

    A vocab-parallel head (TP > 1, or attention TP > 1 with ``--enable-dp-lm-head``) under
    the overlap scheduler is served: its gather is issued on the forward stream, in the
    scheduler's program order (:mod:`.ordering`); it is refused only when the scheduler has
    no forward stream to order it on."""
    if getattr(lp, "do_tensor_parallel_all_gather_dp_attn", False):
        raise ConfigError(
            'synthesizer = "recompute" under DP attention needs --enable-dp-lm-head: without it the draft head '
            "gathers hidden states over every DP rank, whose prebuilt batches are not synchronised",
            path="synthesizer",
        )
    if getattr(lp, "do_tensor_parallel_all_gather", False) and enable_overlap and forward_stream is None:
        # Either gather: the TP group's, or the attention-TP group's (use_attn_tp_group:
        # --enable-dp-lm-head at attention TP > 1); both share the forward's communicator.
        width = "attention TP > 1 with --enable-dp-lm-head" if getattr(lp, "use_attn_tp_group", False) else "TP > 1"
        raise ConfigError(
            f'synthesizer = "recompute" with a vocab-parallel draft head ({width}) under the overlap scheduler '
            "issues its all-gather on the scheduler's forward stream, and this scheduler has none "
            "(Scheduler.forward_stream): run the decode with --disable-overlap-schedule, or use a shipped "
            "strategy (configs/sparse_floor.toml)",
            path="synthesizer",
        )


def check_width(head: Any) -> None:
    """Refuse (ConfigError) a draft whose logits are not the target's width, before any X' is
    drawn; ``head``: an :class:`~.draft_head.SGLangDraftHead` (``arch``, ``logits_width``,
    ``vocab_size``)."""
    if head.logits_width != head.vocab_size:
        raise ConfigError(
            f'synthesizer = "recompute": the draft {head.arch} produces logits over {head.logits_width} ids, the '
            f"target's vocabulary is {head.vocab_size}; rejection sampling needs a full-vocabulary draft",
            path="synthesizer",
        )


# ----------------------------------------------------------------------- the draft's token map


def draft_worker_of(scheduler: Any) -> Any:
    """The decode's or prefill's EAGLE draft worker (``scheduler.draft_worker.draft_worker``:
    SGLang's ``EagleDraftWorker``), or None (no speculative worker, not the last PP stage)."""
    worker = getattr(scheduler, "draft_worker", None)
    return getattr(worker, "draft_worker", None) if worker is not None else None


def token_map_of(draft_worker: Any) -> torch.Tensor | None:
    """The draft's ``hot_token_id`` map (draft id -> target id): the worker's
    (``--speculative-token-map``, EAGLE) or the draft model's (EAGLE3); None without one."""
    hot = getattr(draft_worker, "hot_token_id", None)
    if hot is None:
        runner = getattr(draft_worker, "draft_runner", None)
        hot = getattr(getattr(runner, "model", None), "hot_token_id", None)
    return hot if isinstance(hot, torch.Tensor) else None


def check_token_map(hot: torch.Tensor | None, vocab_size: int) -> None:
    """Refuse (ConfigError) a non-identity draft token map under rejection sampling.

    SGLang 0.5.23 maps draft *tokens* through ``hot_token_id`` (``eagle_worker_v2.py``
    around 757 and 897) but never its draft *probabilities*: every draft step's
    ``draft_probs`` stays in draft-id order while the verify reads it at target ids, so a
    map that is not the identity makes the verify inexact at every step, the ones SGLang
    drafts on the decode included. The first verify is no better: a shipped q is in
    draft-id order too, and a one-hot at the received X (SGLang's own, or the drop-in's
    fallback) sits at the draft id while the verify reads ``hot[X]``. Scattering the first
    proposal into target ids would repair that step only, never the later ones, so the
    deployment is refused at startup, whatever the strategy (:func:`check_draft`).
    """
    if hot is None:
        return
    flat = hot.reshape(-1).to("cpu", torch.int64)
    if flat.numel() == vocab_size and torch.equal(flat, torch.arange(vocab_size)):
        return
    raise ConfigError(
        f"the draft maps its {flat.numel()} ids through a token map that is not the identity (--speculative-token-map, "
        f"or an EAGLE3 draft's d2t), target V={vocab_size}: SGLang 0.5.23 maps draft tokens but not draft "
        "probabilities through it, so rejection sampling verifies every step against a proposal in the wrong order; "
        "drop the token map (a full-vocabulary draft needs none) or run without --speculative-use-rejection-sampling",
        path="sglang",
    )


def check_draft(scheduler: Any, facts: EngineFacts, symbols: Symbols) -> None:
    """Scheduler start, every role and strategy: refuse what no proposal can serve exactly
    in the scheduler's draft (today its token map, :func:`check_token_map`). ``scheduler``
    None (a harness that passes facts) or one without a draft worker: nothing to check.
    SGLang's ``EagleDraftWorker`` must carry ``hot_token_id`` (a READ target of the
    ``scheduler`` feature): a renamed attribute is refused, never read as "no map"."""
    if scheduler is None or not facts.rejection_sampling:
        return
    worker = draft_worker_of(scheduler)
    if type(worker).__name__ == "EagleDraftWorker":
        symbols.check_instance(worker, f"{WORKER_MODULE}.EagleDraftWorker")
    check_token_map(token_map_of(worker), facts.vocab_size)


# ----------------------------------------------------------------------- the features


def wrap_scheduler_init(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def init_disaggregation(self: Any) -> Any:
        # Startup: every failure stops the scheduler (SGLang then stops the server), with
        # the reason. A server that is not a PD prefill or decode is refused here too.
        try:
            inst.activate(facts_from_scheduler(self, inst.symbols), scheduler=self)
        except PDMiddlewareError:
            raise
        except Exception as exc:
            raise PluginError(f"pd-middleware could not start on this scheduler: {type(exc).__name__}: {exc}") from exc
        out = orig(self)
        inst.self_check()
        return out

    return init_disaggregation


register_feature(
    Feature(
        "scheduler",
        (
            Target(SCHEDULER_MODULE, "Scheduler.init_disaggregation", ("self",), Hook.AROUND, wrap_scheduler_init),
            read(RUNTIME_MODULE, "get_spec", ()),
            read(RUNTIME_MODULE, "get_disagg", ()),
            read(RUNTIME_MODULE, "get_parallel", ()),
            read(RUNTIME_MODULE, "get_observability", ()),
            read(WORKER_MODULE, "EagleDraftWorker.hot_token_id", instance=True),
        ),
        lambda plan: plan.options.facts is None and plan.options.hook_scheduler,
        summary="scheduler start: the checks, the engine's shapes, the role's objects",
    )
)
register_feature(
    Feature(
        "announce",
        (read(HOOKS_MODULE, "_current_plugin_source"),),
        lambda plan: True,
        summary="who registered the hooks, in HookRegistry's log format",
    )
)
