"""One typed, frozen, strict config schema, loaded from TOML, YAML, JSON or inline JSON.

Unknown keys and bad values are :class:`~pd_middleware.ConfigError` with the full key
path (``synthesizer.options.top_k``, ``hooks[1].name``), a "did you mean" for a misspelled
key, and every problem of a document at once (``.issues``); reading and checking live in
:mod:`pd_middleware.config_loader`. There are no environment
overrides and no silent defaults for misspelled keys. Plugin options are typed by the
plugin that owns them and checked when the config is resolved against a registry
(:func:`resolve_plugins`), so ``pd-middleware check-config`` catches them too.

A minimal file (everything else has a default)::

    [model]
    vocab_size = 152064
    num_steps = 1

    [synthesizer]
    name = "one_hot"
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from . import config_loader
from ._errors import ConfigError, ConfigIssue, OptionValueError, PluginError
from .ab.config import ABConfig, WorkloadRef, check_workload_options  # the [ab] table belongs to the job
from .contracts import NoOptions, PluginContext, PluginSpec
from .transport.config import TransportConfig

_STRUCT = dict(forbid_unknown_fields=True, frozen=True, kw_only=True)
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class PluginRef(msgspec.Struct, **_STRUCT):
    """Selects one plugin: a registered ``name`` or a ``package.module:ATTR`` reference."""

    name: str
    # The plugin's own options; their schema belongs to the plugin.
    options: dict[str, Any] = {}


class ModelConfig(msgspec.Struct, **_STRUCT):
    """Facts about the target and draft models."""

    # Target vocabulary size V: every proposal row is exactly this wide.
    vocab_size: int = 152064
    # Draft steps per request: 1 = single-layer EAGLE, >1 = multi-layer chain (num_steps).
    num_steps: int = 1
    # Hidden-state width H the prefill sends to seed the next draft step.
    hidden_size: int = 4096
    # Hidden-state dtype on the wire.
    hidden_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"

    def __post_init__(self) -> None:
        if not 1 <= self.vocab_size <= 1 << 24:
            raise OptionValueError("vocab_size", f"must be in [1, 16777216], got {self.vocab_size}")
        if not 1 <= self.num_steps <= 16:
            raise OptionValueError("num_steps", f"must be in [1, 16], got {self.num_steps}")
        if not 0 <= self.hidden_size <= 1 << 16:
            raise OptionValueError("hidden_size", f"must be in [0, 65536], got {self.hidden_size}")


class DecodeConfig(msgspec.Struct, **_STRUCT):
    """The decode node's verifier and proposal assembler."""

    # Whether the verifier uses rejection sampling; without it no draft_probs is built.
    rejection_sampling: bool = True
    # Largest batch the scheduler builds: rows of the persistent proposal buffer.
    max_batch: int = 64
    # Torch device of the proposal buffer: "cpu", "cuda" or "cuda:N".
    device: str = "cpu"
    # Buffers to rotate through, for overlap schedulers that keep one batch in flight
    # while building the next; a view stays valid for num_buffers builds.
    num_buffers: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch <= 1 << 16:
            raise OptionValueError("max_batch", f"must be in [1, 65536], got {self.max_batch}")
        if not _DEVICE_RE.match(self.device):
            raise OptionValueError("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 1 <= self.num_buffers <= 8:
            raise OptionValueError("num_buffers", f"must be in [1, 8], got {self.num_buffers}")


class ArmConfig(msgspec.Struct, **_STRUCT):
    """One arm of an A/B comparison (offline ``pd-middleware ab`` or live split)."""

    # Arm name, unique; used in reports and counters.
    name: str
    # Decode-side synthesizer of this arm.
    synthesizer: PluginRef
    # Prefill-side encoder for the offline A/B job; the top-level encoder if omitted.
    encoder: PluginRef | None = None
    # Relative share of live traffic routed to this arm by the ab_split hook.
    weight: int = 1

    def __post_init__(self) -> None:
        if not re.match(r"^[A-Za-z0-9_.\-]{1,64}$", self.name):
            raise OptionValueError("name", f"must be 1-64 of [A-Za-z0-9_.-], got {self.name!r}")
        if not 0 <= self.weight <= 1_000_000:
            raise OptionValueError("weight", f"must be in [0, 1000000], got {self.weight}")


class Config(msgspec.Struct, **_STRUCT):
    """The whole deployment: model facts, decode settings, plugins, transport, A/B."""

    model: ModelConfig = ModelConfig()
    decode: DecodeConfig = DecodeConfig()
    # Receive hooks, run in this order on every payload before synthesis.
    hooks: list[PluginRef] = []
    # The decode-side synthesizer (one per deployment; per arm when [[arms]] is set).
    synthesizer: PluginRef = PluginRef(name="one_hot")
    # The prefill-side encoder (what the prefill samples X from and sends).
    encoder: PluginRef = PluginRef(name="softmax")
    # A/B arms; when set, each arm has its own synthesizer.
    arms: list[ArmConfig] = []
    transport: TransportConfig = TransportConfig()
    ab: ABConfig = ABConfig()

    def __post_init__(self) -> None:
        names = [a.name for a in self.arms]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise ConfigError(f"duplicate arm name {n!r}", path=f"arms[{i}].name")

    def plugin_context(self, side: Literal["prefill", "decode"] = "decode") -> PluginContext:
        return PluginContext(
            vocab_size=self.model.vocab_size,
            num_steps=self.model.num_steps,
            rejection_sampling=self.decode.rejection_sampling,
            device=self.decode.device,
            side=side,
            arms=tuple((a.name, a.weight) for a in self.arms),
        )


def _convert(data: Any, typ: type, prefix: str, source: str | None) -> Any:
    return config_loader.convert(data, typ, prefix, source)


def parse_config(data: Any, source: str | None = None) -> Config:
    """Build a :class:`Config` from an already-parsed mapping.

    Raises one ConfigError whose ``.issues`` lists every problem, each at its full key
    path with a "did you mean" for a misspelled key.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a table/mapping, got {type(data).__name__}", source=source)
    return _convert(data, Config, "", source)


def load_config(path: str | Path) -> Config:
    """Read a config into a :class:`Config`.

    ``path`` is a ``.toml``, ``.yaml``, ``.yml`` or ``.json`` file, or an inline JSON
    document (a string starting with ``{``), as vLLM's ``--kv-transfer-config '{...}'``.
    The same holds wherever a config is named: the CLI and ``PD_MIDDLEWARE_CONFIG``.
    """
    data, src = config_loader.read_document(path)
    return parse_config(data, src)


def convert_options(spec: PluginSpec, raw: dict[str, Any], key: str, source: str | None = None) -> Any:
    """Typed options for ``spec`` from a raw table; errors carry ``key`` as path prefix."""
    if spec.options is NoOptions:
        if raw:
            issues = [
                ConfigIssue(f"{key}.{k}", f"plugin {spec.name!r} takes no options, got {k!r}") for k in raw
            ]
            raise ConfigError.from_issues(issues, source=source)
        return NoOptions()
    return _convert(raw, spec.options, key, source)


@dataclass(frozen=True)
class ResolvedPlugin:
    """A plugin reference checked against the registry, with typed options."""

    key: str
    spec: PluginSpec
    options: Any


@dataclass(frozen=True)
class ResolvedConfig:
    """Every plugin a config selects, resolved once (the hot path never looks up names)."""

    config: Config
    hooks: tuple[ResolvedPlugin, ...]
    synthesizers: dict[str, ResolvedPlugin]
    encoders: dict[str, ResolvedPlugin]


def _resolve_ref(registry: Any, kind: str, ref: PluginRef, key: str, source: str | None) -> ResolvedPlugin:
    try:
        spec = registry.resolve(kind, ref.name, key=f"{key}.name")
    except PluginError as exc:
        if exc.key is None:
            raise PluginError(exc.detail, plugin=exc.plugin, key=f"{key}.name") from None
        raise
    opts = convert_options(spec, dict(ref.options), f"{key}.options", source)
    return ResolvedPlugin(key, spec, opts)


def resolve_plugins(
    config: Config, registry: Any, source: str | None = None, sides: tuple[str, ...] = ("prefill", "decode")
) -> ResolvedConfig:
    """Resolve every plugin name/path and convert every plugin's options.

    ``sides`` limits the work to what one process needs: a decode node resolves hooks
    and synthesizers only (``("decode",)``), a prefill node encoders only.

    Raises PluginError (unknown or broken plugin, naming the config key) or
    ConfigError (bad options, naming the full key path).
    """
    dec, pre = "decode" in sides, "prefill" in sides
    plugin_errors: list[PluginError] = []
    issues: list[config_loader.ConfigIssue] = []

    def attempt(fn: Any, *args: Any) -> Any:
        # Keep going after a bad plugin so that one run reports every problem.
        try:
            return fn(*args)
        except PluginError as exc:
            plugin_errors.append(exc)
        except ConfigError as exc:
            issues.extend(exc.issues)
        return None

    hooks = tuple(
        attempt(_resolve_ref, registry, "hook", ref, f"hooks[{i}]", source) for i, ref in enumerate(config.hooks) if dec
    )
    synths: dict[str, ResolvedPlugin] = {}
    encs: dict[str, ResolvedPlugin] = {}
    base_enc = attempt(_resolve_ref, registry, "encoder", config.encoder, "encoder", source) if pre else None
    arms = config.arms or [ArmConfig(name="default", synthesizer=config.synthesizer)]
    for i, arm in enumerate(arms):
        key = f"arms[{i}]" if config.arms else ""
        if dec:
            synths[arm.name] = attempt(
                _resolve_ref, registry, "synthesizer", arm.synthesizer, f"{key}.synthesizer" if key else "synthesizer", source
            )
        if pre:
            encs[arm.name] = (
                attempt(_resolve_ref, registry, "encoder", arm.encoder, f"{key}.encoder", source)
                if arm.encoder is not None
                else base_enc
            )
    if pre:  # the prefill's A/B workload: its options are typed too, check them now
        attempt(check_workload_options, config, source)
    if plugin_errors:
        raise plugin_errors[0]
    if issues:
        raise ConfigError.from_issues(issues, source=source)
    return ResolvedConfig(config, hooks, synths, encs)
