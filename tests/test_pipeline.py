"""The receive pipeline: a faulty hook fails one payload, counted and visible."""

from __future__ import annotations

from pd_middleware import Payload, ReceiveContext
from pd_middleware.core.metrics import Metrics
from pd_middleware.core.proposal import OneHotProposal
from pd_middleware.decode.pipeline import Delivery, Failure, ReceivePipeline


class Boom:
    def on_receive(self, payload, context):
        if payload.request_id.endswith("bad"):
            raise RuntimeError("hook exploded")


class Tag:
    def __init__(self):
        self.calls = []

    def on_receive(self, payload, context):
        self.calls.append(payload.request_id)
        context.arm = "b" if payload.draft_tokens[0] % 2 else "a"


class Synth:
    def synthesize(self, payload):
        return OneHotProposal(payload.draft_tokens)


def p(rid, tok=1):
    return Payload(request_id=rid, draft_tokens=(tok,), draft_probs=(0.5,), vocab_size=10)


def test_hook_failure_fails_only_that_payload():
    released = []
    tag = Tag()
    pipe = ReceivePipeline([("boom", Boom()), ("tag", tag)], {"a": ("s", Synth()), "b": ("s", Synth())})
    outs = [
        pipe.process(p(rid, i), releaser=lambda rid=rid: released.append(rid))
        for i, rid in enumerate(["r0", "r1bad", "r2", "r3"])
    ]
    assert [type(o) for o in outs] == [Delivery, Failure, Delivery, Delivery]
    f = outs[1]
    assert f.stage == "hook:boom" and f.request_id == "r1bad"
    assert "RuntimeError: hook exploded" in f.reason
    assert released == ["r1bad"], "a failed payload frees its slot at once"
    assert tag.calls == ["r0", "r2", "r3"], "hooks after the failing one never see it"
    assert [o.arm for o in outs if isinstance(o, Delivery)] == ["a", "a", "b"]
    s = pipe.metrics.snapshot()
    assert s["received"] == 4 and s["delivered"] == 3 and s["failed"] == 1
    assert s["failed_by_reason"] == {"hook:boom": 1}
    assert s["delivered_by_arm"] == {"a": 2, "b": 1}
    outs[0].release()
    assert released == ["r1bad", "r0"]


def test_hook_may_replace_payload_and_unknown_arm_fails():
    class Replace:
        def on_receive(self, payload, context):
            return Payload(request_id=payload.request_id, draft_tokens=(9,), draft_probs=(1.0,), vocab_size=10)

    class Route:
        def on_receive(self, payload, context):
            context.arm = "ghost"

    pipe = ReceivePipeline([("replace", Replace())], {"default": ("s", Synth())})
    d = pipe.process(p("r"))
    assert isinstance(d, Delivery) and d.proposal == OneHotProposal((9,))
    pipe2 = ReceivePipeline([("route", Route())], {"default": ("s", Synth())})
    f = pipe2.process(p("r"), ReceiveContext())
    assert isinstance(f, Failure) and f.stage == "route" and f.field == "arm"
    assert "unknown A/B arm 'ghost'" in f.reason


def test_metrics_format_and_prometheus():
    from prometheus_client import CollectorRegistry, generate_latest

    m = Metrics()
    pipe = ReceivePipeline([("boom", Boom())], {"default": ("s", Synth())}, m)
    pipe.process(p("ok"))
    pipe.process(p("xbad"))
    text = m.format()
    assert "received  2" in text and "failed[hook:boom] 1" in text
    reg = CollectorRegistry()
    m.register_prometheus(reg)
    out = generate_latest(reg).decode()
    assert "pd_middleware_payloads_received_total 2.0" in out
    assert 'pd_middleware_payloads_failed_total{reason="hook:boom"} 1.0' in out
    assert 'pd_middleware_payloads_delivered_total{arm="default"} 1.0' in out
