"""Drop-in for SGLang PD deployments: proposals for the PD decode's first verify.

SGLang's PD decode builds the first verify's draft input of each request in
``sglang.srt.speculative.eagle_disaggregation.build_eagle_disagg_draft_input(batch,
last_tokens_tensor, future_map)``. Since 0.5.23, under
``--speculative-use-rejection-sampling``, that function attaches the proposal
``pd_first_draft_proposal(topk_index, vocab_size)``: a one-hot FP32 tensor (b, n, V),
sliced by the caller to (b, V) for single-layer EAGLE. :func:`install` makes that
proposal come from the configured synthesizer and assembler:

- **decode builder** (``mode = "proposal"``): ``build_eagle_disagg_draft_input`` is
  wrapped only to publish the current batch in a :class:`contextvars.ContextVar`, and
  ``pd_first_draft_proposal`` is replaced by the middleware's proposer, which reads
  it. SGLang's own code keeps doing everything else (the rejection-sampling gate, the
  single-layer ``[:, 0]`` slice, the overlap relay, which copies our tensor).
  ``mode = "post_hoc"`` (older SGLang, ``allow_unsupported`` only) attaches it after.
- **how proposals arrive** (``[sglang].channel``):
  ``"metadata"`` (default): a row appended to SGLang's own PD metadata buffers
  (:mod:`.sglang_metadata`), written by the prefill's ``set_buf`` and read on every
  decode rank when the transfer commits; ``"sidechannel"``: the middleware's own
  transport (a receiver on the decode, a publisher on the prefill).
- **prefill**: an AROUND wrapper of
  ``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill`` that
  encodes each finishing request's draft distribution (:mod:`.sglang_prefill`).
- **scheduler start**: ``Scheduler.init_disaggregation`` is wrapped so every check
  (config, version, algorithm, top-k, rejection sampling, shapes, backend) runs before
  SGLang allocates its buffers, the shapes V and S are taken from the engine, and the
  prefill/decode objects are built (:mod:`.sglang_startup`).

Everything is checked before anything is patched: a missing module, function or class,
or a changed signature, raises :class:`~pd_middleware.PluginError` and leaves SGLang
untouched. :func:`uninstall` restores the originals.

**One switch** (``docs/sglang.md``): ``PD_MIDDLEWARE_CONFIG=<config file>`` in the
environment of both servers. SGLang's plugin loader (entry point ``pd_middleware`` in
group ``sglang.srt.plugins``) calls :func:`sglang_plugin` in every process it starts; it
installs the patches, and each scheduler finishes activation in its
``init_disaggregation``, with the role from ``--disaggregation-mode``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._errors import ConfigError, PDMiddlewareError, PluginError
from .sglang_ab import PROCESSOR_MODULE, install_first_verify
from .sglang_decode import ATTACH_ATTR, DecodeProposer, ProposalStore, RequestProposal, room_key
from .sglang_installation import ENV_ALLOW_UNSUPPORTED, ENV_CONFIG, Installation, InstallOptions
from .sglang_metadata import MetadataChannel
from .sglang_patch import (
    BUILD_PARAMS,
    DECODE_MODULE,
    METADATA_PARAMS,
    MOONCAKE_MODULE,
    PREFILL_CLASS,
    PREFILL_MODULE,
    PREFILL_PARAMS,
    PROPOSAL_PARAMS,
    SCHEDULER_MODULE,
    TRANSFER_MODULE,
    UTILS_MODULE,
    SGLangModules,
    _check_signature,
    _mark,
    _module,
    _wrap_build,
    _wrap_build_post_hoc,
    _wrap_proposal,
    detect_version,
)
from .sglang_prefill import ProposalPublisher, wrap_process_batch_result
from .sglang_recompute import install_recompute, uses_recompute
from .sglang_startup import EngineFacts, facts_from_scheduler

__all__ = [
    "ATTACH_ATTR",
    "SUPPORTED_SGLANG_VERSIONS",
    "EngineFacts",
    "InstallOptions",
    "Installation",
    "ProposalPublisher",
    "ProposalStore",
    "RequestProposal",
    "SGLangModules",
    "activate_from_env",
    "current",
    "detect_version",
    "install",
    "room_key",
    "sglang_plugin",
    "uninstall",
]

logger = logging.getLogger("pd_middleware.integrations.sglang")

#: SGLang releases whose decode path this adapter was verified against.
SUPPORTED_SGLANG_VERSIONS: tuple[str, ...] = ("0.5.23",)

_lock = threading.RLock()
_installed: Installation | None = None


def install(config: Any, options: InstallOptions | None = None) -> Installation:
    """Install the drop-in into SGLang for ``config`` (a Config or a config file path).

    See :class:`InstallOptions`. Installing again first uninstalls the previous
    installation. Raises PluginError (unsupported version, missing function, changed
    signature: nothing is patched), and Config/PluginError from the config and plugins
    (also nothing patched). With ``options.facts`` the installation is activated at
    once (:meth:`Installation.activate`); otherwise at scheduler start.
    """
    opts = options if options is not None else InstallOptions()
    mods = opts.modules
    with _lock:
        if _installed is not None:
            uninstall()
        ver = opts.version if opts.version is not None else detect_version()
        if ver not in SUPPORTED_SGLANG_VERSIONS and not opts.allow_unsupported:
            raise PluginError(
                f"SGLang {ver} is not a supported version {SUPPORTED_SGLANG_VERSIONS}; pass "
                f"allow_unsupported=True (or set {ENV_ALLOW_UNSUPPORTED}=1) to try it, signatures are still checked",
                plugin="sglang",
            )
        if isinstance(config, (str, Path)):
            from ..config import load_config

            config = load_config(config)
        if uses_recompute(config):
            # Decode-only recompute (.sglang_recompute): no channel, no prefill patch.
            inst = install_recompute(config, opts, ver)
            for owner, attr, _, new in inst.patches:
                setattr(owner, attr, new)
            _set_installed(inst)
            logger.info("pd-middleware installed into SGLang %s (decode-only recompute)", ver)
            return inst
        channel_name = opts.channel if opts.channel is not None else config.sglang.channel
        if channel_name not in ("metadata", "sidechannel"):
            raise ConfigError(
                f"channel must be 'metadata' or 'sidechannel' ('none' only with synthesizer = \"recompute\"), got {channel_name!r}",
                path="sglang.channel",
            )

        dec = _module(mods.builder, DECODE_MODULE, mods)
        if dec is None:
            raise PluginError("no SGLang builder module given", plugin="sglang")
        build = _check_signature(dec, "build_eagle_disagg_draft_input", BUILD_PARAMS, dec.__name__)
        if hasattr(dec, "pd_first_draft_proposal"):
            first = _check_signature(dec, "pd_first_draft_proposal", PROPOSAL_PARAMS, dec.__name__)
            mode = "proposal"
        elif opts.allow_unsupported:
            first, mode = None, "post_hoc"
        else:
            raise PluginError(f"{dec.__name__}.pd_first_draft_proposal not found", plugin="sglang")
        need_prefill = channel_name == "metadata" or opts.publisher is not None or mods.prefill is not None
        pre = _module(mods.prefill, PREFILL_MODULE, mods) if need_prefill else None
        pre_owner = pre_orig = None
        if pre is not None:
            pre_owner = getattr(pre, PREFILL_CLASS, None)
            if pre_owner is None:
                raise PluginError(f"{pre.__name__}.{PREFILL_CLASS} not found", plugin="sglang")
            pre_orig = _check_signature(
                pre_owner, "process_batch_result_disagg_prefill", PREFILL_PARAMS, f"{pre.__name__}.{PREFILL_CLASS}"
            )
        channel = None
        meta_patches: list[tuple[Any, str, Any, Any]] = []
        if channel_name == "metadata":
            utils = _module(mods.utils, UTILS_MODULE, mods)
            if utils is not None:
                mb = getattr(utils, "MetadataBuffers", None)
                if mb is None:
                    raise PluginError(f"{utils.__name__}.MetadataBuffers not found", plugin="sglang")
                for attr, params in METADATA_PARAMS.items():
                    _check_signature(mb, attr, params, f"{utils.__name__}.MetadataBuffers")
                transfer = _module(mods.transfer, TRANSFER_MODULE, mods)
                if transfer is not None:
                    _check_signature(
                        transfer.DecodeTransferQueue,
                        "_commit_transfer_to_req",
                        ("self", "decode_req"),
                        transfer.__name__,
                    )
                mooncake = _module(mods.mooncake, MOONCAKE_MODULE, mods)
                if mooncake is not None:
                    _check_signature(
                        mooncake.MooncakeKVManager, "build_receiver_registration_message", ("self",), mooncake.__name__
                    )
                    _check_signature(
                        mooncake.MooncakeKVManager,
                        "_validate_peer_state_layout",
                        ("self", "registration_info"),
                        mooncake.__name__,
                    )
                channel = MetadataChannel(config.sglang.capacity_bytes)
                meta_patches = channel.patches(utils, transfer, mooncake)
            else:
                channel = MetadataChannel(config.sglang.capacity_bytes)
        # With facts the installation activates now (a harness without a Scheduler);
        # otherwise at Scheduler.init_disaggregation, which is wrapped.
        hook = opts.facts is None and opts.hook_scheduler
        sched_mod = _module(mods.scheduler, SCHEDULER_MODULE, mods) if hook else None
        sched_cls = getattr(sched_mod, "Scheduler", None) if sched_mod is not None else None
        if sched_mod is not None and sched_cls is None:
            raise PluginError(f"{sched_mod.__name__}.Scheduler not found", plugin="sglang")
        sched_init = _check_signature(sched_cls, "init_disaggregation", ("self",), "Scheduler") if sched_cls else None

        # Every plugin name and option, on both sides, before anything is patched
        # (building them needs the engine's shapes: at scheduler start).
        from ..config import resolve_plugins
        from ..registry import default_registry

        resolved = resolve_plugins(config, opts.registry if opts.registry is not None else default_registry())
        if config.arms and not any(getattr(r.spec.factory, "routes_arms", False) for r in resolved.hooks):
            # An offline A/B job config (pd-middleware ab): a live decode needs a router.
            raise ConfigError(
                "[[arms]] needs a routing hook in [[hooks]] (e.g. ab_split) on a live decode; "
                "a config with arms and no router is for the offline `pd-middleware ab` job",
                path="hooks",
            )
        store = opts.store
        if store is None and opts.receiver is not None:
            store = ProposalStore(opts.receiver)
        proposer = DecodeProposer(config, store, registry=opts.registry, metrics=opts.metrics)
        if channel is not None:
            channel.on_row = proposer.on_row
        inst = Installation(ver, mode, config, opts, proposer, channel, opts.publisher, opts.receiver)
        # Live A/B: each request's first verify, by arm (sglang_ab; checked, nothing patched yet).
        processor = _module(mods.processor, PROCESSOR_MODULE, mods)
        ab_patch = (
            install_first_verify(proposer.metrics, config.metrics, proposer.exporters, processor)
            if processor is not None
            else None
        )

        # ... then patch, all at once.
        if first is not None:  # mode == "proposal"
            inst.patches.append((dec, "build_eagle_disagg_draft_input", build, _wrap_build(build)))
            inst.patches.append((dec, "pd_first_draft_proposal", first, _wrap_proposal(first, proposer)))
        else:
            inst.patches.append((dec, "build_eagle_disagg_draft_input", build, _wrap_build_post_hoc(build, proposer)))
        if pre_owner is not None and pre_orig is not None:
            inst.patches.append(
                (
                    pre_owner,
                    "process_batch_result_disagg_prefill",
                    pre_orig,
                    wrap_process_batch_result(pre_orig, lambda: inst.publisher),
                )
            )
        inst.patches.extend(meta_patches)
        if ab_patch is not None:
            inst.patches.append(ab_patch)
        if sched_cls is not None and sched_init is not None:
            inst.patches.append((sched_cls, "init_disaggregation", sched_init, _wrap_scheduler_init(sched_init, inst)))
        for owner, attr, _, new in inst.patches:
            setattr(owner, attr, new)
        _set_installed(inst)
        logger.info(
            "pd-middleware installed into SGLang %s (%s mode, channel %s, %d patches)",
            ver,
            mode,
            channel_name,
            len(inst.patches),
        )
        if opts.facts is not None:
            try:
                inst.activate(opts.facts)
            except BaseException:
                uninstall()
                raise
        return inst


def _wrap_scheduler_init(orig: Callable[..., Any], inst: Installation) -> Callable[..., Any]:
    def init_disaggregation(self: Any) -> Any:
        facts = facts_from_scheduler(self)
        if facts.role in ("prefill", "decode"):
            # Before SGLang allocates MetadataBuffers: the row layout must be bound.
            inst.activate(facts)
        return orig(self)

    return _mark(init_disaggregation, orig)


def _set_installed(inst: Installation | None) -> None:
    global _installed
    _installed = inst


def current() -> Installation | None:
    """The active installation, or None."""
    return _installed


def _attr_now(owner: Any, attr: str) -> Any:
    # A class's own __dict__ entry (a classmethod object stays itself there).
    if isinstance(owner, type) and attr in owner.__dict__:
        return owner.__dict__[attr]
    return getattr(owner, attr, None)


def uninstall() -> bool:
    """Restore every original SGLang attribute; returns False when nothing was installed.

    Raises PluginError, restoring nothing, when another party re-patched one of the
    attributes on top of ours (restoring would silently drop their patch).
    """
    with _lock:
        inst = _installed
        if inst is None:
            return False
        for owner, attr, _, new in inst.patches:
            if _attr_now(owner, attr) is not new:
                raise PluginError(
                    f"{getattr(owner, '__name__', owner)}.{attr} was replaced by someone else after install; "
                    "not restoring, remove their patch first",
                    plugin="sglang",
                )
        for owner, attr, orig, _ in reversed(inst.patches):
            setattr(owner, attr, orig)
        _set_installed(None)
        if inst.receiver is not None:
            inst.receiver.stop()
        if inst.store is not None:
            inst.store.clear()
        inst.proposer.close()
        return True


def activate_from_env(environ: Any = None) -> Installation | None:
    """Install from ``PD_MIDDLEWARE_CONFIG`` (no-op returning None when it is unset).

    The one switch: the config file names the channel; the role, shapes and ranks come
    from SGLang when each scheduler starts (``Scheduler.init_disaggregation``). In a
    process that never starts a scheduler (launcher, detokenizer) the patches are
    installed and stay idle. Idempotent per process. Raises ConfigError for a bad
    config, and whatever :func:`install` raises.
    """
    env = os.environ if environ is None else environ
    path = env.get(ENV_CONFIG)
    if not path:
        return None
    with _lock:
        if _installed is not None:
            return _installed
        from ..config import load_config

        if env.get("PD_MIDDLEWARE_ROLE"):
            logger.warning("PD_MIDDLEWARE_ROLE is no longer read: the role comes from --disaggregation-mode")
        cfg = load_config(path)
        return install(cfg, InstallOptions(allow_unsupported=env.get(ENV_ALLOW_UNSUPPORTED, "") == "1"))


def sglang_plugin() -> None:
    """Entry point of group ``sglang.srt.plugins``; SGLang calls it in each process it starts.

    Does nothing unless ``PD_MIDDLEWARE_CONFIG`` is set. When activation fails the
    process exits with the error: SGLang's loader logs and swallows plugin exceptions,
    and an operator who asked for the middleware must not get a server silently
    running without it. (Checks that need the engine run at scheduler start, where a
    ConfigError stops the scheduler process, and SGLang with it.)
    """
    try:
        activate_from_env()
    except PDMiddlewareError as exc:
        logger.error("pd-middleware activation failed: %s", exc)
        raise SystemExit(f"pd-middleware: {exc}") from exc
