"""Plugin registry: validation at registration, entry points, module:attr paths."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from pd_middleware import PluginError, PluginSpec
from pd_middleware.config import parse_config, resolve_plugins
from pd_middleware.core.contracts import PluginContext
from pd_middleware.registry import PluginRegistry, default_registry


class GoodHook:
    def __init__(self, options, context):
        self.seen = []

    def on_receive(self, payload, context):
        self.seen.append(payload.request_id)


class Opts(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    level: int = 1


GOOD = PluginSpec(name="good", kind="hook", factory=GoodHook, options=Opts)


def test_register_and_get():
    reg = PluginRegistry()
    reg.register(GOOD)
    assert reg.get("hook", "good") is GOOD
    assert [i.name for i in reg.plugins()] == ["good"]


def test_duplicate_name_refused():
    reg = PluginRegistry()
    reg.register(GOOD, origin="first")
    other = PluginSpec(name="good", kind="hook", factory=GoodHook)
    with pytest.raises(PluginError, match="duplicate hook plugin 'good': already registered from first") as ei:
        reg.register(other, origin="second")
    assert ei.value.plugin == "good"
    reg.register(GOOD)  # the very same spec object again is a no-op


def test_bad_signatures_refused():
    class NoMethod:
        def __init__(self, options, context):
            pass

    class WrongArity:
        def __init__(self, options, context):
            pass

        def on_receive(self, payload):  # missing context
            pass

    reg = PluginRegistry()
    with pytest.raises(PluginError, match=r"hook plugin must define on_receive\('payload', 'context'\)"):
        reg.register(PluginSpec(name="a", kind="hook", factory=NoMethod))
    with pytest.raises(PluginError, match=r"cannot be called as on_receive\(payload, context\)"):
        reg.register(PluginSpec(name="b", kind="hook", factory=WrongArity))
    with pytest.raises(PluginError, match=r"factory must accept \(options, context\)"):
        reg.register(PluginSpec(name="c", kind="synthesizer", factory=lambda options: None))
    with pytest.raises(PluginError, match="unknown kind 'filter'"):
        reg.register(PluginSpec(name="d", kind="filter", factory=GoodHook))  # type: ignore[arg-type]
    with pytest.raises(PluginError, match="must be lowercase letters"):
        reg.register(PluginSpec(name="Bad-Name", kind="hook", factory=GoodHook))
    with pytest.raises(PluginError, match="not a PluginSpec"):
        reg.register(GoodHook)  # type: ignore[arg-type]

    class LooseOpts(msgspec.Struct):
        x: int = 0

    with pytest.raises(PluginError, match="forbid_unknown_fields=True"):
        reg.register(PluginSpec(name="e", kind="hook", factory=GoodHook, options=LooseOpts))


def test_built_object_checked_against_contract():
    """A factory function is checked when it builds: the object must honour the kind."""
    reg = PluginRegistry()
    spec = reg.register(PluginSpec(name="fn", kind="synthesizer", factory=lambda o, c: object()))
    ctx = PluginContext(vocab_size=10, num_steps=1, rejection_sampling=True)
    with pytest.raises(PluginError, match=r"must define synthesize\('payload',\)") as ei:
        reg.build(spec, None, ctx, key="synthesizer")
    assert ei.value.key == "synthesizer"


def test_unknown_plugin_names_the_config_key():
    reg = PluginRegistry()
    reg.register(GOOD)
    cfg = parse_config({"hooks": [{"name": "good"}, {"name": "nope"}], "synthesizer": {"name": "x"}})
    with pytest.raises(
        PluginError, match=r"config key hooks\[1\]\.name.*no hook plugin named 'nope'; registered: good"
    ) as ei:
        resolve_plugins(cfg, reg)
    assert ei.value.key == "hooks[1].name"


def test_module_attr_path(tmp_path, monkeypatch):
    pkg = tmp_path / "third_party_hooks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            from pd_middleware import PluginSpec
            class H:
                def __init__(self, options, context): pass
                def on_receive(self, payload, context): return None
            SPEC = PluginSpec(name="tp_hook", kind="hook", factory=H)
            NOT_A_SPEC = 42
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = PluginRegistry()
    spec = reg.resolve("hook", "third_party_hooks:SPEC", key="hooks[0].name")
    assert spec.name == "tp_hook"
    assert reg.resolve("hook", "third_party_hooks:SPEC") is spec  # idempotent
    with pytest.raises(PluginError, match="is a int, not a PluginSpec") as ei:
        reg.resolve("hook", "third_party_hooks:NOT_A_SPEC", key="hooks[0].name")
    assert ei.value.key == "hooks[0].name"
    with pytest.raises(PluginError, match="has no attribute 'MISSING'"):
        reg.resolve("hook", "third_party_hooks:MISSING")
    with pytest.raises(PluginError, match="cannot import 'no_such_module_xyz'"):
        reg.resolve("hook", "no_such_module_xyz:SPEC")
    with pytest.raises(PluginError, match="is a hook plugin, expected a synthesizer"):
        reg.resolve("synthesizer", "third_party_hooks:SPEC")
    # Only importable module names: no file paths, no code strings.
    for bad in ["/tmp/evil.py:SPEC", "os.system('x'):SPEC", "a b:C", "mod:attr:x", "../x:Y"]:
        with pytest.raises(PluginError, match="is not a 'package.module:attribute' reference"):
            reg.resolve("hook", bad)


def _install_fake_dist(root, dist_name, module, body, entry_lines):
    """Write a real (metadata-level) installed distribution under ``root``."""
    (root / module).mkdir()
    (root / module / "__init__.py").write_text(textwrap.dedent(body))
    info = root / f"{dist_name.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[pd_middleware.plugins]\n" + "\n".join(entry_lines) + "\n")


def test_entry_point_discovery_through_installed_distribution(tmp_path, monkeypatch):
    _install_fake_dist(
        tmp_path,
        "pdm-test-plugin",
        "pdm_test_plugin",
        """
        from pd_middleware import PluginSpec
        class H:
            def __init__(self, options, context): pass
            def on_receive(self, payload, context): return None
        HOOK = PluginSpec(name="ep_hook", kind="hook", factory=H, summary="from a dist")
        """,
        ["hook.ep_hook = pdm_test_plugin:HOOK"],
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = PluginRegistry()
    n = reg.load_entry_points()
    assert n >= 2  # ours plus at least the first-party one_hot
    info = {i.name: i for i in reg.plugins()}["ep_hook"]
    assert "pdm-test-plugin 1.2.3" in info.origin
    assert reg.load_entry_points() == 0, "loading twice registers nothing new"


def test_broken_entry_point_is_a_hard_error(tmp_path, monkeypatch):
    _install_fake_dist(tmp_path, "pdm-broken", "pdm_broken", "raise ImportError('boom')\n", ["hook.x = pdm_broken:X"])
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("pdm_broken", None)
    with pytest.raises(PluginError, match=r"cannot load entry point hook.x = pdm_broken:X .*ImportError: boom"):
        PluginRegistry().load_entry_points()


def test_first_party_plugins_come_only_through_entry_points():
    """The core never imports plugin modules by name: every one has an entry-point origin."""
    reg = default_registry()
    infos = reg.plugins()
    assert any(i.name == "one_hot" and i.kind == "synthesizer" for i in infos)
    for i in infos:
        assert i.origin.startswith("entry point "), i
    import pathlib

    import pd_middleware

    core = pathlib.Path(pd_middleware.__file__).parent
    for f in core.rglob("*.py"):
        text = f.read_text()
        assert "pd_middleware_plugins" not in text and "pd_middleware_full" not in text, f


def test_the_full_distribution_pair_ships_with_the_core():
    """One install runs the main job: ``full`` and ``full_distribution`` come with pd-middleware,
    still found through the entry-point group, like every plugin."""
    reg = default_registry()
    infos = {(i.kind, i.name): i for i in reg.plugins()}
    for key in (("synthesizer", "full_distribution"), ("encoder", "full")):
        assert key in infos, f"{key} is not registered: run `make setup`"
        assert infos[key].origin.startswith("entry point ") and "[pd-middleware " in infos[key].origin, infos[key]


def test_broken_entry_point_is_lazy_listed_and_only_breaks_its_users(tmp_path, monkeypatch):
    """An unrelated broken entry point never breaks a lookup; the one that uses it names it."""
    _install_fake_dist(
        tmp_path, "pdm-broken2", "pdm_broken2", "raise ImportError('boom2')\n", ["hook.broken = pdm_broken2:NOPE"]
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("pdm_broken2", None)
    reg = default_registry()
    assert reg.get("synthesizer", "one_hot").name == "one_hot"
    assert "pdm_broken2" not in sys.modules, "looking up one_hot imported an unrelated plugin"
    with pytest.raises(
        PluginError, match=r"cannot load entry point hook.broken = pdm_broken2:NOPE .*ImportError: boom2"
    ) as ei:
        reg.get("hook", "broken", key="hooks[0].name")
    assert ei.value.key == "hooks[0].name"
    names = {(i.kind, i.name) for i in reg.plugins()}
    assert ("synthesizer", "one_hot") in names and ("hook", "broken") not in names
    (b,) = [b for b in reg.broken() if "pdm_broken2" in b.entry_point]
    assert b.entry_point == "hook.broken = pdm_broken2:NOPE" and "boom2" in str(b.error)


def test_unknown_plugin_name_suggests_the_closest():
    with pytest.raises(PluginError, match=r"no synthesizer plugin named 'one_hto'; did you mean `one_hot`\?") as ei:
        default_registry().get("synthesizer", "one_hto", key="synthesizer.name")
    assert ei.value.key == "synthesizer.name"


def test_a_known_plugin_that_is_not_installed_names_its_distribution_and_the_pip_line():
    reg = PluginRegistry()  # nothing discovered: as if no distribution were installed
    with pytest.raises(PluginError) as exc:
        reg.get("synthesizer", "full_distribution", key="arms[1].synthesizer.name")
    assert exc.value.key == "arms[1].synthesizer.name"
    assert (
        "no synthesizer plugin named 'full_distribution'; registered: none; synthesizer 'full_distribution' comes "
        "with the distribution pd-middleware, which is not installed here: pip install pd-middleware"
    ) in str(exc.value)
    with pytest.raises(PluginError, match="comes with the distribution pd-middleware-example-plugin") as exc:
        reg.get("hook", "arm_tally")
    assert "pip install ./examples/pd-middleware-example-plugin" in str(exc.value)
    with pytest.raises(PluginError) as exc:  # a name nobody documents gets no install line
        reg.get("hook", "no_such_hook")
    assert "comes with" not in str(exc.value) and "pip install" not in str(exc.value)


def test_known_plugins_match_the_entry_points_their_distributions_declare():
    import tomllib

    from pd_middleware.registry import KNOWN_PLUGINS

    root = Path(__file__).resolve().parent.parent
    for dist, pyproject in (
        ("pd-middleware", root / "pyproject.toml"),
        ("pd-middleware-example-plugin", root / "examples" / "pd-middleware-example-plugin" / "pyproject.toml"),
    ):
        eps = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["pd_middleware.plugins"]
        declared = {tuple(k.split(".", 1)) for k in eps}
        known = {key for key, (d, _) in KNOWN_PLUGINS.items() if d == dist}
        assert declared == known, f"{dist}: entry points {sorted(declared)} vs KNOWN_PLUGINS {sorted(known)}"
