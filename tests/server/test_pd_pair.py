"""A real PD pair (EAGLE3, rejection sampling, Mooncake over TCP, sglang-router) with the drop-in on.

The pair runs ``configs/sglang_live_ab_recompute.toml``: the prefill ships a sparse
distribution with a uniform floor (the ``sparse_floor.toml`` encoding) and the decode
splits the traffic live between three arms, ``recompute`` (the decode redraws X' from
its own draft head's q', the shipped default's source), ``sparse`` (the shipped
distribution) and ``one_hot`` (the same payloads, the distribution ignored: SGLang's own
baseline). It is compared with
the session's aggregated server (the reference) and its PD pair without the drop-in
(SGLang's own one-hot proposal): ``conftest.shared``. The decode also runs the seed's
builder (``PDM_TEST_SEED_BUILDER=1``: SGLang's own PD proposal made inert, as before
SGLang's fix): with the drop-in on, every request is served anyway (the negative
control, the same decode without the drop-in, is test_seed.py).

Statistics (fixed prompts; SGLang's sampling is not seeded across modes, so the modes are
independent samples): first-verify acceptance is P(the first verify accepts >= 1 draft),
read from SGLang's own per-request ``spec_num_correct_drafts`` at ``max_new_tokens = 2``,
and per arm from the decode's own ``/metrics`` (the first-verify histogram by arm, which
must add up to SGLang's per-request figures exactly).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from server import harness as h
from server import workload as w
from server.conftest import Shared, attach_logs

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[2]
ARMS = ("one_hot", "recompute", "sparse")
N_ACCEPT = 240  # requests at T = 1, max_new_tokens = 2 (about 80 per arm)
N_GREEDY = 12
N_EXACT = 192  # one prompt, T = 1, max_new_tokens = 2: the committed token after the bonus
Z_SAME = 3.29  # two-sided alpha = 1e-3: "within the CI of aggregated"
Z_BETTER = 2.33  # one-sided alpha = 1e-2: "above the one-hot baseline"
SCRAPE_DEADLINE_S = 30.0  # the copy into SGLang's /metrics runs every sync_interval_s (1 s)


class Servers:
    def __init__(self, shared: Shared, dropin: h.Pair, restart: Callable[[h.Server], h.Server]) -> None:
        self.agg: h.Server = shared.agg  # type: ignore[assignment]
        self.onehot: h.Pair = shared.onehot  # type: ignore[assignment]
        self.dropin = dropin
        self.sent_dropin = 0
        #: Of those, greedy (temperature 0): a shipped arm proposes them one-hot at the argmax.
        self.greedy_dropin = 0
        #: Starts a prefill like the pair's in place of a stopped one (same ports).
        self.restart = restart

    @property
    def decode_metrics(self) -> str:
        return self.dropin.decode.url + "/metrics"


@pytest.fixture(scope="module")
def servers(
    shared: Shared, server_models: dict[str, Path], log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Servers]:
    models = h.Models(server_models["target"], server_models["eagle3"])
    cfg = h.server_config(
        REPO / "configs" / "sglang_live_ab_recompute.toml",
        tmp_path_factory.mktemp("cfg") / "sglang_live_ab_recompute.toml",
    )
    dropin = h.start_pair(
        models,
        log_dir / "dropin",
        prefill_config=cfg,
        decode_config=cfg,
        decode_env={"PDM_TEST_SEED_BUILDER": "1"},
        extra_args=["--enable-metrics"],
    )
    attach_logs(dropin.servers)

    def restart(old: h.Server) -> h.Server:
        srv = h.start_server(
            "prefill",
            models,
            log_dir / "dropin-restarted",
            role="prefill",
            config=cfg,
            extra_args=["--enable-metrics"],
            port=old.port,
            bootstrap_port=old.bootstrap_port,
        )
        dropin.servers.append(srv)  # stopped with the pair
        return srv

    try:
        yield Servers(shared, dropin, restart)
    finally:
        dropin.stop()


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
    servers.greedy_dropin += len(pd)
    assert all(r.status == 200 for r in agg + pd + base), [r.error for r in agg + pd + base if r.status != 200]
    assert [r.output_ids for r in pd] == [r.output_ids for r in agg]
    assert [r.output_ids for r in base] == [r.output_ids for r in agg]


def test_first_verify_acceptance_recompute_and_shipped_arms_match_aggregated_and_beat_one_hot(
    servers: Servers,
) -> None:
    texts = w.prompts(N_ACCEPT, offset=2)
    agg = w.first_verify_rate(w.generate(servers.agg.url, texts, temperature=1.0, max_new_tokens=2))
    before = w.arm_counts(servers.decode_metrics)
    res = w.generate(servers.dropin.router.url, texts, temperature=1.0, max_new_tokens=2)  # type: ignore[union-attr]
    servers.sent_dropin += len(res)
    assert all(r.status == 200 for r in res), [r.error for r in res if r.status != 200]
    pd = w.first_verify_rate(res)
    base = w.first_verify_rate(w.generate(servers.onehot.router.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[union-attr]
    arms = w.arm_rates_since(servers.decode_metrics, before, N_ACCEPT)
    print(
        f"first-verify acceptance: aggregated {agg}, PD + drop-in (all arms, SGLang's figures) {pd}, "
        f"arm recompute {arms.get('recompute')}, arm sparse {arms.get('sparse')}, arm one_hot {arms.get('one_hot')}, "
        f"PD without the drop-in {base}"
    )
    assert sorted(arms) == sorted(ARMS)
    # The decode's per-arm counts are SGLang's own per-request results, each request once.
    assert sum(r.n for r in arms.values()) == N_ACCEPT
    assert sum(r.hits for r in arms.values()) == pd.hits
    onehot = arms["one_hot"]
    for name in ("recompute", "sparse"):
        rate = arms[name]
        assert abs(w.z_diff(rate, agg)) <= Z_SAME, f"arm {name} {rate} vs aggregated {agg}: outside the 1e-3 band"
        assert w.z_diff(rate, base) >= Z_BETTER, f"arm {name} {rate} not above one-hot {base} at alpha 1e-2"
    # The drop-in's one-hot arm is SGLang's own proposal: the same law as the pair without it.
    assert abs(w.z_diff(onehot, base)) <= Z_SAME, f"arm one_hot {onehot} vs SGLang's one-hot {base}"


def test_first_token_after_the_bonus_is_distributed_as_aggregated(servers: Servers) -> None:
    """At T = 1 the committed token after the prefill's bonus has the aggregated law.

    Every arm is exact, so the mixed traffic is too. The two samples are compared by the
    permutation test of their TV (``w.same_law``: false-positive bound alpha = 1e-3 at any
    number of categories; the trained model spreads this token over about 100, where the
    former TV threshold 2 * tv_bound(K, N, 1e-6) was above 1, vacuous). Its power at this
    size: a law 0.5 away in TV is always rejected, one 0.27 away about half the time
    (tests/test_stats.py).
    """
    text = [w.prompts(1, offset=3)[0]] * N_EXACT
    agg = w.generate(servers.agg.url, text, temperature=1.0, max_new_tokens=2)
    pd = w.generate(servers.dropin.router.url, text, temperature=1.0, max_new_tokens=2)  # type: ignore[union-attr]
    servers.sent_dropin += len(pd)
    tv, p, k = w.same_law(agg, pd, 1)
    print(f"token after the bonus: K = {k}, TV = {tv:.3f}, permutation p = {p:.4f} (alpha {w.LAW_ALPHA})")
    assert p > w.LAW_ALPHA


def test_live_ab_reports_both_arms_from_the_running_decode(servers: Servers) -> None:
    """``pd-middleware live-ab --url <decode>/metrics --json``: per-arm acceptance with CIs, no manual join."""
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    while True:
        out = subprocess.run(
            [sys.executable, "-m", "pd_middleware.cli", "live-ab", "--url", servers.decode_metrics, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        n = sum(a["first_verifies"] for a in report["arms"])
        if n >= servers.sent_dropin or time.monotonic() > deadline:
            break
        time.sleep(2.5)
    print(f"live-ab: {report}")
    assert report["baseline"] == "one_hot"
    assert sorted(a["arm"] for a in report["arms"]) == sorted(ARMS)
    assert n == servers.sent_dropin  # each request's first verify, once; warmups and health checks excluded
    by_arm = {a["arm"]: a for a in report["arms"]}
    for arm in by_arm.values():
        lo, hi = arm["acceptance_ci"]
        assert 0.0 <= lo <= arm["acceptance"] <= hi <= 1.0
    # The shipped and recompute arms' lower bounds are above the one-hot arm's upper bound on these models.
    for name in ("recompute", "sparse"):
        assert by_arm[name]["acceptance_ci"][0] > by_arm["one_hot"]["acceptance_ci"][1], by_arm


def test_counters_on_both_nodes_count_each_request_once(servers: Servers) -> None:
    """Read from the outside (SGLang's /metrics, --enable-metrics), on the decode and the prefill."""
    sent = servers.sent_dropin
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    while True:
        dec = h.get_text(servers.decode_metrics)
        pre = h.get_text(servers.dropin.prefill.url + "/metrics")
        received = sum(h.metric_values(dec, "pd_middleware_payloads_received_total").values())
        events = h.metric_values(dec, "pd_middleware_integration_events_total")
        published = h.metric_values(pre, "pd_middleware_integration_events_total")
        if received >= sent or time.monotonic() > deadline:
            break
        time.sleep(2.5)
    fallbacks = h.metric_values(dec, "pd_middleware_fallbacks_total")
    print(f"decode: payloads_received {received}, fallbacks {fallbacks}, events {events}; prefill: {published}")
    assert received == sent
    assert {k: v for k, v in fallbacks.items() if "sglang:" in k and v} == {}

    def event(values: dict[str, float], part: str, name: str) -> float:
        return sum(v for k, v in values.items() if f'part="{part}"' in k and f'event="{name}"' in k)

    # Every request's proposal came from the prefill's payload (arms sparse and one_hot), was
    # recomputed by the decode's draft head (arm recompute), or, a greedy request on a shipped
    # arm, is the one-hot at the argmax the prefill sent X-only (proposal:local, as SGLang
    # proposes greedy rows): once each, none from a fallback.
    recomputed, local = event(events, "recompute", "recomputed"), event(events, "decode", "proposal:local")
    assert recomputed > 0 and event(events, "decode", "proposal:prefill") + local + recomputed == sent
    assert local <= servers.greedy_dropin, (local, servers.greedy_dropin)
    # Each row read and attached once: a distribution for every sampled request, none (X-only)
    # for a greedy one, whichever arm it went to.
    assert event(events, "decode", "attached:prefill") == sent - servers.greedy_dropin
    assert event(events, "decode", "attached:no_distribution") == servers.greedy_dropin
    assert not [k for k, v in events.items() if 'part="recompute"' in k and "fallback" in k and v], events
    # The prefill proposed every greedy request at its argmax (its health checks apart).
    assert event(published, "prefill", "greedy") - event(published, "prefill", "probe") == servers.greedy_dropin
    assert event(events, "inband", "inband:read") >= sent
    # The prefill staged one payload per request (its warmups and health checks apart), and
    # its own /metrics says so.
    assert event(published, "prefill", "staged") == sent
    # No KV transfer was lost on either node (SGLang's own count, absent until its first
    # failure; a lost one fails its request after the tier's 60 s transfer timeouts,
    # harness.TRANSFER_TIMEOUT_S, instead of SGLang's default 300 s).
    lost = {
        node: sum(h.metric_values(text, "sglang:num_transfer_failed_reqs_total").values())
        for node, text in (("prefill", pre), ("decode", dec))
    }
    assert lost == {"prefill": 0, "decode": 0}, lost


#: Requests in flight when the prefill is killed, and the bound on each one's end.
N_INFLIGHT = 16
KILL_BOUND_S = 240.0


def _ours_in_traceback(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if ln.lstrip().startswith('File "') and "pd_middleware" in ln]


def test_a_killed_prefill_fails_its_requests_as_sglang_does_and_a_restarted_one_serves(servers: Servers) -> None:
    """The module's last test: SIGKILL to the prefill's process group while 16 requests are
    in flight. Every request ends within the bound, with 200 or SGLang's own error; the
    decode still answers /health and its log has no traceback through pd_middleware; a
    prefill restarted on the same ports is found by the router and serves a new request."""
    pd = servers.dropin
    prefill, log_before = pd.prefill, pd.prefill.log(10**8).count("Prefill batch")
    results: list[w.Result] = []
    texts = w.prompts(N_INFLIGHT, offset=7)

    def send() -> None:
        results.extend(
            w.generate(
                pd.router.url,  # type: ignore[union-attr]
                texts,
                temperature=1.0,
                max_new_tokens=48,
                concurrency=N_INFLIGHT,
                timeout_s=KILL_BOUND_S,
            )
        )

    sender = threading.Thread(target=send, daemon=True)
    t0 = time.monotonic()
    sender.start()
    # The event: the prefill has started on this traffic (a new prefill batch in its log).
    deadline = time.monotonic() + 120
    while prefill.log(10**8).count("Prefill batch") == log_before and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(prefill.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic() - t0
    sender.join(KILL_BOUND_S + 30)
    took = time.monotonic() - t0
    assert not sender.is_alive(), f"requests still open {took:.0f} s after the kill"
    outcomes: dict[str, int] = {}
    for r in results:
        key = "200" if r.status == 200 else f"{r.status}: {r.error[:120]}"
        outcomes[key] = outcomes.get(key, 0) + 1
    print(f"prefill killed {killed_at:.1f} s into {N_INFLIGHT} requests; all ended after {took:.1f} s: {outcomes}")
    assert len(results) == N_INFLIGHT
    for r in results:
        assert r.status == 200 or r.status >= 400, r  # an HTTP answer, never a hang or a dropped socket
    with urllib.request.urlopen(pd.decode.url + "/health", timeout=30) as resp:
        assert resp.status == 200
    assert _ours_in_traceback(pd.decode.log(10**8)) == []
    assert pd.decode.alive()
    # The restart: same HTTP and bootstrap ports, so the router's configured worker is back.
    servers.restart(prefill)
    deadline = time.monotonic() + 180
    last = None
    while time.monotonic() < deadline:
        (last,) = w.generate(pd.router.url, texts[:1], temperature=0.0, max_new_tokens=4, timeout_s=60)  # type: ignore[union-attr]
        if last.status == 200:
            break
        time.sleep(3)
    assert last is not None and last.status == 200, last
    assert _ours_in_traceback(pd.decode.log(10**8)) == []
