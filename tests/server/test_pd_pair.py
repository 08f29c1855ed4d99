"""A real PD pair (EAGLE3, rejection sampling, Mooncake over TCP, sglang-router) with the drop-in on.

Started once for the module, side by side with an aggregated server (the reference) and
a PD pair without the drop-in (SGLang's own one-hot proposal, the baseline). The decode
with the drop-in also runs the seed's builder (``PDM_TEST_SEED_BUILDER=1``: SGLang's own
PD proposal made inert, as before SGLang's fix): with the drop-in on, every request is
served anyway (the negative control, the same decode without the drop-in, is
test_seed.py).

Statistics (fixed prompts; SGLang's sampling is not seeded across modes, so the modes are
independent samples): first-verify acceptance is P(the first verify accepts >= 1 draft),
read from SGLang's own per-request ``spec_num_correct_drafts`` at ``max_new_tokens = 2``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pd_middleware.stats import tv_bound
from server import harness as h
from server import workload as w
from server.conftest import attach_logs

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[2]
N_ACCEPT = 128  # requests per mode at T = 1, max_new_tokens = 2
N_GREEDY = 12
N_EXACT = 192  # one prompt, T = 1, max_new_tokens = 2: the committed token after the bonus
Z_SAME = 3.29  # two-sided alpha = 1e-3: "within the CI of aggregated"
Z_BETTER = 2.33  # one-sided alpha = 1e-2: "above the one-hot baseline"


class Servers:
    def __init__(self, agg: h.Server, dropin: h.Pair, onehot: h.Pair) -> None:
        self.agg, self.dropin, self.onehot = agg, dropin, onehot
        self.sent_dropin = 0


@pytest.fixture(scope="module")
def servers(
    server_models: dict[str, Path], log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    models = h.Models(server_models["target"], server_models["eagle3"])
    cfg = h.server_config(REPO / "configs" / "sparse_floor.toml", tmp_path_factory.mktemp("cfg") / "sparse_floor.toml")
    metrics = ["--enable-metrics"]
    out: dict[str, object] = {}
    errors: list[BaseException] = []

    def run(key: str, fn: object) -> None:
        try:
            out[key] = fn()  # type: ignore[operator]
        except BaseException as exc:  # re-raised below, after the others stop
            errors.append(exc)

    starts = {
        "agg": lambda: h.start_server("aggregated", models, log_dir / "agg", extra_args=metrics),
        "dropin": lambda: h.start_pair(
            models,
            log_dir / "dropin",
            prefill_config=cfg,
            decode_config=cfg,
            decode_env={"PDM_TEST_SEED_BUILDER": "1"},
            extra_args=metrics,
        ),
        "onehot": lambda: h.start_pair(models, log_dir / "onehot", extra_args=metrics),
    }
    threads = [threading.Thread(target=run, args=(k, f)) for k, f in starts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for v in out.values():
            v.stop() if isinstance(v, h.Pair) else h.stop(v)  # type: ignore[arg-type]
        raise errors[0]
    s = Servers(out["agg"], out["dropin"], out["onehot"])  # type: ignore[arg-type]
    attach_logs([s.agg, *s.dropin.servers, *s.onehot.servers])
    try:
        yield s
    finally:
        s.dropin.stop()
        s.onehot.stop()
        h.stop(s.agg)


def test_the_drop_in_serves_where_the_seed_builder_leaves_draft_probs_unset(servers: Servers) -> None:
    log = servers.dropin.decode.log(10**7)
    assert "override seed_builder: sglang.srt.speculative.eagle_disaggregation.pd_first_draft_proposal" in log
    res = w.generate(servers.dropin.router.url, w.prompts(8), temperature=1.0, max_new_tokens=4)  # type: ignore[union-attr]
    servers.sent_dropin += len(res)
    assert [r.status for r in res] == [200] * 8, [r.error for r in res]
    assert "NoneType" not in servers.dropin.decode.log(10**7)


def test_greedy_outputs_equal_aggregated(servers: Servers) -> None:
    texts = w.prompts(N_GREEDY, offset=1)
    agg = w.generate(servers.agg.url, texts, temperature=0.0, max_new_tokens=12)
    pd = w.generate(servers.dropin.router.url, texts, temperature=0.0, max_new_tokens=12)  # type: ignore[union-attr]
    base = w.generate(servers.onehot.router.url, texts, temperature=0.0, max_new_tokens=12)  # type: ignore[union-attr]
    servers.sent_dropin += len(pd)
    assert all(r.status == 200 for r in agg + pd + base), [r.error for r in agg + pd + base if r.status != 200]
    assert [r.output_ids for r in pd] == [r.output_ids for r in agg]
    assert [r.output_ids for r in base] == [r.output_ids for r in agg]


def test_first_verify_acceptance_drop_in_matches_aggregated_and_beats_one_hot(servers: Servers) -> None:
    texts = w.prompts(N_ACCEPT, offset=2)
    agg = w.first_verify_rate(w.generate(servers.agg.url, texts, temperature=1.0, max_new_tokens=2))
    res = w.generate(servers.dropin.router.url, texts, temperature=1.0, max_new_tokens=2)  # type: ignore[union-attr]
    servers.sent_dropin += len(res)
    pd = w.first_verify_rate(res)
    base = w.first_verify_rate(w.generate(servers.onehot.router.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[union-attr]
    print(f"first-verify acceptance: aggregated {agg}, PD + drop-in {pd}, PD one-hot {base}")
    assert abs(w.z_diff(pd, agg)) <= Z_SAME, f"PD + drop-in {pd} vs aggregated {agg}: outside the 1e-3 band"
    assert w.z_diff(pd, base) >= Z_BETTER, f"PD + drop-in {pd} not above one-hot {base} at alpha 1e-2"


def test_first_token_after_the_bonus_is_distributed_as_aggregated(servers: Servers) -> None:
    """At T = 1 the committed token after the prefill's bonus has the aggregated law (TV, alpha = 1e-6).

    Both samples are compared with the same unknown law: P(TV(emp_a, emp_b) > 2 * bound) <= 2 alpha,
    with bound = tv_bound(K, N, alpha) and K the categories seen in either sample.
    """
    text = [w.prompts(1, offset=3)[0]] * N_EXACT
    agg = w.generate(servers.agg.url, text, temperature=1.0, max_new_tokens=2)
    pd = w.generate(servers.dropin.router.url, text, temperature=1.0, max_new_tokens=2)  # type: ignore[union-attr]
    servers.sent_dropin += len(pd)
    a, b = w.token_counts(agg, 1), w.token_counts(pd, 1)
    assert sum(a.values()) == sum(b.values()) == N_EXACT
    keys = set(a) | set(b)
    tv = 0.5 * sum(abs(a[k] - b[k]) for k in keys) / N_EXACT
    bound = 2 * tv_bound(len(keys), N_EXACT, 1e-6)
    print(f"token after the bonus: K = {len(keys)}, TV = {tv:.3f}, bound {bound:.3f}")
    assert tv <= bound


def test_live_ab_reads_the_running_decodes_metrics(servers: Servers) -> None:
    """``pd-middleware live-ab --url <decode>/metrics``: per-arm first-verify acceptance with CIs, no manual join."""
    import json
    import subprocess
    import sys

    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pd_middleware.cli",
                "live-ab",
                "--url",
                servers.dropin.decode.url + "/metrics",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        n = sum(a["first_verifies"] for a in report["arms"])
        if n >= servers.sent_dropin or time.monotonic() > deadline:
            break
        time.sleep(3)  # the copy into SGLang's /metrics runs every sync_interval_s
    print(f"live-ab: {report}")
    assert [a["arm"] for a in report["arms"]] == ["default"]
    (arm,) = report["arms"]
    assert arm["first_verifies"] == servers.sent_dropin  # each request's first verify, once
    lo, hi = arm["acceptance_ci"]
    assert 0.0 <= lo <= arm["acceptance"] <= hi <= 1.0


def test_decode_counters_from_metrics_count_each_request_once(servers: Servers) -> None:
    """Read from the outside (SGLang's /metrics, --enable-metrics): payloads = requests sent, no fallbacks."""
    # The counters are copied into SGLang's /metrics every sync_interval_s: wait (bounded)
    # until the copy holds every request sent, or stops changing.
    received, last, deadline = -1.0, -2.0, time.monotonic() + 30
    while time.monotonic() < deadline and received != servers.sent_dropin:
        text = h.get_text(servers.dropin.decode.url + "/metrics")
        received = sum(h.metric_values(text, "pd_middleware_payloads_received_total").values())
        if received == last:
            break
        last = received
        time.sleep(3)
    fallbacks = h.metric_values(text, "pd_middleware_fallbacks_total")
    print(f"decode: payloads_received {received}, fallbacks {fallbacks}, sent {servers.sent_dropin}")
    assert received == servers.sent_dropin
    assert {k: v for k, v in fallbacks.items() if "sglang:" in k and v} == {}
