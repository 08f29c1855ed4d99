"""The versioned table: which rows each SGLang release gets, what it refuses, and what the CLI says.

No SGLang here: the selection is the table's (``patching``), the install runs on stand-in
modules (``tests/test_sglang.py``'s, shaped like each release's builder), and the CLI reads
only package metadata or ``--release``. The real releases are in
``tests/test_sglang_releases.py``.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pd_middleware import PluginError
from pd_middleware.cli import main
from pd_middleware.config import parse_config
from pd_middleware.config_loader import read_document
from pd_middleware.core._errors import ExactnessError
from pd_middleware.integrations import sglang as S
from pd_middleware.integrations.sglang.patching import (
    FEATURES,
    RELEASES,
    Plan,
    SGLangModules,
    parse_version,
    release_table_markdown,
)
from pd_middleware.integrations.sglang.releases import configs_for, release_report

pytestmark = pytest.mark.usefixtures("sglang_uninstall")  # conftest: no installation outlives a test

V = 11
OLD = ("0.5.18", "0.5.19", "0.5.20", "0.5.21")


def rows(feature: str, version: str) -> dict[str, tuple[str, ...] | None]:
    """{attr: params} of a feature's rows for ``version``."""
    return {t.attr: t.params for t in FEATURES[feature].targets_for(parse_version(version))}


def test_versions_parse_as_numbers_not_strings() -> None:
    assert parse_version("0.5.9") < parse_version("0.5.18") < parse_version("0.5.23") < parse_version("0.6")
    assert parse_version("0.5.21.post1") == parse_version("0.5.21rc2") == (0, 5, 21)
    assert S.SUPPORTED_SGLANG_VERSIONS == ("0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
    with pytest.raises(ValueError, match="not a version"):
        parse_version("latest")


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_selects_the_rows_its_sglang_has(version) -> None:
    old, r22 = version in OLD, version == "0.5.22"
    decode = rows("decode", version)
    # The builder's proposal: SGLang's hook from 0.5.22, the draft input's construction before.
    assert ("pd_first_draft_proposal" in decode) is not old and ("EagleDraftInput" in decode) is old
    rec = rows("recompute", version)
    seeded = ("probs", "num_samples", "sampling_seed", "positions", "draft_step")
    assert rec["fast_sample"] == (("probs", "num_samples") if old or r22 else seeded)
    want_ctx = {"0.5.21": ("tp_group", "owns_attention"), "0.5.22": ("owns_attention",), "0.5.23": ("layout",)}
    assert rec["draft_tp_context"] == want_ctx.get(version, ("tp_group",))
    assert ("EagleDraftWorker.parallel_layout" in rec) is (version == "0.5.23")
    assert rec["LogitsProcessor._compute_lm_head"][-1] == ("out" if version == "0.5.23" else "embedding_bias")
    assert rec["LogitsProcessor._copy_logits_to_buffer"][-1] == ("use_buffer" if old else "softcap")
    chain = rows("chain", version)
    assert len(chain["sample_draft_proposal"]) == (
        2 if version in OLD[:3] else 3 if version in ("0.5.21", "0.5.22") else 6
    )
    assert chain["MultiLayerEagleDraftWorker._draft_extend_for_prefill"][-1] == (
        "next_token_ids" if old else "kv_loc_plan"
    )
    # One row per target per release.
    for f in FEATURES.values():
        paths = [t.path for t in f.targets_for(parse_version(version)) if not t.instance]
        assert len(paths) == len(set(paths)), (f.name, version)


def test_features_refused_by_release_with_their_line() -> None:
    want = {
        "draft_kv": {"0.5.23"},
    }
    for name, f in FEATURES.items():
        have = {v for v in RELEASES if f.refusal(parse_version(v)) is None}
        assert have == want.get(name, set(RELEASES)), name
    line = FEATURES["draft_kv"].refusal(parse_version("0.5.22")).line("0.5.22", "draft_kv")
    assert line.startswith("SGLang 0.5.22: feature 'draft_kv' is not available") and 'draft_kv = "first_step"' in line
    assert "\n" not in line


def cfg(**sglang):
    return parse_config(
        {"model": {"vocab_size": V, "num_steps": 1}, "transport": {"mooncake": {"enabled": False}}, "sglang": sglang}
    )


OLD_BUILDER = """
import torch

class EagleDraftInput:  # SGLang's dataclass: draft_probs defaults to None
    def __init__(self, topk_p=None, topk_index=None, draft_probs=None, hidden_states=None):
        self.topk_p, self.topk_index, self.draft_probs = topk_p, topk_index, draft_probs

def get_spec():
    return SPEC

def build_eagle_disagg_draft_input(batch, last_tokens_tensor, future_map):
    spec = get_spec()
    n = spec.speculative_num_steps if spec.enable_multi_layer_eagle else 1
    topk_index = torch.stack([torch.as_tensor(r.output_topk_index[:n], dtype=torch.int64) for r in batch.reqs])
    return EagleDraftInput(topk_p=torch.ones_like(topk_index, dtype=torch.float32), topk_index=topk_index)
"""


def old_builder(name="fake_sglang_ed_old"):
    """A module shaped like SGLang 0.5.18-0.5.21's eagle_disaggregation: its builder constructs
    the module-global ``EagleDraftInput`` and never sets ``draft_probs``; it reads the
    module-global ``get_spec`` (defined in the module, so the builder's globals are the module's)."""
    m = types.ModuleType(name)
    m.SPEC = SimpleNamespace(
        speculative_use_rejection_sampling=True, enable_multi_layer_eagle=False, speculative_num_steps=1
    )
    exec(OLD_BUILDER, m.__dict__)
    return m


def batch(chains):
    reqs = [
        SimpleNamespace(output_topk_index=list(c), output_topk_p=[1.0] * len(c), bootstrap_room=None) for c in chains
    ]
    return SimpleNamespace(reqs=reqs, device="cpu", model_config=SimpleNamespace(vocab_size=V), enable_overlap=False)


def install_old(m, version="0.5.21", **kw):
    return S.install(
        cfg(draft_kv="first_step"),
        S.InstallOptions(
            channel="sidechannel",
            modules=SGLangModules(builder=m, only_given=True),
            version=version,
            hook_scheduler=False,
            **kw,
        ),
    )


@pytest.mark.parametrize("version", OLD)
def test_old_builder_gets_the_proposal_at_construction(version) -> None:
    m = old_builder()
    cls = m.EagleDraftInput
    # Negative control: the stock builder leaves draft_probs None, and the draft step's stack raises.
    stock = m.build_eagle_disagg_draft_input(batch([[3], [4]]), None, None)
    assert stock.draft_probs is None
    with pytest.raises(TypeError, match="expected Tensor as element 0"):
        torch.stack([stock.draft_probs])
    inst = install_old(m, version)
    assert m.EagleDraftInput is not cls and {p.target.attr for p in inst.patches} == {
        "build_eagle_disagg_draft_input",
        "EagleDraftInput",
    }
    got = m.build_eagle_disagg_draft_input(batch([[3], [4]]), None, None)
    assert type(got) is cls  # SGLang's own class, built with the proposal
    assert torch.equal(got.draft_probs, torch.nn.functional.one_hot(torch.tensor([3, 4]), V).float())
    # A chain: (b, S, V).
    m.SPEC.enable_multi_layer_eagle, m.SPEC.speculative_num_steps = True, 3
    got = m.build_eagle_disagg_draft_input(batch([[1, 2, 3]]), None, None)
    assert tuple(got.draft_probs.shape) == (1, 3, V) and torch.equal(
        got.draft_probs[0].argmax(-1), torch.tensor([1, 2, 3])
    )
    # Without rejection sampling no proposal (a greedy verify), as 0.5.22's builder.
    m.SPEC.speculative_use_rejection_sampling = False
    assert m.build_eagle_disagg_draft_input(batch([[1, 2, 3]]), None, None).draft_probs is None
    # Outside the builder the class is SGLang's, unchanged.
    assert m.EagleDraftInput(topk_index=torch.tensor([[1]])).draft_probs is None
    assert S.uninstall() and m.EagleDraftInput is cls


def test_a_source_failure_on_an_old_builder_gives_a_counted_one_hot(monkeypatch) -> None:
    m = old_builder()
    inst = install_old(m)

    def boom(*a):
        raise RuntimeError("source down")

    monkeypatch.setattr(inst.source, "propose", boom)
    got = m.build_eagle_disagg_draft_input(batch([[5]]), None, None)
    assert torch.equal(got.draft_probs, torch.nn.functional.one_hot(torch.tensor([5]), V).float())
    assert inst.guard.counts == {"guard:propose:RuntimeError": 1}


def foreign_wrapper(m):
    """Another plugin's wrapper around ``m``'s builder, defined in a module of its own: the
    builder the drop-in wraps then has globals without SGLang's ``get_spec``, so the drop-in
    cannot read the builder's settings (``Building.read_spec`` is None)."""
    ns = {"inner": m.build_eagle_disagg_draft_input}
    exec(
        "def build_eagle_disagg_draft_input(batch, last_tokens_tensor, future_map):\n"
        "    return inner(batch, last_tokens_tensor, future_map)\n",
        ns,
    )
    m.build_eagle_disagg_draft_input = ns["build_eagle_disagg_draft_input"]
    return m


def started(inst, steps=1, rejection_sampling=True):
    """What the scheduler's start read (``Installation.activate``'s facts), without a scheduler."""
    inst.facts = S.EngineFacts(
        role="decode",
        vocab_size=V,
        num_steps=steps,
        algorithm="EAGLE",
        topk=1,
        rejection_sampling=rejection_sampling,
    )
    return inst


def one_hot(chains):
    return torch.nn.functional.one_hot(torch.tensor(chains), V).float()


@pytest.mark.parametrize("version", OLD)
def test_an_unreadable_spec_still_gives_the_draft_input_the_one_hot(version) -> None:
    """Issue 45 item 3: where the builder's settings cannot be read, the old builder's draft
    input got no proposal (the seed's TypeError on the eager path, a stale proposal under
    graph replay). It gets the one-hot at X, shaped by the start's facts, counted."""
    m = foreign_wrapper(old_builder())
    inst = started(install_old(m, version))
    got = m.build_eagle_disagg_draft_input(batch([[3], [4]]), None, None)
    assert got.draft_probs is not None, "no proposal: the first draft step's stack raises"
    assert torch.equal(got.draft_probs, one_hot([3, 4]))  # (b, V)
    assert inst.guard.counts == {"guard:draft_input:TypeError": 1}
    # A chain: (b, S, V), S from the start's facts.
    m.SPEC.enable_multi_layer_eagle, m.SPEC.speculative_num_steps = True, 3
    started(inst, steps=3)
    got = m.build_eagle_disagg_draft_input(batch([[1, 2, 3], [4, 5, 6]]), None, None)
    assert torch.equal(got.draft_probs, one_hot([[1, 2, 3], [4, 5, 6]]))


def test_an_unreadable_batch_vocab_takes_the_starts() -> None:
    # 0.5.18-0.5.20's builder reads no model config: a batch without one fails only our read.
    m = old_builder()
    inst = started(install_old(m, "0.5.20"))
    b = batch([[7]])
    del b.model_config
    got = m.build_eagle_disagg_draft_input(b, None, None)
    assert torch.equal(got.draft_probs, one_hot([7]))
    assert inst.guard.counts == {"guard:draft_input:AttributeError": 1}


def test_an_unreadable_spec_before_the_start_shapes_by_the_batch() -> None:
    # No start read (an installation never activated): V is the batch's, a chain is n > 1,
    # and the one-hot is attached although rejection sampling is unknown (exact for any rule;
    # a greedy verify does not read it).
    m = foreign_wrapper(old_builder())
    inst = install_old(m)
    assert inst.facts is None
    assert torch.equal(m.build_eagle_disagg_draft_input(batch([[5]]), None, None).draft_probs, one_hot([5]))
    m.SPEC.enable_multi_layer_eagle, m.SPEC.speculative_num_steps = True, 2
    assert torch.equal(m.build_eagle_disagg_draft_input(batch([[5, 6]]), None, None).draft_probs, one_hot([[5, 6]]))
    # Nothing to read V from: refused, never a draft input without a proposal.
    b = batch([[5, 6]])
    del b.model_config
    with pytest.raises(ExactnessError, match="cannot shape the first draft input's proposal") as e:
        m.build_eagle_disagg_draft_input(b, None, None)
    assert e.value.reason == "draft_input_unshaped"


def test_an_unreadable_spec_with_rejection_sampling_off_at_the_start_sets_none() -> None:
    m = foreign_wrapper(old_builder())
    started(install_old(m), rejection_sampling=False)
    assert m.build_eagle_disagg_draft_input(batch([[5]]), None, None).draft_probs is None


def test_a_refused_feature_refuses_the_install_whole() -> None:
    m = old_builder()
    build, cls = m.build_eagle_disagg_draft_input, m.EagleDraftInput
    for version in ("0.5.21", "0.5.22"):
        with pytest.raises(PluginError) as e:
            S.install(
                cfg(draft_kv="all_steps"),
                S.InstallOptions(
                    channel="sidechannel",
                    modules=SGLangModules(builder=m, only_given=True),
                    version=version,
                    hook_scheduler=False,
                ),
            )
        assert f"SGLang {version}: feature 'draft_kv' is not available" in e.value.detail
        assert m.build_eagle_disagg_draft_input is build and m.EagleDraftInput is cls and S.current() is None
    assert S.current() is None


def test_allow_unsupported_names_every_mismatch_and_patches_nothing() -> None:
    # A release newer than the table, on the newest rows: two changed targets, both named.
    m = types.ModuleType("fake_sglang_ed_new")
    exec("def build_eagle_disagg_draft_input(batch, last_tokens_tensor, future_map, extra=None): pass", m.__dict__)
    build = m.build_eagle_disagg_draft_input
    with pytest.raises(PluginError, match="not a supported version"):
        install_old(m, "0.6.0")
    with pytest.raises(PluginError) as e:
        install_old(m, "0.6.0", allow_unsupported=True)
    lines = e.value.detail.splitlines()
    assert len(lines) == 2
    assert "build_eagle_disagg_draft_input has parameters" in lines[0] and "'extra'" in lines[0]
    assert "pd_first_draft_proposal not found" in lines[1]
    assert m.build_eagle_disagg_draft_input is build and S.current() is None


def test_older_than_the_table_is_refused_even_when_allowed() -> None:
    for allow in (False, True):
        problem = S.version_problem("0.5.17", allow_unsupported=allow)
        assert problem is not None and problem.startswith(
            "SGLang 0.5.17 is older than the oldest supported release 0.5.18"
        )
    assert S.version_problem("0.5.23") is None and S.version_problem("0.6.0", allow_unsupported=True) is None
    assert "rows of 0.5.21" in S.version_problem("0.5.21.post1")


def test_plan_takes_the_newest_rows_past_the_table() -> None:
    assert Plan(frozenset(), None, None, "0.7.1").release == parse_version("0.5.23")
    assert Plan(frozenset(), None, None, "0.5.19").release == parse_version("0.5.19")


# ----------------------------------------------------------------- docs and CLI


def test_docs_release_table_is_the_codes() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "sglang.md").read_text(encoding="utf-8")
    (shown,) = re.findall(r"<!-- releases:start -->\n(.*?)\n<!-- releases:end -->", page, re.S)
    assert shown == release_table_markdown()
    assert shown.replace("| no |", "| yes |", 1) != release_table_markdown()  # negative control


@pytest.mark.parametrize("version", RELEASES)
def test_cli_prints_each_release(version, capsys) -> None:
    assert main(["sglang", "--release", version]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"SGLang {version} (--release): supported")
    for name, f in FEATURES.items():
        r = f.refusal(parse_version(version))
        assert (f"refused: {r.line(version, name)}" if r else f"{name}") in out
    if version in OLD:
        assert "EagleDraftInput (0.5.18-0.5.21)" in out and "never None" in out
    # The metadata channel's inline-step rows, named with their class (not a bare "__init__").
    inline = "DecodeTransferQueue.__init__ (0.5.18-0.5.22), ReqToMetadataIdxAllocator.free (0.5.18-0.5.22)"
    assert (inline in out) is (version != "0.5.23"), out
    assert main(["sglang", "--release", version, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep == {**release_report(version), "source": "--release", "supported": True}
    assert rep["features"]["draft_kv"]["available"] is (version == "0.5.23")


def test_cli_reads_the_installed_release_without_importing_sglang(capsys, monkeypatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.5.20" if dist == "sglang" else "0")
    before = {m for m in sys.modules if m == "sglang" or m.startswith("sglang.")}
    assert main(["sglang"]) == 0
    assert capsys.readouterr().out.startswith("SGLang 0.5.20 (installed): supported")
    assert {m for m in sys.modules if m == "sglang" or m.startswith("sglang.")} == before


def test_cli_refuses_with_one_line(capsys, monkeypatch) -> None:
    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert main(["sglang"]) == 2
    err = capsys.readouterr().err
    assert "SGLang is not installed here" in err and "--release X.Y.Z" in err and len(err.strip().splitlines()) == 1
    assert main(["sglang", "--release", "0.5.17"]) == 2
    assert "older than the oldest supported release 0.5.18" in capsys.readouterr().err
    assert main(["sglang", "--release", "0.6.0"]) == 2
    assert "PD_MIDDLEWARE_ALLOW_UNSUPPORTED_SGLANG" in capsys.readouterr().err
    assert main(["sglang", "--release", "0.6.0", "--allow-unsupported"]) == 0
    assert "not in the table: tried on the rows of 0.5.23" in capsys.readouterr().out


# ------------------------------------------------------- the config each release is told to run

DECODE_ONLY = "configs/sglang.toml on the decode only (decode-only recompute; the prefill runs stock SGLang)"
CHAIN_INBAND = (
    'configs/multi_layer.yaml on both nodes (the shipped chain in SGLang\'s PD metadata, draft_kv = "all_steps")'
)
CHAIN_SIDECHANNEL = (
    'configs/multi_layer.yaml on both nodes with [sglang] channel = "sidechannel" and draft_kv = "first_step" '
    "(PD_MIDDLEWARE_DECODE_ADDRESS on the prefill): this release's metadata path cannot carry the chain"
)
BEHIND_STOCK = "; behind a stock prefill: configs/sglang.toml on the decode only (an exact one-hot chain)"
CHAIN_INBAND_FIRST_STEP = (
    "configs/multi_layer.yaml on both nodes (the shipped chain in SGLang's PD metadata; draft_kv left out "
    'is "first_step" on this release: the first step\'s draft KV, as SGLang transfers it)'
)
CHAIN_BY_RELEASE = {**dict.fromkeys(RELEASES[:-1], CHAIN_INBAND_FIRST_STEP), "0.5.23": CHAIN_INBAND}


def configs_printed(out: str) -> list[str]:
    """The lines of the CLI's "config per draft kind" block."""
    (block,) = re.findall(r"\nconfig per draft kind:\n(.*?)\n\n", out, re.S)
    return block.splitlines()


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_is_told_exactly_which_config_to_run(version, capsys) -> None:
    """Issue 45 item 4: the config recommended per release and per draft kind, pinned. The
    surviving mutant (``configs_for`` testing a feature's presence, ``available.get(...) is not
    None``, instead of its availability) told every release to run the in-band chain with
    ``draft_kv = "all_steps"``, refused before 0.5.23; the CLI test passed on it because its
    text also appears in the refusal lines."""
    want = {
        "single-layer EAGLE/EAGLE3": DECODE_ONLY,
        "DeepSeek NextN": DECODE_ONLY,
        "multi-layer MTP chain": CHAIN_BY_RELEASE[version] + BEHIND_STOCK,
    }
    assert release_report(version)["configs"] == want
    assert main(["sglang", "--release", version]) == 0
    assert configs_printed(capsys.readouterr().out) == [f"  {kind}: {text}" for kind, text in want.items()]


def test_configs_follow_availability_not_presence() -> None:
    # Every feature present in the dict, some refused: presence says nothing.
    every = dict.fromkeys(FEATURES, True)
    refused = {**every, "metadata": False, "draft_kv": False}
    assert configs_for(every)["multi-layer MTP chain"].startswith(CHAIN_INBAND)
    assert configs_for(refused)["multi-layer MTP chain"].startswith(CHAIN_SIDECHANNEL)
    assert configs_for({**every, "draft_kv": False})["multi-layer MTP chain"].startswith(CHAIN_INBAND_FIRST_STEP)
    assert configs_for({**refused, "chain": False})["multi-layer MTP chain"].startswith(
        "no shipped chain on this release"
    )


ROOT = Path(__file__).resolve().parents[1]


def recommended(text: str) -> list[tuple[str, dict[str, str]]]:
    """Each config a recommendation names, with the [sglang] keys it says to set: "a.toml ...
    with [sglang] channel = "x" and draft_kv = "y" ...; behind a stock prefill: b.toml ..." """
    out = []
    for alternative in text.split("; behind a stock prefill: "):
        (path,) = re.findall(r"\bconfigs/\S+\.(?:toml|yaml)\b", alternative)
        keys = dict(re.findall(r'\b(channel|draft_kv) = "(\w+)"', alternative))
        out.append((path, keys))
    return out


@pytest.mark.parametrize("version", RELEASES)
def test_every_recommended_config_installs_on_its_release(version) -> None:
    """Whatever the texts become: each config the CLI recommends for a release, with the keys
    it says to set, installs there (no wanted feature refused). Under the mutant above the
    in-band chain is recommended on 0.5.18-0.5.22 and its install is refused."""
    m = old_builder(f"fake_sglang_ed_{version.replace('.', '_')}")
    if version not in OLD:  # 0.5.22 on: SGLang's builder asks its proposal hook
        exec("def pd_first_draft_proposal(topk_index, vocab_size): pass", m.__dict__)
    for kind, text in release_report(version)["configs"].items():
        for path, keys in recommended(text):
            data, _ = read_document(ROOT / path)
            data.setdefault("sglang", {}).update(keys)
            try:
                S.install(
                    parse_config(data),
                    S.InstallOptions(
                        modules=SGLangModules(builder=m, only_given=True), version=version, hook_scheduler=False
                    ),
                )
            except PluginError as exc:
                pytest.fail(f"SGLang {version}, {kind}: {path} with {keys} is refused: {exc.detail}")
            assert S.uninstall()


@pytest.mark.parametrize("version", RELEASES)
def test_each_release_says_which_sampler_draws_recompute_x(version, capsys) -> None:
    """Issue 45 item 3: up to 0.5.22 SGLang's fast_sample takes no seed and the drop-in draws X'
    with its own seeded inverse-CDF draw (recompute_capture.py's ``_unseeded``); from 0.5.23 SGLang's
    seeded fast_sample draws it. Under the overlap scheduler at TP > 1 the head runs on the
    forward stream on every release (nothing refused there)."""
    seeded = version == "0.5.23"
    assert main(["sglang", "--release", version]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.lstrip().startswith("recompute ")]
    # The feature's line names no sampler (it is the same on every release); the next says which.
    summary = line.split("supported: ", 1)[1].split(" [", 1)[0]  # the rows' list follows in brackets
    assert "a seeded rank-agreed draw of X'" in summary and "SGLang's seeded" not in summary, summary
    if seeded:
        assert "  X' drawn by: SGLang's seeded fast_sample(q', sampling_seed, positions)" in out
    else:
        assert "X' drawn by: the drop-in's seeded inverse-CDF draw" in out
        assert "this release's fast_sample takes no seed" in out
        assert "SGLang's seeded" not in out
    (overlap,) = [ln for ln in out.splitlines() if ln.startswith("  under the overlap scheduler: ")]
    assert "DeepSeek NextN included" in overlap and "issued on the scheduler's forward stream" in overlap
    assert "refused" not in overlap
    rep = release_report(version)["recompute"]
    assert f"  X' drawn by: {rep['draw']}" in out and overlap == f"  under the overlap scheduler: {rep['overlap']}"
