"""Drop-in for SGLang PD deployments: route the PD decode's first draft input through the middleware.

SGLang's PD decode builds the first verify's draft input of each request in
``sglang.srt.speculative.eagle_disaggregation.build_eagle_disagg_draft_input(batch,
last_tokens_tensor, future_map)``. Since 0.5.23, under
``--speculative-use-rejection-sampling``, that function attaches the proposal
``pd_first_draft_proposal(topk_index, vocab_size)``: a one-hot FP32 tensor (b, n, V),
sliced by the caller to (b, V) for single-layer EAGLE. :func:`install` makes that
proposal come from the configured synthesizer and assembler:

- **decode** (``mode = "proposal"``, supported versions): ``build_eagle_disagg_draft_input``
  is wrapped only to publish the current batch in a :class:`contextvars.ContextVar`, and
  ``pd_first_draft_proposal`` is replaced by the middleware's proposer, which reads it.
  SGLang's own code keeps doing everything else: the rejection-sampling gate (None
  without it), the single-layer ``[:, 0]`` slice, every other field, and the overlap
  relay (``FutureMap.stash`` copies our tensor, so the next forward reads our q). A
  post-call replacement would not work under overlap: the relay already holds a copy.
- **decode** (``mode = "post_hoc"``, older SGLang without ``pd_first_draft_proposal``,
  only with ``allow_unsupported=True``): the proposal is attached after the call, and
  written into the overlap relay's ``draft_probs_buf`` when there is one.
- **prefill** (when a :class:`ProposalPublisher` is given): an AROUND wrapper of
  ``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill``; see
  :mod:`.sglang_prefill`.

Everything is checked before anything is patched: a missing module, function or class,
or a changed signature, raises :class:`~pd_middleware.PluginError` and leaves SGLang
untouched. :func:`uninstall` restores the originals.

Activation without editing SGLang (``docs/sglang.md``):

- SGLang's plugin mechanism: the entry point ``pd_middleware =
  "pd_middleware.integrations.sglang:sglang_plugin"`` in group ``sglang.srt.plugins``;
  SGLang calls it first thing in every scheduler process.
- A launch wrapper that calls :func:`activate_from_env` at module level.

Both read ``PD_MIDDLEWARE_CONFIG`` (the config file) and ``PD_MIDDLEWARE_ROLE``
(``decode``: start a receiver and use published proposals; ``prefill``: publish to
``PD_MIDDLEWARE_DECODE_ADDRESS``; unset: decode-side synthesis only, no transport).
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.metadata
import inspect
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from .._errors import ConfigError, PDMiddlewareError, PluginError
from .sglang_ab import install_first_verify
from .sglang_decode import DecodeProposer, ProposalStore, room_key
from .sglang_prefill import ProposalPublisher, wrap_process_batch_result

__all__ = [
    "SUPPORTED_SGLANG_VERSIONS",
    "Installation",
    "ProposalPublisher",
    "ProposalStore",
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

# Parameter names the adapter relies on; anything else means SGLang changed under us.
BUILD_PARAMS = ("batch", "last_tokens_tensor", "future_map")
PROPOSAL_PARAMS = ("topk_index", "vocab_size")
PREFILL_PARAMS = ("self", "batch", "result")

ENV_CONFIG = "PD_MIDDLEWARE_CONFIG"
ENV_ROLE = "PD_MIDDLEWARE_ROLE"
ENV_DECODE_ADDRESS = "PD_MIDDLEWARE_DECODE_ADDRESS"
ENV_ALLOW_UNSUPPORTED = "PD_MIDDLEWARE_ALLOW_UNSUPPORTED_SGLANG"

# The batch whose first draft input SGLang is building (set by the build wrapper,
# read by the proposal replacement). A ContextVar rather than a global: correct even
# if two schedulers ever share a process on different threads.
_current_batch: contextvars.ContextVar[Any] = contextvars.ContextVar("pd_middleware_sglang_batch", default=None)

_lock = threading.RLock()
_installed: "Installation | None" = None


@dataclass
class Installation:
    """What :func:`install` did; ``current()`` returns it while installed.

    ``proposer``: decode-side proposer (its ``counts`` and the middleware's metrics
    are the counters to watch); ``publisher``: prefill publisher or None;
    ``receiver``: the transport receiver this installation owns (stopped on
    uninstall), if any; ``patches``: (owner, attribute, original, replacement).
    """

    version: str
    mode: str
    proposer: DecodeProposer
    publisher: ProposalPublisher | None = None
    receiver: Any = None
    patches: list[tuple[Any, str, Any, Any]] = field(default_factory=list)

    @property
    def middleware(self) -> Any:
        return self.proposer.middleware

    @property
    def store(self) -> ProposalStore | None:
        return self.proposer.store

    def counters(self) -> dict[str, Any]:
        """Integration counters plus the middleware's receive-path snapshot."""
        out: dict[str, Any] = {"decode": dict(self.proposer.counts), "metrics": self.middleware.metrics.snapshot()}
        if self.publisher is not None:
            out["prefill"] = dict(self.publisher.counts)
        return out


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


def install(
    config: Any,
    *,
    receiver: Any = None,
    publisher: ProposalPublisher | None = None,
    store: ProposalStore | None = None,
    registry: Any = None,
    metrics: Any = None,
    allow_unsupported: bool = False,
    decode_module: ModuleType | None = None,
    prefill_module: ModuleType | None = None,
    version: str | None = None,
    processor_module: ModuleType | None = None,
) -> Installation:
    """Route SGLang's PD first draft input (and, with ``publisher``, the prefill) through the middleware.

    ``config``: a :class:`~pd_middleware.config.Config` or a config file path.
    ``receiver``: a started :class:`~pd_middleware.transport.DecodeReceiver` feeding
    published proposals (its pipeline should be the installation's; see
    :func:`activate_from_env`), owned by the installation. ``store``: an existing
    :class:`ProposalStore` instead. ``publisher``: patch the prefill too.
    ``allow_unsupported``: try a version outside :data:`SUPPORTED_SGLANG_VERSIONS`
    (signatures are still checked). ``decode_module``/``prefill_module``/``version``
    inject stand-ins for tests; by default the real SGLang modules are imported. The
    live A/B counters (:mod:`.sglang_ab`) patch the real scheduler's verify-result
    method, or ``processor_module``; with a stand-in ``decode_module`` and no
    ``processor_module`` they are left out.

    Installing again first uninstalls the previous installation. Raises PluginError
    (unsupported version, missing function, changed signature: nothing is patched)
    and Config/PluginError from building the middleware.
    """
    from ..middleware import DecodeMiddleware

    with _lock:
        if _installed is not None:
            uninstall()
        ver = version if version is not None else detect_version()
        if ver not in SUPPORTED_SGLANG_VERSIONS and not allow_unsupported:
            raise PluginError(
                f"SGLang {ver} is not a supported version {SUPPORTED_SGLANG_VERSIONS}; pass "
                f"allow_unsupported=True (or set {ENV_ALLOW_UNSUPPORTED}=1) to try it, signatures are still checked",
                plugin="sglang",
            )
        dec = decode_module if decode_module is not None else _import(DECODE_MODULE)
        build = _check_signature(dec, "build_eagle_disagg_draft_input", BUILD_PARAMS, dec.__name__)
        if hasattr(dec, "pd_first_draft_proposal"):
            first = _check_signature(dec, "pd_first_draft_proposal", PROPOSAL_PARAMS, dec.__name__)
            mode = "proposal"
        elif allow_unsupported:
            first, mode = None, "post_hoc"
        else:
            raise PluginError(f"{dec.__name__}.pd_first_draft_proposal not found", plugin="sglang")
        pre_owner = pre_orig = None
        if publisher is not None:
            pre = prefill_module if prefill_module is not None else _import(PREFILL_MODULE)
            pre_owner = getattr(pre, PREFILL_CLASS, None)
            if pre_owner is None:
                raise PluginError(f"{pre.__name__}.{PREFILL_CLASS} not found", plugin="sglang")
            pre_orig = _check_signature(
                pre_owner, "process_batch_result_disagg_prefill", PREFILL_PARAMS, f"{pre.__name__}.{PREFILL_CLASS}"
            )

        # Everything checked; build the middleware (may raise Config/PluginError) ...
        if isinstance(config, (str, Path)):
            from ..config import load_config

            config = load_config(config)
        mw = DecodeMiddleware.from_config(config, registry, metrics)
        ab_patch = None
        if decode_module is None or processor_module is not None:  # live A/B counters (sglang_ab)
            try:
                ab_patch = install_first_verify(mw.metrics, mw.config.metrics, mw.exporters, processor_module)
            except PluginError:
                mw.close()
                raise
        if store is None and receiver is not None:
            store = ProposalStore(receiver)
        proposer = DecodeProposer(mw, store)
        inst = Installation(ver, mode, proposer, publisher, receiver)

        # ... then patch, all at once.
        if mode == "proposal":
            inst.patches.append((dec, "build_eagle_disagg_draft_input", build, _wrap_build(build)))
            inst.patches.append((dec, "pd_first_draft_proposal", first, _wrap_proposal(first, proposer)))
        else:
            inst.patches.append((dec, "build_eagle_disagg_draft_input", build, _wrap_build_post_hoc(build, proposer)))
        if pre_owner is not None:
            inst.patches.append(
                (
                    pre_owner,
                    "process_batch_result_disagg_prefill",
                    pre_orig,
                    wrap_process_batch_result(pre_orig, lambda: inst.publisher),
                )
            )
        if ab_patch is not None:
            inst.patches.append(ab_patch)
        for owner, attr, _, new in inst.patches:
            setattr(owner, attr, new)
        _set_installed(inst)
        logger.info("pd-middleware installed into SGLang %s (%s mode, %d patches)", ver, mode, len(inst.patches))
        return inst


def _set_installed(inst: "Installation | None") -> None:
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
        for owner, attr, _, new in inst.patches:
            if getattr(owner, attr, None) is not new:
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
        inst.middleware.close()
        return True


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


def activate_from_env(environ: Any = None, *, transport: bool = True) -> Installation | None:
    """Install from ``PD_MIDDLEWARE_CONFIG`` (no-op returning None when it is unset).

    ``transport=False`` installs the patches without starting a receiver or publisher
    (processes that never build batches: SGLang's launcher, detokenizer, DP controller).

    ``PD_MIDDLEWARE_ROLE=decode`` also starts a :class:`DecodeReceiver` on
    ``transport.bind_host:port`` feeding the installation's pipeline;
    ``PD_MIDDLEWARE_ROLE=prefill`` patches the prefill with a publisher that connects to
    ``PD_MIDDLEWARE_DECODE_ADDRESS`` on its first publish. Idempotent per process.
    Raises ConfigError for a bad role or a missing address, and whatever
    :func:`install` raises.
    """
    env = os.environ if environ is None else environ
    path = env.get(ENV_CONFIG)
    if not path:
        return None
    with _lock:
        if _installed is not None:
            return _installed
        from ..config import load_config

        cfg = load_config(path)
        role = env.get(ENV_ROLE, "")
        allow = env.get(ENV_ALLOW_UNSUPPORTED, "") == "1"
        if role not in ("", "decode", "prefill"):
            raise ConfigError(f"{ENV_ROLE} must be 'decode', 'prefill' or unset, got {role!r}", source=path)
        if role == "prefill" and transport:
            addr = env.get(ENV_DECODE_ADDRESS)
            if not addr:
                raise ConfigError(f"{ENV_ROLE}=prefill needs {ENV_DECODE_ADDRESS}=tcp://host:port", source=path)
            from ..transport import open_sender

            pub = ProposalPublisher.from_config(
                cfg, lambda: open_sender(cfg.transport, addr, name=f"sglang-prefill-{os.getpid()}")
            )
            return install(cfg, publisher=pub, allow_unsupported=allow)
        inst = install(cfg, allow_unsupported=allow)
        if role == "decode" and transport:
            from ..transport import open_receiver

            rx = open_receiver(cfg.transport, inst.middleware.pipeline)
            inst.receiver = rx
            inst.proposer.store = ProposalStore(rx)
            logger.info("pd-middleware decode receiver listening on %s", rx.address)
        return inst


def _scheduler_locals() -> dict[str, Any] | None:
    """Locals of SGLang's ``run_scheduler_process`` when it is on the call stack.

    SGLang runs its plugin loader in every process it starts (launcher, schedulers,
    detokenizer, DP controller); only a scheduler builds batches, so only a scheduler
    may bind the receiver port. Its parameters also say the role and the TP rank.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "run_scheduler_process":
            return dict(frame.f_locals)
        frame = frame.f_back
    return None


def sglang_plugin() -> None:
    """Entry point of group ``sglang.srt.plugins``; SGLang calls it in each process it starts.

    Does nothing unless ``PD_MIDDLEWARE_CONFIG`` is set. Outside a scheduler process it
    installs the patches without transport. In a scheduler it checks that
    ``PD_MIDDLEWARE_ROLE`` matches ``--disaggregation-mode`` and that a transport role
    runs at TP rank 0 only. When activation fails the process exits with the error:
    SGLang's loader logs and swallows plugin exceptions, and an operator who asked for
    the middleware must not get a server silently running without it.
    """
    try:
        sched = _scheduler_locals()
        role = os.environ.get(ENV_ROLE, "")
        if sched is not None and role and os.environ.get(ENV_CONFIG):
            mode = getattr(sched.get("server_args"), "disaggregation_mode", None)
            if mode is not None and mode != role:
                raise ConfigError(f"{ENV_ROLE}={role} but this SGLang server runs --disaggregation-mode {mode}")
            if sched.get("tp_rank", 0) not in (0, None):
                raise ConfigError(
                    f"{ENV_ROLE}={role} needs one scheduler per node (TP size 1): TP rank "
                    f"{sched.get('tp_rank')} would not see the payloads; use one_hot with TP > 1"
                )
        activate_from_env(transport=sched is not None)
    except PDMiddlewareError as exc:
        logger.error("pd-middleware activation failed: %s", exc)
        raise SystemExit(f"pd-middleware: {exc}") from exc
