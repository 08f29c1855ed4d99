"""Drop-in for SGLang PD deployments: proposals for the PD decode's first verify.

SGLang's PD decode builds the first verify's draft input of each request in
``sglang.srt.speculative.eagle_disaggregation.build_eagle_disagg_draft_input(batch,
last_tokens_tensor, future_map)``. Since 0.5.23, under
``--speculative-use-rejection-sampling``, that function attaches the proposal
``pd_first_draft_proposal(topk_index, vocab_size)``: a one-hot FP32 tensor (b, n, V),
sliced by the caller to (b, V) for single-layer EAGLE. :func:`install` makes that
proposal come from the configured synthesizer and assembler:

Every SGLang symbol it touches is in one table (:mod:`.sglang_patch`: target, expected
signature, hook type, wrapper), grouped by feature:

- **decode**: ``build_eagle_disagg_draft_input`` is wrapped only to publish the current
  batch in a :class:`contextvars.ContextVar`, and ``pd_first_draft_proposal`` is
  replaced by the middleware's proposer, which reads it. SGLang's own code keeps doing
  everything else (the rejection-sampling gate, the single-layer ``[:, 0]`` slice, the
  overlap relay, which copies our tensor).
- **how proposals arrive** (``[sglang].channel``): ``"metadata"`` (default): a row
  appended to SGLang's own PD metadata buffers (:mod:`.sglang_metadata`), written by the
  prefill's ``set_buf`` and read on every decode rank when the transfer commits;
  ``"sidechannel"``: the middleware's own transport (a receiver on the decode, a
  publisher on the prefill).
- **prefill**: an AROUND wrapper of
  ``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill`` that
  encodes each finishing request's draft distribution, agreed across the TP ranks
  (:mod:`.sglang_prefill`), on both channels.
- **scheduler start**: ``Scheduler.init_disaggregation`` is wrapped so every check
  (config, version, algorithm, top-k, rejection sampling, shapes, backend, PD role) runs
  before SGLang allocates its buffers, the shapes V and S are taken from the engine, the
  prefill/decode objects are built (:mod:`.sglang_startup`), each patch is logged once in
  SGLang's ``HookRegistry`` format (after SGLang configured its logging), and SGLang's
  metadata layout is self-checked once its buffers exist.

All or nothing: every target of every wanted feature is resolved and checked before
anything is patched (the multi-layer chain's too, though it is applied only when a
prefill starts with S > 1); a missing module, function or class, or a changed signature,
raises :class:`~pd_middleware.PluginError` and leaves SGLang untouched. :func:`uninstall`
restores the originals. On a hot path nothing raises into SGLang (``Guard``).

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
from pathlib import Path
from typing import Any

from .._errors import ConfigError, PDMiddlewareError, PluginError
from .sglang_ab import make_recorder
from .sglang_decode import ATTACH_ATTR, DecodeProposer, ProposalStore, RequestProposal, room_key
from .sglang_installation import ENV_ALLOW_UNSUPPORTED, ENV_CONFIG, Installation, InstallOptions
from .sglang_metadata import MetadataChannel
from .sglang_patch import (
    BUILDER_MODULE,
    FEATURES,
    SCHEDULER_MODULE,
    Guard,
    Plan,
    SGLangModules,
    apply,
    build,
    detect_version,
    resolve_features,
)
from .sglang_prefill import ProposalPublisher
from .sglang_recompute import DecodeRecompute, uses_recompute
from .sglang_startup import EngineFacts

__all__ = [
    "ATTACH_ATTR",
    "BUILDER_MODULE",
    "SCHEDULER_MODULE",
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
    installation. All or nothing: every target of every wanted feature in
    :mod:`.sglang_patch`'s table is resolved and its signature checked, and every plugin
    resolved, before anything is patched; PluginError or ConfigError otherwise, with
    SGLang untouched. With ``options.facts`` the installation is activated at once
    (:meth:`Installation.activate`); otherwise at scheduler start.
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
        channel_name = opts.channel if opts.channel is not None else config.sglang.channel
        recompute = uses_recompute(config)
        if recompute and channel_name == "sidechannel":
            raise ConfigError(
                'synthesizer = "recompute" ships nothing: it needs no channel (use channel = "none")',
                path="sglang.channel",
            )
        if recompute:
            # Decode-only recompute: no row, no side channel, nothing patched on the prefill.
            channel_name = "none"
        elif channel_name not in ("metadata", "sidechannel"):
            raise ConfigError(
                f"channel must be 'metadata' or 'sidechannel' ('none' only with synthesizer = \"recompute\"), got {channel_name!r}",
                path="sglang.channel",
            )
        # 1. Every SGLang symbol the wanted features use: present, unpatched, same signature.
        found = resolve_features(Plan(channel_name, config, opts), mods)
        if "decode" not in found or len(found["decode"]) != len(FEATURES["decode"].targets):
            raise PluginError("no SGLang builder module given", plugin="sglang")

        # 2. Every plugin name and option, on both sides (building them needs the engine's
        # shapes: at scheduler start).
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
        channel = MetadataChannel(config.sglang.capacity_bytes) if channel_name == "metadata" else None
        if channel is not None:
            channel.on_row = proposer.on_row
        inst = Installation(ver, config, opts, proposer, channel, opts.publisher, opts.receiver)
        inst.guard = Guard(proposer.metrics)
        if recompute:
            inst.recompute = DecodeRecompute(config, opts.registry, proposer.metrics)
        inst.rank_agreement = opts.rank_agreement
        if "live_ab" in found:
            inst.recorder = make_recorder(proposer.metrics, config.metrics, proposer.exporters)

        # 3. The wrappers, then patch, all at once (READ targets are kept, not patched).
        now: list[Any] = []
        for name, patches in found.items():
            if FEATURES[name].applied != "install":
                inst.deferred[name] = patches  # checked now, applied at activation
                continue
            for p in patches:
                if p.target.wrap is None:
                    continue
                if p.target.hook.value == "read":
                    p.target.wrap(p.original, inst)
                else:
                    now.append(build(p, inst))
        apply(now)
        inst.patches.extend(now)
        _set_installed(inst)
        if opts.facts is not None:
            try:
                inst.activate(opts.facts)
                inst.self_check()
            except BaseException:
                uninstall()
                raise
        return inst


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
        for p in inst.patches:
            if _attr_now(p.owner, p.name) is not p.replacement:
                raise PluginError(
                    f"{p.target.path} was replaced by someone else after install; "
                    "not restoring, remove their patch first",
                    plugin="sglang",
                )
        for p in reversed(inst.patches):
            setattr(p.owner, p.name, p.original)
        _set_installed(None)
        if inst.receiver is not None:
            inst.receiver.stop()
        if inst.store is not None:
            inst.store.clear()
        if inst.publisher is not None:
            inst.publisher.close()
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

    Does nothing unless ``PD_MIDDLEWARE_CONFIG`` is set. When installing fails, with any
    exception, the process exits with the reason (``SystemExit``): SGLang's loader logs
    and swallows every other exception (``plugins/__init__.py``, ``load_plugins``), and
    an operator who asked for the middleware must not get a server silently running
    without it. (Checks that need the engine run at scheduler start, where an error
    stops the scheduler process, and SGLang with it.)
    """
    try:
        activate_from_env()
    except Exception as exc:
        reason = f"{exc}" if isinstance(exc, PDMiddlewareError) else f"{type(exc).__name__}: {exc}"
        logger.error("pd-middleware install failed, stopping this process: %s", reason)
        raise SystemExit(f"pd-middleware: install failed: {reason}") from exc
