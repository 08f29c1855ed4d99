"""The example plugins through pd-middleware's public API: registry, config, pipeline."""

from __future__ import annotations

import pytest
from pd_middleware_example import ArmTally

from pd_middleware import ConfigError, Payload, Provenance
from pd_middleware.config import parse_config
from pd_middleware.middleware import DecodeMiddleware
from pd_middleware.registry import default_registry

V = 64


def _payload(rid: str, prob: float) -> Payload:
    return Payload(
        request_id=rid,
        draft_tokens=(3,),
        draft_probs=(prob,),
        vocab_size=V,
        hidden=b"",
        hidden_dtype="bf16",
        provenance=Provenance(rule="sampled", temperature=1.0),
        proposal=None,
    )


def _middleware(hook_options: dict, synth_options: dict) -> DecodeMiddleware:
    cfg = parse_config(
        {
            "model": {"vocab_size": V, "num_steps": 1, "hidden_size": 0},
            "decode": {"max_batch": 4},
            "hooks": [{"name": "ab_split"}, {"name": "arm_tally", "options": hook_options}],
            "arms": [
                {"name": "a", "synthesizer": {"name": "min_prob_one_hot", "options": synth_options}},
                {"name": "b", "synthesizer": {"name": "one_hot"}},
            ],
        }
    )
    return DecodeMiddleware.from_config(cfg)


def test_entry_points_register_both_plugins() -> None:
    reg = default_registry()
    assert reg.resolve("hook", "arm_tally").options.__name__ == "ArmTallyOptions"
    assert reg.resolve("synthesizer", "min_prob_one_hot").kind == "synthesizer"


def test_hook_counts_per_arm_and_fails_on_purpose() -> None:
    mw = _middleware({"fail_every": 5}, {})
    outcomes = [mw.receive(_payload(f"r{i}", 0.5)) for i in range(20)]
    tally = ArmTally.latest
    assert tally is not None and tally.seen == 20
    assert sum(tally.counts.values()) == 20 and set(tally.counts) == {"a", "b"}  # the router ran first
    failed = [o for o in outcomes if not hasattr(o, "proposal")]
    assert len(failed) == 4
    assert {f.stage for f in failed} == {"hook:arm_tally"}
    assert "failing payload #5 on purpose" in failed[0].reason
    mw.close()


def test_synthesizer_refuses_improbable_drafts_with_the_field() -> None:
    mw = _middleware({}, {"min_draft_prob": 0.2})
    arm_a = next(f"r{i}" for i in range(100) if mw.receive(_payload(f"r{i}", 0.9)).arm == "a")
    low = mw.receive(_payload(arm_a, 0.1))
    assert low.stage == "synthesizer:min_prob_one_hot" and low.field == "draft_probs"
    assert "below min_draft_prob 0.2" in low.reason
    ok = mw.receive(_payload(arm_a, 0.9))
    assert ok.proposal is not None and ok.proposal.tokens == (3,)
    mw.close()


def test_bad_options_name_the_full_key_path() -> None:
    with pytest.raises(ConfigError, match=r"hooks\[1\]\.options\.fail_every.*must be in \[0, 1000000\]"):
        _middleware({"fail_every": -1}, {})
    with pytest.raises(ConfigError, match=r"arms\[0\]\.synthesizer\.options\.min_draft_prob"):
        _middleware({}, {"min_draft_prob": 1.5})
