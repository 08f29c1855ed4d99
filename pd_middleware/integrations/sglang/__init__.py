"""Drop-in for SGLang PD deployments: proposals for the PD decode's first verify.

SGLang's PD decode builds the first verify's draft input of each request in
``sglang.srt.speculative.eagle_disaggregation.build_eagle_disagg_draft_input(batch,
last_tokens_tensor, future_map)``. Since 0.5.22, under
``--speculative-use-rejection-sampling``, that function attaches the proposal
``pd_first_draft_proposal(topk_index, vocab_size)``: a one-hot FP32 tensor (b, n, V),
sliced by the caller to (b, V) for single-layer EAGLE; up to 0.5.21 it attaches none (the
drop-in then sets it where the builder constructs the draft input). :func:`install` makes
that proposal come from the configured strategy, on every release of
:data:`SUPPORTED_SGLANG_VERSIONS` (the versioned table of :mod:`.patching`; what each
release gets: :mod:`.releases`, ``pd-middleware sglang``).

The package is laid out by role (``docs/architecture.md``):

- :mod:`.patching`: the machinery and the table (every SGLang symbol the drop-in patches
  or reads, its expected signature, its hook type); the one module that imports SGLang;
- :mod:`.sources`: the decode's one :class:`~.sources.ProposalSource` with its lifecycle
  (bind, on_commit, prepare, propose, close), chosen by what the synthesizer needs, and the
  ``decode`` feature (the builder and its proposal); the sources are
  :class:`~.sources.InBandSource` (``[sglang].channel = "metadata"``, :mod:`.metadata`),
  :class:`~.sources.SideChannelSource` (``"sidechannel"``) and
  :class:`~.recompute.RecomputeSource` (decode-only: the synthesizer needs the draft head);
  :class:`~.arms.ArmedSource` holds a channel's source and a recompute source, for a live
  A/B whose ``[[arms]]`` mix a recompute arm with shipped ones (:mod:`.arms`);
- :mod:`.prefill` (the prefill's encoder and its wrapper), :mod:`.chain` (the multi-layer
  prefill), :mod:`.draft_kv` (every chain step's draft KV in the PD transfer, the peer check), :mod:`.startup` (the scheduler-start checks), :mod:`.live_ab` (first verifies
  per arm, the copy into SGLang's ``/metrics``): each declares its feature of the table
  next to its wrappers;
- :mod:`.agreement`: the one cross-rank vote (a failure on a rank is its vote, never a
  skipped collective); :mod:`.common`: what every room shares;
- :mod:`.installation`: :class:`InstallOptions`, :class:`Installation` and its activation.

All or nothing: every target of every wanted feature is resolved and checked before
anything is patched (the multi-layer chain's too, though it is applied only when a
prefill starts with S > 1); a missing module, function or class, or a changed signature,
raises :class:`~pd_middleware.PluginError` and leaves SGLang untouched. :func:`uninstall`
restores the originals. On a hot path nothing raises into SGLang (the installation's
guard :class:`~pd_middleware.core.events.Events` counts and logs once).

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

import msgspec

from ...core._errors import ConfigError, PDMiddlewareError, PluginError

# The feature modules register their part of the table at import (the order is the table's).
from . import arrivals as _arrivals  # noqa: F401  # registers "arrival_wait"
from . import chain as _chain  # noqa: F401  # registers "chain"
from . import draft_kv as _draft_kv  # noqa: F401  # registers "draft_kv", "peer_check"
from . import live_ab as _live_ab  # noqa: F401  # registers "live_ab", "metrics_export"
from . import metadata as _metadata  # noqa: F401  # registers "metadata"
from . import recompute as _recompute  # noqa: F401  # registers "recompute"
from .arms import ArmedSource, recompute_arms, recompute_config, shipped_config
from .common import ATTACH_ATTR, RequestProposal, room_key
from .installation import ENV_ALLOW_UNSUPPORTED, ENV_CONFIG, Installation, InstallOptions
from .live_ab import make_recorder
from .metadata import MetadataChannel
from .patching import (
    BUILDER_MODULE,
    FEATURES,
    NEWEST,
    OLDEST,
    RELEASES,
    SCHEDULER_MODULE,
    Patch,
    Plan,
    SGLangModules,
    Symbols,
    apply,
    build,
    detect_version,
    parse_version,
    resolve_features,
    restore,
)
from .prefill import ProposalPublisher
from .proposer import DecodeProposer
from .recompute import RecomputeSource
from .sources import InBandSource, ProposalSource, SideChannelSource, needs_draft_head
from .startup import EngineFacts
from .store import ProposalStore

__all__ = [
    "ATTACH_ATTR",
    "BUILDER_MODULE",
    "SCHEDULER_MODULE",
    "SUPPORTED_SGLANG_VERSIONS",
    "EngineFacts",
    "InstallOptions",
    "Installation",
    "PluginError",
    "ProposalPublisher",
    "ProposalSource",
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
    "version_problem",
]

logger = logging.getLogger("pd_middleware.integrations.sglang")

#: SGLang releases whose decode path this adapter was verified against.
SUPPORTED_SGLANG_VERSIONS: tuple[str, ...] = RELEASES

_lock = threading.RLock()
_installed: Installation | None = None


def install(config: Any, options: InstallOptions | None = None) -> Installation:
    """Install the drop-in into SGLang for ``config`` (a Config or a config file path).

    See :class:`InstallOptions`. Installing again first uninstalls the previous
    installation. All or nothing: the version, the channel, every plugin, and every
    target of every wanted feature of the table are resolved and checked before
    anything is patched; PluginError or ConfigError otherwise, with SGLang untouched.
    With ``options.facts`` the installation is activated at once
    (:meth:`Installation.activate`); otherwise at scheduler start.
    """
    opts = options if options is not None else InstallOptions()
    with _lock:
        if _installed is not None:
            uninstall()
        ver = _check_version(opts)
        config = _load(config)
        registry = _registry(opts)
        _check_plugins(config, registry)
        source = _choose_source(config, opts, registry)
        # Every SGLang symbol the wanted features use: present, unpatched, same signature.
        plan = Plan(frozenset({"decode", *source.features}), config, opts, ver)
        found = resolve_features(plan, opts.modules)
        builder_rows = [t for t in FEATURES["decode"].targets_for(plan.release) if t.module == BUILDER_MODULE]
        if sum(p.target.module == BUILDER_MODULE for p in found.get("decode", ())) != len(builder_rows):
            raise PluginError("no SGLang builder module given", plugin="sglang")
        inst = _installation(ver, config, opts, source, found)
        _patch(inst, found)
        _set_installed(inst)
        if opts.facts is not None:
            try:
                inst.activate(opts.facts)
                inst.self_check()
            except BaseException:
                uninstall()
                raise
        return inst


def _check_version(opts: InstallOptions) -> str:
    ver = opts.version if opts.version is not None else detect_version()
    problem = version_problem(ver, allow_unsupported=opts.allow_unsupported)
    if problem is not None:
        raise PluginError(problem, plugin="sglang")
    return ver


def version_problem(ver: str, *, allow_unsupported: bool = False) -> str | None:
    """Why SGLang ``ver`` is refused (one line), or None when the drop-in runs on it.

    A release of the table runs on its rows. One older than the oldest row is refused
    always (the table has no rows for it). Any other (newer than the table, or a pre/post
    release of it) is refused unless ``allow_unsupported``; then it runs on the rows of
    its release segment (the newest rows past the table), every signature still checked.
    """
    try:
        release = parse_version(ver)
    except ValueError:
        return f"SGLang {ver!r} is not a version the drop-in can read"
    if ver in SUPPORTED_SGLANG_VERSIONS:
        return None
    if release < parse_version(OLDEST):
        return (
            f"SGLang {ver} is older than the oldest supported release {OLDEST} "
            f"(supported: {', '.join(SUPPORTED_SGLANG_VERSIONS)}); upgrade SGLang to one of them"
        )
    if allow_unsupported:
        return None
    return (
        f"SGLang {ver} is not a supported version {SUPPORTED_SGLANG_VERSIONS}; pass allow_unsupported=True "
        f"(or set {ENV_ALLOW_UNSUPPORTED}=1) to try it on the rows of {'.'.join(map(str, min(release, parse_version(NEWEST))))}: "
        "every signature is still checked"
    )


def _load(config: Any) -> Any:
    if isinstance(config, (str, Path)):
        from ...config import load_config

        return load_config(config)
    return config


def _registry(opts: InstallOptions) -> Any:
    if opts.registry is not None:
        return opts.registry
    from ...registry import default_registry

    return default_registry()


def _check_plugins(config: Any, registry: Any) -> None:
    """Every plugin name and option, on both sides (building them needs the engine's shapes:
    at scheduler start), and a live decode's A/B needs a router."""
    from ...config import resolve_plugins

    resolved = resolve_plugins(config, registry)
    if config.arms and not any(getattr(r.spec.factory, "routes_arms", False) for r in resolved.hooks):
        # An offline A/B job config (pd-middleware ab): a live decode needs a router.
        raise ConfigError(
            "[[arms]] needs a routing hook in [[hooks]] (e.g. ab_split) on a live decode; "
            "a config with arms and no router is for the offline `pd-middleware ab` job",
            path="hooks",
        )


def _choose_source(config: Any, opts: InstallOptions, registry: Any) -> ProposalSource:
    """The one proposal source: from what the synthesizer needs, then the channel."""
    channel = opts.channel if opts.channel is not None else config.sglang.channel
    metrics = opts.metrics
    if not config.arms and needs_draft_head(config, registry):
        # Decode-only: the synthesizer recomputes from the engine's draft head; nothing ships.
        if channel == "sidechannel":
            raise ConfigError(
                f"synthesizer = {config.synthesizer.name!r} needs the decode's draft head and ships nothing: "
                'it needs no channel (use channel = "none")',
                path="sglang.channel",
            )
        return RecomputeSource(config, opts.registry, metrics)
    if channel not in ("metadata", "sidechannel"):
        raise ConfigError(
            f"channel must be 'metadata' or 'sidechannel' ('none' only with a synthesizer that needs the draft "
            f'head, e.g. synthesizer = "recompute"), got {channel!r}',
            path="sglang.channel",
        )
    mixed = recompute_arms(
        config, lambda ref: needs_draft_head(msgspec.structs.replace(config, synthesizer=ref), registry)
    )
    if len(mixed) > 1:
        raise ConfigError(
            f"[[arms]] holds {len(mixed)} arms whose synthesizer needs the draft head ({', '.join(mixed)}); "
            "a live A/B takes one recompute arm",
            path="arms",
        )
    if mixed and channel != "metadata":
        # The side channel's store would keep the recompute rows' payloads, never taken.
        raise ConfigError(
            f'[[arms]] with a recompute arm ({mixed[0]!r}) runs on channel = "metadata" only, got {channel!r}',
            path="sglang.channel",
        )
    shipped_cfg = shipped_config(config, mixed[0]) if mixed else config
    store = (
        opts.store if opts.store is not None else ProposalStore(opts.receiver) if opts.receiver is not None else None
    )
    proposer = DecodeProposer(shipped_cfg, store, registry=opts.registry, metrics=metrics)
    source: ProposalSource
    if channel == "metadata":
        source = InBandSource(proposer, MetadataChannel(config.sglang.capacity_bytes))
    else:
        source = SideChannelSource(proposer)
    if mixed:
        # A live A/B with a recompute arm: that arm's rows recomputed, the others shipped (.arms).
        return ArmedSource(
            source, RecomputeSource(recompute_config(config, mixed[0]), opts.registry, metrics), mixed[0]
        )
    return source


def _installation(ver: str, config: Any, opts: InstallOptions, source: ProposalSource, found: Any) -> Installation:
    from ...core.metrics import Metrics

    proposer = getattr(source, "proposer", None)
    metrics = proposer.metrics if proposer is not None else opts.metrics if opts.metrics is not None else Metrics()
    if isinstance(source, RecomputeSource):
        source.metrics = metrics
    elif isinstance(source, ArmedSource):
        source.recompute.metrics = metrics
    reads = [p for patches in found.values() for p in patches if p.target.wrap is None]
    inst = Installation(
        ver,
        config,
        opts,
        source,
        metrics,
        symbols=Symbols(reads),
        publisher=opts.publisher,
        receiver=opts.receiver,
        rank_agreement=opts.rank_agreement,
    )
    inst.events.attach_metrics(metrics)
    source.attach(inst)
    if "live_ab" in found:
        inst.recorder = make_recorder(metrics, config.metrics, inst.exporters)
    return inst


def _patch(inst: Installation, found: dict[str, list[Patch]]) -> None:
    """Build every wrapper, then patch all at once (READ targets are kept, deferred
    features are applied at activation)."""
    now: list[Patch] = []
    for name, patches in found.items():
        if FEATURES[name].applied != "install":
            inst.deferred[name] = patches  # checked now, applied at activation
            continue
        now.extend(build(p, inst) for p in patches if p.target.wrap is not None)
    apply(now)
    inst.patches.extend(now)


def _set_installed(inst: Installation | None) -> None:
    global _installed
    _installed = inst


def current() -> Installation | None:
    """The active installation, or None."""
    return _installed


def uninstall() -> bool:
    """Restore every original SGLang attribute; returns False when nothing was installed.

    Raises PluginError, restoring nothing, when another party re-patched one of the
    attributes on top of ours (restoring would silently drop their patch).
    """
    with _lock:
        inst = _installed
        if inst is None:
            return False
        restore(inst.patches)
        _set_installed(None)
        inst.close()
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
        from ...config import load_config

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
