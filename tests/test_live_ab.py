"""Live A/B (issue 12 item 7): first verifies by arm, and ``pd-middleware live-ab``.

- The report's statistics: coverage of the mean and ratio intervals over seeded
  replications (with a stated binomial bound), and a negative control.
- The sources: a real HTTP endpoint on loopback, a saved scrape, a snapshot JSON, a
  first-verify log; the CLI as a subprocess.
- Tests marked ``sglang`` run SGLang 0.5.23's REAL scheduler method
  ``SchedulerBatchResultProcessor._resolve_spec_v2_tokens`` on real ``Req`` and
  ``GenerationBatchResult`` objects on CPU, patched by the hook. Stand-ins, and why:
  the per-request ``accept_lens`` come from the project's reference chain verifier
  (``pd_middleware.evaluation.verify.verify_chain``, the rule of SGLang's rejection-sampling
  kernel) because that kernel is CUDA-only; the processor's ``metrics_reporter`` and
  ``model_worker`` are recording stand-ins (scheduler components this method only
  notifies); the arm record on each request stands in for the decode path's
  ``req.pd_middleware`` record.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pd_middleware import ConfigError, PluginError
from pd_middleware.core.metrics import MAX_ACCEPTED, Metrics
from pd_middleware.evaluation.live_ab import (
    ArmAcceptance,
    load,
    parse_json,
    parse_prometheus,
    ratio_interval,
    summarize,
)

SEED = 20261201


def _simulated(metrics: Metrics, arm: str, p: float, steps: int, n: int, rng: random.Random) -> list[int]:
    """n first verifies of an S-step chain with per-position acceptance p (geometric, capped)."""
    out = []
    for _ in range(n):
        k = 0
        while k < steps and rng.random() < p:
            k += 1
        metrics.record_first_verify(arm, k)
        out.append(k)
    return out


def _true_mean(p: float, steps: int) -> float:
    return sum(p**k for k in range(1, steps + 1))


def _exposition(m: Metrics) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    reg = CollectorRegistry()
    m.register_prometheus(reg)
    return generate_latest(reg).decode()


# ------------------------------------------------------------------- statistics


def test_intervals_cover_the_truth_at_their_level() -> None:
    """200 seeded replications: each 95% interval misses the truth in ~5% of them.

    Misses ~ Binomial(200, 0.05) for a correct interval (mean 10); P(misses > 22) < 1e-3,
    so the bound 22 fails a correct implementation with probability under 0.1%. The
    seed is fixed, so CI is deterministic.
    """
    rng = random.Random(SEED)
    pa, pb, steps, n = 0.62, 0.45, 3, 400
    true_ratio = _true_mean(pa, steps) / _true_mean(pb, steps)
    miss_mean = miss_rate = miss_ratio = 0
    for _ in range(200):
        m = Metrics()
        _simulated(m, "sparse", pa, steps, n, rng)
        _simulated(m, "one_hot", pb, steps, n, rng)
        arms = parse_json(json.dumps(m.snapshot()))
        a = arms["sparse"]
        lo, hi = a.mean_interval()
        miss_mean += not lo <= _true_mean(pa, steps) <= hi
        lo, hi = a.rate_interval()
        miss_rate += not lo <= pa <= hi
        _, lo, hi = ratio_interval(a, arms["one_hot"])
        miss_ratio += not lo <= true_ratio <= hi
    assert miss_mean <= 22 and miss_rate <= 22 and miss_ratio <= 22, (SEED, miss_mean, miss_rate, miss_ratio)
    # Negative control: the same intervals against a wrong truth miss nearly always.
    m = Metrics()
    _simulated(m, "sparse", pa, steps, n, rng)
    lo, hi = parse_json(json.dumps(m.snapshot()))["sparse"].mean_interval()
    assert not lo <= _true_mean(pa - 0.1, steps) <= hi


def test_summary_figures_match_hand_computation() -> None:
    # arm a: 10 verifies, accepted 0 x4, 1 x3, 2 x3 -> mean 0.9, acceptance 0.6
    a = ArmAcceptance("a", (4, 3, 3))
    assert a.n == 10 and a.mean == pytest.approx(0.9) and a.first_accepted == 6
    var = (4 * 0.81 + 3 * 0.01 + 3 * 1.21) / 9
    assert a.variance == pytest.approx(var)
    lo, hi = a.mean_interval()
    assert (hi - lo) / 2 == pytest.approx(1.959964 * math.sqrt(var / 10), rel=1e-5)
    b = ArmAcceptance("one_hot", (6, 4))
    rep = summarize({"a": a, "one_hot": b}, None)
    assert rep["baseline"] == "one_hot"
    row = {r["arm"]: r for r in rep["arms"]}
    assert row["a"]["ratio_vs_baseline"] == pytest.approx(0.9 / 0.4)
    assert row["one_hot"]["ratio_vs_baseline"] == 1.0 and all(math.isnan(x) for x in row["one_hot"]["ratio_ci"])
    with pytest.raises(ConfigError, match=r"baseline arm 'nope' has no first verifies; arms: \['a', 'one_hot'\]"):
        summarize({"a": a, "one_hot": b}, "nope")
    with pytest.raises(ConfigError, match="no first verifies recorded yet"):
        summarize({}, None)


def test_zero_mean_baseline_gives_no_ratio_and_small_arms_are_flagged() -> None:
    from pd_middleware.evaluation.live_ab import format_table

    rep = summarize({"a": ArmAcceptance("a", (5, 5)), "b": ArmAcceptance("b", (10,))}, "b")
    row = {r["arm"]: r for r in rep["arms"]}
    assert math.isnan(row["a"]["ratio_vs_baseline"])
    table = format_table(rep)
    assert "0.500 [0.237, 0.763]" in table.splitlines()[1]  # Wilson interval of 5/10
    assert "fewer than 30 first verifies in a, b: the normal intervals are rough there" in table


# ------------------------------------------------------------------- sources


def test_prometheus_snapshot_and_log_sources_agree(tmp_path) -> None:
    pytest.importorskip("prometheus_client")
    rng = random.Random(SEED)
    m = Metrics()
    log = []
    for arm, p in (("one_hot", 0.4), ("sparse", 0.7)):
        for k in _simulated(m, arm, p, 4, 300, rng):
            log.append(json.dumps({"request_id": str(len(log)), "arm": arm, "accepted": k}))
    m.record_first_verify("sparse", MAX_ACCEPTED + 5)  # clamped into the last bucket
    log.append(json.dumps({"request_id": "x", "arm": "sparse", "accepted": MAX_ACCEPTED + 5}))
    m.record_first_verify(None, 1)  # unattributed: in no arm
    log.append(json.dumps({"request_id": "y", "arm": None, "accepted": 1}))
    want = {a: tuple(c) for a, c in m.snapshot()["first_verify_accepted_by_arm"].items()}
    from_text = {a: x.counts for a, x in parse_prometheus(_exposition(m)).items()}
    from_snap = {a: x.counts for a, x in parse_json(json.dumps(m.snapshot())).items()}
    (tmp_path / "fv.jsonl").write_text("\n".join(log) + "\n")
    from_log = {a: x.counts for a, x in load(str(tmp_path / "fv.jsonl")).items()}
    assert from_text == from_snap == from_log == want
    assert want["sparse"][MAX_ACCEPTED] == 1


def test_since_reports_only_the_window(tmp_path) -> None:
    pytest.importorskip("prometheus_client")
    rng = random.Random(SEED)
    m = Metrics()
    _simulated(m, "a", 0.3, 2, 200, rng)
    start = tmp_path / "start.prom"
    start.write_text(_exposition(m))
    window = Metrics()
    for k in _simulated(m, "a", 0.8, 2, 300, rng):
        window.record_first_verify("a", k)
    now = tmp_path / "now.prom"
    now.write_text(_exposition(m))
    out = _cli("--from", str(now), "--since", str(start), "--json")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)["arms"][0]
    assert row["first_verifies"] == 300
    assert row["mean_accepted"] == pytest.approx(parse_json(json.dumps(window.snapshot()))["a"].mean)
    back = _cli("--from", str(start), "--since", str(now))  # reversed: counts went down
    assert back.returncode == 2 and "arm 'a': counts went down since the earlier read" in back.stderr


def test_bad_sources_name_the_problem(tmp_path) -> None:
    pytest.importorskip("prometheus_client")
    with pytest.raises(ConfigError, match="no pd_middleware_first_verify_accepted_tokens in the metrics"):
        parse_prometheus("# TYPE other_total counter\nother_total 1\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arm": "a", "accepted": 1}\n{"arm": "a"}\n')
    with pytest.raises(ConfigError, match="line 2: not a first-verify record"):
        load(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        load(str(tmp_path / "missing"))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pd_middleware.cli", "live-ab", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_reads_a_running_endpoint() -> None:
    pytest.importorskip("prometheus_client")
    from pd_middleware.metrics_export import MetricsServer

    rng = random.Random(SEED)
    m = Metrics()
    _simulated(m, "one_hot", 0.4, 1, 500, rng)
    _simulated(m, "sparse", 0.6, 1, 500, rng)
    server = MetricsServer(m, "127.0.0.1", 0).start()
    url = server.url
    try:
        out = _cli("--url", url)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("arm") and "ratio vs one_hot" in lines[0]
        row = next(line for line in lines if line.startswith("sparse"))
        assert " 500 " in row
        js = _cli("--url", url, "--json", "--baseline", "sparse")
        rep = json.loads(js.stdout)
        assert rep["baseline"] == "sparse"
        by = {r["arm"]: r for r in rep["arms"]}
        exp = summarize(load(url), "sparse")
        assert by["one_hot"]["ratio_vs_baseline"] == pytest.approx(
            next(r for r in exp["arms"] if r["arm"] == "one_hot")["ratio_vs_baseline"]
        )
        assert by["sparse"]["ratio_vs_baseline"] == 1.0 and by["sparse"]["ratio_ci"] == [None, None]
    finally:
        server.stop()
    gone = _cli("--url", url)  # stopped: the port is released
    assert gone.returncode == 2 and f"cannot read {url}" in gone.stderr and "refused" in gone.stderr


# ------------------------------------------------------------------- the real SGLang method

SGLANG_ABSENT = importlib.util.find_spec("sglang") is None


@pytest.fixture(scope="module")
def brp():
    """SGLang 0.5.23's real batch_result_processor module (tests/_sglang_import.py says why the stand-in)."""
    from _sglang_import import import_sglang  # tests/ is on sys.path (no __init__.py)

    return import_sglang("sglang.srt.managers.scheduler_components.batch_result_processor")


def _processor(brp):
    import dataclasses

    calls: list = []
    fields = {f.name: None for f in dataclasses.fields(brp.SchedulerBatchResultProcessor)}
    fields["metrics_reporter"] = SimpleNamespace(
        snapshot_spec_decode_metrics=lambda batch, result: calls.append("snap")
    )
    fields["model_worker"] = SimpleNamespace(on_verify_complete_cpu=lambda n, batch_size: calls.append(list(n)))
    return brp.SchedulerBatchResultProcessor(**fields), calls


def _reqs(n: int, arms: list[str | None]):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = []
    for i in range(n):
        r = Req(f"r{i}", "", [1, 2, 3], SamplingParams(max_new_tokens=64), bootstrap_room=1000 + i)
        if arms[i] is not None:
            r.pd_middleware = SimpleNamespace(arm=arms[i], proposal=None, reason=None)
        reqs.append(r)
    return reqs


def _result(accept_lens, stride: int):
    import torch
    from sglang.srt.managers.utils import GenerationBatchResult

    b = len(accept_lens)
    return GenerationBatchResult(
        next_token_ids=torch.arange(b * stride, dtype=torch.int64),
        accept_lens=torch.as_tensor(accept_lens, dtype=torch.int32),
        speculative_num_draft_tokens=stride,
    )


@pytest.mark.sglang
@pytest.mark.skipif(SGLANG_ABSENT, reason="SGLang is not installed; run `make setup-sglang`")
def test_real_verify_result_counts_first_verifies_by_arm(brp, tmp_path) -> None:
    """Two arms with different q' at the first position, verified by the reference rule.

    Arm one_hot hands q' = δ_X (acceptance p(X)); arm full hands the q that X was drawn
    from (acceptance Σ min(p, q)); V = 8, one draft step. The counters must equal, by
    arm, exactly the accepted lengths the verifier produced for the first verifies; a
    second verify of the same requests adds nothing; a finished request is skipped.
    """
    import torch

    from pd_middleware.evaluation.verify import verify_chain
    from pd_middleware.integrations.sglang.live_ab import FirstVerifyRecorder

    g = torch.Generator().manual_seed(SEED)
    b, v = 240, 8
    p = torch.softmax(torch.randn(b, 2, v, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(b, v, generator=g) * 1.5, dim=-1)
    x = torch.multinomial(q, 1, generator=g).squeeze(1)
    arms = ["one_hot" if i % 2 else "full" for i in range(b)]
    arms[7] = None  # a request without a record: unattributed
    qprime = torch.where(
        torch.tensor([a == "one_hot" for a in arms]).unsqueeze(1), torch.nn.functional.one_hot(x, v).float(), q
    )
    accepted = verify_chain(p, qprime, x, g).accepted_lengths  # (b,), 0 or 1

    m = Metrics()
    log = tmp_path / "fv.jsonl"
    rec = FirstVerifyRecorder(m, log_path=log)
    owner, attr, orig, new = first_verify_patch(rec, brp)
    assert orig is brp.SchedulerBatchResultProcessor._resolve_spec_v2_tokens
    setattr(owner, attr, new)
    try:
        proc, calls = _processor(brp)
        reqs = _reqs(b, arms)
        reqs[3].finished_reason = SimpleNamespace(to_json=dict, is_error=False)  # finished: not verified
        batch = SimpleNamespace(reqs=reqs, has_grammar=False)
        tokens = proc._resolve_spec_v2_tokens(_result((accepted + 1).tolist(), 2), batch)
        assert len(tokens) == b and calls[0] == "snap"
        # later verify of the same requests: not a first verify
        proc._resolve_spec_v2_tokens(_result([2] * b, 2), batch)
    finally:
        setattr(owner, attr, orig)
        rec.stop()
    assert brp.SchedulerBatchResultProcessor._resolve_spec_v2_tokens is orig
    want: dict[str, list[int]] = {"one_hot": [0] * (MAX_ACCEPTED + 1), "full": [0] * (MAX_ACCEPTED + 1)}
    for i, a in enumerate(arms):
        if a is not None and i != 3:
            want[a][int(accepted[i])] += 1
    snap = m.snapshot()
    assert snap["first_verify_accepted_by_arm"] == want
    assert snap["first_verify_unattributed"] == 1
    lines = [json.loads(s) for s in log.read_text().splitlines()]
    assert len(lines) == b - 1 and {ln["request_id"] for ln in lines} == {str(1000 + i) for i in range(b) if i != 3}
    # The report separates the arms the way the law says: full accepts Σ min(p, q), one_hot p(X).
    rep = summarize(load(str(log)), "one_hot")
    row = {r["arm"]: r for r in rep["arms"]}
    # Each request has its own law, so the truth is the average of its acceptance
    # probability over the arm's requests (a Wilson interval stays conservative for it).
    idx = {a: [i for i in range(b) if arms[i] == a and i != 3] for a in ("full", "one_hot")}
    truth = {
        "full": float(torch.minimum(p[idx["full"], 0], q[idx["full"]]).sum(1).mean()),
        "one_hot": float(p[idx["one_hot"], 0].gather(1, x[idx["one_hot"]].unsqueeze(1)).mean()),
    }
    for a, t in truth.items():
        lo, hi = row[a]["acceptance_ci"]
        assert lo <= t <= hi, (SEED, a, t, lo, hi)


@pytest.mark.sglang
@pytest.mark.skipif(SGLANG_ABSENT, reason="SGLang is not installed; run `make setup-sglang`")
def test_patch_refuses_a_changed_method(brp) -> None:
    from pd_middleware.integrations.sglang.live_ab import FirstVerifyRecorder

    fake = SimpleNamespace(__name__="fake_brp", SchedulerBatchResultProcessor=type("P", (), {}))

    def _resolve_spec_v2_tokens(self, result, batch, extra):
        return None

    fake.SchedulerBatchResultProcessor._resolve_spec_v2_tokens = _resolve_spec_v2_tokens
    with pytest.raises(
        PluginError,
        match=r"fake_brp\.SchedulerBatchResultProcessor\._resolve_spec_v2_tokens has parameters "
        r"\('self', 'result', 'batch', 'extra'\), expected",
    ):
        first_verify_patch(FirstVerifyRecorder(Metrics()), fake)
    with pytest.raises(PluginError, match="fake_brp.SchedulerBatchResultProcessor not found"):
        first_verify_patch(FirstVerifyRecorder(Metrics()), SimpleNamespace(__name__="fake_brp"))


@pytest.mark.sglang
@pytest.mark.skipif(SGLANG_ABSENT, reason="SGLang is not installed; run `make setup-sglang`")
def test_install_patches_and_uninstall_restores(brp) -> None:
    """The SGLang installation applies the live A/B patch with its others, only with arms, and restores it."""
    from pd_middleware.config import parse_config
    from pd_middleware.integrations import sglang as S

    orig = brp.SchedulerBatchResultProcessor._resolve_spec_v2_tokens
    base = {"model": {"vocab_size": 16}, "decode": {"max_batch": 4}, "transport": {"mooncake": {"enabled": False}}}
    cfg = parse_config(
        {
            **base,
            "hooks": [{"name": "ab_split"}],
            "arms": [
                {"name": "a", "synthesizer": {"name": "one_hot"}},
                {"name": "b", "synthesizer": {"name": "one_hot"}},
            ],
        }
    )
    ed = SimpleNamespace(
        __name__="fake_ed",
        build_eagle_disagg_draft_input=lambda batch, last_tokens_tensor, future_map: None,
        pd_first_draft_proposal=lambda topk_index, vocab_size: None,
    )
    mods = S.SGLangModules(builder=ed, processor=brp, only_given=True)
    inst = S.install(cfg, S.InstallOptions(modules=mods, version="0.5.23", hook_scheduler=False))
    try:
        assert brp.SchedulerBatchResultProcessor._resolve_spec_v2_tokens is not orig
        assert any(p.name == "_resolve_spec_v2_tokens" for p in inst.patches) and inst.recorder is not None
    finally:
        S.uninstall()
    assert brp.SchedulerBatchResultProcessor._resolve_spec_v2_tokens is orig
    # Without [[arms]] nothing scans every decode step: the method is not wrapped at all.
    inst = S.install(parse_config(base), S.InstallOptions(modules=mods, version="0.5.23", hook_scheduler=False))
    try:
        assert brp.SchedulerBatchResultProcessor._resolve_spec_v2_tokens is orig and inst.recorder is None
    finally:
        S.uninstall()


def first_verify_patch(recorder, module):
    """The live A/B target of the drop-in's table, resolved in ``module`` and wrapped (not applied)."""
    from pd_middleware.core.events import Events
    from pd_middleware.integrations.sglang.patching import FEATURES, build, resolve

    (target,) = FEATURES["live_ab"].targets
    p = build(resolve(target, module), SimpleNamespace(recorder=recorder, events=Events("guard")))
    return p.owner, p.name, p.original, p.replacement


def test_a_recorder_that_raises_never_reaches_sglang() -> None:
    """Fault injection: the recorder raises before and after; SGLang's result still comes back, counted."""
    from pd_middleware.core.events import Events
    from pd_middleware.integrations.sglang.patching import FEATURES, build, resolve

    class Processor:
        def _resolve_spec_v2_tokens(self, result, batch):
            return ["sglang's"]

    class Broken:
        def before(self, batch):
            raise KeyError("spec_verify_ct")

        def after(self, batch, result, before):
            raise ValueError("corrupt accept_lens")

    fake = SimpleNamespace(__name__="fake_brp", SchedulerBatchResultProcessor=Processor)
    guard = Events("guard")
    (target,) = FEATURES["live_ab"].targets
    new = build(resolve(target, fake), SimpleNamespace(recorder=Broken(), events=guard)).replacement
    assert new(Processor(), SimpleNamespace(), SimpleNamespace(reqs=[])) == ["sglang's"]
    assert guard.counts == {"guard:first_verify:KeyError": 1, "guard:first_verify:ValueError": 1}
    # Negative control: the same recorder called bare raises into the caller.
    with pytest.raises(KeyError):
        Broken().before(None)


def test_a_failed_export_is_logged_and_serving_goes_on(monkeypatch, caplog) -> None:
    """A refused copy into SGLang's /metrics is logged once, returns None, and adds no exporter."""
    from pd_middleware import metrics_export
    from pd_middleware.integrations.sglang import live_ab as sglang_ab

    calls = []

    def refuse(source, interval_s):
        calls.append(interval_s)
        raise PluginError("not in multiprocess mode", plugin="prometheus_client")

    monkeypatch.setattr(metrics_export, "MultiprocessMirror", refuse)
    exporters: list = []
    with caplog.at_level("ERROR", logger="pd_middleware.integrations.sglang"):
        got = sglang_ab.start_sglang_export(Metrics(), 2.0, exporters, enabled=lambda: True)
    assert got is None and exporters == [] and calls == [2.0]
    assert caplog.text.count("counters not copied into SGLang's /metrics: plugin error: not in multiprocess mode") == 1
    # Negative control: not enabled, nothing is tried.
    assert sglang_ab.start_sglang_export(Metrics(), 2.0, exporters, enabled=lambda: False) is None and calls == [2.0]


def test_the_integration_events_family_carries_every_part() -> None:
    """CounterSource: the middleware's families plus pd_middleware_integration_events_total{part, event}."""
    from prometheus_client import CollectorRegistry, generate_latest

    from pd_middleware.integrations.sglang.live_ab import CounterSource

    m = Metrics()
    m.received += 2
    parts = {"decode": {"proposal:prefill": 2}, "prefill": {"published": 3}, "guard": {}}
    src = CounterSource(m, lambda: parts)

    class Collector:
        def collect(self):
            return src.families("pd_middleware")

    reg = CollectorRegistry()
    reg.register(Collector())
    text = generate_latest(reg).decode()
    assert "pd_middleware_payloads_received_total 2.0" in text
    assert 'pd_middleware_integration_events_total{event="proposal:prefill",part="decode"} 2.0' in text
    assert 'pd_middleware_integration_events_total{event="published",part="prefill"} 3.0' in text
    # A copy racing the scheduler (a dict resized mid-copy) is retried, then left for the next sync.
    tries = []

    def racing():
        tries.append(1)
        raise RuntimeError("dictionary changed size during iteration")

    racy = list(CounterSource(m, racing).families("pd_middleware"))
    assert len(tries) == 3 and racy[-1].samples == []
