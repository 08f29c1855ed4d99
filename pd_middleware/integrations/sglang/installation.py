"""One installation of the SGLang drop-in: its options, its objects, and its activation.

:class:`InstallOptions` says how :func:`~pd_middleware.integrations.sglang.install`
installs; :class:`Installation` is what it did: the resolved table (its patches and its
READ :class:`~.patching.Symbols`), the one :class:`~.sources.ProposalSource`, the guard's
:class:`~pd_middleware.core.events.Events`. :meth:`Installation.activate` finishes the job
when the engine is known (a scheduler starts, or a harness passes
:class:`~.startup.EngineFacts`): the checks, the shapes, the source's objects for this
node's role, the metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ...core._errors import ConfigError
from ...core.events import Events
from ...core.metrics import Metrics
from .patching import (
    FEATURES,
    Hook,
    Patch,
    Plan,
    SGLangModules,
    Symbols,
    announce,
    apply,
    build,
    feature_of,
    hook_source,
)
from .prefill import ProposalPublisher
from .sources import InBandSource, ProposalSource
from .startup import EngineFacts, check, check_draft, check_layout, check_registration
from .store import ProposalStore

logger = logging.getLogger("pd_middleware.integrations.sglang")

ENV_CONFIG = "PD_MIDDLEWARE_CONFIG"
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
    the startup checks do not run). ``rank_agreement``: False skips every cross-rank
    agreement (the prefill's per batch, the decode's X canary and recompute vote): a
    negative control for tests; never turn it off on a server with TP > 1.
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

    ``source``: where the decode's proposals come from (its counters by part:
    :meth:`parts`); ``metrics``: the middleware's counters; ``events``: the guard of the
    per-batch wrappers (``guard:<wrapper>:<error>``); ``symbols``: the READ targets;
    ``publisher``: the prefill's encoder/publisher once known; ``receiver``: the side
    channel receiver this installation owns (stopped on uninstall); ``facts``: the
    engine, once a scheduler started; ``patches``: the applied :class:`Patch` list;
    ``deferred``: checked patches applied at activation (the multi-layer chain);
    ``recorder``: the live A/B first-verify recorder (with ``[[arms]]`` only);
    ``exporters``: metric exporters stopped on uninstall.
    """

    version: str
    config: Any
    options: InstallOptions
    source: ProposalSource
    metrics: Metrics
    symbols: Symbols = field(default_factory=Symbols)
    publisher: ProposalPublisher | None = None
    receiver: Any = None
    facts: EngineFacts | None = None
    patches: list[Patch] = field(default_factory=list)
    deferred: dict[str, list[Patch]] = field(default_factory=dict)
    events: Events = field(default_factory=lambda: Events("guard", source="sglang", logger=logger))
    recorder: Any = None
    # Every chain step's draft KV pool in the PD transfer (a multi-layer node, :mod:`.draft_kv`), or None.
    draft_kv: Any = None
    exporters: list[Any] = field(default_factory=list)
    announced: bool = False
    self_checked: bool = False
    # Every cross-rank agreement (InstallOptions.rank_agreement; a harness's negative control turns it off).
    rank_agreement: bool = True

    @property
    def channel_name(self) -> str:
        """The channel proposals travel on: ``metadata``, ``sidechannel``, or ``none`` (decode-only)."""
        return self.source.name

    @property
    def channel(self) -> Any:
        """The in-band :class:`~.metadata.MetadataChannel`, or None for another source."""
        if isinstance(self.source, InBandSource):
            return self.source.channel
        return getattr(self.source, "channel", None)  # a live A/B with a recompute arm (.arms)

    @property
    def proposer(self) -> Any:
        """The decode's pipeline proposer (in-band and side channel), or None (recompute)."""
        return getattr(self.source, "proposer", None)

    @property
    def recompute(self) -> Any:
        """The decode-only recompute source, or None for a shipped-law source."""
        inner = getattr(self.source, "recompute", None)  # a live A/B's recompute arm (.arms)
        if inner is not None:
            return inner
        return self.source if "recompute" in self.source.features else None

    @property
    def guard(self) -> Events:
        """The per-batch wrappers' failures (an alias of :attr:`events`)."""
        return self.events

    @property
    def middleware(self) -> Any:
        return self.proposer.middleware if self.proposer is not None else None

    @property
    def store(self) -> ProposalStore | None:
        return self.proposer.store if self.proposer is not None else None

    @property
    def is_fake_transfer(self) -> Any:
        """SGLang's ``_is_fake_transfer`` (a READ target of the metadata feature), or None."""
        from .metadata import IS_FAKE_TRANSFER

        return self.symbols.get(IS_FAKE_TRANSFER)

    def counters(self) -> dict[str, Any]:
        """Integration counters (:meth:`parts`) plus the middleware's receive-path snapshot."""
        return {**self.parts(), "metrics": self.metrics.snapshot()}

    def parts(self) -> dict[str, dict[str, int]]:
        """The integration's own counters by part: the source's, and the guard's."""
        return {**self.source.parts(), "guard": self.events.snapshot()}

    def stage_requests(self, reqs: Any, draft_probs: Any, temperature: Any = 1.0, positions: Any = None) -> Any:
        """Prefill, without a scheduler (a harness): what the prefill wrapper does for ``reqs``.

        ``reqs``: SGLang Reqs (``bootstrap_room`` set); ``draft_probs``: float (B, V)
        after temperature; ``positions``: B draw positions, default each Req's
        ``len(origin_input_ids) + len(output_ids)`` (:func:`~.prefill.draw_position`: a
        rebootstrapped request's longer prefix gives it a fresh uniform). Encodes each
        request from its (seed, room, rid, position) uniforms, stages its row for
        ``MetadataBuffers.set_buf`` and sets ``req.output_topk_index`` / ``output_topk_p`` to
        the encoder's X and q'(X), as SGLang's ``process_batch_result_disagg_prefill`` would
        after the wrapper. Returns the :class:`~pd_middleware.core.contracts.EncodedBatch`.
        """
        if self.publisher is None:
            raise ConfigError("stage_requests needs an activated prefill (EngineFacts(role='prefill'))")
        reqs = list(reqs)
        enc = self.publisher.publish(
            [r.bootstrap_room for r in reqs], draft_probs, temperature, targets=reqs, positions=positions
        )
        for i, r in enumerate(reqs):
            r.output_topk_index = enc.tokens[i].clone()
            r.output_topk_p = enc.token_probs[i].clone()
        return enc

    # -- activation ------------------------------------------------------------------
    def activate(self, facts: EngineFacts, scheduler: Any = None) -> None:
        """Finish activation for the engine ``facts`` (called at scheduler start).

        Runs every check (raises ConfigError, also for a server that is not a PD prefill
        or decode), binds the source for this node's role, applies the deferred patches
        it needs, serves and copies the metrics, and logs every patch once
        (:meth:`announce`).
        """
        check(self.config, facts, self.channel_name)
        check_draft(scheduler, facts, self.symbols)
        self.facts = facts
        self.source.bind(facts, scheduler)
        if scheduler is not None and self.draft_kv is None and {"draft_kv", "peer_check"} <= self.applied_features():
            # Before SGLang's init_disaggregation builds its KV manager from the pools.
            from .draft_kv import attach

            self.draft_kv = attach(scheduler, facts)
        if facts.role == "prefill" and self.publisher is not None:
            if self.channel is not None:
                self._warn_capacity(facts)
            if facts.num_steps > 1:
                self._patch_chain()
        if facts.role == "decode" and facts.tp_rank == 0:
            # One [metrics] endpoint per node (every TP rank would bind the same port).
            from ...metrics_export import serve

            server = serve(self.metrics, self.config.metrics)
            if server is not None:
                self.exporters.append(server)
        self._export_counters()
        self.announce()
        logger.info(
            "pd-middleware active: %s node, %s, V=%d, S=%d",
            facts.role,
            "decode-only recompute"
            if self.recompute is self.source
            else f"channel {self.channel_name}" + (", a recompute arm" if self.recompute is not None else ""),
            facts.vocab_size,
            facts.num_steps,
        )

    def applied_features(self) -> set[str]:
        """The features whose every target is applied (patched or resolved) in this installation."""
        have = {p.target.path for p in self.patches} | set(self.symbols)
        release = Plan(frozenset(), self.config, self.options, self.version).release  # this release's rows
        out = set()
        for name, f in FEATURES.items():
            rows = f.targets_for(release)
            if rows and all(t.path in have for t in rows):
                out.add(name)
        return out

    def _export_counters(self) -> None:
        """Under SGLang's ``--enable-metrics``: copy the counters (the middleware's and
        :meth:`parts`) into SGLang's ``/metrics``, on the prefill and the decode."""
        from .live_ab import CounterSource, sglang_exports_metrics, start_sglang_export

        source = CounterSource(self.metrics, self.parts)
        start_sglang_export(
            source,
            self.config.metrics.sync_interval_s,
            self.exporters,
            enabled=lambda: sglang_exports_metrics(self.symbols),
        )

    def _patch_chain(self) -> None:
        """Multi-layer prefill: draw each chain step from its encoded law (:mod:`.chain`)."""
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
        announce(self.patches, hook_source(self.symbols))
        logger.info(
            "pd-middleware installed into SGLang %s: channel %s, %d patches, features %s",
            self.version,
            self.channel_name,
            len(self.patches),
            ", ".join(sorted({feature_of(p.target) for p in self.patches})),
        )

    def self_check(self) -> None:
        """Startup self-check of SGLang's layout (metadata channel; once per process).

        Builds a two-row ``MetadataBuffers`` and checks the widths, dtypes and
        ``get_buf_infos`` triple the channel relies on; round-trips
        ``KVArgsRegisterInfo.from_zmq`` with our trailing frame. Raises PluginError
        naming the field (which stops the scheduler, and SGLang with it).
        """
        channel = self.channel
        if self.self_checked or channel is None or channel.layout is None:
            return
        self.self_checked = True
        owners = {p.target.attr: p.owner for p in self.patches if p.target.hook is not Hook.READ}
        mb = owners.get("MetadataBuffers.__init__")
        if mb is not None:
            check_layout(mb, channel)
        info = owners.get("KVArgsRegisterInfo.from_zmq")
        if info is not None:
            check_registration(info, channel)
        logger.info("pd-middleware: SGLang's PD metadata layout checked (%s)", channel.describe())

    def _warn_capacity(self, facts: EngineFacts) -> None:
        """Prefill start: say once if the encoder's largest row exceeds ``capacity_bytes``.

        The largest row comes from a flat draft (uniform over V): it makes a dense row
        V wide and a sparse encoder keep its most entries (``k_max``/``k``). Such requests
        would be sent X-only (exact one-hot, counted ``inband:overflow``) on every batch.
        """
        channel, publisher = self.channel, self.publisher
        assert channel is not None and publisher is not None
        from ...codecs.inband import row_bytes

        shape = (1, facts.vocab_size) if facts.num_steps == 1 else (1, facts.num_steps, facts.vocab_size)
        flat = torch.full(shape, 1.0 / facts.vocab_size)
        try:
            _, payloads = publisher.encode([0], flat)
            need = row_bytes(payloads[0])
        except Exception as exc:  # a probe, not a gate: the first real batch reports encoder errors
            logger.warning("pd-middleware could not size the encoder's largest row (%s)", exc)
            return
        cap = channel.capacity_bytes
        if need > cap:
            logger.warning(
                "pd-middleware: the encoder's largest row is %d bytes (a flat draft), [sglang].capacity_bytes is %d: "
                "requests whose draft is that flat are sent X-only (exact one-hot, counted inband:overflow); "
                "raise capacity_bytes to %d to carry every proposal",
                need,
                cap,
                -(-need // 64) * 64,
            )

    def close(self) -> None:
        """Uninstall: stop the exporters, the receiver and the publisher; close the source."""
        exporters, self.exporters = self.exporters, []
        for e in exporters:
            e.stop()
        if self.draft_kv is not None:
            self.draft_kv.remove()
            self.draft_kv = None
        if self.receiver is not None:
            self.receiver.stop()
        if self.store is not None:
            self.store.clear()
        if self.publisher is not None:
            self.publisher.close()
        self.source.close()


def deferred_features() -> set[str]:
    """The features applied at activation rather than at install."""
    return {f.name for f in FEATURES.values() if f.applied != "install"}
