"""One installation of the SGLang drop-in: its options, its objects, and its activation.

:class:`InstallOptions` says how :func:`~pd_middleware.integrations.sglang.install`
installs; :class:`Installation` is what it did, and :meth:`Installation.activate`
finishes the job when the engine is known (a scheduler starts, or a harness passes
:class:`~.sglang_startup.EngineFacts`): the checks, the shapes, the role's objects.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .._errors import ConfigError
from .sglang_decode import DecodeProposer, ProposalStore
from .sglang_metadata import MetadataChannel
from .sglang_patch import Guard, Hook, Patch, SGLangModules, announce, apply, build, hook_source
from .sglang_prefill import ProposalPublisher
from .sglang_startup import EngineFacts, check, check_layout, check_registration

logger = logging.getLogger("pd_middleware.integrations.sglang")

ENV_CONFIG = "PD_MIDDLEWARE_CONFIG"
ENV_DECODE_ADDRESS = "PD_MIDDLEWARE_DECODE_ADDRESS"
ENV_ALLOW_UNSUPPORTED = "PD_MIDDLEWARE_ALLOW_UNSUPPORTED_SGLANG"


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
    the startup checks do not run). ``rank_agreement``: False skips the prefill's
    per-batch agreement and the decode's X canary across TP ranks (a negative control
    for tests; never turn it off on a server with TP > 1).
    """

    channel: Literal["metadata", "sidechannel"] | None = None
    facts: EngineFacts | None = None
    receiver: Any = None
    store: ProposalStore | None = None
    publisher: ProposalPublisher | None = None
    registry: Any = None
    metrics: Any = None
    allow_unsupported: bool = False
    modules: SGLangModules = field(default_factory=SGLangModules)
    version: str | None = None
    hook_scheduler: bool = True
    rank_agreement: bool = True


@dataclass
class Installation:
    """What :func:`install` did; ``current()`` returns it while installed.

    ``proposer``: decode-side proposer (its ``counts`` and the middleware's metrics
    are the counters to watch); ``channel``: the metadata channel or None;
    ``publisher``: prefill encoder/publisher once known; ``receiver``: the side
    channel receiver this installation owns (stopped on uninstall); ``facts``: the
    engine, once a scheduler started; ``patches``: the applied :class:`Patch` list;
    ``deferred``: checked patches applied at activation (the multi-layer chain);
    ``guard``: the per-batch wrappers' failure counts; ``recorder``: the live A/B
    first-verify recorder (with ``[[arms]]`` only).
    """

    version: str
    config: Any
    options: InstallOptions
    proposer: DecodeProposer
    channel: MetadataChannel | None = None
    publisher: ProposalPublisher | None = None
    receiver: Any = None
    facts: EngineFacts | None = None
    patches: list[Patch] = field(default_factory=list)
    deferred: dict[str, list[Patch]] = field(default_factory=dict)
    guard: Guard = field(default_factory=Guard)
    recorder: Any = None
    is_fake_transfer: Any = None
    announced: bool = False
    self_checked: bool = False
    # The prefill's per-batch agreement and the decode's X canary across TP ranks
    # (InstallOptions.rank_agreement; a harness's negative control turns it off).
    rank_agreement: bool = True
    # Decode-only recompute (synthesizer = "recompute"): its DecodeRecompute (.sglang_recompute).
    recompute: Any = None

    @property
    def middleware(self) -> Any:
        return self.proposer.middleware

    @property
    def store(self) -> ProposalStore | None:
        return self.proposer.store

    @property
    def channel_name(self) -> str:
        if self.recompute is not None:
            return "none"  # decode-only recompute ships nothing
        return "metadata" if self.channel is not None else "sidechannel"

    def counters(self) -> dict[str, Any]:
        """Integration counters (:meth:`parts`) plus the middleware's receive-path snapshot."""
        return {**self.parts(), "metrics": self.proposer.metrics.snapshot()}

    def parts(self) -> dict[str, dict[str, int]]:
        """The integration's own counters by part: decode, prefill, inband, recompute, guard."""
        out: dict[str, dict[str, int]] = {"decode": dict(self.proposer.counts)}
        if self.publisher is not None:
            out["prefill"] = dict(self.publisher.counts)
        if self.channel is not None:
            out["inband"] = dict(self.channel.counts)
        if self.recompute is not None:
            out["recompute"] = dict(self.recompute.counts)
        out["guard"] = dict(self.guard.counts)
        return out

    def stage_requests(self, reqs: Any, draft_probs: Any, temperature: Any = 1.0) -> Any:
        """Prefill, without a scheduler (a harness): what the prefill wrapper does for ``reqs``.

        ``reqs``: SGLang Reqs (``bootstrap_room`` set); ``draft_probs``: float (B, V)
        after temperature. Encodes each request from its (seed, room, rid) generator,
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

    def activate(self, facts: EngineFacts, scheduler: Any = None) -> None:
        """Finish activation for the engine ``facts`` (called at scheduler start).

        Runs every check (raises ConfigError, also for a server that is not a PD prefill
        or decode), binds V and S, builds the role's objects (the decode middleware, the
        prefill encoder, the side channel's receiver or publisher), applies the deferred
        patches it needs, and logs every patch once (:meth:`announce`).
        """
        check(self.config, facts, self.channel_name)
        self.facts = facts
        if self.recompute is not None:
            self._activate_recompute(facts, scheduler)
            return
        if self.channel is not None:
            self.channel.bind(facts.vocab_size, facts.num_steps)
        if facts.role == "decode":
            self.proposer.bind(facts.vocab_size, facts.num_steps)
            if facts.tp_rank == 0:
                # One [metrics] endpoint per node (every TP rank would bind the same port).
                from ..metrics_export import serve

                server = serve(self.proposer.metrics, self.config.metrics)
                if server is not None:
                    self.proposer.exporters.append(server)
            if self.channel is None and self.receiver is None and self.proposer.store is None and facts.tp_rank == 0:
                from ..transport import open_receiver

                self.receiver = open_receiver(self.config.transport, self.proposer.middleware.pipeline)
                self.proposer.store = ProposalStore(self.receiver)
                logger.info("pd-middleware decode receiver listening on %s", self.receiver.address)
        elif self.publisher is None:
            self._make_publisher(facts)
            if self.channel is not None:
                self._warn_capacity(facts)
        if facts.role == "prefill" and facts.num_steps > 1:
            self._patch_chain()
        self._export_counters()
        self.announce()
        logger.info(
            "pd-middleware active: %s node, channel %s, V=%d, S=%d",
            facts.role,
            self.channel_name,
            facts.vocab_size,
            facts.num_steps,
        )

    def _activate_recompute(self, facts: EngineFacts, scheduler: Any) -> None:
        """Decode-only recompute (``synthesizer = "recompute"``): capture the draft head from
        ``scheduler`` (.sglang_recompute), serve the decode's metrics, announce."""
        from .sglang_recompute import activate_recompute

        activate_recompute(self, facts, scheduler)
        if facts.role == "decode" and facts.tp_rank == 0:
            from ..metrics_export import serve

            server = serve(self.proposer.metrics, self.config.metrics)
            if server is not None:
                self.proposer.exporters.append(server)
        self._export_counters()
        self.announce()
        logger.info(
            "pd-middleware active: %s node, decode-only recompute, V=%d, S=%d",
            facts.role,
            facts.vocab_size,
            facts.num_steps,
        )

    def _export_counters(self) -> None:
        """Under SGLang's ``--enable-metrics``: copy the counters (the middleware's and
        :meth:`counters`' parts) into SGLang's ``/metrics``, on the prefill and the decode."""
        from .sglang_ab import CounterSource, start_sglang_export

        source = CounterSource(self.proposer.metrics, self.parts)
        start_sglang_export(source, self.config.metrics.sync_interval_s, self.proposer.exporters)

    def _patch_chain(self) -> None:
        """Multi-layer prefill: draw each chain step from its encoded law (.sglang_chain)."""
        patches = self.deferred.pop("chain", None)
        if patches is None:
            return  # stand-ins without the multi-layer module (only_given), or applied already
        ready = [build(p, self) for p in patches]
        apply(ready)
        self.patches.extend(ready)

    def announce(self) -> None:
        """Log each applied patch once, in SGLang's ``HookRegistry`` format, and a summary.

        Called at activation: in a scheduler process that is after SGLang configured its
        logging (the plugin loader runs before it, so lines logged at install were lost).
        """
        if self.announced:
            return
        self.announced = True
        announce(self.patches, hook_source())
        logger.info(
            "pd-middleware installed into SGLang %s: channel %s, %d patches, features %s",
            self.version,
            self.channel_name,
            len(self.patches),
            ", ".join(sorted({self._feature_of(p) for p in self.patches})),
        )

    @staticmethod
    def _feature_of(patch: Patch) -> str:
        from .sglang_patch import FEATURES

        for f in FEATURES.values():
            if patch.target in f.targets:
                return f.name
        return "?"

    def self_check(self) -> None:
        """Startup self-check of SGLang's layout (metadata channel; once per process).

        Builds a two-row ``MetadataBuffers`` and checks the widths, dtypes and
        ``get_buf_infos`` triple the channel relies on; round-trips
        ``KVArgsRegisterInfo.from_zmq`` with our trailing frame. Raises PluginError
        naming the field (which stops the scheduler, and SGLang with it).
        """
        if self.self_checked or self.channel is None or self.channel.layout is None:
            return
        self.self_checked = True
        owners = {p.target.attr: p.owner for p in self.patches if p.target.hook is not Hook.READ}
        mb = owners.get("MetadataBuffers.__init__")
        if mb is not None:
            check_layout(mb, self.channel)
        info = owners.get("KVArgsRegisterInfo.from_zmq")
        if info is not None:
            check_registration(info, self.channel)
        logger.info("pd-middleware: SGLang's PD metadata layout checked (%s)", self.channel.describe())

    def _warn_capacity(self, facts: EngineFacts) -> None:
        """Prefill start: say once if the encoder's largest row exceeds ``capacity_bytes``.

        The largest row comes from a flat draft (uniform over V): it makes a dense row
        V wide and a sparse encoder keep its most entries (``k_max``/``k``). Such requests
        would be sent X-only (exact one-hot, counted ``inband:overflow``) on every batch.
        """
        assert self.channel is not None and self.publisher is not None
        from ..inband import row_bytes

        shape = (1, facts.vocab_size) if facts.num_steps == 1 else (1, facts.num_steps, facts.vocab_size)
        flat = torch.full(shape, 1.0 / facts.vocab_size)
        try:
            _, payloads = self.publisher.encode([0], flat)
            need = row_bytes(payloads[0])
        except Exception as exc:  # a probe, not a gate: the first real batch reports encoder errors
            logger.warning("pd-middleware could not size the encoder's largest row (%s)", exc)
            return
        cap = self.channel.capacity_bytes
        if need > cap:
            logger.warning(
                "pd-middleware: the encoder's largest row is %d bytes (a flat draft), [sglang].capacity_bytes is %d: "
                "requests whose draft is that flat are sent X-only (exact one-hot, counted inband:overflow); "
                "raise capacity_bytes to %d to carry every proposal",
                need,
                cap,
                -(-need // 64) * 64,
            )

    def _make_publisher(self, facts: EngineFacts) -> None:
        """The prefill's encoder, fed to the metadata channel or the side channel."""
        if self.channel is not None:
            self.publisher = ProposalPublisher.from_config(
                self.config,
                stage=self.channel.stage,
                vocab_size=facts.vocab_size,
                num_steps=facts.num_steps,
                registry=self.options.registry,
            )
        else:
            addr = os.environ.get(ENV_DECODE_ADDRESS)
            if not addr:
                raise ConfigError(
                    f'[sglang].channel = "sidechannel" on a prefill needs {ENV_DECODE_ADDRESS}=tcp://host:port',
                    path="sglang.channel",
                )
            from ..transport import open_sender

            cfg = self.config
            self.publisher = ProposalPublisher.from_config(
                cfg,
                lambda: open_sender(cfg.transport, addr, name=f"sglang-prefill-{os.getpid()}"),
                vocab_size=facts.vocab_size,
                num_steps=facts.num_steps,
                registry=self.options.registry,
            )
