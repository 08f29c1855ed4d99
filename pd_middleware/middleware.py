"""Build a deployment's decode (and prefill) objects from a config, once.

:class:`DecodeMiddleware` bundles what a decode node runs per payload and per batch:
the receive pipeline (hooks + synthesizer per arm), the proposal assembler and the
counters. Engines call :meth:`DecodeMiddleware.receive` for every incoming payload and
:meth:`DecodeMiddleware.assemble` when they build a batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config, ResolvedConfig, load_config, resolve_plugins
from .core._errors import ConfigError
from .core.contracts import ReceiveContext
from .core.metrics import Metrics
from .core.payload import Payload
from .decode.assembler import ProposalAssembler
from .decode.pipeline import Delivery, Failure, ReceivePipeline
from .registry import PluginRegistry, default_registry


def _resolve(
    config: Config | str | Path, registry: PluginRegistry | None, side: str
) -> tuple[ResolvedConfig, PluginRegistry]:
    source = None
    if not isinstance(config, Config):
        source = str(config)
        config = load_config(config)
    reg = registry if registry is not None else default_registry()
    return resolve_plugins(config, reg, source, sides=(side,)), reg


@dataclass
class DecodeMiddleware:
    """The decode side of one deployment: pipeline, assembler, metrics."""

    config: Config
    pipeline: ReceivePipeline
    assembler: ProposalAssembler
    metrics: Metrics
    # Metric exporters this middleware owns (the [metrics] endpoint, an engine's
    # multiprocess mirror): anything with stop(), stopped by close().
    exporters: list[Any] = field(default_factory=list)

    @classmethod
    def from_config(
        cls,
        config: Config | str | Path,
        registry: PluginRegistry | None = None,
        metrics: Metrics | None = None,
        *,
        serve_metrics: bool = True,
        router: Any | None = None,
        assembler_factory: Callable[[Config], ProposalAssembler] | None = None,
        capabilities: Mapping[str, Any] | None = None,
    ) -> DecodeMiddleware:
        """Resolve plugins, build hooks/synthesizers/assembler. Raises Config/PluginError.

        With ``[metrics] port`` set and ``serve_metrics``, also starts the metrics
        endpoint (stopped by :meth:`close`); an engine that builds several middlewares
        over one ``metrics`` passes False and starts one endpoint itself
        (:func:`pd_middleware.metrics_export.serve`).
        ``router``: a receive hook that sets ``context.arm``. It replaces every
        configured hook that routes arms (``routes_arms = True``, e.g. ``ab_split``)
        and runs first, so every other hook sees the payload's arm. The offline A/B
        job uses it to route by request id.
        ``assembler_factory``: builds the assembler from the resolved config instead
        of ``decode.max_batch``/``decode.num_buffers`` (the A/B job sizes it to its
        batch).
        ``capabilities``: what the engine offers plugins (``{"draft_head": head}``); a
        plugin that needs one it lacks is refused with a ConfigError naming its key.
        """
        resolved, reg = _resolve(config, registry, "decode")
        cfg = resolved.config
        ctx = cfg.plugin_context("decode", capabilities)
        hooks = [(r.spec.name, reg.build(r.spec, r.options, ctx, r.key)) for r in resolved.hooks]
        if router is not None:
            hooks = [("router", router)] + [(n, h) for n, h in hooks if not getattr(h, "routes_arms", False)]
        if cfg.arms and router is None and not any(getattr(h, "routes_arms", False) for _, h in hooks):
            # Without a router every payload would land on the missing "default" arm.
            raise ConfigError(
                "[[arms]] needs a routing hook in [[hooks]] (e.g. ab_split); none of "
                f"{[n for n, _ in hooks] or 'the (empty) hook list'} routes arms",
                path="hooks",
                source=None if isinstance(config, Config) else str(config),
            )
        synths = {
            arm: (r.spec.name, reg.build(r.spec, r.options, ctx, r.key)) for arm, r in resolved.synthesizers.items()
        }
        m = metrics if metrics is not None else Metrics()
        for _, s in synths.values():
            guard = getattr(s, "guard", None)
            if guard is not None and hasattr(guard, "attach_metrics"):
                guard.attach_metrics(m)
        pipeline = ReceivePipeline(hooks, synths, m)
        if assembler_factory is not None:
            assembler = assembler_factory(cfg)
        else:
            assembler = ProposalAssembler(
                cfg.model.vocab_size,
                cfg.model.num_steps,
                cfg.decode.max_batch,
                device=cfg.decode.device,
                num_buffers=cfg.decode.num_buffers,
            )
        mw = cls(cfg, pipeline, assembler, m)
        if serve_metrics:
            from .metrics_export import serve

            server = serve(m, cfg.metrics)
            if server is not None:
                mw.exporters.append(server)
        return mw

    def receive(self, payload: Payload, context: ReceiveContext | None = None) -> Delivery | Failure:
        """Run one payload through hooks and synthesis (never raises for bad payloads)."""
        return self.pipeline.process(payload, context)

    def assemble(self, deliveries: Sequence[Delivery]) -> Any:
        """``draft_probs`` for a batch: (B, V) or (B, S, V) FP32 view, or None (RS off)."""
        t0 = time.perf_counter()
        out = self.assembler.build([d.proposal for d in deliveries])
        self.metrics.batch_assembly.observe(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        """Close plugins and stop the metric exporters (the endpoint releases its port)."""
        exporters, self.exporters = self.exporters, []
        for e in exporters:
            e.stop()
        self.pipeline.close()


def build_encoders(config: Config | str | Path, registry: PluginRegistry | None = None) -> dict[str, Any]:
    """Prefill side: the encoder of each arm (``default`` without arms)."""
    resolved, reg = _resolve(config, registry, "prefill")
    ctx = resolved.config.plugin_context("prefill")
    return {arm: reg.build(r.spec, r.options, ctx, r.key) for arm, r in resolved.encoders.items()}
