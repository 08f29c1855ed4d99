"""Config fuzz: broken TOML and YAML files must each be rejected with a key path.

``python reliability/config_fuzz.py [--cases 1200] [--seed 3] [--budget-s 120]``

Each case takes one shipped ``configs/*.toml`` (and ``configs/*.yaml``), breaks it in
exactly one way, writes it as TOML or YAML into a temporary directory and runs
:func:`pd_middleware.config.load_config` then
:func:`~pd_middleware.config.resolve_plugins` with the default registry (what
``pd-middleware check-config`` does). Mutation families:

- ``unknown_key``: an unknown key added to a table at any depth (plugin options included);
- ``wrong_type``: a value replaced by one of another type;
- ``out_of_range``: a known field set outside its documented range;
- ``bad_plugin_name`` / ``bad_plugin_path``: a plugin name that is not registered, or a
  ``module:attr`` reference that is malformed, not importable, names a non-plugin, or
  looks like a file path or shell/code string (these must never be imported);
- ``bad_option``: a plugin option key that the plugin does not define, or a bad value;
- ``duplicate_key``: a key written twice in the same table (YAML would keep the last);
- ``syntax``: the file text cut short or garbled;
- ``hostile``: TOML, YAML or JSON nested thousands deep, a 5000-digit integer, a file
  over the size limit: a ConfigError naming the file, never a RecursionError/ValueError;
- ``inline_json``: one of the mutations above passed as an inline JSON document (as
  ``pd-middleware check-config '{...}'`` or ``PD_MIDDLEWARE_CONFIG``) instead of a file;
- ``startup``: a config that parses but would not start (an unset ``hmac_key_env``, a
  garbage ``bind_host`` or ``mooncake.host``, a slot pool larger than the machine), which
  :func:`~pd_middleware.preflight.preflight` must report as an error at that key.

Separately, every encoder/synthesizer pair of the registry is probed once: a pair whose
proposal never reaches the verifier must draw a preflight warning, an exact pair none.

A case passes when the loader raises :class:`~pd_middleware.ConfigError` with a
non-empty ``.path``, :class:`~pd_middleware.PluginError` with a non-empty ``.key``, or
(syntax only) a ConfigError naming the file. ``accepted_silently`` and ``crashes`` (any
other exception) must be 0. ``path_mismatch`` counts rejections whose path does not
name the mutated key itself (informational, listed with examples).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import tempfile
import tomllib
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.setup_env()

import yaml

from pd_middleware import ConfigError, PluginError
from pd_middleware.config import load_config, resolve_plugins
from pd_middleware.preflight import preflight
from pd_middleware.registry import default_registry

FAMILIES = (
    "unknown_key",
    "wrong_type",
    "out_of_range",
    "bad_plugin_name",
    "bad_plugin_path",
    "bad_option",
    "duplicate_key",
    "syntax",
    "hostile",
    "inline_json",
    "startup",
)
HOSTILE = [
    ("toml", lambda: "a = " + "[" * 5000 + "]" * 5000 + "\n"),
    ("toml", lambda: "a = " + "{b = " * 400 + "1" + "}" * 400 + "\n"),
    ("yaml", lambda: "a: " + "[" * 5000 + "]" * 5000 + "\n"),
    ("yaml", lambda: "".join(" " * i + f"k{i}:\n" for i in range(300)) + " " * 300 + "v: 1\n"),
    ("yaml", lambda: "model:\n  vocab_size: " + "7" * 5000 + "\n"),
    ("toml", lambda: "[model]\nvocab_size = " + "7" * 5000 + "\n"),
    ("json", lambda: '{"a": ' + "[" * 5000 + "]" * 5000 + "}"),
    ("json", lambda: '{"model": {"vocab_size": ' + "7" * 5000 + "}}"),
    ("toml", lambda: "# " + "x" * (2 << 20) + "\n"),
]
STARTUP = [
    (("transport", "hmac_key_env"), "PDM_FUZZ_SURELY_UNSET_SECRET"),
    (("transport", "bind_host"), "not a host!"),
    (("transport", "bind_host"), "999.1.1.1"),
    (("transport", "mooncake", "host"), "bad host name"),
    (("transport", "mooncake", "host"), "-leading-dash"),
    (("transport", "slots"), {"count": 2**20, "size_bytes": 2**32}),
]
# (encoder, synthesizer, warned): the guard makes the first group fall back on every payload.
PAIRS = [
    ("greedy", "full_distribution", True),
    ("softmax", "full_distribution", True),
    ("greedy", "sparse", True),
    ("softmax", "sparse", True),
    ("full", "sparse", True),
    ("sparse", "full_distribution", True),
    ("full", "one_hot", True),
    ("sparse", "one_hot", True),
    ("softmax", "one_hot", False),
    ("greedy", "one_hot", False),
    ("full", "full_distribution", False),
    ("sparse", "sparse", False),
]

# Known fields and values outside their documented ranges (config.py, transport/config.py).
OUT_OF_RANGE: dict[tuple[str, ...], list[Any]] = {
    ("model", "vocab_size"): [0, -1, 2**24 + 1],
    ("model", "num_steps"): [0, 17],
    ("model", "hidden_size"): [-1, 65537],
    ("model", "hidden_dtype"): ["fp8", "BF16"],
    ("decode", "max_batch"): [0, 65537],
    ("decode", "device"): ["gpu", "cuda:x", ""],
    ("decode", "num_buffers"): [0, 9],
    ("ab", "requests"): [0, 10_000_001],
    ("ab", "batch_size"): [0, 4097],
    ("ab", "response_tokens"): [0],
    ("ab", "later_acceptance"): [1.0, -0.1, math.nan],
    ("transport", "port"): [-1, 65536],
    ("transport", "heartbeat_s"): [0.0, 61.0],
    ("transport", "peer_timeout_s"): [0.01, 4000.0],
    ("transport", "connect_timeout_s"): [0.0, 601.0],
    ("transport", "hmac_key"): ["short"],
    ("transport", "hmac_key_env"): ["1BAD-NAME", "has space"],
    ("transport", "hwm"): [0],
    ("transport", "recv_batch"): [0, 70000],
    ("transport", "inline_threshold_bytes"): [-1],
    ("transport", "bind_host"): [""],
    ("transport", "slots", "count"): [-1, 2**21],
    ("transport", "slots", "size_bytes"): [63, 2**33],
    ("transport", "slots", "per_peer"): [-1],
    ("transport", "slots", "wait_s"): [-1.0, 3601.0],
    ("transport", "limits", "max_message_bytes"): [1023, 2**27],
    ("transport", "limits", "max_tensor_bytes"): [0],
    ("transport", "limits", "max_frames"): [1, 65],
    ("transport", "limits", "max_steps"): [0, 4097],
    ("transport", "limits", "max_vocab"): [0],
    ("transport", "limits", "max_request_id"): [0, 65537],
    ("transport", "mooncake", "host"): [""],
    ("transport", "mooncake", "protocol"): ["udp"],
    ("transport", "mooncake", "log_level"): ["DEBUG"],
    ("ab", "workload", "name"): ["nope"],
}

BAD_NAMES = ["nope", "ONE_HOT", "one-hot", "", " one_hot", "one_hot\n", "sparse;ls", "../one_hot", "x" * 300]
BAD_PATHS = [
    "/tmp/x.py:Y",
    "./plugin.py:SPEC",
    "os.system('x'):Y",
    "x; rm -rf /:Y",
    "$(touch /tmp/pwn):Y",
    "__import__('os'):Y",
    "pd_middleware:NOT_THERE",
    "no_such_module_pdm_fuzz:SPEC",
    "json:loads",
    "pd_middleware.config:Config",
    "a..b:C",
    ":SPEC",
    "pd_middleware:",
    "pd_middleware:a:b",
    "pd middleware:X",
    "pd_middleware_plugins.one_hot:SYNTHESIZER.factory",
    "pd_middleware_plugins.one_hot:OneHotSynthesizer",
]


def tables(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every table (dict) in ``node``, arrays of tables included."""
    out = [path] if isinstance(node, dict) else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += tables(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += tables(v, (*path, i))
    return out


def leaves(node: Any, path: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out += leaves(v, (*path, k)) if isinstance(v, (dict, list)) and v else [(*path, k)]
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += leaves(v, (*path, i)) if isinstance(v, (dict, list)) and v else [(*path, i)]
    return out


def get(node: Any, path: tuple) -> Any:
    for k in path:
        node = node[k]
    return node


def ensure(node: dict, path: tuple) -> dict:
    for k in path:
        node = node[k] if isinstance(k, int) else node.setdefault(k, {})
    return node


def dotted(path: tuple) -> str:
    s = ""
    for k in path:
        s += f"[{k}]" if isinstance(k, int) else (f".{k}" if s else str(k))
    return s


def plugin_refs(data: dict) -> list[tuple]:
    """Paths of every plugin reference table (``{name, options}``) in a config."""
    refs = [(k,) for k in ("synthesizer", "encoder") if isinstance(data.get(k), dict)]
    refs += [("hooks", i) for i in range(len(data.get("hooks", [])))]
    for i, arm in enumerate(data.get("arms", [])):
        refs += [("arms", i, k) for k in ("synthesizer", "encoder") if isinstance(arm.get(k), dict)]
    return refs or [("synthesizer",)]


def wrong_type(rng: random.Random, old: Any) -> Any:
    if isinstance(old, bool):
        return rng.choice(["yes", 1, [True]])
    if isinstance(old, (int, float)):
        return rng.choice(["12", [old], {"v": old}, True])
    if isinstance(old, str):
        return rng.choice([5, [old], {"name": old}, False])
    if isinstance(old, list):
        return rng.choice(["list", 3, {"a": 1}])
    return rng.choice(["table", 3, [1, 2]])


# ---- writers -------------------------------------------------------------------------------


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == math.inf else "-inf" if v == -math.inf else repr(v))
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string is a JSON string for what we write
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def to_toml(data: dict, dup: tuple | None = None) -> str:
    """Top-level keys as ``key = inline value``; ``dup`` writes that top-level key twice."""
    lines = [f"{json.dumps(k)} = {toml_value(v)}" for k, v in data.items()]
    if dup is not None:
        lines.append(f"{json.dumps(dup[0])} = {toml_value(data[dup[0]])}")
    return "\n".join(lines) + "\n"


def to_yaml(data: dict, dup: tuple | None = None) -> str:
    """Block-style YAML; ``dup`` (a path of string keys to a scalar) writes that line twice."""
    text = yaml.safe_dump(data, sort_keys=False)
    if dup is None:
        return text
    lines = text.splitlines()
    pos = -1
    for depth, key in enumerate(dup):
        prefix = f"{'  ' * depth}{key}:"
        pos = next((j for j in range(pos + 1, len(lines)) if lines[j].startswith(prefix)), -1)
        if pos < 0:
            raise ValueError(f"cannot find {dup} in the YAML text")
    lines.insert(pos + 1, lines[pos])
    return "\n".join(lines) + "\n"


# ---- one case ------------------------------------------------------------------------------


def mutate(rng: random.Random, family: str, base: dict, text: str, fmt: str) -> tuple[str, str, str]:
    """(file text, mutated key path, description)."""
    data = copy.deepcopy(base)
    dup = None
    if family == "unknown_key":
        candidates = [
            *tables(data),
            ("transport",),
            ("transport", "slots"),
            ("transport", "limits"),
            ("transport", "mooncake"),
            ("ab", "workload", "options"),
        ]
        candidates += [(*r, "options") for r in plugin_refs(data)]
        where = rng.choice(candidates)
        key = rng.choice(["bogus", "vocab_sise", "Name", "options_", "x-y", "__init__"])
        ensure(data, where)[key] = rng.choice([1, "x", True, [1]])
        path, what = (*where, key), "unknown key"
    elif family == "wrong_type":
        path = rng.choice(leaves(data))
        old = get(data, path)
        get(data, path[:-1])[path[-1]] = new = wrong_type(rng, old)
        what = f"{old!r} -> {new!r}"
    elif family == "out_of_range":
        path = rng.choice(list(OUT_OF_RANGE))
        value = rng.choice(OUT_OF_RANGE[path])
        ensure(data, path[:-1])[path[-1]] = value
        if path[-1] == "peer_timeout_s" and value > 1000:
            ensure(data, path[:-1])["heartbeat_s"] = 0.5
        what = f"= {value!r}"
    elif family in ("bad_plugin_name", "bad_plugin_path"):
        ref = rng.choice([*plugin_refs(data), ("hooks", 0)])
        if ref == ("hooks", 0) and not data.get("hooks"):
            data["hooks"] = [{"name": "record"}]
        value = rng.choice(BAD_NAMES if family == "bad_plugin_name" else BAD_PATHS)
        get(data, ref)["name"] = value
        get(data, ref).pop("options", None)
        path, what = (*ref, "name"), f"= {value!r}"
    elif family == "bad_option":
        ref = rng.choice(plugin_refs(data))
        opts = get(data, ref).setdefault("options", {})
        name = get(data, ref).get("name")
        if name == "sparse" and ref[-1] == "encoder" and rng.random() < 0.6:
            key, val = rng.choice(
                [("k", 0), ("epsilon", 1.0), ("mode", "median"), ("value_dtype", "fp64"), ("k_max", -3)]
            )
        elif name == "full" and rng.random() < 0.6:
            key, val = "dtype", rng.choice(["fp8", "int8", 32])
        else:
            key, val = rng.choice(["top_kk", "dtyp", "Mode", "threshold"]), 1
        opts[key] = val
        path, what = (*ref, "options", key), f"= {val!r}"
    elif family == "duplicate_key":
        if fmt == "toml":
            dup = (rng.choice(list(data)),)
        else:
            dup = rng.choice(
                [
                    p
                    for p in leaves(data)
                    if all(isinstance(k, str) for k in p) and not isinstance(get(data, p), (dict, list))
                ]
                or [("model", "vocab_size")]
            )
        path, what = dup, "written twice"
    elif family == "inline_json":
        sub = rng.choice(["unknown_key", "wrong_type", "out_of_range", "bad_option"])
        raw, path_s, what = mutate(rng, sub, base, text, "toml")
        return json.dumps(tomllib.loads(raw)), path_s, f"inline {sub}: {what}"
    elif family == "hostile":
        ext, make = rng.choice(HOSTILE)
        return make(), "", f"hostile .{ext}"
    elif family == "startup":
        where, value = rng.choice(STARTUP)
        ensure(data, where[:-1])[where[-1]] = value
        return json.dumps(data), dotted(where), f"= {value!r}"
    else:  # syntax
        r = rng.random()
        raw = to_toml(data) if fmt == "toml" else to_yaml(data)
        if r < 0.4:
            cut = rng.randrange(1, max(2, len(raw) - 1))
            raw = raw[:cut] + rng.choice(["= ", "[", "{", '"', ":\n  - ", "{a: [", "x = [1,"])
        elif r < 0.7:
            at = rng.randrange(len(raw))
            raw = (
                raw[:at]
                + rng.choice(['"""', "]]", "\t:\t", "= =", "{{", "\x00", "&a *b", "!!python/object:os.system ''"])
                + raw[at:]
            )
        else:
            raw = rng.choice(
                [
                    "[model\nvocab_size = 1\n",
                    "model = {vocab_size = }\n",
                    "= 3\n",
                    "model:\n vocab_size: [1,\n",
                    "\x00\x01\x02",
                    "!!python/object/apply:os.system ['true']\n",
                ]
            )
        return raw, "", "syntax"
    text = to_toml(data, dup) if fmt == "toml" else to_yaml(data, dup)
    return text, dotted(path), what


def classify(exc: BaseException | None, family: str, path: str, src: str) -> tuple[str, str]:
    """(verdict, error path): verdict in rejected / accepted_silently / crash / no_path."""
    if exc is None:
        return "accepted_silently", ""
    if isinstance(exc, PluginError):
        return ("rejected" if exc.key else "no_path"), exc.key or ""
    if isinstance(exc, ConfigError):
        if exc.path:
            return "rejected", exc.path
        if family in ("syntax", "duplicate_key", "hostile") and exc.source == src:
            return "rejected", "<file>"
        return "no_path", ""
    return "crash", ""


def check_pairs(registry: Any) -> list[str]:
    """Each PAIRS entry: a warning exactly when the pair can never hand over its proposal."""
    wrong = []
    for enc, syn, warned in PAIRS:
        cfg = load_config(
            json.dumps({"model": {"vocab_size": 2048}, "encoder": {"name": enc}, "synthesizer": {"name": syn}})
        )
        findings = preflight(cfg, resolve_plugins(cfg, registry), registry)
        got = any(f.level == "warning" and f.path == "synthesizer" for f in findings)
        if got != warned:
            wrong.append(f"{enc} -> {syn}: warned={got}, expected {warned}")
    return wrong


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=120.0)
    args = ap.parse_args()
    budget = C.Budget(args.budget_s)
    rng = random.Random(args.seed)
    registry = default_registry()
    bases = []
    for f in sorted((C.ROOT / "configs").iterdir()):
        if f.suffix == ".toml":
            bases.append((f.name, tomllib.loads(f.read_text())))
        elif f.suffix in (".yaml", ".yml"):
            bases.append((f.name, yaml.safe_load(f.read_text()) or {}))
    # Negative control: every shipped config is accepted as it is (else the fuzz proves nothing).
    broken_bases = []
    for name, _data in bases:
        try:
            resolve_plugins(load_config(C.ROOT / "configs" / name), registry)
        except Exception as exc:
            broken_bases.append(f"{name}: {exc}")
    imported_before = set(sys.modules)
    verdicts: Counter[str] = Counter()
    by_family: dict[str, Counter[str]] = {f: Counter() for f in FAMILIES}
    examples: dict[str, list[str]] = {}
    mismatch = 0
    tried = 0
    with tempfile.TemporaryDirectory(prefix="pdm-config-fuzz-") as tmp:
        while tried < args.cases and not budget.over():
            family = FAMILIES[tried % len(FAMILIES)]
            name, base = rng.choice(bases)
            fmt = rng.choice(["toml", "yaml"])
            text, path, what = mutate(rng, family, base, "", fmt)
            if family == "hostile":
                fmt = what.rsplit(".", 1)[1]
            src = os.path.join(tmp, f"case{tried}.{fmt}")
            with open(src, "w", encoding="utf-8") as fh:
                fh.write(text)
            exc: BaseException | None = None
            try:
                if family == "startup":
                    cfg = load_config(text)
                    findings = preflight(cfg, resolve_plugins(cfg, registry), registry, probe=False)
                    hit = [f for f in findings if f.level == "error" and f.path == path]
                    exc = ConfigError(hit[0].message, path=path) if hit else None
                else:
                    resolve_plugins(load_config(text if family == "inline_json" else src), registry, source=src)
            except Exception as e:
                exc = e
            verdict, got = classify(exc, family, path, src)
            tried += 1
            verdicts[verdict] += 1
            by_family[family][verdict] += 1
            note = f"{name} as {fmt}: {family} {path} {what} -> {type(exc).__name__ if exc else 'accepted'}: {str(exc)[:160] if exc else ''}"
            if verdict != "rejected":
                examples.setdefault(verdict, [])
                if len(examples[verdict]) < 8:
                    examples[verdict].append(note)
            elif path and got != "<file>":
                norm = got.replace("[", ".[")
                want = path.replace("[", ".[")
                # Full key paths now: the error must name the mutated key itself (or below it).
                if not (norm == want or norm.startswith(want + ".")):
                    mismatch += 1
                    examples.setdefault("path_mismatch", [])
                    if len(examples["path_mismatch"]) < 8:
                        examples["path_mismatch"].append(note + f" (path {got})")
            os.unlink(src)
    imported = sorted(m for m in set(sys.modules) - imported_before if "fuzz" in m or m.startswith(("x", "a")))
    pair_errors = check_pairs(registry)
    result = {
        "script": "config_fuzz",
        "seed": args.seed,
        "tried": tried,
        "rejected_with_path": verdicts["rejected"],
        "accepted_silently": verdicts["accepted_silently"],
        "crashes": verdicts["crash"],
        "rejected_without_path": verdicts["no_path"],
        "path_mismatch": mismatch,
        "shipped_configs_broken": broken_bases,
        "suspicious_imports": imported,
        "pair_warnings_wrong": pair_errors,
        "by_family": {f: dict(c) for f, c in by_family.items()},
        "examples": examples,
        "seconds": round(budget.elapsed(), 1),
        "machine": C.machine(),
        "must_be_zero": ["accepted_silently", "crashes", "rejected_without_path"],
    }
    C.emit(result)
    bad = (
        verdicts["accepted_silently"]
        + verdicts["crash"]
        + verdicts["no_path"]
        + len(broken_bases)
        + len(imported)
        + len(pair_errors)
    )
    return 0 if bad == 0 and tried >= min(args.cases, 1000) else 1


if __name__ == "__main__":
    sys.exit(main())
