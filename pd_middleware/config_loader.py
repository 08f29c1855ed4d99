"""Reading config documents and converting them to typed structs, with every error at once.

Two halves, both independent of the schema in :mod:`pd_middleware.config`:

- :func:`read_document` turns a path (``.toml``, ``.yaml``, ``.yml``, ``.json``) or an
  inline JSON document (``'{"model": {...}}'``, as vLLM's ``--kv-transfer-config``) into
  plain data. Sizes and nesting are bounded *before* anything recursive sees them, so a
  hostile file is a :class:`~pd_middleware.ConfigError`, never a traceback.
- :func:`convert` walks that data against a ``msgspec.Struct`` type and collects *every*
  problem (unknown key with a "did you mean", wrong type, value out of range), each at its
  full key path (``model.vocab_sise``, ``encoder.options.top_k``), then raises one
  ConfigError that carries them all in ``.issues``. Only data without problems reaches
  ``msgspec.convert``, which builds the frozen struct.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import msgspec

from .core._errors import ConfigError, ConfigIssue, OptionValueError

# A config is a few KB; the bounds are generous for humans and tight for attacks.
MAX_DOCUMENT_BYTES = 1 << 20
MAX_DEPTH = 32
#: Values a YAML document may expand to, aliases counted at every use (a "billion laughs"
#: document is a few hundred bytes that expand to 10**9 values).
MAX_YAML_NODES = 100_000
# Python refuses int() of more than 4300 digits (CVE-2020-10735); say so without a traceback.
_SUFFIXES = (".toml", ".yaml", ".yml", ".json")


def is_inline(ref: str | Path) -> bool:
    """True when ``ref`` is an inline JSON document rather than a file path."""
    return isinstance(ref, str) and ref.lstrip().startswith("{")


def read_document(ref: str | Path) -> tuple[Any, str]:
    """Parse a config path or inline JSON text into plain data; return ``(data, source)``.

    Raises ConfigError (naming the source) for an unreadable or oversized file, an
    unsupported extension, a syntax error, nesting deeper than :data:`MAX_DEPTH`, or an
    integer too long to parse.
    """
    if is_inline(ref):
        src, text, kind = "<inline JSON>", str(ref), ".json"
    else:
        p = Path(ref)
        src, kind = str(p), p.suffix.lower()
        if kind not in _SUFFIXES:
            raise ConfigError(
                f"unsupported extension {kind!r}; use .toml, .yaml, .yml or .json, or pass inline JSON ('{{...}}')",
                source=src,
            )
        try:
            if p.stat().st_size > MAX_DOCUMENT_BYTES:
                raise ConfigError(f"file is larger than {MAX_DOCUMENT_BYTES} bytes", source=src)
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read file: {exc}", source=src) from None
    if len(text) > MAX_DOCUMENT_BYTES:
        raise ConfigError(f"document is larger than {MAX_DOCUMENT_BYTES} bytes", source=src)
    # Brackets and indentation both nest; bound the cheap upper estimate before parsing,
    # because the TOML, YAML and JSON parsers all recurse per level.
    if _bracket_depth(text) > 4 * MAX_DEPTH:
        raise ConfigError(f"nesting deeper than {MAX_DEPTH} levels", source=src)
    lang = {".toml": "TOML", ".json": "JSON"}.get(kind, "YAML")
    try:
        if kind == ".toml":
            data = tomllib.loads(text)
        elif kind == ".json":
            data = json.loads(text)
        else:
            data = _load_yaml(text, src)
    except ConfigError:
        raise
    except RecursionError:
        raise ConfigError(f"nesting deeper than {MAX_DEPTH} levels", source=src) from None
    except ValueError as exc:  # json/toml decode errors are ValueErrors too; keep their text
        msg = str(exc)
        if "integer string conversion" in msg:
            msg = "an integer has too many digits (at most 4300)"
        raise ConfigError(f"invalid {lang}: {msg}", source=src) from None
    except Exception as exc:
        raise ConfigError(f"invalid {lang}: {exc}", source=src) from None
    depth = data_depth(data)
    if depth > MAX_DEPTH:
        raise ConfigError(f"nesting deeper than {MAX_DEPTH} levels", source=src)
    return data, src


def _load_yaml(text: str, src: str) -> Any:
    """Compose the YAML node graph, bound what its aliases expand to, then construct it."""
    loader = _strict_yaml_loader()(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        _bound_yaml_nodes(node, src)
        data = loader.construct_document(node)
    finally:
        loader.dispose()
    return {} if data is None else data


def _bound_yaml_nodes(root: Any, src: str) -> None:
    """Refuse a node graph that expands (each alias at every use) past :data:`MAX_YAML_NODES`
    values, or that refers to itself; linear in the graph's size, not in its expansion."""
    import yaml

    size: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    open_: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_.discard(key)
            kids = _yaml_children(node, yaml)
            total = 1 + sum(size[id(k)] for k in kids)
            if total > MAX_YAML_NODES:
                raise ConfigError(
                    f"YAML aliases expand to more than MAX_YAML_NODES = {MAX_YAML_NODES} values "
                    "(a 'billion laughs' document?)",
                    source=src,
                )
            size[key] = total
            continue
        if key in size:
            continue
        if key in open_:
            raise ConfigError("a YAML alias refers to the node that contains it", source=src)
        open_.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _yaml_children(node, yaml) if id(k) not in size)


def _yaml_children(node: Any, yaml: Any) -> list[Any]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _bracket_depth(text: str) -> int:
    depth = best = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            best = max(best, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return best


def data_depth(data: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of dicts/lists, computed without recursion; stops past ``limit``."""
    best = 0
    stack = [(data, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            best = max(best, d)
            if best > limit:
                return best
            stack.extend((v, d + 1) for v in (node.values() if isinstance(node, dict) else node))
    return best


@functools.cache
def _strict_yaml_loader() -> type:
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping.

    Plain YAML keeps the last value silently (TOML refuses it); a config that says
    ``vocab_size`` twice is a mistake either way. Merge keys (``<<``) may still be
    overridden.
    """
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader: Any, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = loader.construct_object(key_node, deep=deep)
            try:
                dup = key in seen
                seen.add(key)
            except TypeError:  # unhashable key: construct_mapping reports it
                continue
            if dup:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {key!r}", key_node.start_mark
                )
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return StrictLoader


# ---------------------------------------------------------------- conversion

_AT_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def join_path(prefix: str, path: str) -> str:
    """``join_path("arms[1]", "weight") == "arms[1].weight"``; list indices attach directly."""
    if not prefix:
        return path
    if not path:
        return prefix
    return f"{prefix}{path}" if path.startswith("[") else f"{prefix}.{path}"


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    """``"; did you mean `x`?"`` for the closest choice, or ``""`` when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def _struct_type(typ: Any) -> tuple[type | None, bool]:
    """``(StructType, none_allowed)`` if ``typ`` is a Struct or ``Struct | None``."""
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        return typ, False
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        structs = [a for a in args if isinstance(a, type) and issubclass(a, msgspec.Struct)]
        if len(structs) == 1 and len(args) == 2 and type(None) in args:
            return structs[0], True
    return None, False


def _walk(data: Any, typ: Any, path: str, issues: list[ConfigIssue]) -> None:
    struct, none_ok = _struct_type(typ)
    if struct is not None:
        if data is None and none_ok:
            return
        _walk_struct(data, struct, path, issues)
        return
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ) or (Any,)
        if _struct_type(item)[0] is not None:
            if not isinstance(data, list):
                issues.append(ConfigIssue(path, f"Expected `array`, got `{type(data).__name__}`"))
                return
            for i, x in enumerate(data):
                _walk(x, item, f"{path}[{i}]", issues)
            return
    try:
        msgspec.convert(data, typ, strict=True)
    except msgspec.ValidationError as exc:
        m = _AT_RE.match(str(exc))
        assert m is not None
        issues.append(ConfigIssue(join_path(path, (m.group("path") or "").lstrip(".")), m.group("msg")))


def _walk_struct(data: Any, struct: type, path: str, issues: list[ConfigIssue]) -> None:
    if not isinstance(data, dict):
        issues.append(ConfigIssue(path, f"Expected a table/mapping, got `{type(data).__name__}`"))
        return
    fields = {f.encode_name: f for f in msgspec.structs.fields(struct)}
    for key in data:
        if key not in fields:
            issues.append(
                ConfigIssue(join_path(path, str(key)), f"unknown field `{key}`{did_you_mean(str(key), fields)}")
            )
    before = len(issues)
    for name, f in fields.items():
        if name in data:
            _walk(data[name], f.type, join_path(path, name), issues)
        elif f.required:
            issues.append(ConfigIssue(join_path(path, name), f"Object missing required field `{name}`"))
    if len(issues) > before:
        return
    # Every known field is well-typed (unknown keys aside): build the struct once so its
    # __post_init__ range checks run too, and a typo does not hide a bad value.
    try:
        msgspec.convert({k: v for k, v in data.items() if k in fields}, struct, strict=True)
    except msgspec.ValidationError as exc:
        cause = exc.__cause__ or exc.__context__
        m = _AT_RE.match(str(exc))
        assert m is not None
        where = join_path(path, (m.group("path") or "").lstrip("."))
        if isinstance(cause, OptionValueError):
            issues.append(ConfigIssue(join_path(where, cause.field), cause.message))
        else:
            issues.append(ConfigIssue(where, m.group("msg")))
    except ConfigError as exc:  # raised by a __post_init__ with a path relative to the struct
        for issue in exc.issues:
            issues.append(ConfigIssue(join_path(path, issue.path), issue.message))


def collect_issues(data: Any, typ: type, prefix: str = "") -> list[ConfigIssue]:
    """Every problem of ``data`` as a ``typ`` (a msgspec Struct), each at its full path."""
    if data_depth(data) > MAX_DEPTH:
        return [ConfigIssue(prefix, f"nesting deeper than {MAX_DEPTH} levels")]
    issues: list[ConfigIssue] = []
    _walk(data, typ, prefix, issues)
    return issues


def convert(data: Any, typ: type, prefix: str = "", source: str | None = None) -> Any:
    """Convert ``data`` to ``typ`` or raise one ConfigError listing every issue."""
    issues = collect_issues(data, typ, prefix)
    if issues:
        raise ConfigError.from_issues(issues, source=source)
    try:
        return msgspec.convert(data, typ, strict=True)
    except (msgspec.ValidationError, ConfigError) as exc:  # pragma: no cover - the walk found none
        raise ConfigError(f"{exc}", path=prefix, source=source) from None


# ---------------------------------------------------------------- shipped configs


def shipped_dir() -> Path:
    """The example configs installed with the package (``pd_middleware/configs``)."""
    return Path(__file__).resolve().parent / "configs"


def shipped_configs() -> list[Path]:
    """Every shipped example config, sorted by name."""
    d = shipped_dir()
    return sorted(p for p in d.iterdir() if p.suffix in _SUFFIXES) if d.is_dir() else []


def find_config(ref: str) -> str:
    """What a command-line config argument means: inline JSON and existing files as given,
    otherwise the name of a shipped config (``ab`` or ``ab.toml``), otherwise as given (so
    the loader reports the missing file)."""
    if is_inline(ref) or Path(ref).exists():
        return ref
    for p in shipped_configs():
        if ref in (p.name, p.stem):
            return str(p)
    return ref
