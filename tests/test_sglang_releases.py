"""The drop-in against every SGLang release of its table, each real release in a process of its own.

For each release folder present (``$PDM_SGLANG_RELEASES/<version>/``, default
``.venv-releases/`` in the repository: one ``pip install --target`` folder per release,
put first on ``PYTHONPATH``; the venv's own SGLang for 0.5.23 when no folder holds it),
``tests/_sglang_release_check.py`` runs in a subprocess (one SGLang per process) and
reports: every row the table selects for that release resolved against the real modules
(present, unpatched, that row's parameters: ``table_vs_versions`` by the real import);
the decode-only default (``configs/sglang.toml``) with SGLang's real EAGLE3 draft head at
TP 1 through the real builder, and with its real DeepSeek-V3 NextN draft (MLA, MoE; the
shipped hidden state after ``shared_head.norm``: q' is SGLang's own draft distribution bit
for bit, the pre-norm state and the other head convention give another law); the chain's per-step draw on the release's own
``sample_draft_proposal``; and SGLang's real PD first-draft builder with the drop-in installed, through the real
``FutureMap`` stash and resolve (the overlap scheduler's relay; stand-ins only for its
two CUDA-only calls, said there). Negative control: the same builder without the
drop-in leaves ``draft_probs`` None up to 0.5.21, and SGLang's first draft step
(``torch.stack([draft_probs])``) raises the seed's TypeError on it.

The subprocesses start together (the SGLang import dominates; they overlap on two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pd_middleware.integrations.sglang import SUPPORTED_SGLANG_VERSIONS
from pd_middleware.integrations.sglang.patching import FEATURES, parse_version

pytestmark = [pytest.mark.sglang]

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "_sglang_release_check.py"
V = 13  # the check's vocabulary
ENV_RELEASES = "PDM_SGLANG_RELEASES"


def releases_dir() -> Path:
    return Path(os.environ.get(ENV_RELEASES) or ROOT / ".venv-releases")


def _venv_release() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def _command(version: str) -> tuple[list[str], dict[str, str]] | None:
    folder = releases_dir() / version
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if (folder / "sglang").is_dir():
        env["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT)])
    elif _venv_release() == version:
        env["PYTHONPATH"] = str(ROOT)
    else:
        return None
    return [sys.executable, str(CHECK)], env


_RUNS: dict[str, Any] = {}


def _start_all() -> None:
    if _RUNS:
        return
    for v in SUPPORTED_SGLANG_VERSIONS:
        cmd = _command(v)
        _RUNS[v] = (
            None
            if cmd is None
            else subprocess.Popen(
                cmd[0], env=cmd[1], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )


def report(version: str) -> dict[str, Any]:
    _start_all()
    proc = _RUNS[version]
    if proc is None:
        pytest.skip(f"SGLang {version}: no release folder {releases_dir() / version} (set {ENV_RELEASES})")
    if isinstance(proc, dict):
        return proc
    out, err = proc.communicate(timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("PDM-RELEASE-CHECK ")]
    assert proc.returncode == 0 and lines, f"SGLang {version}'s check failed:\n{err[-4000:]}"
    got: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    _RUNS[version] = got
    return got


def one_hot(chains: list[list[int]]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(chains), V).float()


@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_every_row_of_the_release_resolves_against_its_real_modules(version) -> None:
    got = report(version)
    assert got["version"] == version
    folder = releases_dir() / version
    if (folder / "sglang").is_dir():
        assert Path(got["file"]).is_relative_to(folder.resolve()), got["file"]  # that release, not the venv's
    release = parse_version(version)
    want = {
        f"{f.name} {t.path} {t.span}"
        for f in FEATURES.values()
        if f.refusal(release) is None
        for t in f.targets_for(release)
    }
    assert set(got["rows"]) == want
    bad = {k: v for k, v in got["rows"].items() if v != "ok"}
    assert not bad, f"SGLang {version}: {bad}"


@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_the_proposal_survives_the_real_builder_and_relay(version) -> None:
    relay = report(version)["relay"]
    single, multi, shipped = relay["recompute_single"], relay["recompute_multi"], relay["shipped_single"]
    # Decode-only recompute without a scheduler binds no draft head: the one-hot at the
    # builder's X, shaped as the verify reads it: (b, V) single-layer, (b, S, V) a chain.
    assert torch.equal(torch.tensor(single["built"]), one_hot(single["chains"])[:, 0])
    assert torch.equal(torch.tensor(multi["built"]), one_hot(multi["chains"]))
    # A shipped law (the side channel's store): the store's sparse law, not a one-hot.
    want = torch.zeros(2, V)
    for i, x in enumerate([3, 4]):
        want[i, x], want[i, (x + 5) % V] = 0.75, 0.25
    assert torch.equal(torch.tensor(shipped["built"]), want)
    for case in (single, multi, shipped):  # what the next iteration's draft step reads
        assert case["relayed"] == case["built"]


@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_an_unreadable_spec_still_gives_the_real_builder_a_proposal(version) -> None:
    """Issue 45 item 3: the builder's settings unreadable (another plugin's wrapper around the
    builder): up to 0.5.21 the drop-in's EagleDraftInput row gave SGLang's draft input no
    proposal (the seed's TypeError, a stale proposal under graph replay); now the one-hot at
    X, (b, V) and (b, S, V), through the real relay, counted."""
    relay = report(version)["relay"]
    single, multi = relay["unread_spec_single"], relay["unread_spec_multi"]
    assert single["built"] is not None and multi["built"] is not None
    assert torch.equal(torch.tensor(single["built"]), one_hot(single["chains"])[:, 0])
    assert torch.equal(torch.tensor(multi["built"]), one_hot(multi["chains"]))
    for case in (single, multi):
        assert case["relayed"] == case["built"]
        old = parse_version(version) <= parse_version("0.5.21")
        assert case["guard"].get("guard:draft_input:TypeError", 0) == (1 if old else 0), case["guard"]


@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_negative_control_the_stock_builder(version) -> None:
    stock, chain = report(version)["relay"]["stock"], report(version)["relay"]["stock_multi"]
    if parse_version(version) <= parse_version("0.5.21"):
        # The seed's failure: no proposal, and the first draft step's stack raises; a chain's
        # verify gets None too (SGLang raises "Rejection sampling requires a target-vocab
        # draft proposal" on it).
        assert stock["built"] is None and chain["built"] is None
        assert stock["draft_step"].startswith("TypeError: expected Tensor as element 0")
    else:  # 0.5.22 on: SGLang's own one-hot at X, (b, V) and (b, S, V)
        assert torch.equal(torch.tensor(stock["built"]), one_hot(stock["chains"])[:, 0])
        assert torch.equal(torch.tensor(chain["built"]), one_hot(chain["chains"]))
        assert stock["draft_step"] == "ok"


@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_the_decode_only_default_recomputes_with_the_real_head(version) -> None:
    head = report(version)["recompute_head"]
    # q' is softmax(head(h) / T) of the model's own LogitsProcessor, for every request.
    assert head["counts"]["recomputed"] == 4 and head["shape"] == [4, V]
    assert head["q_max_abs_diff"] <= 1e-6 and head["x_redrawn"]
    if parse_version(version) < parse_version("0.5.23"):
        # fast_sample has no seed there: the row hands the drop-in's seeded inverse-CDF draw.
        assert head["sampler"] == "pd_middleware.inverse_cdf" and head["x_is_the_draw"]


@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_the_decode_only_default_recomputes_with_the_real_deepseek_nextn_head(version) -> None:
    nextn = report(version)["nextn_head"]
    # The release's real NextN draft, served by the head the installation bound (this
    # release's symbols): its logits are the draft's LogitsProcessor's, bit for bit, and q'
    # is SGLang's own renorm_draft_probs of them at fp32, for every request.
    assert nextn["arch"] == nextn["head"] == "DeepseekV3ForCausalLMNextN"
    assert nextn["head_logits_equal"] and nextn["shipped_is_normed"]
    assert nextn["counts"]["recomputed"] == 3 and not any(k.startswith("fallback:") for k in nextn["counts"])
    assert nextn["dtype"] == "torch.float32" and nextn["shape"] == [3, 97]
    assert nextn["q_equal"] and nextn["q_max_abs_diff"] == 0.0
    # Negative controls: the wrong hidden state (the pre-norm residual sum) and the wrong
    # convention (norm again at the decode) are served too, silently, with another law
    # (every row's TV above 0.5 on every release, seen).
    assert nextn["pre_norm_recomputed"] == 3
    assert nextn["pre_norm_tv_min"] > 0.1 and nextn["eagle3_convention_tv_min"] > 0.1


@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_the_chain_draws_every_step_from_the_encoder_on_the_releases_sampler(version) -> None:
    chain = report(version)["chain"]
    # The release's own parameters (no draft step before 0.5.23: the chain counts its steps).
    assert ("draft_step" in chain["params"]) is (version == "0.5.23")
    assert chain["steps"] == 3 and not chain["broken"] and chain["failures"] == []
    # Each row's shipped chain is the X the prefill fed to the next step.
    assert chain["payload_tokens"] == [list(col) for col in zip(*chain["xs"], strict=True)]


@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_the_metadata_channels_registration_peer_check_and_slot_reset_on_the_real_release(version) -> None:
    """Issue 45 item 1 (``tests/_sglang_release_inband.py``, the release's real receiver, zmq,
    parser, queue and allocator). Before 0.5.23 the decode's registration is SGLang's inline
    one, and SGLang lists every aux buffer (the negative control), which a stock prefill's
    ``send_aux`` walks with its own item lengths (IndexError). With the drop-in the proposal
    buffer's address rides the trailing frame: a stock prefill reads SGLang's buffers only,
    every other field unchanged; the drop-in's prefill reads them plus ours, last, and the
    layout. Before 0.5.22 that prefill checks each session at its first aux transfer: a
    matching decode and one without the drop-in are served, another layout fails every
    transfer and sends nothing. The queue binds its allocator, whose free clears our row's
    header (0.5.23: SGLang's ``clear_slot`` does, so free alone does not)."""
    got = report(version)["inband"]
    old = parse_version(version) <= parse_version("0.5.22")
    stock, dropin, seen = got["stock"], got["dropin"], got["stock_reads_dropin"]
    aux = [0x10000, 0x20000]
    assert stock["aux"] == [*aux, dropin["row_ptr"]]  # SGLang's registration: every buffer, ours too
    assert dropin["frames"] == stock["frames"] + 1
    assert dropin["aux"] == [*aux, dropin["row_ptr"]] and dropin["layout"] == dropin["mine"]
    assert seen["other_fields_equal"] is True
    slot = got["slot_reset"]
    if old:
        assert stock["send_aux"] == "IndexError", stock
        assert seen["aux"] == aux
        assert "queue_error" not in got, got["queue_error"]
        assert slot == {"bound": True, "header_after_free": 0, "rest_after_free": 112, "other_row": 448}
    else:
        assert seen["aux"] == [*aux, dropin["row_ptr"]]  # 0.5.23's prefill pairs them by count itself
        assert slot["bound"] is False and slot["header_after_free"] > 0
    if parse_version(version) <= parse_version("0.5.21"):
        sa = got["send_aux"]
        assert sa["returns"] == {
            "match": 0,
            "match_again": 0,
            "without_dropin": 0,
            "without_dropin_again": 0,
            "other_layout": 1,
            "other_layout_again": 1,
        }
        assert sa["sent"] == [["match", 3], ["match", 3], ["without_dropin", 2], ["without_dropin", 2]]
    else:
        assert "send_aux" not in got  # SGLang's _validate_peer_state_layout carries the check
