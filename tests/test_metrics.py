"""Metrics (issue 14 item 4): names, histograms, the endpoint, SGLang's /metrics, promtool.

Everything real: prometheus_client's own exposition and parser, a real HTTP endpoint on
loopback, real ``promtool check metrics`` (Debian package ``prometheus``; skipped when
absent), real multiprocess files written by separate processes. The ``sglang`` test serves
them through SGLang's own ``add_prometheus_middleware`` (the ``/metrics`` of its HTTP
server under ``--enable-metrics``) with Starlette's test client.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pd_middleware import ConfigError, Payload, PluginError
from pd_middleware.config import parse_config
from pd_middleware.core.metrics import ASSEMBLY_BUCKETS, RECEIVE_BUCKETS, Histogram, Metrics

prometheus_client = pytest.importorskip("prometheus_client")

PROMTOOL = shutil.which("promtool")
SGLANG_ABSENT = importlib.util.find_spec("sglang") is None
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def exposition(m: Metrics) -> str:
    reg = prometheus_client.CollectorRegistry()
    m.register_prometheus(reg)
    return prometheus_client.generate_latest(reg).decode()


def busy_metrics() -> Metrics:
    """A Metrics with every family non-empty."""
    m = Metrics()
    m.received = 7
    m.delivered = 5
    m.arm_delivered.update({"one_hot": 2, "sparse": 3})
    m.record_failure("wire:draft_probs", "sparse")
    m.record_failure("hook:boom")
    m.fallbacks["greedy"] += 4
    m.bytes["inline"] += 1024
    for v in (3e-6, 5e-6, 2e-4, 0.5, 2.0):
        m.receive_to_delivery.observe(v)
    m.batch_assembly.observe(1.2e-5)
    for arm, k in (("one_hot", 0), ("one_hot", 1), ("sparse", 1), ("sparse", 3)):
        m.record_first_verify(arm, k)
    m.record_first_verify(None, 2)
    return m


# ----------------------------------------------------------------- histograms and counts


def test_histogram_buckets_follow_prometheus_le() -> None:
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 2.0, 2.5):
        h.observe(v)
    assert h.counts == [2, 2, 1] and h.count == 5 and h.sum == pytest.approx(7.5)
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram((2.0, 1.0))
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram(())


def test_first_verify_counts_by_arm_with_caps() -> None:
    m = Metrics()
    m.record_first_verify("a", 2)
    m.record_first_verify("a", 99)  # clamped into the last bucket
    m.record_first_verify(None, 1)
    with pytest.raises(ValueError, match="accepted draft tokens must be >= 0, got -1"):
        m.record_first_verify("a", -1)
    for i in range(80):  # past MAX_ARMS distinct arms: unattributed, the label set stays bounded
        m.record_first_verify(f"arm{i}", 0)
    s = m.snapshot()
    assert s["first_verify_accepted_by_arm"]["a"][2] == 1 and s["first_verify_accepted_by_arm"]["a"][-1] == 1
    assert len(s["first_verify_accepted_by_arm"]) == 64
    assert s["first_verify_unattributed"] == 1 + (80 - 63)


def test_pipeline_and_assembly_observe_their_histograms() -> None:
    from pd_middleware.core.contracts import ReceiveContext
    from pd_middleware.middleware import DecodeMiddleware

    cfg = parse_config({"model": {"vocab_size": 16}, "decode": {"max_batch": 4}})
    mw = DecodeMiddleware.from_config(cfg)
    try:
        p = Payload("r1", (3,), (0.5,), 16)
        d = mw.receive(p)
        mw.receive(Payload("r2", (3,), (0.5,), 16), ReceiveContext())  # no arrival stamp: not observed
        assert mw.metrics.receive_to_delivery.count == 1
        assert 0 <= mw.metrics.receive_to_delivery.sum < 1.0
        mw.assemble([d])
        assert mw.metrics.batch_assembly.count == 1
    finally:
        mw.close()


# ----------------------------------------------------------------- names and the exposition

NAMES = {
    "pd_middleware_payloads_received_total": "counter",
    "pd_middleware_payloads_delivered_total": "counter",
    "pd_middleware_payloads_failed_total": "counter",
    "pd_middleware_payloads_failed_by_arm_total": "counter",
    "pd_middleware_fallbacks_total": "counter",
    "pd_middleware_received_bytes_total": "counter",
    "pd_middleware_receive_to_delivery_seconds": "histogram",
    "pd_middleware_batch_assembly_seconds": "histogram",
    "pd_middleware_first_verify_accepted_tokens": "histogram",
    "pd_middleware_first_verify_unattributed_total": "counter",
    "pd_middleware_receive_loop_deaths_total": "counter",
}


def test_names_and_types_keep_to_convention() -> None:
    text = exposition(busy_metrics())
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert types == NAMES
    for name, typ in types.items():
        assert name.startswith("pd_middleware_")
        if typ == "counter":
            assert name.endswith("_total")
        if "bytes" in name:
            assert name.endswith("_bytes_total")
    assert 'pd_middleware_received_bytes_total{plane="inline"} 1024.0' in text
    assert 'pd_middleware_payloads_failed_total{reason="wire:draft_probs"} 1.0' in text
    assert 'pd_middleware_payloads_failed_by_arm_total{arm="sparse"} 1.0' in text


def test_histogram_exposition_is_cumulative_and_matches_counts() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    m = busy_metrics()
    fams = {f.name: f for f in text_string_to_metric_families(exposition(m))}
    rtd = fams["pd_middleware_receive_to_delivery_seconds"]
    buckets = [(s.labels["le"], s.value) for s in rtd.samples if s.name.endswith("_bucket")]
    assert len(buckets) == len(RECEIVE_BUCKETS) + 1 and buckets[-1] == ("+Inf", 5.0)
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert dict(buckets)["5e-06"] == 2.0  # 3 µs and 5 µs: le is inclusive
    count = next(s.value for s in rtd.samples if s.name.endswith("_count"))
    assert count == 5.0
    fv = fams["pd_middleware_first_verify_accepted_tokens"]
    sums = {s.labels["arm"]: s.value for s in fv.samples if s.name.endswith("_sum")}
    counts = {s.labels["arm"]: s.value for s in fv.samples if s.name.endswith("_count")}
    assert sums == {"one_hot": 1.0, "sparse": 4.0} and counts == {"one_hot": 2.0, "sparse": 2.0}
    assert len([s for s in fams["pd_middleware_batch_assembly_seconds"].samples if s.name.endswith("_bucket")]) == (
        len(ASSEMBLY_BUCKETS) + 1
    )


def _promtool(text: str) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)"
)
def test_promtool_accepts_the_exposition() -> None:
    out = _promtool(exposition(busy_metrics()))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "" and out.stderr.strip() == ""
    # Negative control: the lint does reject a counter named against the convention.
    bad = "# HELP pd_bad_bytes A counter\n# TYPE pd_bad_bytes counter\npd_bad_bytes 1\n"
    out = _promtool(bad)
    assert out.returncode != 0 and 'counter metrics should have "_total" suffix' in out.stdout + out.stderr


# ----------------------------------------------------------------- the endpoint


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", ""


def test_endpoint_serves_and_releases_its_port() -> None:
    from pd_middleware.middleware import DecodeMiddleware

    cfg = parse_config({"model": {"vocab_size": 16}, "decode": {"max_batch": 4}, "metrics": {"port": 0}})
    mw = DecodeMiddleware.from_config(cfg)
    server = mw.exporters[0]
    url = server.url
    host, port = url.split("//")[1].split("/")[0].split(":")
    try:
        mw.receive(Payload("r1", (3,), (0.5,), 16))
        status, ctype, body = _get(url)
        assert status == 200 and ctype.startswith("text/plain; version=")
        assert "pd_middleware_payloads_received_total 1.0" in body
        assert _get(url.replace("/metrics", "/other"))[0] == 404
        # The port is taken while it serves: a second endpoint on it is a config error.
        cfg2 = parse_config({"model": {"vocab_size": 16}, "decode": {"max_batch": 4}, "metrics": {"port": int(port)}})
        with pytest.raises(ConfigError, match=rf"metrics.port.*cannot serve metrics on 127.0.0.1:{port}"):
            DecodeMiddleware.from_config(cfg2)
    finally:
        mw.close()
    assert mw.exporters == []
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=2).close()


def test_metrics_config_is_typed_and_strict() -> None:
    assert parse_config({}).metrics.port is None
    with pytest.raises(ConfigError, match=r"metrics\.port"):
        parse_config({"metrics": {"port": 70000}})
    with pytest.raises(ConfigError, match=r"metrics\.sync_interval_s"):
        parse_config({"metrics": {"sync_interval_s": 0}})
    with pytest.raises(ConfigError, match=r"metrics"):
        parse_config({"metrics": {"prot": 9400}})


# ----------------------------------------------------------------- multiprocess (SGLang's /metrics)

WRITER = textwrap.dedent(
    """
    import sys
    from pd_middleware.core.metrics import Metrics
    from pd_middleware.metrics_export import MultiprocessMirror
    scale = int(sys.argv[1])
    m = Metrics()
    mirror = MultiprocessMirror(m, interval_s=60.0).start()   # first sync: zeros
    m.received += 3 * scale
    m.bytes["bulk"] += 1000 * scale
    m.receive_to_delivery.observe(2e-5)
    for _ in range(scale):
        m.record_first_verify("sparse", 1)
    m.record_first_verify("one_hot", 0)
    mirror.sync()
    m.received += 1          # after a sync: stop() writes the rest
    mirror.stop()
    print("synced", mirror.syncs)
    """
)


def _write_from_processes(tmp_path) -> str:
    """Two writer processes (two DP groups' schedulers) fill one multiprocess directory."""
    d = tmp_path / "prom"
    d.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d), "PYTHONPATH": ROOT}
    for scale in (1, 2):
        out = subprocess.run(
            [sys.executable, "-c", WRITER, str(scale)], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "synced 3"
    assert sorted(p.name.split("_")[0] for p in d.iterdir()) == ["counter", "counter", "histogram", "histogram"]
    return str(d)


def _check_merged(text: str) -> None:
    assert "pd_middleware_payloads_received_total 11.0" in text  # (3+1) + (6+1)
    assert 'pd_middleware_received_bytes_total{plane="bulk"} 3000.0' in text
    assert 'pd_middleware_first_verify_accepted_tokens_bucket{arm="sparse",le="0.0"} 0.0' in text
    assert 'pd_middleware_first_verify_accepted_tokens_bucket{arm="sparse",le="1.0"} 3.0' in text
    assert 'pd_middleware_first_verify_accepted_tokens_count{arm="one_hot"} 2.0' in text
    assert 'pd_middleware_first_verify_accepted_tokens_sum{arm="sparse"} 3.0' in text
    assert "pd_middleware_receive_to_delivery_seconds_count 2.0" in text
    from pd_middleware.evaluation.live_ab import parse_prometheus

    arms = parse_prometheus(text)
    assert arms["sparse"].counts[:2] == (0, 3) and arms["one_hot"].counts[:1] == (2,)


def test_multiprocess_files_merge_across_processes(tmp_path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    d = _write_from_processes(tmp_path)
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=d)
    text = generate_latest(reg).decode()
    _check_merged(text)
    if PROMTOOL is not None:
        out = _promtool(text)
        assert out.returncode == 0, out.stdout + out.stderr


FLAKY_SOURCE = textwrap.dedent(
    """
    import logging, sys, time
    from pd_middleware.core.metrics import Metrics
    from pd_middleware.metrics_export import MultiprocessMirror
    logging.basicConfig(level=logging.ERROR, stream=sys.stdout, format="%(message)s")
    m = Metrics()

    class Flaky:
        calls = 0
        def families(self, prefix):
            Flaky.calls += 1
            if Flaky.calls in (2, 3):   # the thread's first two syncs fail
                raise ValueError("boom")
            return m.families(prefix)

    mirror = MultiprocessMirror(Flaky(), interval_s=0.05).start()
    m.received += 5
    deadline = time.monotonic() + 20
    while Flaky.calls < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    print("alive", mirror._thread.is_alive(), "calls", Flaky.calls >= 6)
    mirror.stop()
    """
)


def test_a_failing_sync_is_logged_once_and_the_copy_goes_on(tmp_path) -> None:
    """The mirror's thread survives a sync that raises: one log line, later syncs write the values."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    d = tmp_path / "prom"
    d.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d), "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", FLAKY_SOURCE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("copying counters into the multiprocess files failed: ValueError('boom')") == 1, out.stdout
    assert "alive True calls True" in out.stdout
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(d))
    assert "pd_middleware_payloads_received_total 5.0" in generate_latest(reg).decode()


def test_mirror_refuses_a_process_not_in_multiprocess_mode() -> None:
    from pd_middleware.metrics_export import MultiprocessMirror

    if getattr(prometheus_client.values.ValueClass, "_multiprocess", False):
        pytest.skip("this test process runs prometheus_client in multiprocess mode")
    with pytest.raises(PluginError, match="not in multiprocess mode in this process"):
        MultiprocessMirror(Metrics())


@pytest.mark.sglang
@pytest.mark.skipif(SGLANG_ABSENT, reason="SGLang is not installed; run `make setup-sglang`")
def test_counters_appear_in_sglangs_own_metrics_route(tmp_path, monkeypatch) -> None:
    """SGLang's real ``add_prometheus_middleware`` (its HTTP server's /metrics) serves our counters."""
    from _sglang_import import import_sglang  # tests/ is on sys.path (no __init__.py)
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    d = _write_from_processes(tmp_path)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", d)
    common = import_sglang("sglang.srt.utils.common")
    app = Starlette()
    common.add_prometheus_middleware(app)
    with TestClient(app) as client:
        r = client.get("/metrics")
    assert r.status_code == 200
    _check_merged(r.text)


def test_sglang_export_gate_is_off_outside_a_metrics_scheduler(monkeypatch) -> None:
    from pd_middleware.integrations.sglang.live_ab import (
        sglang_exports_metrics,
        start_sglang_export,
    )
    from pd_middleware.integrations.sglang.patching import Symbols

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert sglang_exports_metrics(Symbols()) is False

    exporters: list = []
    gate = lambda: sglang_exports_metrics(Symbols())  # noqa: E731  # the installation's gate, without SGLang
    assert start_sglang_export(Metrics(), 1.0, exporters, enabled=gate) is None and exporters == []


RANK_WRITER = textwrap.dedent(
    """
    import sys, types
    from types import SimpleNamespace
    from pd_middleware.core.metrics import Metrics
    from pd_middleware.integrations.sglang.live_ab import CounterSource, sglang_exports_metrics, start_sglang_export
    from pd_middleware.integrations.sglang.patching import FEATURES, RUNTIME_MODULE, Symbols, resolve
    rank, all_schedulers = int(sys.argv[1]), sys.argv[2] == "1"
    # SGLang's runtime context as a scheduler of attention-TP rank `rank` publishes it.
    rc = types.ModuleType(RUNTIME_MODULE)
    obs = SimpleNamespace(enable_metrics=True, enable_metrics_for_all_schedulers=all_schedulers)
    par = SimpleNamespace(attn_tp_rank=rank, attn_cp_rank=0)
    rc.get_observability = lambda: obs
    rc.get_parallel = lambda: par
    symbols = Symbols([resolve(t, rc) for t in FEATURES["metrics_export"].targets])
    # Every attention-TP rank of the group ran the same requests: the same counts on each.
    m = Metrics()
    m.received += 5
    for _ in range(3):
        m.record_first_verify("sparse", 1)
    source = CounterSource(m, lambda: {"decode": {"proposal:prefill": 5}})
    exporters = []
    mirror = start_sglang_export(source, 60.0, exporters, enabled=lambda: sglang_exports_metrics(symbols))
    for e in exporters:
        e.stop()
    print("exported", mirror is not None)
    """
)


@pytest.mark.parametrize("all_schedulers", [False, True], ids=["rank0_only", "all_schedulers"])
def test_counts_are_copied_once_under_every_metrics_flag(tmp_path, all_schedulers) -> None:
    """Two scheduler processes of one attention-TP group (ranks 0 and 1, the same requests)
    behind one multiprocess directory, as SGLang runs them: the merged /metrics counts each
    request once, with and without --enable-metrics-for-all-schedulers (which made every rank
    copy its counters, and the collector summed the identical series: counts x attention-TP
    size)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    d = tmp_path / "prom"
    d.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(d), "PYTHONPATH": ROOT}
    said = []
    for rank in (0, 1):
        out = subprocess.run(
            [sys.executable, "-c", RANK_WRITER, str(rank), str(int(all_schedulers))],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        said.append(out.stdout.strip())
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(d))
    text = generate_latest(reg).decode()
    assert "pd_middleware_payloads_received_total 5.0" in text, text
    assert 'pd_middleware_first_verify_accepted_tokens_count{arm="sparse"} 3.0' in text
    assert 'pd_middleware_integration_events_total{event="proposal:prefill",part="decode"} 5.0' in text
    assert said == ["exported True", "exported False"]


# ----------------------------------------------------------------- docs and the dashboard

DOC = os.path.join(ROOT, "docs", "metrics.md")
DASHBOARD = os.path.join(ROOT, "docs", "grafana", "pd-middleware.json")
GRAFANA_VARS = {"$__rate_interval": "5m", "$__range": "6h", "$baseline": "one_hot"}


def doc_promql() -> list[str]:
    """The expressions of docs/metrics.md's ```promql blocks (comments and blank lines separate them;
    a line starting at column 0 with a name or number starts a new one)."""
    text = Path(DOC).read_text(encoding="utf-8")
    exprs: list[list[str]] = []
    for block in re.findall(r"```promql\n(.*?)```", text, re.S):
        fresh = True
        for line in block.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                fresh = True
                continue
            if fresh or re.match(r"^[A-Za-z0-9]", line):
                exprs.append([])
            exprs[-1].append(line)
            fresh = False
    return ["\n".join(e) for e in exprs]


def dashboard_promql() -> list[str]:
    import json

    dash = json.loads(Path(DASHBOARD).read_text(encoding="utf-8"))
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            e = t["expr"]
            for k, v in GRAFANA_VARS.items():
                e = e.replace(k, v)
            out.append(e)
    return out


def test_every_name_in_the_docs_and_dashboard_is_exported() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    samples = set()
    for fam in text_string_to_metric_families(exposition(busy_metrics())):
        samples.add(fam.name)
        samples.update(s.name for s in fam.samples)
    # The SGLang integration's own family (its copy into SGLang's /metrics carries it too).
    from pd_middleware.integrations.sglang.live_ab import CounterSource

    for fam in CounterSource(busy_metrics(), lambda: {"decode": {"probe": 1}}).families("pd_middleware"):
        samples.add(fam.name)
        samples.update(s.name for s in fam.samples)
    doc = Path(DOC).read_text(encoding="utf-8")
    used = set(re.findall(r"\bpd_middleware_[a-z_]+\b", doc + "\n".join(dashboard_promql())))
    used = {u for u in used if not u.startswith("pd_middleware_plugins")}
    assert used - samples == set()
    # and every exported family is documented
    assert set(NAMES) - used == set()
    assert len(doc_promql()) >= 12 and len(dashboard_promql()) >= 15


def _check_rules(exprs: list[str], tmp_path) -> subprocess.CompletedProcess:
    lines = ["groups:", "  - name: docs", "    rules:"]
    for i, e in enumerate(exprs):
        lines += [f"      - record: docs:expr_{i}", "        expr: |"] + [f"          {x}" for x in e.splitlines()]
    path = tmp_path / "rules.yml"
    path.write_text("\n".join(lines) + "\n")
    return subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)"
)
def test_promtool_parses_every_documented_query(tmp_path) -> None:
    exprs = doc_promql() + dashboard_promql()
    out = _check_rules(exprs, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout
    # Negative control: a broken query is refused.
    bad = _check_rules(["sum by (arm) (rate(pd_middleware_payloads_received_total[5m]"], tmp_path)
    assert bad.returncode != 0 and "unclosed left parenthesis" in bad.stdout + bad.stderr


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`; .ci/run installs it)"
)
def test_the_documented_ab_queries_compute_the_right_numbers(tmp_path) -> None:
    """promtool evaluates the doc's live A/B queries on series of known increase.

    Per minute: one_hot 8 first verifies, 4 drafts accepted, 4 with none accepted;
    sparse 8, 6 accepted, 2 with none. Expected: mean 0.5 and 0.75, first-position
    acceptance 0.5 and 0.75, ratio vs one_hot 1.0 and 1.5 (increase()'s extrapolation
    scales numerator and denominator alike, and these ratios are exact in binary).
    """
    exprs = doc_promql()
    mean = next(
        e for e in exprs if e.startswith("sum by (arm) (increase(pd_middleware_first_verify_accepted_tokens_sum")
    )
    accept = next(e for e in exprs if e.startswith("1 - sum by (arm)"))
    ratio = next(e for e in exprs if "group_left()" in e)
    fv = "pd_middleware_first_verify_accepted_tokens"
    series = []
    for arm, acc, zero in (("one_hot", 4, 4), ("sparse", 6, 2)):
        series += [
            (f'{fv}_sum{{arm="{arm}"}}', f"0+{acc}x400"),
            (f'{fv}_count{{arm="{arm}"}}', "0+8x400"),
            (f'{fv}_bucket{{arm="{arm}",le="0.0"}}', f"0+{zero}x400"),
        ]
    want = {
        mean: {"one_hot": 0.5, "sparse": 0.75},
        accept: {"one_hot": 0.5, "sparse": 0.75},
        ratio: {"one_hot": 1.0, "sparse": 1.5},
    }
    lines = ["tests:", "  - interval: 1m", "    input_series:"]
    for s, v in series:
        lines += [f"      - series: '{s}'", f"        values: '{v}'"]
    lines.append("    promql_expr_test:")
    for expr, values in want.items():
        lines += ["      - expr: |"] + [f"          {x}" for x in expr.splitlines()]
        lines += ["        eval_time: 360m", "        exp_samples:"]
        for arm, v in values.items():
            lines += [f"          - labels: '{{arm=\"{arm}\"}}'", f"            value: {v}"]
    path = tmp_path / "ab_test.yml"
    path.write_text("\n".join(lines) + "\n")
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # Negative control: a wrong expectation fails.
    path.write_text(path.read_text().replace("value: 1.5", "value: 1.4"))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "FAILED" in out.stdout + out.stderr


@pytest.mark.sglang
@pytest.mark.skipif(SGLANG_ABSENT, reason="SGLang is not installed; run `make setup-sglang`")
def test_sglang_export_gate_is_sglangs_stats_logging_rank_under_every_flag(monkeypatch, tmp_path) -> None:
    """Copied from SGLang's stats-logging rank only (attention-TP rank 0, attention-CP rank 0),
    with or without --enable-metrics-for-all-schedulers: our series carry no rank label, so a
    copy from every rank would be summed (``test_counts_are_copied_once_under_every_metrics_flag``).

    SGLang's runtime context is published only inside a started scheduler, so its two
    getters are replaced here by objects with the attributes SGLang's Scheduler reads.
    """
    from types import SimpleNamespace

    from _sglang_import import import_sglang  # tests/ is on sys.path (no __init__.py)

    from pd_middleware.integrations.sglang.live_ab import sglang_exports_metrics
    from pd_middleware.integrations.sglang.patching import FEATURES, Symbols, resolve

    rc = import_sglang("sglang.srt.runtime_context")

    def symbols():  # the table's READ targets of the export, resolved in SGLang's module as it is now
        return Symbols([resolve(t, rc) for t in FEATURES["metrics_export"].targets])

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert sglang_exports_metrics(symbols()) is False  # no published context: not a scheduler
    for enabled, rank, cp_rank, all_schedulers, want in (
        (True, 0, 0, False, True),
        (True, 1, 0, False, False),
        (True, 0, 0, True, True),
        (True, 1, 0, True, False),  # SGLang reports from this rank too; our unlabelled series would be summed
        (True, 0, 1, True, False),  # attention CP: the same requests again
        (False, 0, 0, False, False),
    ):
        obs = SimpleNamespace(enable_metrics=enabled, enable_metrics_for_all_schedulers=all_schedulers)
        par = SimpleNamespace(attn_tp_rank=rank, attn_cp_rank=cp_rank)
        # Stand-ins with SGLang's own signature (no parameters): the table checks it.
        monkeypatch.setattr(rc, "get_observability", (lambda o: lambda: o)(obs))
        monkeypatch.setattr(rc, "get_parallel", (lambda p: lambda: p)(par))
        assert sglang_exports_metrics(symbols()) is want, (enabled, rank, cp_rank, all_schedulers)
