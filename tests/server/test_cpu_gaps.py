"""The CPU gap overrides (site/cpu_gaps.py): applied when the target matches, refused when it changed."""

from __future__ import annotations

import types

import cpu_gaps  # tests/server/site is on sys.path (conftest.py)
import pytest
import torch


def _module(**attrs: object) -> types.ModuleType:
    m = types.ModuleType("fake_sglang_module")
    m.__dict__.update(attrs)
    return m


def test_an_override_applies_to_its_target_and_logs(capsys: pytest.CaptureFixture[str]) -> None:
    def row_argmax(x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the GPU kernel must not run on CPU")

    ov = next(o for o in cpu_gaps.GAPS if o.name == "row_argmax")
    mod = _module(row_argmax=row_argmax)
    assert cpu_gaps.apply(ov, mod) is row_argmax
    x = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.1, 0.4]])
    assert mod.row_argmax(x).tolist() == [1, 0]
    assert f"override row_argmax: {ov.module}.row_argmax" in capsys.readouterr().err


def test_an_override_is_refused_when_its_target_signature_changed() -> None:
    def _verify_uses_greedy(*, is_all_greedy: bool, is_cpu: bool) -> bool:
        return True

    ov = next(o for o in cpu_gaps.GAPS if o.name == "verify_greedy")
    mod = _module(_verify_uses_greedy=_verify_uses_greedy)
    with pytest.raises(
        cpu_gaps.OverrideRefused,
        match=r"override verify_greedy refused: .*has parameters \('is_all_greedy', 'is_cpu'\)",
    ):
        cpu_gaps.apply(ov, mod)
    assert mod._verify_uses_greedy is _verify_uses_greedy  # untouched
    with pytest.raises(cpu_gaps.OverrideRefused, match="not found"):
        cpu_gaps.apply(ov, _module())


def test_the_renorm_override_is_refused_once_sglang_has_the_function() -> None:
    ov = next(o for o in cpu_gaps.GAPS if o.name == "renorm")
    with pytest.raises(cpu_gaps.OverrideRefused, match="closed upstream"):
        cpu_gaps.apply(ov, _module(top_k_renorm_prob=lambda p, k: p))


def test_verify_greedy_keeps_sampling_on_cpu_with_rejection_sampling() -> None:
    ov = next(o for o in cpu_gaps.GAPS if o.name == "verify_greedy")

    def orig(*, is_all_greedy: bool, is_cpu: bool, is_hip: bool, is_xpu: bool, use_rejection_sampling: bool) -> bool:
        return is_all_greedy or is_cpu or is_xpu

    new = ov.make(_module(), orig)
    kw = {"is_cpu": True, "is_hip": False, "is_xpu": False}
    assert new(is_all_greedy=False, use_rejection_sampling=True, **kw) is False
    assert new(is_all_greedy=True, use_rejection_sampling=True, **kw) is True
    assert new(is_all_greedy=False, use_rejection_sampling=False, **kw) is True  # SGLang's rule without it


def test_unknown_gap_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"PDM_CPU_GAPS: unknown override\(s\) \['rowargmax'\]"):
        cpu_gaps.selected({cpu_gaps.ENV_GAPS: "rowargmax"})
    names = [o.name for o in cpu_gaps.selected({})]
    assert names[:7] == [o.name for o in cpu_gaps.GAPS] and "seed_builder" not in names
    assert "seed_builder" in [o.name for o in cpu_gaps.selected({cpu_gaps.ENV_SEED: "1"})]


@pytest.mark.parametrize("rows", [1, 5])
def test_top_k_and_top_p_renorm_against_a_plain_reference(rows: int) -> None:
    g = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(rows, 12, generator=g), dim=-1)
    ks = torch.randint(1, 13, (rows,), generator=g)
    ps = torch.rand(rows, generator=g)
    got_k = cpu_gaps.top_k_renorm_prob(probs, ks)
    got_p = cpu_gaps.top_p_renorm_prob(probs, ps)
    for i in range(rows):
        order = probs[i].argsort(descending=True).tolist()
        keep_k = set(order[: int(ks[i])])
        want = torch.tensor([probs[i, j] if j in keep_k else 0.0 for j in range(12)])
        torch.testing.assert_close(got_k[i], want / want.sum())
        keep_p, mass = set(), 0.0
        for j in order:  # the smallest top set with mass >= p
            keep_p.add(j)
            mass += float(probs[i, j])
            if mass >= float(ps[i]):
                break
        want = torch.tensor([probs[i, j] if j in keep_p else 0.0 for j in range(12)])
        torch.testing.assert_close(got_p[i], want / want.sum())
