"""Config strictness: unknown keys and bad values name the full key path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_middleware import ConfigError
from pd_middleware.config import Config, load_config, parse_config, resolve_plugins
from pd_middleware.registry import default_registry


def test_defaults():
    cfg = parse_config({})
    assert cfg.model.vocab_size == 152064 and cfg.model.num_steps == 1
    assert cfg.decode.rejection_sampling is True and cfg.decode.device == "cpu"
    assert cfg.synthesizer.name == "one_hot"


@pytest.mark.parametrize(
    "data, path, message",
    [
        ({"modle": {}}, "modle", "unknown field `modle`"),
        ({"model": {"vocab_sise": 5}}, "model.vocab_sise", "unknown field `vocab_sise`; did you mean `vocab_size`?"),
        ({"model": {"vocab_size": 0}}, "model.vocab_size", r"must be in \[1, 16777216\]"),
        ({"model": {"vocab_size": "10"}}, "model.vocab_size", "Expected `int \\| null`, got `str`"),
        ({"model": {"num_steps": True}}, "model.num_steps", "Expected `int \\| null`, got `bool`"),
        ({"model": {"hidden_dtype": "int8"}}, "model.hidden_dtype", "Invalid enum value 'int8'"),
        ({"decode": {"rejection_sampling": "yes"}}, "decode.rejection_sampling", "Expected `bool`"),
        ({"decode": {"device": "tpu"}}, "decode.device", "must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"decode": {"max_batch": 0}}, "decode.max_batch", r"must be in \[1, 65536\]"),
        ({"hooks": [{"name": "a"}, {"nam": "b"}]}, "hooks[1].nam", "unknown field `nam`; did you mean `name`"),
        (
            {"synthesizer": {"name": "x", "option": {}}},
            "synthesizer.option",
            "unknown field `option`; did you mean `options`",
        ),
        ({"transport": {"slots": {"cout": 3}}}, "transport.slots.cout", "did you mean `count`"),
        ({"transport": {"slots": {"count": -1}}}, "transport.slots.count", r"must be in \[0, 2\*\*20\]"),
        ({"synthesizer": {"options": {}}}, "synthesizer.name", "missing required field `name`"),
        ({"model": 5}, "model", "Expected a table/mapping, got `int`"),
        ({"hooks": {"name": "a"}}, "hooks", "Expected `array`, got `dict`"),
        ({"arms": [{"name": "a", "synthesizer": {"name": "one_hot"}, "weight": -2}]}, "arms[0].weight", "must be in"),
        (
            {"arms": [{"name": "a", "synthesizer": {"name": "x"}}, {"name": "a", "synthesizer": {"name": "y"}}]},
            "arms[1].name",
            "duplicate arm name 'a'",
        ),
        ({"ab": {"later_acceptance": 1.5}}, "ab.later_acceptance", r"must be in \[0, 1\)"),
        ({"ab": {"requestz": 10}}, "ab.requestz", "unknown field `requestz`; did you mean `requests`"),
        ({"ab": {"workload": {"nmae": "ngram"}}}, "ab.workload.nmae", "did you mean `name`"),
        ({"ab": {"baseline": "two words"}}, "ab.baseline", "must be an arm name"),
    ],
)
def test_errors_name_the_key_path(data, path, message):
    with pytest.raises(ConfigError, match=message) as ei:
        parse_config(data)
    assert ei.value.path == path
    if path:
        assert f"at {path}" in str(ei.value)


def test_ab_table_is_checked_at_load_without_the_job(tmp_path):
    """The [ab] table's schema lives in the config layer: a typo in a file fails at load
    time at its full path, while loading a config imports nothing of the job (ab/), and
    the job's names for the schema are the same classes."""
    f = tmp_path / "c.toml"
    f.write_text("[ab]\nrequests = 5\nrequestz = 10\n")
    with pytest.raises(ConfigError, match="did you mean `requests`") as ei:
        load_config(f)
    assert ei.value.path == "ab.requestz" and str(f) in str(ei.value)
    f.write_text("[ab]\nrequests = 5\n")
    assert load_config(f).ab.requests == 5
    code = (
        "import sys, pd_middleware.config as c; c.load_config(sys.argv[1]);"
        "print(sorted(m for m in sys.modules if m.startswith('pd_middleware.ab')))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    import pd_middleware.ab
    import pd_middleware.ab.config
    from pd_middleware.config import ABConfig, WorkloadRef

    assert pd_middleware.ab.ABConfig is ABConfig is pd_middleware.ab.config.ABConfig
    assert pd_middleware.ab.WorkloadRef is WorkloadRef


def test_one_hot_takes_no_options():
    cfg = parse_config({"synthesizer": {"name": "one_hot", "options": {"top_k": 3}}, "encoder": {"name": "softmax"}})
    reg = default_registry()
    with pytest.raises(ConfigError, match="plugin 'one_hot' takes no options") as ei:
        resolve_plugins(cfg, reg)
    assert ei.value.path == "synthesizer.options.top_k"


def test_toml_and_yaml_load_the_same(tmp_path):
    (tmp_path / "a.toml").write_text('[model]\nvocab_size = 99\nnum_steps = 3\n[synthesizer]\nname = "one_hot"\n')
    (tmp_path / "a.yaml").write_text("model:\n  vocab_size: 99\n  num_steps: 3\nsynthesizer:\n  name: one_hot\n")
    assert load_config(tmp_path / "a.toml") == load_config(tmp_path / "a.yaml")
    assert isinstance(load_config(tmp_path / "a.yaml"), Config)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="unsupported extension '.ini'"):
        load_config(tmp_path / "x.ini")
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[model\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "bad.yaml").write_text("model: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a table/mapping, got list"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "deep.yaml").write_text("model:\n  vocab_size: 10\n  extra: 1\n")
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path / "deep.yaml")
    assert ei.value.path == "model.extra" and "deep.yaml" in str(ei.value) and "`extra`" in str(ei.value)


def test_config_is_frozen():
    cfg = parse_config({})
    with pytest.raises(AttributeError):
        cfg.model = None  # type: ignore[misc]


def test_shipped_configs_are_valid():
    import pathlib

    reg = default_registry()
    root = pathlib.Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.toml")) + sorted(root.glob("*.yaml"))
    assert files, "configs/ ships examples"
    for f in files:
        resolve_plugins(load_config(f), reg, source=str(f))


def test_every_error_is_reported_at_once_with_suggestions():
    data = {
        "modle": {},
        "model": {"vocab_sise": 5, "num_steps": "2"},
        "decode": {"max_batch": 0},
        "hooks": [{"name": "record", "optoins": {}}],
    }
    with pytest.raises(ConfigError) as ei:
        parse_config(data)
    got = {(i.path, i.message) for i in ei.value.issues}
    assert got == {
        ("modle", "unknown field `modle`; did you mean `model`?"),
        ("model.vocab_sise", "unknown field `vocab_sise`; did you mean `vocab_size`?"),
        ("model.num_steps", "Expected `int | null`, got `str`"),
        ("decode.max_batch", "must be in [1, 65536], got 0"),
        ("hooks[0].optoins", "unknown field `optoins`; did you mean `options`?"),
    }
    text = str(ei.value)
    assert text.startswith("config error: 5 problems:")
    assert "\n  at model.vocab_sise: unknown field `vocab_sise`; did you mean `vocab_size`?" in text
    # The first issue stays reachable as .path/.detail for callers that want one.
    first = ei.value.issues[0]
    assert (
        (ei.value.path, ei.value.detail)
        == (first.path, first.message)
        == ("modle", "unknown field `modle`; did you mean `model`?")
    )


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(ConfigError) as ei:
        parse_config({"model": {"zzz": 1}})
    assert ei.value.detail == "unknown field `zzz`"


def test_plugin_option_errors_name_the_option_and_are_all_reported():
    cfg = parse_config(
        {
            "encoder": {"name": "sparse", "options": {"k_mx": 3, "mode": "x"}},
            "synthesizer": {"name": "one_hot", "options": {"a": 1}},
        }
    )
    with pytest.raises(ConfigError) as ei:
        resolve_plugins(cfg, default_registry())
    paths = {i.path for i in ei.value.issues}
    assert "encoder.options.k_mx" in paths and "encoder.options.mode" in paths and "synthesizer.options.a" in paths
    msg = {i.path: i.message for i in ei.value.issues}
    assert msg["encoder.options.k_mx"] == "unknown field `k_mx`; did you mean `k_max`?"


def test_inline_json_is_a_config_everywhere_a_path_is(tmp_path):
    doc = '{"model": {"vocab_size": 99, "num_steps": 3}, "synthesizer": {"name": "one_hot"}}'
    (tmp_path / "a.toml").write_text('[model]\nvocab_size = 99\nnum_steps = 3\n[synthesizer]\nname = "one_hot"\n')
    (tmp_path / "a.json").write_text(doc)
    assert load_config(doc) == load_config(tmp_path / "a.toml") == load_config(tmp_path / "a.json")
    with pytest.raises(ConfigError) as ei:
        load_config('{"model": {"vocab_sise": 5}}')
    assert ei.value.path == "model.vocab_sise" and ei.value.source == "<inline JSON>"
    with pytest.raises(ConfigError, match=r"\(<inline JSON>\): invalid JSON: Expecting"):
        load_config('{"model": ')


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("deep.toml", "a = " + "[" * 5000 + "]" * 5000, "nesting deeper than 32 levels"),
        ("deep.yaml", "a: " + "[" * 5000 + "]" * 5000, "nesting deeper than 32 levels"),
        ("deep.json", '{"a": ' + "[" * 5000 + "]" * 5000 + "}", "nesting deeper than 32 levels"),
        ("indent.yaml", "".join(" " * i + f"k{i}:\n" for i in range(60)), "nesting deeper than 32 levels"),
        ("bigint.yaml", "model:\n  vocab_size: " + "1" * 5000 + "\n", "an integer has too many digits"),
        ("bigint.toml", "[model]\nvocab_size = " + "1" * 5000 + "\n", "an integer has too many digits"),
        ("huge.toml", "# " + "x" * (1 << 20) + "\n", "larger than 1048576 bytes"),
    ],
)
def test_hostile_documents_are_clean_errors(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message) as ei:
        load_config(tmp_path / name)
    assert ei.value.source == str(tmp_path / name)
    with pytest.raises(ConfigError, match="nesting deeper than 32 levels"):
        deep: list = [1]
        for _ in range(40):
            deep = [deep]
        parse_config({"ab": {"workload": {"options": {"x": deep}}}})


def test_every_public_error_derives_from_the_root():
    """One error root: every exception class the package defines is a PDMiddlewareError."""
    import importlib
    import inspect
    import pkgutil

    import pd_middleware
    from pd_middleware import PDMiddlewareError

    found = []
    for mod in pkgutil.walk_packages(pd_middleware.__path__, "pd_middleware."):
        module = importlib.import_module(mod.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found.append(obj)
    assert len(found) >= 8, found
    outside = [f"{c.__module__}.{c.__qualname__}" for c in found if not issubclass(c, PDMiddlewareError)]
    assert outside == []


def test_model_hidden_state_becomes_the_receivers_limit() -> None:
    """A hidden state written in [model] is what the receiver checks (issue 13, finding 6)."""
    cfg = parse_config({"model": {"hidden_size": 32, "hidden_dtype": "fp16"}})
    assert cfg.transport.limits.hidden_size == 32
    assert cfg.transport.limits.hidden_dtype == "fp16"
    # Negative control: an unwritten hidden_size is a default, not a check.
    assert parse_config({}).transport.limits.hidden_size == 0
    assert parse_config({}).transport.limits.hidden_dtype is None
    # The limits may restate it, never contradict it.
    same = parse_config({"model": {"hidden_size": 32}, "transport": {"limits": {"hidden_size": 32}}})
    assert same.transport.limits.hidden_size == 32
    with pytest.raises(ConfigError, match=r"model.hidden_size = 32 but transport.limits.hidden_size = 64") as ei:
        parse_config({"model": {"hidden_size": 32}, "transport": {"limits": {"hidden_size": 64}}})
    assert ei.value.path == "transport.limits.hidden_size"
