"""The plugin registry: specs are validated when they register, not when they are called.

There are exactly two ways in, the same for first-party and third-party plugins:

- the entry-point group :data:`ENTRY_POINT_GROUP`. :meth:`PluginRegistry.discover_entry_points`
  notes them without importing; each ``<kind>.<name>`` entry point is imported when that
  plugin is first asked for, so one broken package only breaks the configs that use it.
  :meth:`PluginRegistry.load_entry_points` imports them all and returns how many specs it
  registered;
- a ``module:attr`` reference written where a config names a plugin, resolved by
  :meth:`PluginRegistry.resolve`. It can only name an importable module and an
  attribute in it: no file paths, no shell, no code strings.

The core never imports a plugin module by name. A broken plugin that a config uses is a
hard error (:class:`~pd_middleware.PluginError`) that names the plugin and the config
key; import errors are never swallowed: when listing, they are kept in
:meth:`PluginRegistry.broken` and shown.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from .config_loader import did_you_mean
from .core._errors import ConfigError, PluginError
from .core.contracts import CAPABILITIES, KIND_METHODS, PLUGIN_KINDS, NoOptions, PluginContext, PluginSpec

ENTRY_POINT_GROUP = "pd_middleware.plugins"

#: Plugins a config may name that this registry can say where to get: first-party
#: ones (absent only when pd-middleware runs from a source tree, not installed) and the
#: documented example distribution (docs/plugins.md). ``(kind, name) -> (distribution,
#: the install line)``; a name missing from the registry and listed here gets both in
#: its error.
_CORE = ("pd-middleware", "pip install pd-middleware")
_EXAMPLE = (
    "pd-middleware-example-plugin",
    "pip install ./examples/pd-middleware-example-plugin  (from a pd-middleware checkout)",
)
KNOWN_PLUGINS: dict[tuple[str, str], tuple[str, str]] = {
    **dict.fromkeys(
        [
            ("synthesizer", "one_hot"),
            ("synthesizer", "sparse"),
            ("synthesizer", "full_distribution"),
            ("synthesizer", "recompute"),
            ("encoder", "softmax"),
            ("encoder", "greedy"),
            ("encoder", "sparse"),
            ("encoder", "full"),
            ("hook", "ab_split"),
            ("hook", "record"),
        ],
        _CORE,
    ),
    ("hook", "arm_tally"): _EXAMPLE,
    ("synthesizer", "min_prob_one_hot"): _EXAMPLE,
}

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def is_module_reference(ref: str) -> bool:
    """Whether ``ref`` has the form of an importable ``package.module:attribute`` reference
    (not a ``.py`` file name); checks the form only, imports nothing."""
    return bool(_PATH_RE.match(ref)) and not ref.split(":")[0].endswith(".py")


@dataclass(frozen=True, slots=True)
class BrokenPlugin:
    """An entry point that could not be loaded, as ``pd-middleware plugins`` lists it."""

    entry_point: str
    origin: str
    error: PluginError


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """A registered plugin as ``pd-middleware plugins`` lists it."""

    name: str
    kind: str
    origin: str
    summary: str
    spec: PluginSpec


def _check_method(obj: Any, kind: str, plugin: Any, key: str | None, bound: bool) -> None:
    meth_name, params = KIND_METHODS[kind]
    meth = getattr(obj, meth_name, None)
    if meth is None or not callable(meth):
        raise PluginError(f"{kind} plugin must define {meth_name}{params}", plugin=plugin, key=key)
    try:
        sig = inspect.signature(meth)
    except (TypeError, ValueError):  # builtins without signatures: trust them
        return
    args = (None,) * (len(params) + (0 if bound else 1))
    try:
        sig.bind(*args)
    except TypeError as exc:
        raise PluginError(
            f"{kind} plugin method {meth_name}{sig} cannot be called as {meth_name}({', '.join(params)}): {exc}",
            plugin=plugin,
            key=key,
        ) from None


def validate_spec(spec: Any, origin: str = "<api>") -> PluginSpec:
    """Check a spec's shape: kind, name, factory signature, options type, methods."""
    if not isinstance(spec, PluginSpec):
        raise PluginError(f"{origin} is a {type(spec).__name__}, not a PluginSpec", plugin=spec)
    if spec.kind not in PLUGIN_KINDS:
        raise PluginError(f"unknown kind {spec.kind!r}; expected one of {PLUGIN_KINDS}", plugin=spec.name)
    if not isinstance(spec.name, str) or not _NAME_RE.match(spec.name):
        raise PluginError(f"name {spec.name!r} must be lowercase letters, digits and underscores", plugin=spec.name)
    if not callable(spec.factory):
        raise PluginError("factory is not callable", plugin=spec.name)
    try:
        inspect.signature(spec.factory).bind(None, None)
    except TypeError as exc:
        raise PluginError(f"factory must accept (options, context): {exc}", plugin=spec.name) from None
    except ValueError:
        pass
    unknown = [n for n in spec.needs if n not in CAPABILITIES]
    if unknown:
        raise PluginError(f"needs unknown capabilities {unknown}; known: {list(CAPABILITIES)}", plugin=spec.name)
    if spec.options is not NoOptions:
        cfg = getattr(spec.options, "__struct_config__", None)
        if cfg is None or not cfg.forbid_unknown_fields:
            raise PluginError(
                "options type must be a msgspec.Struct with forbid_unknown_fields=True "
                "(unknown option keys must be errors)",
                plugin=spec.name,
            )
    if inspect.isclass(spec.factory):
        _check_method(spec.factory, spec.kind, spec.name, None, bound=False)
    return spec


class PluginRegistry:
    """Registered plugin specs, keyed by ``(kind, name)``. Duplicates are refused."""

    def __init__(self, *, plugin_paths: Sequence[str] | None = None) -> None:
        """``plugin_paths``: when given (the CLI does), the directories from which a
        ``module:attr`` reference may import a module that is not installed; a module that
        would come from the working directory is refused unless the directory is listed.
        ``None`` (the library default) trusts ``sys.path`` as the host program set it.
        """
        self._plugin_paths = None if plugin_paths is None else tuple(os.path.realpath(p) for p in plugin_paths)
        self._specs: dict[tuple[str, str], PluginInfo] = {}
        self._loaded_eps: set[tuple[str, str]] = set()
        # Discovered entry points not imported yet: by the (kind, name) their name
        # promises, and those whose name promises nothing.
        self._pending: dict[tuple[str, str], list[metadata.EntryPoint]] = {}
        self._unkeyed: list[metadata.EntryPoint] = []
        self._broken: dict[tuple[str, str], BrokenPlugin] = {}

    def register(self, spec: PluginSpec, origin: str = "<api>") -> PluginSpec:
        """Validate and add ``spec``; raises PluginError on a duplicate ``(kind, name)``."""
        validate_spec(spec, origin)
        key = (spec.kind, spec.name)
        have = self._specs.get(key)
        if have is not None:
            if have.spec is spec:
                return spec
            raise PluginError(
                f"duplicate {spec.kind} plugin {spec.name!r}: already registered from {have.origin}, "
                f"refused from {origin}",
                plugin=spec.name,
            )
        self._specs[key] = PluginInfo(spec.name, spec.kind, origin, spec.summary, spec)
        return spec

    def discover_entry_points(self, group: str = ENTRY_POINT_GROUP) -> int:
        """Note every entry point of ``group`` without importing any; return how many.

        An entry point named ``<kind>.<name>`` (``synthesizer.one_hot``) is imported only
        when :meth:`get` asks for that plugin, so a broken, unrelated plugin cannot break
        a config that does not use it. Others are imported on the first miss.
        """
        found = 0
        for ep in sorted(metadata.entry_points(group=group), key=lambda e: (e.name, e.value)):
            ident = (ep.name, ep.value)
            if ident in self._loaded_eps or ident in self._broken:
                continue
            kind, dot, name = ep.name.partition(".")
            if dot and kind in PLUGIN_KINDS and _NAME_RE.match(name):
                self._pending.setdefault((kind, name), []).append(ep)
            else:
                self._unkeyed.append(ep)
            found += 1
        return found

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP, *, strict: bool = True) -> int:
        """Import every entry point of ``group``; return how many specs were registered.

        An entry point may name a :class:`PluginSpec` or a list/tuple of them. Loading
        the same entry point twice is a no-op. A failing import raises PluginError when
        ``strict``; otherwise it is kept in :meth:`broken` and loading goes on.
        """
        self.discover_entry_points(group)
        count = 0
        for ep in [e for eps in self._pending.values() for e in eps] + self._unkeyed:
            count += self._load_one(ep, strict)
        return count

    def _load_one(self, ep: metadata.EntryPoint, strict: bool) -> int:
        ident = (ep.name, ep.value)
        if ident in self._loaded_eps:
            return 0
        if ident in self._broken:
            if strict:
                raise self._broken[ident].error
            return 0
        for eps in self._pending.values():
            if ep in eps:
                eps.remove(ep)
        if ep in self._unkeyed:
            self._unkeyed.remove(ep)
        dist = getattr(ep, "dist", None)
        origin = f"entry point {ep.name} = {ep.value}" + (f" [{dist.name} {dist.version}]" if dist is not None else "")
        count = 0
        try:
            try:
                obj = ep.load()
            except Exception as exc:
                raise PluginError(f"cannot load {origin}: {type(exc).__name__}: {exc}", plugin=ep.value) from exc
            specs = obj if isinstance(obj, (list, tuple)) else [obj]
            for spec in specs:
                self.register(spec, origin)
                count += 1
        except PluginError as exc:
            self._broken[ident] = BrokenPlugin(f"{ep.name} = {ep.value}", origin, exc)
            if strict:
                raise
            return count
        self._loaded_eps.add(ident)
        return count

    def broken(self) -> list[BrokenPlugin]:
        """Entry points that failed to load, with their error (after :meth:`plugins`)."""
        return sorted(self._broken.values(), key=lambda b: b.entry_point)

    def load_path(self, path: str, key: str | None = None) -> PluginSpec:
        """Import ``module:attr`` and register the PluginSpec it names."""
        if not isinstance(path, str) or not _PATH_RE.match(path):
            raise PluginError(f"{path!r} is not a 'package.module:attribute' reference", plugin=path, key=key)
        mod_name, attr = path.split(":")
        if mod_name == "py" or mod_name.endswith(".py"):
            # "plugin.py:SPEC" matches the pattern but means a file; importing it would run
            # a same-named module found on sys.path (the current directory for `python -m`).
            raise PluginError(
                f"{path!r} names a .py file; use the importable module's dotted name (package.module:attribute)",
                plugin=path,
                key=key,
            )
        self._check_origin(mod_name, path, key)
        try:
            module = importlib.import_module(mod_name)
        except Exception as exc:
            hint = ""
            top = mod_name.split(".")[0]
            if (
                self._plugin_paths is not None
                and isinstance(exc, ModuleNotFoundError)
                and (os.path.exists(f"{top}.py") or os.path.isdir(top))
            ):
                hint = f" ('{top}' in the working directory is not used: pass --plugin-path DIR to allow it)"
            raise PluginError(
                f"cannot import {mod_name!r}: {type(exc).__name__}: {exc}{hint}", plugin=path, key=key
            ) from exc
        if not hasattr(module, attr):
            raise PluginError(f"module {mod_name!r} has no attribute {attr!r}", plugin=path, key=key)
        spec = getattr(module, attr)
        try:
            existing = self._specs.get((spec.kind, spec.name)) if isinstance(spec, PluginSpec) else None
            if existing is not None and existing.spec is spec:
                return spec
            return self.register(spec, origin=f"config path {path}")
        except PluginError as exc:
            raise PluginError(exc.detail, plugin=path, key=key) from None

    def _check_origin(self, mod_name: str, path: str, key: str | None) -> None:
        """Refuse a module that would be imported from the working directory by accident.

        ``python -m``, ``PYTHONPATH=.`` and a script in the current directory all put it on
        ``sys.path``, so a config naming ``plugin:SPEC`` would run whatever ``plugin.py``
        sits where the command was typed. Only the top-level name is located (no import).
        """
        if self._plugin_paths is None:
            return
        top = mod_name.split(".")[0]
        if top in sys.modules:
            return
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return  # the import below reports it
        if spec is None:
            return
        where = (
            spec.origin
            if spec.submodule_search_locations is None
            else next(iter(spec.submodule_search_locations), None)
        )
        if not where or where in ("built-in", "frozen"):
            return
        parent = os.path.dirname(os.path.realpath(where))
        cwd = os.path.realpath(os.getcwd())
        if parent == cwd and cwd not in self._plugin_paths:
            raise PluginError(
                f"{top!r} would be imported from the working directory ({parent}); "
                "pass --plugin-path DIR to allow plugins from a directory",
                plugin=path,
                key=key,
            )

    def get(self, kind: str, name: str, key: str | None = None) -> PluginSpec:
        """The spec registered as ``(kind, name)``; PluginError naming ``key`` if absent.

        Imports the entry point that promises ``(kind, name)`` on first use; a broken
        one raises PluginError naming ``key``.
        """
        if (kind, name) not in self._specs:
            for ep in list(self._pending.get((kind, name), ())):
                try:
                    self._load_one(ep, strict=True)
                except PluginError as exc:
                    raise PluginError(exc.detail, plugin=exc.plugin, key=key) from exc.__cause__
        if (kind, name) not in self._specs and self._unkeyed:
            for ep in list(self._unkeyed):
                self._load_one(ep, strict=False)
        info = self._specs.get((kind, name))
        if info is None:
            known = sorted({n for k, n in self._specs if k == kind} | {n for k, n in self._pending if k == kind})
            hint = did_you_mean(name, known)
            where = KNOWN_PLUGINS.get((kind, name))
            install = (
                f"; {kind} {name!r} comes with the distribution {where[0]}, which is not installed here: {where[1]}"
                if where is not None
                else ""
            )
            raise PluginError(
                f"no {kind} plugin named {name!r}{hint}; registered: {', '.join(known) or 'none'}{install}",
                plugin=name,
                key=key,
            )
        return info.spec

    def resolve(self, kind: str, ref: str, key: str | None = None) -> PluginSpec:
        """A registered name, or a ``module:attr`` reference (contains ':')."""
        if ":" in ref:
            spec = self.load_path(ref, key)
            if spec.kind != kind:
                raise PluginError(f"{ref} is a {spec.kind} plugin, expected a {kind}", plugin=ref, key=key)
            return spec
        return self.get(kind, ref, key)

    def options(self, spec: PluginSpec, raw: dict[str, Any], key: str) -> Any:
        """Convert a raw options table to the spec's typed options; errors name ``key``."""
        from .config import convert_options

        return convert_options(spec, raw, key)

    def build(self, spec: PluginSpec, options: Any, context: PluginContext, key: str | None = None) -> Any:
        """Instantiate a plugin and check the object honours its kind's contract.

        Raises ConfigError naming ``key`` when the plugin needs an engine capability
        (``spec.needs``) that ``context.capabilities`` does not offer.
        """
        missing = [n for n in spec.needs if context.capabilities.get(n) is None]
        if missing:
            raise ConfigError(
                f"{spec.kind} {spec.name!r} needs the engine capability {', '.join(map(repr, missing))}, which this "
                f"engine does not offer on the {context.side} side (the SGLang decode offers 'draft_head' from its "
                "EAGLE worker, the ab job from its workload); choose another synthesizer",
                path=key or "",
            )
        try:
            obj = spec.factory(options, context)
        except (PluginError, ConfigError):
            raise
        except Exception as exc:
            raise PluginError(
                f"factory of {spec.kind} {spec.name!r} raised {type(exc).__name__}: {exc}", plugin=spec.name, key=key
            ) from exc
        _check_method(obj, spec.kind, spec.name, key, bound=True)
        return obj

    def plugins(self) -> list[PluginInfo]:
        """Every registered plugin, sorted by kind then name.

        Imports every discovered entry point first; the ones that fail are listed by
        :meth:`broken` instead of raising.
        """
        for ep in [e for eps in self._pending.values() for e in eps] + self._unkeyed:
            self._load_one(ep, strict=False)
        return sorted(self._specs.values(), key=lambda i: (i.kind, i.name))

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._specs


def default_registry(plugin_paths: Sequence[str] | None = None) -> PluginRegistry:
    """A registry that knows every installed entry point and imports each on first use.

    ``plugin_paths`` (see :class:`PluginRegistry`) are also put on ``sys.path``.
    """
    for p in plugin_paths or ():
        if p not in sys.path:
            sys.path.insert(0, p)
    reg = PluginRegistry(plugin_paths=plugin_paths)
    reg.discover_entry_points()
    return reg
