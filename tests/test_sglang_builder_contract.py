"""Acceptance: SGLang's PD first-draft builder keeps its contract with the drop-in active.

SGLang tests ``build_eagle_disagg_draft_input`` in its repository
(``test/registered/unit/speculative/test_pd_eagle_draft_proposal.py``, five cases; the
file is not shipped in the wheel). The five cases below are written here from the
function's contract, not copied: one-hot FP32 at the drafted token; the proposal as
wide as the target vocab; no proposal without rejection sampling; a (b, num_steps, V)
one-hot chain for multi-layer EAGLE; and the verify stays exact. They run against the
real SGLang builder with the drop-in installed under EVERY shipped config with its
shape keys (``model.vocab_size``, ``model.num_steps``) left out: the drop-in must serve
whatever shape SGLang hands it (V = 11 and a 3-step chain here), as SGLang's own
function does.
"""

from __future__ import annotations

import tomllib
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
import yaml

from pd_middleware.config import parse_config
from pd_middleware.integrations import sglang as S

pytestmark = [pytest.mark.sglang]

VOCAB = 11
ALL = sorted(p for p in (Path(__file__).parent.parent / "configs").iterdir() if p.suffix in (".toml", ".yaml", ".yml"))
# Offline A/B job configs (``[[arms]]`` with no routing hook, for `pd-middleware ab`):
# the drop-in refuses them at install (test below); every other shipped config serves.
JOB_CONFIGS = [p for p in ALL if p.name.startswith("ab")]
CONFIGS = [p for p in ALL if p not in JOB_CONFIGS]


def shapeless(path: Path):
    data = tomllib.loads(path.read_text()) if path.suffix == ".toml" else yaml.safe_load(path.read_text())
    model = data.get("model", {})
    model.pop("vocab_size", None)
    model.pop("num_steps", None)
    return parse_config(data, str(path))


@pytest.fixture(params=CONFIGS, ids=lambda p: p.name)
def ed(request, sglang_importable):
    import importlib

    cfg = shapeless(request.param)
    assert cfg.model.declared_vocab_size is None and cfg.model.declared_num_steps is None
    S.install(cfg, S.InstallOptions(hook_scheduler=False))
    yield importlib.import_module(S.BUILDER_MODULE)
    S.uninstall()


@pytest.mark.parametrize("path", JOB_CONFIGS, ids=lambda p: p.name)
def test_offline_job_configs_are_refused_at_install(path, sglang_importable) -> None:
    from pd_middleware import ConfigError

    with pytest.raises(
        ConfigError, match=r"at hooks: \[\[arms\]\] needs a routing hook .* offline `pd-middleware ab` job"
    ):
        S.install(shapeless(path), S.InstallOptions(hook_scheduler=False))
    assert S.current() is None


def test_every_deployable_config_is_covered() -> None:
    assert len(CONFIGS) >= 7 and {p.name for p in CONFIGS} >= {"one_hot.toml", "sparse_floor.toml", "multi_layer.yaml"}


def spec(rejection_sampling=True, multi_layer=False):
    return SimpleNamespace(
        speculative_eagle_topk=1,
        speculative_num_steps=3,
        enable_multi_layer_eagle=multi_layer,
        speculative_use_rejection_sampling=rejection_sampling,
    )


def batch(chains, vocab=VOCAB):
    reqs = [
        SimpleNamespace(
            output_topk_p=[0.25] * len(c),
            output_topk_index=list(c),
            hidden_states_tensor=torch.full((4,), float(i)),
            output_dsa_topk_indices=None,
        )
        for i, c in enumerate(chains)
    ]
    return SimpleNamespace(
        reqs=reqs,
        device="cpu",
        enable_overlap=False,
        model_config=SimpleNamespace(vocab_size=vocab, hf_config=SimpleNamespace()),
    )


def build(ed, sp, chains, vocab=VOCAB):
    assert ed.pd_first_draft_proposal.__pd_middleware__  # the drop-in is what answers
    with patch.object(ed, "get_spec", return_value=sp):
        return ed.build_eagle_disagg_draft_input(batch(chains, vocab), torch.arange(len(chains)), future_map=None)


def test_one_hot_fp32_at_the_drafted_token(ed) -> None:
    got = build(ed, spec(), [(3,), (7,)])
    want = torch.zeros((2, VOCAB))
    want[0, 3] = want[1, 7] = 1.0
    assert got.draft_probs.dtype == torch.float32
    assert torch.equal(got.draft_probs, want)
    assert torch.equal(got.topk_index, torch.tensor([[3], [7]]))


def test_proposal_as_wide_as_the_target_vocab(ed) -> None:
    for vocab in (VOCAB, 29):
        assert build(ed, spec(), [(3,), (7,)], vocab).draft_probs.shape == (2, vocab)


def test_no_proposal_without_rejection_sampling(ed) -> None:
    assert build(ed, spec(rejection_sampling=False), [(3,), (7,)]).draft_probs is None
    assert build(ed, spec(rejection_sampling=False, multi_layer=True), [(3, 5, 9), (7, 0, 10)]).draft_probs is None


def test_multi_layer_one_hot_per_chain_step(ed) -> None:
    chains = [(3, 5, 9), (7, 0, 10)]
    got = build(ed, spec(multi_layer=True), chains)
    want = torch.zeros((2, 3, VOCAB))
    for row, chain in enumerate(chains):
        for step, token in enumerate(chain):
            want[row, step, token] = 1.0
    assert got.draft_probs.dtype == torch.float32 and torch.equal(got.draft_probs, want)
    assert torch.equal(got.topk_index, torch.tensor(chains))


def test_verify_stays_exact(ed) -> None:
    # Chain verify of one token with the proposal the builder hands over: accept X with
    # probability min(1, p(X)/q(X)), else draw from (p - q)+. Enumerated exactly over
    # X ~ q_draft, the committed token must be distributed as p.
    p = [Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)]
    q_draft = [Fraction(1, 10), Fraction(3, 5), Fraction(3, 10)]
    committed = [Fraction(0)] * 3
    for x in range(3):
        q = [Fraction(v) for v in build(ed, spec(), [(x,)], 3).draft_probs[0].tolist()]
        accept = min(Fraction(1), p[x] / q[x])
        residual = [max(Fraction(0), pi - qi) for pi, qi in zip(p, q)]
        total = sum(residual)
        committed[x] += q_draft[x] * accept
        for y in range(3):
            committed[y] += q_draft[x] * (1 - accept) * residual[y] / total
    assert committed == p
