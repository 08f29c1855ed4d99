"""Config strictness: unknown keys and bad values name the full key path."""

from __future__ import annotations

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
        ({"model": {"vocab_sise": 5}}, "model", "unknown field `vocab_sise`"),
        ({"model": {"vocab_size": 0}}, "model.vocab_size", r"must be in \[1, 16777216\]"),
        ({"model": {"vocab_size": "10"}}, "model.vocab_size", "Expected `int \\| null`, got `str`"),
        ({"model": {"num_steps": True}}, "model.num_steps", "Expected `int \\| null`, got `bool`"),
        ({"model": {"hidden_dtype": "int8"}}, "model.hidden_dtype", "Invalid enum value 'int8'"),
        ({"decode": {"rejection_sampling": "yes"}}, "decode.rejection_sampling", "Expected `bool`"),
        ({"decode": {"device": "tpu"}}, "decode.device", "must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"decode": {"max_batch": 0}}, "decode.max_batch", r"must be in \[1, 65536\]"),
        ({"hooks": [{"name": "a"}, {"nam": "b"}]}, "hooks[1]", "unknown field `nam`"),
        ({"synthesizer": {"name": "x", "option": {}}}, "synthesizer", "unknown field `option`"),
        ({"arms": [{"name": "a", "synthesizer": {"name": "one_hot"}, "weight": -2}]}, "arms[0].weight", "must be in"),
        (
            {"arms": [{"name": "a", "synthesizer": {"name": "x"}}, {"name": "a", "synthesizer": {"name": "y"}}]},
            "arms[1].name",
            "duplicate arm name 'a'",
        ),
        ({"ab": {"later_acceptance": 1.5}}, "ab.later_acceptance", r"must be in \[0, 1\)"),
    ],
)
def test_errors_name_the_key_path(data, path, message):
    with pytest.raises(ConfigError, match=message) as ei:
        parse_config(data)
    assert ei.value.path == path
    if path:
        assert f"at {path}" in str(ei.value)


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
    with pytest.raises(ConfigError, match="unsupported extension '.json'"):
        load_config(tmp_path / "x.json")
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
    assert ei.value.path == "model" and "deep.yaml" in str(ei.value) and "`extra`" in str(ei.value)


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
