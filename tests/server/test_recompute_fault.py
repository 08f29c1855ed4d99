"""The tier's recompute fault switch (site/recompute_fault.py, switched on by PDM_TEST_RECOMPUTE_FAULT), without a server.

The switch lives in the tier's site overrides, never in the product: it wraps the
middleware's own per-rank steps (``RecomputeSource.prepare``/``_hidden``/``_stage``,
``SGLangDraftHead._local``). Real, where SGLang is installed: SGLang's ``LlamaForCausalLMEagle3``
(tiny random weights) in a one-rank gloo group (``tests/_sglang_tp1.py``), the drop-in
installed from ``configs/sglang.toml``, its scheduler-start ``capture`` and its per-batch
``prepare``; the scheduler and the prebuilt batch are namespaces with the fields those read.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cpu_gaps  # tests/server/site is on sys.path (conftest.py)
import pytest
import recompute_fault as rf
import torch

V, H = 97, 32
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "sglang.toml"


def test_the_switch_adds_the_two_overrides_only_when_set() -> None:
    names = [o.name for o in cpu_gaps.selected({})]
    assert "recompute_fault_source" not in names and "recompute_fault_head" not in names
    names = [o.name for o in cpu_gaps.selected({cpu_gaps.ENV_RECOMPUTE_FAULT: "head:1"})]
    assert names[-2:] == ["recompute_fault_source", "recompute_fault_head"]
    assert cpu_gaps.ENV_RECOMPUTE_FAULT == rf.ENV


def test_a_spec_names_a_step_and_optionally_a_rank() -> None:
    assert rf.where("head:1", 1) == "head" and rf.where("head:1", 0) == ""
    assert rf.where("head", 0) == rf.where("head", 3) == "head"  # no rank: every rank
    assert rf.where("draw:0\n", 0) == "draw" and rf.where("", 0) == ""
    with pytest.raises(ValueError, match=r"PDM_TEST_RECOMPUTE_FAULT: unknown step 'heads'"):
        rf.where("heads:1", 1)


def test_the_gating_file_turns_the_fault_on_and_may_hold_the_spec(tmp_path: Path) -> None:
    gate = tmp_path / "fault-on"
    env = {rf.ENV: "head:1", rf.ENV_WHILE: str(gate)}
    assert rf.now(1, env) == ""  # absent: off
    gate.touch()
    assert rf.now(1, env) == "head" and rf.now(0, env) == ""  # empty: the environment's spec
    gate.write_text("hidden\n")
    assert rf.now(0, env) == rf.now(1, env) == "hidden"  # not empty: its own, every rank
    assert rf.now(1, {rf.ENV_WHILE: str(gate)}) == ""  # no spec in the environment: never on
    assert rf.now(0, {rf.ENV: "draw"}) == "draw"  # no gate: always on


def test_the_overrides_are_refused_when_the_products_method_changed() -> None:
    class RecomputeSource:
        def bind_head(self, head, *, vocab_size, num_steps, rejection_sampling, group=None, draw=None):  # type: ignore[no-untyped-def]
            return None

        def prepare(self, batch, extra):  # type: ignore[no-untyped-def]
            return None

        def _hidden(self, reqs):  # type: ignore[no-untyped-def]
            return None

        def _stage(self, rec, tokens):  # type: ignore[no-untyped-def]
            return None

    ov = cpu_gaps.RECOMPUTE_FAULT[0]
    mod = types.ModuleType("m")
    mod.RecomputeSource = RecomputeSource  # type: ignore[attr-defined]
    with pytest.raises(
        cpu_gaps.OverrideRefused, match=r"RecomputeSource.prepare has parameters \('self', 'batch', 'extra'\)"
    ):
        cpu_gaps.apply(ov, mod)


def test_the_targets_are_the_products_per_rank_steps() -> None:
    """The seams the overrides wrap exist in pd_middleware with the parameters they expect."""
    for ov in cpu_gaps.RECOMPUTE_FAULT:
        target = getattr(importlib.import_module(ov.module), ov.attr)
        assert cpu_gaps._refusal(ov, target) == "", ov.name


def test_nothing_in_the_product_reads_a_test_variable() -> None:
    root = Path(__file__).resolve().parents[2] / "pd_middleware"
    hits = [str(p) for p in root.rglob("*.py") if "PDM_TEST" in p.read_text(encoding="utf-8")]
    assert hits == []


# ---------------------------------------------------------------------- through the real head


@pytest.fixture(scope="module")
def sgl(sglang_importable: bool) -> Iterator[Any]:
    from _sglang_import import import_sglang
    from _sglang_tp1 import tp1

    with tp1():
        yield import_sglang("sglang.srt.models.llama_eagle3")


@pytest.fixture
def wrapped() -> Iterator[None]:
    """The two overrides applied to the product's real classes for one test, then taken off."""
    classes = []
    for ov in cpu_gaps.RECOMPUTE_FAULT:
        module = importlib.import_module(ov.module)
        cpu_gaps.apply(ov, module)
        classes.append(getattr(module, ov.attr))
    try:
        yield
    finally:
        for cls in classes:
            rf.unwrap(cls)


def _start(sgl: Any, inst: Any, rank: int = 0) -> None:
    from _sglang_import import tiny_llama_config

    from pd_middleware.integrations.sglang.recompute import capture

    cfg = tiny_llama_config(V, H)
    cfg.draft_vocab_size = V
    model = sgl.LlamaForCausalLMEagle3(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    inst.recompute.tp_rank = rank
    sched = SimpleNamespace(
        draft_worker=SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=SimpleNamespace(model=model))),
        enable_overlap=False,
    )
    capture(inst.recompute, sched, vocab_size=V, num_steps=1, rs=True)


def _batch(b: int) -> Any:
    g = torch.Generator().manual_seed(11)
    reqs = [
        SimpleNamespace(
            output_topk_p=torch.tensor([0.5]),
            output_topk_index=torch.tensor([5]),  # the prefill's X
            hidden_states_tensor=torch.randn(H, generator=g),
            bootstrap_room=1000 + i,
            rid=f"r{i}",
        )
        for i in range(b)
    ]
    return SimpleNamespace(
        reqs=reqs,
        seq_lens=torch.arange(b, dtype=torch.int64) + 9,
        model_config=SimpleNamespace(vocab_size=V),
        sampling_info=SimpleNamespace(
            temperatures=torch.full((b, 1), 0.8), sampling_seed=None, top_ks=torch.full((b,), 50)
        ),
    )


@pytest.mark.sglang
def test_the_switch_fails_each_step_on_its_rank_only_while_its_file_exists(
    sgl: Any, wrapped: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``head:0`` gated by a file: rank 0's head fails (every row keeps the prefill's X,
    counted ``failed``) while the file exists, and recomputes once it is gone; another rank's
    fault does nothing here; a spec in the file overrides the environment's per batch
    (``hidden``: counted ``no_hidden``; ``draw``: ``failed``). Negative control: the same
    batches with the switch unset all recompute."""
    from pd_middleware.config import load_config
    from pd_middleware.integrations import sglang as S

    inst = S.install(load_config(CONFIG), S.InstallOptions(hook_scheduler=False))
    try:
        rc = inst.recompute

        def served(b: int) -> list[int]:
            batch = _batch(b)
            rc.prepare(batch)
            return [int(r.output_topk_index[0]) for r in batch.reqs]

        _start(sgl, inst)
        assert served(3) != [5, 5, 5] and rc.counts["recomputed"] == 3  # the control: switch unset
        switch = tmp_path / "fault-on"
        switch.touch()
        monkeypatch.setenv(rf.ENV, "head:0")
        monkeypatch.setenv(rf.ENV_WHILE, str(switch))
        _start(sgl, inst)
        assert "test fault 'head' is armed for TP rank 0" in capsys.readouterr().err
        assert served(3) == [5, 5, 5]  # the prefill's X, one-hot
        assert rc.counts["fallback:failed"] == 3 and rc.counts["recomputed"] == 3
        switch.unlink()
        served(3)
        assert rc.counts["recomputed"] == 6 and rc.counts["fallback:failed"] == 3
        monkeypatch.setenv(rf.ENV, "head:1")  # another rank's fault: none on rank 0
        switch.touch()
        _start(sgl, inst)
        assert "armed" not in capsys.readouterr().err
        served(2)
        assert rc.counts["recomputed"] == 8
        switch.write_text("head\n")  # every rank, per batch
        assert served(2) == [5, 5] and rc.counts["fallback:failed"] == 5
        switch.write_text("hidden")
        assert served(2) == [5, 5] and rc.counts["fallback:no_hidden"] == 2
        switch.write_text("draw:0")
        assert served(2) == [5, 5] and rc.counts["fallback:failed"] == 7
        switch.write_text("head:1")
        served(2)
        assert rc.counts["recomputed"] == 10
        switch.unlink()
        served(1)
        assert rc.counts["recomputed"] == 11
        # The head's own first call (its output dtype, at scheduler start) never fails.
        switch.write_text("head")
        _start(sgl, inst)
        assert rc.head is not None
    finally:
        S.uninstall()
