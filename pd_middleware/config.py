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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from . import config_loader
from .core._errors import ConfigError, ConfigIssue, OptionValueError, PluginError
from .core.contracts import NoOptions, PluginContext, PluginSpec
from .transport.config import TransportConfig

_STRUCT = dict(forbid_unknown_fields=True, frozen=True, kw_only=True)
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_ARM_REF_RE = re.compile(r"^[A-Za-z0-9_.\-]{0,64}$")


class PluginRef(msgspec.Struct, **_STRUCT):
    """Selects one plugin: a registered ``name`` or a ``package.module:ATTR`` reference."""

    name: str
    # The plugin's own options; their schema belongs to the plugin.
    options: dict[str, Any] = {}


class ModelConfig(msgspec.Struct, **_STRUCT):
    """Facts about the target and draft models.

    ``vocab_size`` and ``num_steps`` may be left out: an engine integration (SGLang)
    then takes them from the engine when it starts (:meth:`with_shapes`), and tools
    that run without an engine (the offline A/B job, the loopback example) use
    :data:`DEFAULT_VOCAB_SIZE` and :data:`DEFAULT_NUM_STEPS`. ``declared_*`` say what
    the file itself declared (None: left out).
    """

    # Target vocabulary size V: every proposal row is exactly this wide. Optional:
    # left out, the engine's own value is used (offline tools: 152064).
    declared_vocab_size: int | None = msgspec.field(default=None, name="vocab_size")
    # Draft steps per request: 1 = single-layer EAGLE, >1 = multi-layer chain
    # (num_steps). Optional: left out, the engine's own value is used (offline tools: 1).
    declared_num_steps: int | None = msgspec.field(default=None, name="num_steps")
    # Hidden-state width H the prefill sends to seed the next draft step.
    hidden_size: int = 4096
    # Hidden-state dtype on the wire.
    hidden_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"

    def __post_init__(self) -> None:
        v, s = self.declared_vocab_size, self.declared_num_steps
        if v is not None and not 1 <= v <= 1 << 24:
            raise OptionValueError("vocab_size", f"must be in [1, 16777216], got {v}")
        if s is not None and not 1 <= s <= 16:
            raise OptionValueError("num_steps", f"must be in [1, 16], got {s}")
        if not 0 <= self.hidden_size <= 1 << 16:
            raise OptionValueError("hidden_size", f"must be in [0, 65536], got {self.hidden_size}")

    @property
    def vocab_size(self) -> int:
        """V: the declared value, or :data:`DEFAULT_VOCAB_SIZE` when left out."""
        v = self.declared_vocab_size
        return DEFAULT_VOCAB_SIZE if v is None else v

    @property
    def num_steps(self) -> int:
        """S: the declared value, or :data:`DEFAULT_NUM_STEPS` when left out."""
        s = self.declared_num_steps
        return DEFAULT_NUM_STEPS if s is None else s

    def with_shapes(self, vocab_size: int, num_steps: int, *, engine: str = "the engine") -> ModelConfig:
        """This model section with V and S taken from ``engine``.

        Raises :class:`ConfigError` naming both values when the file declared a
        different one (``model.vocab_size`` or ``model.num_steps``).
        """
        for key, declared, got in (
            ("vocab_size", self.declared_vocab_size, vocab_size),
            ("num_steps", self.declared_num_steps, num_steps),
        ):
            if declared is not None and declared != got:
                raise ConfigError(
                    f"{engine} runs with {key} = {got}, the config says {declared}; "
                    "make them equal or leave the key out to take the engine's value",
                    path=f"model.{key}",
                )
        return msgspec.structs.replace(self, declared_vocab_size=vocab_size, declared_num_steps=num_steps)


#: V used by tools that run without an engine when ``model.vocab_size`` is left out.
DEFAULT_VOCAB_SIZE = 152064
#: S used by tools that run without an engine when ``model.num_steps`` is left out.
DEFAULT_NUM_STEPS = 1


class SGLangConfig(msgspec.Struct, **_STRUCT):
    """The SGLang drop-in (``[sglang]``; read only by ``pd_middleware.integrations``)."""

    # How proposals reach the decode: "metadata" = a row appended to SGLang's own PD
    # metadata buffers (travels with the KV, on every rank); "sidechannel" = the
    # middleware's own transport ([transport]; the prefill needs PD_MIDDLEWARE_DECODE_ADDRESS).
    # "none": nothing is shipped (the decode-only synthesizer = "recompute").
    channel: Literal["metadata", "sidechannel", "none"] = "metadata"
    # Bytes per proposal row (a multiple of 64, 256 .. 8 MiB). Each node allocates
    # capacity x metadata rows (decode: 2 x the request pool) of CPU memory. A proposal
    # larger than this travels without its distribution (exact one-hot, counted).
    # 20480 holds sparse_floor/sparse_topp at k_max 4000 (16 KB) at V = 152064;
    # full fp32 at that V needs 608,384, bf16 304,256 (docs/sglang.md, "Bytes").
    capacity_bytes: int = 20480
    # Seed of the prefill encoder's draw; each request's draws invert uniforms of
    # (seed, bootstrap room, rid, position) alone, so every prefill TP rank writes identical
    # bytes (the position, the request's seq_len, is new for each life of a rebootstrapped request).
    seed: int = 0
    # Multi-layer EAGLE (--enable-multi-layer-eagle): which draft KV pools SGLang's PD
    # transfer carries. "all_steps": every chain step's pool, after the target's, in step
    # order (both nodes should say so: such a decode serves a prefill that sends step 1's
    # pool only with that, and fails the requests of a prefill with another chain, naming
    # this key; such a prefill rejects a decode that registers another list);
    # "first_step": step 1's pool only, as SGLang does (pairs with a node without the
    # drop-in). Left out (None): "all_steps"
    # when the source ships proposals, "first_step" when it ships nothing (channel = "none",
    # decode-only recompute: its prefill is stock and sends step 1's pool only), decided
    # by the SGLang drop-in from the source it chose.
    draft_kv: Literal["all_steps", "first_step"] | None = None
    # channel = "sidechannel", decode: the longest a request whose KV transfer is done
    # waits for its payload (SGLang's transfer poll reports it still transferring, so the
    # scheduler loop never blocks), while a prefill is connected to the decode's receiver.
    # Past it the request verifies one-hot (fallback:missing); 0 never waits.
    sidechannel_wait_s: float = 2.0

    def __post_init__(self) -> None:
        w = self.sidechannel_wait_s
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 <= w <= 60:
            raise OptionValueError("sidechannel_wait_s", f"must be a number of seconds in [0, 60], got {w!r}")
        c = self.capacity_bytes
        if not 256 <= c <= 8 << 20 or c % 64:
            raise OptionValueError("capacity_bytes", f"must be a multiple of 64 in [256, 8388608], got {c}")
        if not 0 <= self.seed < 1 << 63:
            raise OptionValueError("seed", f"must be in [0, 2**63), got {self.seed}")


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


class MetricsConfig(msgspec.Struct, **_STRUCT):
    """The decode side's metrics export (docs/metrics.md)."""

    # TCP port of an HTTP endpoint serving GET /metrics (Prometheus text); unset: no
    # endpoint, 0: any free port. Under SGLang use --enable-metrics instead when TP > 1
    # (every rank would bind it).
    port: int | None = None
    # Address the endpoint binds; loopback by default, since the counters name arms and
    # failure reasons.
    host: str = "127.0.0.1"
    # JSON-lines file each request's first verify is appended to (request id, arm,
    # accepted draft tokens), for `pd-middleware live-ab --from`; unset: not written.
    first_verify_log: str | None = None
    # Seconds between copies of the counters into SGLang's multiprocess metric files
    # (SGLang's /metrics under --enable-metrics).
    sync_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise OptionValueError("port", f"must be in [0, 65535], got {self.port}")
        if not self.host:
            raise OptionValueError("host", "must not be empty")
        if not 0.05 <= self.sync_interval_s <= 3600:
            raise OptionValueError("sync_interval_s", f"must be in [0.05, 3600], got {self.sync_interval_s}")


class WorkloadRef(msgspec.Struct, **_STRUCT):
    """Which traffic the offline A/B job generates."""

    # synthetic | ngram | trace
    name: Literal["synthetic", "ngram", "trace"] = "synthetic"
    # Workload options (see docs/workloads.md); typed by the workload, checked by
    # resolve_plugins on the prefill side (check_workload_options).
    options: dict[str, Any] = {}


class ABConfig(msgspec.Struct, **_STRUCT):
    """Defaults of ``pd-middleware ab`` (command-line flags override them).

    The ``[ab]`` table's schema, pure data like every other section here, so that a
    document is checked whole when it is loaded. The job's reading of it (which arms
    the roles name, the workload's options with the model's facts) stays with the job,
    in :mod:`pd_middleware.ab.config`.
    """

    workload: WorkloadRef = WorkloadRef()
    # Requests per arm.
    requests: int = 2000
    # Seed of the workload and of every sampler.
    seed: int = 0
    # Requests per batch sent through the deployment.
    batch_size: int = 32
    # Tokens per response, for the whole-response effect-size estimate.
    response_tokens: int = 256
    # Acceptance rate of the later verifies (drafted on the decode node, same for all arms).
    later_acceptance: float = 0.7
    # Arm every other arm's verify steps are compared with (e.g. today's one-hot
    # proposal); "" = the first [[arms]] entry.
    baseline: str = ""
    # Arm that ships the whole draft distribution, the upper bound that acceptance
    # and bytes are shown as a share of; "" = none (acceptance is then shown as a
    # share of the computed full-distribution bound).
    reference: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.requests <= 10_000_000:
            raise OptionValueError("requests", f"must be in [1, 10000000], got {self.requests}")
        if not 1 <= self.batch_size <= 4096:
            raise OptionValueError("batch_size", f"must be in [1, 4096], got {self.batch_size}")
        if not 1 <= self.response_tokens <= 1 << 20:
            raise OptionValueError("response_tokens", f"must be >= 1, got {self.response_tokens}")
        if not 0.0 <= self.later_acceptance < 1.0:
            raise OptionValueError("later_acceptance", f"must be in [0, 1), got {self.later_acceptance}")
        for key in ("baseline", "reference"):
            if not _ARM_REF_RE.match(getattr(self, key)):
                raise OptionValueError(key, f"must be an arm name, got {getattr(self, key)!r}")


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
    metrics: MetricsConfig = MetricsConfig()
    # The SGLang drop-in: which channel carries proposals, and the row capacity.
    sglang: SGLangConfig = SGLangConfig()

    def __post_init__(self) -> None:
        names = [a.name for a in self.arms]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise ConfigError(f"duplicate arm name {n!r}", path=f"arms[{i}].name")

    def plugin_context(
        self, side: Literal["prefill", "decode"] = "decode", capabilities: Mapping[str, Any] | None = None
    ) -> PluginContext:
        """The plugins' context; ``capabilities``: what the engine offers (``draft_head``...)."""
        return PluginContext(
            vocab_size=self.model.vocab_size,
            num_steps=self.model.num_steps,
            rejection_sampling=self.decode.rejection_sampling,
            device=self.decode.device,
            side=side,
            arms=tuple((a.name, a.weight) for a in self.arms),
            capabilities=dict(capabilities or {}),
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
    return _hidden_limits_from_model(data, _convert(data, Config, "", source), source)


def _table(parent: dict[str, Any], key: str) -> dict[str, Any]:
    """``parent[key]`` when it is a table, else an empty one (the schema reports bad types)."""
    value = parent.get(key)
    return value if isinstance(value, dict) else {}


def _hidden_limits_from_model(data: dict[str, Any], cfg: Config, source: str | None) -> Config:
    """The receiver checks the hidden state the config's ``[model]`` declares.

    A ``model.hidden_size`` / ``model.hidden_dtype`` written in the config becomes the
    receiver's ``transport.limits`` check unless the limits set their own, in which case
    the two must agree. Defaults are not promoted: an unwritten ``hidden_size`` checks
    nothing, as before.
    """
    model = _table(data, "model")
    transport = _table(data, "transport")
    limits_raw = _table(transport, "limits")
    limits = cfg.transport.limits
    changes: dict[str, Any] = {}
    for key in ("hidden_size", "hidden_dtype"):
        if key not in model:
            continue
        declared = getattr(cfg.model, key)
        if key in limits_raw and getattr(limits, key) not in (declared, 0, None):
            raise ConfigError(
                f"model.{key} = {declared!r} but transport.limits.{key} = {getattr(limits, key)!r}",
                path=f"transport.limits.{key}",
                source=source,
            )
        if key not in limits_raw:
            changes[key] = declared
    if not changes:
        return cfg
    new_limits = msgspec.structs.replace(limits, **changes)
    return msgspec.structs.replace(cfg, transport=msgspec.structs.replace(cfg.transport, limits=new_limits))


def load_config(path: str | Path) -> Config:
    """Read a config into a :class:`Config`.

    ``path`` is a ``.toml``, ``.yaml``, ``.yml`` or ``.json`` file, or an inline JSON
    document (a string starting with ``{``), as vLLM's ``--kv-transfer-config '{...}'``.
    The same holds wherever a config is named: the CLI and ``PD_MIDDLEWARE_CONFIG``.
    """
    data, src = config_loader.read_document(path)
    return parse_config(data, src)


def check_workload_options(config: Config, source: str | None) -> None:
    """Convert ``ab.workload.options`` to the workload's options type (as make_workload will).

    Like a plugin's options, a workload's are typed by their owner, so they are checked
    when the config is resolved, not when it is loaded. Without this, a misspelled
    workload option passed ``check-config`` and failed only when the A/B job started.
    Paths match :func:`~pd_middleware.workloads.make_workload`.
    """
    from .workloads import workload_options_type  # the registry of workloads; their types load lazily

    wl = config.ab.workload
    config_loader.convert(dict(wl.options), workload_options_type(wl.name), "ab.workload.options", source)


def convert_options(spec: PluginSpec, raw: dict[str, Any], key: str, source: str | None = None) -> Any:
    """Typed options for ``spec`` from a raw table; errors carry ``key`` as path prefix."""
    if spec.options is NoOptions:
        if raw:
            issues = [ConfigIssue(f"{key}.{k}", f"plugin {spec.name!r} takes no options, got {k!r}") for k in raw]
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


def raw_plugin_issues(data: Any, registry: Any, source: str | None = None) -> list[ConfigIssue]:
    """Plugin-option problems of a document whose schema failed, best effort.

    :func:`parse_config` stops before plugins are resolved, so a file with a schema error
    and a misspelled plugin option would show only the first. This checks every plugin
    reference that is well-formed in the raw document (a string ``name``, a table of
    ``options``) against its plugin's options type, so ``check-config`` can report both
    kinds at once. Unknown plugins are left to the full pass.
    """
    if not isinstance(data, dict):
        return []
    refs: list[tuple[str, str, Any]] = []
    hooks = data.get("hooks")
    if isinstance(hooks, list):
        refs += [("hook", f"hooks[{i}]", h) for i, h in enumerate(hooks)]
    refs += [("synthesizer", "synthesizer", data.get("synthesizer")), ("encoder", "encoder", data.get("encoder"))]
    arms = data.get("arms")
    if isinstance(arms, list):
        for i, arm in enumerate(arms):
            if isinstance(arm, dict):
                refs += [("synthesizer", f"arms[{i}].synthesizer", arm.get("synthesizer"))]
                refs += [("encoder", f"arms[{i}].encoder", arm.get("encoder"))]
    issues: list[ConfigIssue] = []
    for kind, key, ref in refs:
        if not isinstance(ref, dict) or not isinstance(ref.get("name"), str):
            continue
        options = ref.get("options", {})
        if not isinstance(options, dict):
            continue
        try:
            spec = registry.resolve(kind, ref["name"], key=f"{key}.name")
            convert_options(spec, dict(options), f"{key}.options", source)
        except ConfigError as exc:
            issues.extend(exc.issues)
        except PluginError:
            continue
    return issues


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
    issues: list[ConfigIssue] = []

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
    # None without a prefill side, or when its plugin error was collected (raised below).
    base_enc: Any = attempt(_resolve_ref, registry, "encoder", config.encoder, "encoder", source) if pre else None
    arms = config.arms or [ArmConfig(name="default", synthesizer=config.synthesizer)]
    for i, arm in enumerate(arms):
        key = f"arms[{i}]" if config.arms else ""
        if dec:
            synths[arm.name] = attempt(
                _resolve_ref,
                registry,
                "synthesizer",
                arm.synthesizer,
                f"{key}.synthesizer" if key else "synthesizer",
                source,
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
