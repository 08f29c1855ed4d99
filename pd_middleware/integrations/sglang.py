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

import contextvars
import importlib
import importlib.metadata
import inspect
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Literal

from .._errors import ConfigError, PDMiddlewareError, PluginError
from .sglang_decode import ATTACH_ATTR, DecodeProposer, ProposalStore, RequestProposal, room_key
from .sglang_metadata import MetadataChannel
from .sglang_prefill import ProposalPublisher, wrap_process_batch_result
from .sglang_startup import EngineFacts, check, facts_from_scheduler

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

ENV_CONFIG = "PD_MIDDLEWARE_CONFIG"
ENV_DECODE_ADDRESS = "PD_MIDDLEWARE_DECODE_ADDRESS"
ENV_ALLOW_UNSUPPORTED = "PD_MIDDLEWARE_ALLOW_UNSUPPORTED_SGLANG"

# The batch whose first draft input SGLang is building (set by the build wrapper,
# read by the proposal replacement). A ContextVar rather than a global: correct even
# if two schedulers ever share a process on different threads.
_current_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("pd_middleware_sglang_batch", default=None)

_lock = threading.RLock()
_installed: "Installation | None" = None


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
    only_given: bool = False


@dataclass(frozen=True)
class InstallOptions:
    """How :func:`install` installs the drop-in.

    ``channel``: ``metadata`` or ``sidechannel``; None takes ``[sglang].channel``.
    ``facts``: the engine's :class:`EngineFacts`, to activate at once (a harness
    that runs SGLang's transfer classes without a scheduler; the scheduler is then not
    patched); None waits for ``Scheduler.init_disaggregation``.
    ``receiver``/``store``: side channel decode feed (a started receiver, owned by the
    installation, or a :class:`ProposalStore`); ``publisher``: side channel prefill
    publisher. ``registry``/``metrics``: plugin registry and shared metrics.
    ``allow_unsupported``: try a version outside :data:`SUPPORTED_SGLANG_VERSIONS`
    (signatures are still checked). ``modules``/``version``: stand-ins for tests.
    ``hook_scheduler``: False installs no scheduler-start hook (function-level use,
    e.g. SGLang's own unit tests of the builder: shapes are then taken per call and
    the startup checks do not run).
    """

    channel: Literal["metadata", "sidechannel"] | None = None
    facts: EngineFacts | None = None
    receiver: Any = None
    store: ProposalStore | None = None
    publisher: ProposalPublisher | None = None
    registry: Any = None
    metrics: Any = None
    allow_unsupported: bool = False
    modules: SGLangModules = SGLangModules()
    version: str | None = None
    hook_scheduler: bool = True


@dataclass
class Installation:
    """What :func:`install` did; ``current()`` returns it while installed.

    ``proposer``: decode-side proposer (its ``counts`` and the middleware's metrics
    are the counters to watch); ``channel``: the metadata channel or None;
    ``publisher``: prefill encoder/publisher once known; ``receiver``: the side
    channel receiver this installation owns (stopped on uninstall); ``facts``: the
    engine, once a scheduler started; ``patches``: (owner, attribute, original,
    replacement).
    """

    version: str
    mode: str
    config: Any
    options: InstallOptions
    proposer: DecodeProposer
    channel: MetadataChannel | None = None
    publisher: ProposalPublisher | None = None
    receiver: Any = None
    facts: EngineFacts | None = None
    patches: list[tuple[Any, str, Any, Any]] = field(default_factory=list)

    @property
    def middleware(self) -> Any:
        return self.proposer.middleware

    @property
    def store(self) -> ProposalStore | None:
        return self.proposer.store

    @property
    def channel_name(self) -> str:
        return "metadata" if self.channel is not None else "sidechannel"

    def counters(self) -> dict[str, Any]:
        """Integration counters plus the middleware's receive-path snapshot."""
        out: dict[str, Any] = {"decode": dict(self.proposer.counts), "metrics": self.proposer.metrics.snapshot()}
        if self.publisher is not None:
            out["prefill"] = dict(self.publisher.counts)
        if self.channel is not None:
            out["inband"] = dict(self.channel.counts)
        return out

    def stage_requests(self, reqs: Any, draft_probs: Any, temperature: Any = 1.0) -> Any:
        """Prefill, without a scheduler (a harness): what the prefill wrapper does for ``reqs``.

        ``reqs``: SGLang Reqs (``bootstrap_room`` set); ``draft_probs``: float (B, V)
        after temperature. Encodes each request from its (seed, room) generator,
        stages its row for ``MetadataBuffers.set_buf`` and sets ``req.output_topk_index``
        / ``output_topk_p`` to the encoder's X and q'(X), as SGLang's
        ``process_batch_result_disagg_prefill`` would after the wrapper. Returns the
        :class:`~pd_middleware.contracts.EncodedBatch`.
        """
        if self.publisher is None:
            raise ConfigError("stage_requests needs an activated prefill (EngineFacts(role='prefill'))")
        reqs = list(reqs)
        enc = self.publisher.publish([r.bootstrap_room for r in reqs], draft_probs, temperature, targets=reqs)
        for i, r in enumerate(reqs):
            r.output_topk_index = enc.tokens[i].clone()
            r.output_topk_p = enc.token_probs[i].clone()
        return enc

    def activate(self, facts: EngineFacts) -> None:
        """Finish activation for the engine ``facts`` (called at scheduler start).

        Runs every check (raises ConfigError), binds V and S, and builds the
        role's objects: the decode middleware, the prefill encoder, and the side
        channel's receiver or publisher.
        """
        check(self.config, facts, self.channel_name)
        self.facts = facts
        if self.channel is not None:
            self.channel.bind(facts.vocab_size, facts.num_steps)
        if facts.role == "decode":
            self.proposer.bind(facts.vocab_size, facts.num_steps)
            if self.channel is None and self.receiver is None and self.proposer.store is None and facts.tp_rank == 0:
                from ..transport import open_receiver

                self.receiver = open_receiver(self.config.transport, self.proposer.middleware.pipeline)
                self.proposer.store = ProposalStore(self.receiver)
                logger.info("pd-middleware decode receiver listening on %s", self.receiver.address)
        elif self.publisher is None:
            self._make_publisher(facts)
        if facts.role == "prefill" and facts.num_steps > 1:
            self._patch_chain()
        logger.info(
            "pd-middleware active: %s node, channel %s, V=%d, S=%d", facts.role, self.channel_name, facts.vocab_size, facts.num_steps
        )

    def _patch_chain(self) -> None:
        """Multi-layer prefill: draw each chain step from its encoded law (.sglang_chain)."""
        if any(attr == "sample_draft_proposal" for _, attr, _, _ in self.patches):
            return
        from .sglang_chain import MULTI_LAYER_MODULE, WORKER_CLASS, chain_patches

        mods = self.options.modules
        mod = _module(mods.multi_layer, MULTI_LAYER_MODULE, mods)
        if mod is None:
            return
        worker = getattr(mod, WORKER_CLASS, None)
        if worker is None:
            raise PluginError(f"{mod.__name__}.{WORKER_CLASS} not found", plugin="sglang")
        _check_signature(mod, "sample_draft_proposal", SAMPLE_PARAMS, mod.__name__)
        _check_signature(worker, "_draft_extend_for_prefill", EXTEND_PARAMS, f"{mod.__name__}.{WORKER_CLASS}")
        new = chain_patches(mod, lambda: self.publisher)
        for owner, attr, _, fn in new:
            setattr(owner, attr, fn)
        self.patches.extend(new)

    def _make_publisher(self, facts: EngineFacts) -> None:
        """The prefill's encoder, fed to the metadata channel or the side channel."""
        if self.channel is not None:
            self.publisher = ProposalPublisher.from_config(
                self.config, stage=self.channel.stage, vocab_size=facts.vocab_size, num_steps=facts.num_steps,
                registry=self.options.registry,
            )
        else:
            addr = os.environ.get(ENV_DECODE_ADDRESS)
            if not addr:
                raise ConfigError(
                    f"[sglang].channel = \"sidechannel\" on a prefill needs {ENV_DECODE_ADDRESS}=tcp://host:port",
                    path="sglang.channel",
                )
            from ..transport import open_sender

            cfg = self.config
            self.publisher = ProposalPublisher.from_config(
                cfg, lambda: open_sender(cfg.transport, addr, name=f"sglang-prefill-{os.getpid()}"),
                vocab_size=facts.vocab_size, num_steps=facts.num_steps, registry=self.options.registry,
            )


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
    fn = getattr(owner, attr, None)
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
    fn.__wrapped__ = original  # type: ignore[attr-defined]
    fn.__pd_middleware__ = True  # type: ignore[attr-defined]
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
        channel_name = opts.channel if opts.channel is not None else config.sglang.channel
        if channel_name not in ("metadata", "sidechannel"):
            raise ConfigError(f"channel must be 'metadata' or 'sidechannel', got {channel_name!r}", path="sglang.channel")

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
                        transfer.DecodeTransferQueue, "_commit_transfer_to_req", ("self", "decode_req"), transfer.__name__
                    )
                mooncake = _module(mods.mooncake, MOONCAKE_MODULE, mods)
                if mooncake is not None:
                    _check_signature(
                        mooncake.MooncakeKVManager, "build_receiver_registration_message", ("self",), mooncake.__name__
                    )
                    _check_signature(
                        mooncake.MooncakeKVManager, "_validate_peer_state_layout", ("self", "registration_info"), mooncake.__name__
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

        # ... then patch, all at once.
        if mode == "proposal":
            inst.patches.append((dec, "build_eagle_disagg_draft_input", build, _wrap_build(build)))
            inst.patches.append((dec, "pd_first_draft_proposal", first, _wrap_proposal(first, proposer)))
        else:
            inst.patches.append((dec, "build_eagle_disagg_draft_input", build, _wrap_build_post_hoc(build, proposer)))
        if pre_owner is not None:
            inst.patches.append(
                (pre_owner, "process_batch_result_disagg_prefill", pre_orig, wrap_process_batch_result(pre_orig, lambda: inst.publisher))
            )
        inst.patches.extend(meta_patches)
        if sched_cls is not None:
            inst.patches.append((sched_cls, "init_disaggregation", sched_init, _wrap_scheduler_init(sched_init, inst)))
        for owner, attr, _, new in inst.patches:
            setattr(owner, attr, new)
        _set_installed(inst)
        logger.info("pd-middleware installed into SGLang %s (%s mode, channel %s, %d patches)", ver, mode, channel_name, len(inst.patches))
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


def _set_installed(inst: "Installation | None") -> None:
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
