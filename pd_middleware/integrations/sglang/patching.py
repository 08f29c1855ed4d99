"""The patch machinery: every SGLang symbol the drop-in touches or reads is a table entry.

The shape is SGLang's own ``HookRegistry`` (``sglang/srt/plugins/hook_registry.py``): a
dotted target, a hook type (AROUND, REPLACE, or READ for a symbol we only call or read),
and who registered it. The strictness is ours: :func:`resolve_features` checks every
target of every wanted :class:`Feature` for presence and signature before :func:`apply`
patches anything, and a failure raises :class:`~pd_middleware.PluginError` naming the
target (HookRegistry's ``apply_hooks`` logs a failure and goes on; a server that asked for
the drop-in must not run without it). Each applied patch is logged once in HookRegistry's
own line format (:func:`announce`), so operators find it beside other plugins' hooks.

**This is the one module that imports SGLang** (:func:`import_module`). A feature module
declares its :class:`Feature` next to its wrappers and calls :func:`register_feature` at
import; the package ``__init__`` imports every feature module, so :data:`FEATURES` is the
whole table. A feature module never imports SGLang itself: its wrappers receive the
original they wrap, and the symbols it only reads (READ targets) reach it through the
installation's :class:`Symbols`, resolved and checked at install with everything else.
READ targets marked ``instance`` name an attribute every instance of a class carries
(``LogitsProcessor._logits_gatherer``): the class is resolved at install, the attribute
is checked on the live object at scheduler start (:meth:`Symbols.check_instance`).

Stand-ins for tests: :class:`SGLangModules` gives modules by name; under ``only_given`` a
module that is not given is not imported and its targets are left out (a READ symbol of
it is then absent: :meth:`Symbols.get` returns None).
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ...core._errors import PluginError

logger = logging.getLogger("pd_middleware.integrations.sglang")

#: The distribution and entry-point name SGLang's plugin loader knows the drop-in by.
PLUGIN_NAME = "pd_middleware"
DIST_NAME = "pd-middleware"

# The SGLang modules the table's targets live in (one name per module, used everywhere).
BUILDER_MODULE = "sglang.srt.speculative.eagle_disaggregation"
PREFILL_MODULE = "sglang.srt.disaggregation.prefill"
UTILS_MODULE = "sglang.srt.disaggregation.utils"
DECODE_QUEUE_MODULE = "sglang.srt.disaggregation.decode"
MOONCAKE_MODULE = "sglang.srt.disaggregation.mooncake.conn"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
MULTI_LAYER_MODULE = "sglang.srt.speculative.multi_layer_eagle_worker_v2"
PROCESSOR_MODULE = "sglang.srt.managers.scheduler_components.batch_result_processor"
RUNTIME_MODULE = "sglang.srt.runtime_context"
SPEC_UTILS_MODULE = "sglang.srt.speculative.spec_utils"
LOGITS_MODULE = "sglang.srt.layers.logits_processor"
WORKER_MODULE = "sglang.srt.speculative.eagle_worker_v2"
HOOKS_MODULE = "sglang.srt.plugins.hook_registry"


class Hook(enum.Enum):
    """HookRegistry's hook types that the drop-in uses, plus READ (called or read, never patched)."""

    AROUND = "around"  # our wrapper calls SGLang's original
    REPLACE = "replace"  # our function stands in; SGLang's original is its fallback
    READ = "read"  # a symbol the drop-in calls or relies on; checked, not patched


#: The releases the table has rows for, oldest first (parsed versions compare, never strings).
RELEASES: tuple[str, ...] = ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
OLDEST, NEWEST = RELEASES[0], RELEASES[-1]


def parse_version(text: str) -> tuple[int, ...]:
    """The release segment of a version as integers (``0.5.21.post1`` -> (0, 5, 21)); pre,
    post and local parts are left out: they share their release's rows. ValueError when
    the text does not start with a dotted number."""
    parts: list[int] = []
    for piece in text.strip().lstrip("vV").split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break  # "21rc1", "21+local": the rest is not release segment
    if not parts:
        raise ValueError(f"not a version: {text!r}")
    return tuple(parts[:3]) + (0,) * (3 - min(len(parts), 3))


@dataclass(frozen=True)
class Target:
    """One SGLang symbol: ``module`` + ``attr`` (dotted inside it), its expected parameter
    names (None: presence only), the hook type and the wrapper factory
    ``wrap(original, installation) -> replacement`` (None for READ). ``instance``: a READ
    of an attribute set on every instance of the class ``attr`` names up to its last dot
    (checked on a live object at scheduler start, :meth:`Symbols.check_instance`).

    Versioned: the row holds for the releases ``since`` to ``until`` (inclusive; None: no
    bound). Where SGLang changed a symbol, the feature declares one row per span, each with
    its own parameters, wrapper or ``adapt`` (a READ's adapter: ``adapt(symbol)`` is what
    :class:`Symbols` hands out, in the contract the drop-in calls, or None where that
    release's symbol cannot serve it and the drop-in uses its own). Every field describes
    the row for the release being checked (:func:`targets_for`)."""

    module: str
    attr: str
    params: tuple[str, ...] | None
    hook: Hook
    wrap: Callable[[Any, Any], Any] | None = None
    instance: bool = False
    since: str | None = None
    until: str | None = None
    adapt: Callable[[Any], Any] | None = None

    @property
    def path(self) -> str:
        return f"{self.module}.{self.attr}"

    def holds(self, release: tuple[int, ...]) -> bool:
        """Whether this row is the one for ``release`` (a parsed version)."""
        if self.since is not None and release < parse_version(self.since):
            return False
        return not (self.until is not None and release > parse_version(self.until))

    @property
    def span(self) -> str:
        """The releases this row holds for, in words (``0.5.18-0.5.21``, ``0.5.23+``, ``all``)."""
        if self.since is None and self.until is None:
            return "all"
        lo = self.since or OLDEST
        if self.until is None:
            return f"{lo}+"
        return lo if lo == self.until else f"{lo}-{self.until}"


def read(
    module: str,
    attr: str,
    params: tuple[str, ...] | None = None,
    *,
    instance: bool = False,
    since: str | None = None,
    until: str | None = None,
    adapt: Callable[[Any], Any] | None = None,
) -> Target:
    """A READ target: a symbol the drop-in calls or reads (checked at install, never patched)."""
    return Target(module, attr, params, Hook.READ, None, instance, since, until, adapt)


@dataclass(frozen=True)
class Refusal:
    """A feature is not available on the releases ``since`` to ``until`` (inclusive; None:
    no bound): ``why`` (what the release lacks) and ``instead`` (what to run there)."""

    why: str
    instead: str
    since: str | None = None
    until: str | None = None

    def holds(self, release: tuple[int, ...]) -> bool:
        if self.since is not None and release < parse_version(self.since):
            return False
        return not (self.until is not None and release > parse_version(self.until))

    def line(self, version: str, feature: str) -> str:
        return f"SGLang {version}: feature {feature!r} is not available ({self.why}); {self.instead}"


@dataclass(frozen=True)
class Plan:
    """What one installation wants: ``features`` its proposal source needs
    (:attr:`~.roles.ProposalSource.features`), the config, the install options."""

    features: frozenset[str]
    config: Any
    options: Any
    #: The SGLang release whose rows are selected (None: the newest rows).
    version: str | None = None

    @property
    def release(self) -> tuple[int, ...]:
        """The release whose rows apply: the plan's, or the newest for one newer than the table."""
        got = parse_version(self.version) if self.version is not None else parse_version(NEWEST)
        return min(got, parse_version(NEWEST))


@dataclass(frozen=True)
class Feature:
    """A part of the drop-in: its targets, whether a :class:`Plan` wants it, and when it is
    applied (``install``, or ``multi_layer_prefill``: when a prefill starts with S > 1).
    ``summary``: one line for the docs' table."""

    name: str
    targets: tuple[Target, ...]
    wanted: Callable[[Plan], bool]
    applied: str = "install"
    summary: str = ""
    #: The releases this feature is refused on, each with its line (:class:`Refusal`).
    refused: tuple[Refusal, ...] = ()

    def refusal(self, release: tuple[int, ...]) -> Refusal | None:
        """The refusal for ``release`` (a parsed version), or None when the feature is available."""
        return next((r for r in self.refused if r.holds(release)), None)

    def targets_for(self, release: tuple[int, ...]) -> tuple[Target, ...]:
        """This feature's rows for ``release`` (empty when the feature is refused there)."""
        if self.refusal(release) is not None:
            return ()
        return tuple(t for t in self.targets if t.holds(release))


@dataclass
class Patch:
    """One resolved target; for a patch, restore by ``setattr(owner, name, original)``."""

    target: Target
    owner: Any
    name: str
    original: Any  # as stored on the owner (a classmethod object stays one)
    replacement: Any = None


@dataclass(frozen=True)
class SGLangModules:
    """The SGLang modules to patch; a field left None is imported (the real SGLang),
    unless ``only_given`` is set, in which case that module's targets are left out
    (tests with stand-ins for part of SGLang). ``extra``: stand-ins by module name for
    modules without a field."""

    builder: ModuleType | None = None  # BUILDER_MODULE
    prefill: ModuleType | None = None  # PREFILL_MODULE
    utils: ModuleType | None = None  # UTILS_MODULE (MetadataBuffers)
    transfer: ModuleType | None = None  # DECODE_QUEUE_MODULE (DecodeTransferQueue)
    mooncake: ModuleType | None = None  # MOONCAKE_MODULE
    scheduler: ModuleType | None = None  # SCHEDULER_MODULE (Scheduler)
    multi_layer: ModuleType | None = None  # MULTI_LAYER_MODULE
    processor: ModuleType | None = None  # PROCESSOR_MODULE (live A/B)
    only_given: bool = False
    extra: Mapping[str, ModuleType] = field(default_factory=dict)

    def given(self, name: str) -> ModuleType | None:
        slot = _SLOTS.get(name)
        mod = getattr(self, slot) if slot is not None else None
        return mod if mod is not None else self.extra.get(name)


_SLOTS = {
    BUILDER_MODULE: "builder",
    PREFILL_MODULE: "prefill",
    UTILS_MODULE: "utils",
    DECODE_QUEUE_MODULE: "transfer",
    MOONCAKE_MODULE: "mooncake",
    SCHEDULER_MODULE: "scheduler",
    MULTI_LAYER_MODULE: "multi_layer",
    PROCESSOR_MODULE: "processor",
}


def detect_version() -> str:
    """The installed SGLang version (package metadata; no import). PluginError if absent."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise PluginError("SGLang is not installed (no 'sglang' distribution found)", plugin="sglang") from None


def import_module(name: str) -> ModuleType:
    """Import an SGLang module; PluginError naming it when that fails (any exception)."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # an engine's import can fail with anything
        raise PluginError(f"cannot import {name}: {type(exc).__name__}: {exc}", plugin="sglang") from None


def module_for(name: str, mods: SGLangModules) -> ModuleType | None:
    """The module ``name``: the stand-in given, else imported (None under ``only_given``)."""
    given = mods.given(name)
    if given is not None:
        return given
    return None if mods.only_given else import_module(name)


def resolve(target: Target, module: ModuleType, where: str | None = None) -> Patch:
    """Find ``target`` in ``module`` and check it; raises PluginError naming the target.

    Checks: every attribute on the path exists; a callable target is callable, not
    already ours, and has exactly the expected parameter names. An ``instance`` target
    resolves its class (the attribute is checked later, on an instance).
    """
    path = where or f"{module.__name__}.{target.attr}"
    owner: Any = module
    *parents, name = target.attr.split(".")
    for k, part in enumerate(parents):
        owner = getattr(owner, part, None)
        if owner is None:
            prefix = ".".join([module.__name__, *parents[: k + 1]])
            raise PluginError(
                f"{prefix} not found (target {path}); this SGLang version is not supported", plugin="sglang"
            )
    if target.instance:
        if not isinstance(owner, type):
            raise PluginError(f"{path}: {'.'.join(parents)} is not a class", plugin="sglang")
        return Patch(target, owner, name, None)
    raw = owner.__dict__.get(name) if isinstance(owner, type) and name in owner.__dict__ else getattr(owner, name, None)
    if raw is None:
        raise PluginError(f"{path} not found; this SGLang version is not supported", plugin="sglang")
    if target.params is not None:
        _check_signature(target, raw, path)
    return Patch(target, owner, name, raw)


def _check_signature(target: Target, raw: Any, path: str) -> None:
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    if not callable(fn):
        raise PluginError(f"{path} is not callable", plugin="sglang")
    if getattr(fn, "__pd_middleware__", False):
        raise PluginError(f"{path} is already patched by pd-middleware", plugin="sglang")
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"cannot read the signature of {path}: {exc}", plugin="sglang") from None
    if params != target.params:
        raise PluginError(
            f"{path} has parameters {params}, expected {target.params}; SGLang changed this "
            "function and the drop-in would not know what it passes",
            plugin="sglang",
        )


def callable_of(patch: Patch) -> Any:
    """The original as a plain callable (a classmethod's function)."""
    raw = patch.original
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


def mark(fn: Callable[..., Any], original: Any) -> Callable[..., Any]:
    """Mark ``fn`` as our wrapper of ``original`` (what the "already patched" check reads)."""
    fn.__wrapped__ = original  # type: ignore[attr-defined]  # functools.wraps' attribute
    fn.__pd_middleware__ = True  # type: ignore[attr-defined]  # our marker: "already patched"
    return fn


def build(patch: Patch, inst: Any) -> Patch:
    """Make ``patch``'s replacement with its target's wrapper (marked, classmethods kept)."""
    wrap = patch.target.wrap
    assert wrap is not None
    fn = mark(wrap(callable_of(patch), inst), callable_of(patch))
    patch.replacement = classmethod(fn) if isinstance(patch.original, classmethod) else fn
    return patch


def apply(patches: list[Patch]) -> None:
    for p in patches:
        setattr(p.owner, p.name, p.replacement)


def attr_now(owner: Any, attr: str) -> Any:
    """What ``owner`` holds under ``attr`` now (a class's own ``__dict__`` entry: a
    classmethod object stays itself there)."""
    if isinstance(owner, type) and attr in owner.__dict__:
        return owner.__dict__[attr]
    return getattr(owner, attr, None)


def restore(patches: list[Patch]) -> None:
    """Put every original back; PluginError, restoring nothing, when another party
    re-patched one of them on top of ours (restoring would silently drop their patch)."""
    for p in patches:
        if attr_now(p.owner, p.name) is not p.replacement:
            raise PluginError(
                f"{p.target.path} was replaced by someone else after install; not restoring, remove their patch first",
                plugin="sglang",
            )
    for p in reversed(patches):
        setattr(p.owner, p.name, p.original)


class Symbols:
    """The READ targets of one installation, by path (``module.attr``), resolved at install.

    A feature module asks for ``symbols.get(PATH)`` (None only when a test's stand-ins
    left that module out) or ``symbols[PATH]`` (KeyError names it).
    """

    def __init__(self, patches: list[Patch] | None = None) -> None:
        self._by_path: dict[str, Patch] = {p.target.path: p for p in patches or ()}

    def __contains__(self, path: str) -> bool:
        return path in self._by_path

    def __getitem__(self, path: str) -> Any:
        p = self._by_path.get(path)
        if p is None:
            raise KeyError(f"{path} is not a resolved READ target of this installation")
        if p.target.instance:
            return p.owner
        got = callable_of(p)
        # A row's adapter: that release's symbol in the contract the drop-in calls (or None).
        return p.target.adapt(got) if p.target.adapt is not None else got

    def get(self, path: str) -> Any:
        """The symbol at ``path`` (adapted by its row), or None: left out by a test's stand-ins,
        or a row whose adapter says that release's symbol cannot serve (the drop-in's own then)."""
        return self[path] if path in self._by_path else None

    def check_instance(self, obj: Any, class_path: str) -> None:
        """Raise PluginError unless ``obj`` has every ``instance`` attribute the table lists for
        the class ``class_path`` (``module.Class``)."""
        for p in self._by_path.values():
            t = p.target
            if t.instance and t.path.rsplit(".", 1)[0] == class_path and not hasattr(obj, p.name):
                raise PluginError(
                    f"{type(obj).__name__} has no attribute {p.name} (target {t.path}); this SGLang version is "
                    "not supported",
                    plugin="sglang",
                )

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_path)


def hook_source(symbols: Symbols) -> str:
    """Who registered the hooks, in HookRegistry's words (``plugin=..., dist=...``)."""
    var = symbols.get(f"{HOOKS_MODULE}._current_plugin_source")
    src = var.get() if var is not None else None
    if src is not None:
        plugin, dist = src.plugin_name, src.dist_name
        return f"plugin={plugin}, dist={dist}" if dist else f"plugin={plugin}"
    return f"plugin={PLUGIN_NAME}, dist={DIST_NAME}"


def announce(patches: list[Patch], source: str) -> None:
    """Log each patch once, in HookRegistry's format (``Applied 1 hook(s) to <target> (from: ...)``)."""
    for p in patches:
        logger.info("Applied 1 hook(s) to %s (from: %s) [%s]", p.target.path, source, p.target.hook.value)


# --------------------------------------------------------------------- the table

#: Every feature of the drop-in, by name, in registration order (the feature modules
#: register theirs at import; the package ``__init__`` imports them all).
FEATURES: dict[str, Feature] = {}


def register_feature(feature: Feature) -> None:
    """Add a feature to :data:`FEATURES` (ValueError when its name or a patched target is taken)."""
    if feature.name in FEATURES:
        raise ValueError(f"feature {feature.name!r} is already registered")
    for v in RELEASES:
        # One patch per symbol per release: rows of one path must not overlap in releases.
        rel = parse_version(v)
        taken = {t.path: f.name for f in FEATURES.values() for t in f.targets_for(rel) if t.hook is not Hook.READ}
        mine = [t.path for t in feature.targets if t.hook is not Hook.READ and t.holds(rel)]
        for path in mine:
            if path in taken:
                raise ValueError(f"{path} is already patched by feature {taken[path]!r} (SGLang {v})")
        if len(mine) != len(set(mine)):
            raise ValueError(f"feature {feature.name!r} has two rows for one target on SGLang {v}")
    FEATURES[feature.name] = feature


def feature_of(target: Target) -> str:
    """The name of the feature ``target`` belongs to ("?" when none)."""
    for f in FEATURES.values():
        if target in f.targets:
            return f.name
    return "?"


def refusals(plan: Plan) -> list[str]:
    """The line of every wanted feature that the plan's release does not have."""
    out = []
    for feat in FEATURES.values():
        r = feat.refusal(plan.release)
        if r is not None and feat.wanted(plan):
            out.append(r.line(plan.version or NEWEST, feat.name))
    return out


def resolve_features(plan: Plan, mods: SGLangModules) -> dict[str, list[Patch]]:
    """Every wanted feature's rows for the plan's release, resolved and checked; patches nothing.

    A target whose module is not given under ``only_given`` is left out. Raises
    PluginError with the line of every wanted feature the release refuses (:class:`Refusal`)
    and every target that is missing or changed (all of them, one per line).
    """
    out: dict[str, list[Patch]] = {}
    problems = refusals(plan)
    for feat in FEATURES.values():
        if not feat.wanted(plan) or feat.refusal(plan.release) is not None:
            continue
        found = []
        for t in feat.targets_for(plan.release):
            try:
                mod = module_for(t.module, mods)
                if mod is not None:  # None: a module not given under only_given (a test's stand-ins)
                    found.append(resolve(t, mod))
            except PluginError as exc:
                if exc.detail not in problems:  # a module that fails to import: said once
                    problems.append(exc.detail)
        if found:
            out[feat.name] = found
    if problems:
        raise PluginError("\n".join(problems), plugin="sglang")
    return out


#: The order the docs list the features in (the rest follow in registration order).
DOC_ORDER = (
    "decode",
    "prefill",
    "metadata",
    "chain",
    "draft_kv",
    "peer_check",
    "recompute",
    "scheduler",
    "live_ab",
    "metrics_export",
    "announce",
)


def doc_features() -> list[Feature]:
    """Every feature in the docs' order (:data:`DOC_ORDER`, then the rest in registration order)."""
    names = [n for n in DOC_ORDER if n in FEATURES] + [n for n in FEATURES if n not in DOC_ORDER]
    return [FEATURES[n] for n in names]


def table_markdown() -> str:
    """The table as docs/sglang.md shows it (generated: tests check the page against it):
    one line per row, with the releases it holds for."""
    lines = ["| feature | target | hook | checked | releases |", "| --- | --- | --- | --- | --- |"]
    for f in doc_features():
        for t in f.targets:
            if t.instance:
                what = "an attribute of every instance, at scheduler start"
            elif t.params is None:
                what = "presence"
            else:
                what = f"parameters ({', '.join(t.params)})" if t.params else "no parameters"
            if t.adapt is not None:
                what += ", adapted"
            lines.append(f"| `{f.name}` | `{t.path}` | {t.hook.value} | {what} | {t.span} |")
    return "\n".join(lines)


def release_status(version: str) -> dict[str, str | None]:
    """Per feature, for ``version``: None (available: its rows for that release) or its refusal line."""
    release = min(parse_version(version), parse_version(NEWEST))
    out: dict[str, str | None] = {}
    for f in doc_features():
        r = f.refusal(release)
        out[f.name] = None if r is None else r.line(version, f.name)
    return out


def release_table_markdown() -> str:
    """Release x feature, as docs/sglang.md shows it (generated): ``yes`` where the
    feature's rows hold, ``no`` where it is refused (the line says why: ``pd-middleware sglang``)."""
    feats = doc_features()
    lines = ["| feature | " + " | ".join(RELEASES) + " |", "| --- |" + " --- |" * len(RELEASES)]
    for f in feats:
        cells = ["no" if f.refusal(parse_version(v)) is not None else "yes" for v in RELEASES]
        lines.append(f"| `{f.name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
