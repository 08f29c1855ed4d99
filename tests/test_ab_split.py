"""Live A/B split: stable per request id, weight-proportional, counters reconcile."""

from __future__ import annotations

import math

import pytest

from pd_middleware import ConfigError, Payload, PluginError, Provenance
from pd_middleware.config import parse_config
from pd_middleware.decode.pipeline import Delivery, Failure
from pd_middleware.middleware import DecodeMiddleware


def cfg(weights=(1, 3), extra_hooks=()):
    return parse_config(
        {
            "model": {"vocab_size": 100},
            "hooks": [*extra_hooks, {"name": "ab_split"}],
            "arms": [
                {"name": "one_hot", "weight": weights[0], "synthesizer": {"name": "one_hot"}},
                {"name": "other", "weight": weights[1], "synthesizer": {"name": "one_hot"}},
            ],
        }
    )


def payload(i, vocab=100):
    return Payload(
        request_id=f"req-{i}", draft_tokens=(i % 100,), draft_probs=(0.5,), vocab_size=vocab, provenance=Provenance()
    )


def test_split_is_stable_and_weighted():
    n = 20_000
    a = DecodeMiddleware.from_config(cfg())
    b = DecodeMiddleware.from_config(cfg())  # a second decode node, same config
    arms_a = [a.receive(payload(i)).arm for i in range(n)]
    arms_b = [b.receive(payload(i)).arm for i in range(n)]
    assert arms_a == arms_b, "the same request id must land on the same arm everywhere"
    share = arms_a.count("other") / n
    # Binomial(n, 3/4): 6 sigma is a false-alarm bound of ~2e-9.
    sigma = math.sqrt(0.75 * 0.25 / n)
    assert abs(share - 0.75) < 6 * sigma, share
    snap = a.metrics.snapshot()
    assert snap["delivered_by_arm"] == {"one_hot": arms_a.count("one_hot"), "other": arms_a.count("other")}
    assert snap["received"] == snap["delivered"] + snap["failed"] == n


def test_counters_reconcile_with_failures():
    mw = DecodeMiddleware.from_config(cfg())
    outs = [mw.receive(payload(i, vocab=100 if i % 7 else 101)) for i in range(700)]
    s = mw.metrics.snapshot()
    fails = [o for o in outs if isinstance(o, Failure)]
    dels = [o for o in outs if isinstance(o, Delivery)]
    assert len(fails) == 100 and len(dels) == 600
    assert s["received"] == 700 and s["delivered"] == 600 and s["failed"] == 100
    assert sum(s["delivered_by_arm"].values()) == 600
    assert sum(s["failed_by_arm"].values()) == 100
    for arm in ("one_hot", "other"):
        assert s["failed_by_arm"][arm] == sum(1 for f in fails if f.arm == arm)


def test_split_needs_arms():
    c = parse_config({"hooks": [{"name": "ab_split"}]})
    with pytest.raises(PluginError, match=r"config key hooks\[0\].*ab_split needs \[\[arms\]\]"):
        DecodeMiddleware.from_config(c)


def test_arms_without_a_router_is_a_config_error():
    from pd_middleware import ConfigError

    c = parse_config({"arms": [{"name": "a", "synthesizer": {"name": "one_hot"}}]})
    with pytest.raises(ConfigError, match=r"\[\[arms\]\] needs a routing hook") as ei:
        DecodeMiddleware.from_config(c)
    assert ei.value.path == "hooks"


class _FixedRouter:
    """A router that sends everything to arm "other" (it needs no routes_arms flag)."""

    def on_receive(self, payload, context):
        context.arm = "other"


def test_router_override_replaces_routing_hooks_and_runs_first():
    from _ab_hooks import SeeArm  # tests/ is on sys.path (no __init__.py)

    from pd_middleware.decode.assembler import ProposalAssembler

    see = [{"name": "_ab_hooks:SEE_ARM"}]
    # Negative control: in config order, a hook listed before ab_split sees no arm yet.
    plain = DecodeMiddleware.from_config(cfg(extra_hooks=see))
    plain.receive(payload(1))
    assert SeeArm.latest.seen == ["default"]
    mw = DecodeMiddleware.from_config(
        cfg(extra_hooks=see),
        router=_FixedRouter(),
        assembler_factory=lambda c: ProposalAssembler(c.model.vocab_size, c.model.num_steps, 3),
    )
    # ab_split (routes_arms) is replaced, the router runs first, the other hooks keep their order.
    assert [type(h).__name__ for h in mw.pipeline.hook_objects] == ["_FixedRouter", "SeeArm"]
    assert mw.assembler.max_batch == 3
    outs = [mw.receive(payload(i)) for i in range(20)]
    assert {o.arm for o in outs} == {"other"}
    assert SeeArm.latest.seen == ["other"] * 20
    # Without a router, [[arms]] still needs a configured routing hook.
    with pytest.raises(ConfigError, match=r"needs a routing hook"):
        DecodeMiddleware.from_config(
            parse_config({"model": {"vocab_size": 100}, "arms": [{"name": "a", "synthesizer": {"name": "one_hot"}}]})
        )
