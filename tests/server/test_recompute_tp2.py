"""TP 2 in a real server: the shipped default on a decode at ``--tp 2``, overlapped, real collectives.

The decode runs ``configs/sglang.toml`` (decode-only recompute) at ``--tp-size 2`` behind a
stock prefill at TP 1, **with SGLang's overlap scheduler on** (what every GPU decode runs;
``cpu_gaps``' ``overlap_spec_cpu`` keeps it on for speculative decoding on this CPU): two
SGLang scheduler ranks on this machine's two cores (``SGLANG_CPU_OMP_THREADS_BIND="0|1"``),
their all-reduces and all-gathers over gloo on 127.0.0.1 (SGLang's CPU fallback: no
sgl-kernel shared-memory all-reduce here). The draft head's vocab-parallel gather and the
per-batch recompute vote are real collectives between the two ranks; under overlap the
head is issued on the scheduler's forward stream (``ordering.py``; on a CPU every stream
is the caller's, so this shows function, the order itself is pinned in
``tests/test_sglang_groups.py``). X' is drawn by SGLang's own seeded ``fast_sample`` on
0.5.23 (its hash from the tier's CPU ops stand-in), by the drop-in's seeded inverse-CDF
draw on 0.5.21 (whose ``fast_sample`` takes no seed).

Parametrised by release (:data:`RELEASES`): the venv's SGLang (0.5.23), and 0.5.21 (the
release ai-dynamo 1.6.1 pins; its folder from ``make setup-releases``, so ``make
test-releases`` runs it and ``make test-server`` deselects it), each against an
aggregated server of the same release at TP 1, overlapped too, started with the pair.

One pair serves two phases. The decode starts with a fault on rank 1's head alone
(``PDM_TEST_RECOMPUTE_FAULT=head:1``, on while the file named by
``PDM_TEST_RECOMPUTE_FAULT_WHILE`` exists: environment switches only this tier sets,
never a config key):

1. **Fault on.** Rank 1's failure becomes its vote, so both ranks fall back to the same
   one-hot at the prefill's X: SGLang's own proposal, on this very topology. No request
   hangs (each is bounded) or fails, rank 0 (the one that reports) counts no row
   ``recomputed`` and exactly one ``fallback:peer_failed`` per request (SGLang's health
   checks are counted apart, ``probe``). This phase is the same-topology reference: its
   greedy outputs, and its first-verify acceptance (the one-hot baseline).
2. **Fault off** (the file removed). Greedy outputs equal phase 1's token for token;
   first-verify acceptance is within aggregated serving's band (two-sided alpha 1e-3)
   and above phase 1's one-hot (one-sided alpha 1e-2); ``/metrics`` counts each request
   once (``recomputed`` = requests, not twice).

Greedy outputs are compared within this pair, not with aggregated serving at TP 1: a TP 2
decode sums its all-reduces in another order, and on these models that alone changes a
greedy token of one prompt in twelve (seen: index 3 differs from token 3 on, with the
drop-in on and with every row falling back alike), so no PD pair with a TP 2 decode can
equal a TP 1 aggregated server token for token.

The negative control of the vote (agreement off: the ranks hand SGLang different tokens)
runs in two processes against SGLang's real builder (tests/test_sglang_pd.py,
tests/test_sglang_groups.py); in a server the mix has no outside signature to assert on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from server import harness as h
from server import workload as w
from server.conftest import attach_logs

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]
N_ACCEPT = 128
N_GREEDY = 12
Z_SAME, Z_BETTER = 3.29, 2.33
SCRAPE_DEADLINE_S = 30.0  # the copy into SGLang's /metrics runs every sync_interval_s (1 s)
#: No request may take longer than this (a hang in a collective would; one takes seconds).
REQUEST_BOUND_S = 120.0


#: The SGLang releases the TP 2 decode is served on: the venv's (None: 0.5.23) and 0.5.21.
#: The ids let ``make test-server`` and ``make test-releases`` split them (``-k``).
RELEASES = [pytest.param(None, id="v0523"), pytest.param("0.5.21", id="v0521")]
#: The sampler each release's recompute draws X' with (0.5.21's fast_sample takes no seed).
SAMPLER = {None: "sglang.fast_sample", "0.5.21": "pd_middleware.inverse_cdf"}


class TP2:
    """The running pair, its fault switch, the aggregated reference of its release, and
    what the fault phase answered."""

    def __init__(self, pair: h.Pair, switch: Path, agg: h.Server, release: str | None) -> None:
        self.pair, self.switch, self.agg, self.release = pair, switch, agg, release
        self.greedy: list[tuple[int, ...]] | None = None
        self.onehot: w.Rate | None = None


@pytest.fixture(scope="module", params=RELEASES)
def tp2(
    request: pytest.FixtureRequest,
    server_models: dict[str, Path],
    log_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TP2]:
    release: str | None = request.param
    if release is not None and not (h.release_dir(release) / "sglang").is_dir():
        pytest.skip(f"SGLang {release}: no release folder at {h.release_dir(release)} (make setup-releases)")
    folder = tmp_path_factory.mktemp("tp2")
    switch = folder / "fault-on"
    switch.touch()
    cfg = h.server_config(REPO / "configs" / "sglang.toml", folder / "sglang.toml")
    models = h.Models(server_models["target"], server_models["eagle3"])
    logs = log_dir / f"tp2-{release or 'venv'}"
    starts: dict[str, Callable[[], object]] = {
        "pd": lambda: h.start_pair(
            models,
            logs,
            decode_config=cfg,
            decode_tp=2,
            decode_env={"PDM_TEST_RECOMPUTE_FAULT": "head:1", "PDM_TEST_RECOMPUTE_FAULT_WHILE": str(switch)},
            extra_args=["--enable-metrics"],
            sleep_on_idle=True,
            release=release,
        )
    }
    starts["agg"] = lambda: h.start_server("aggregated", models, logs, sleep_on_idle=True, release=release)
    out, error = h.start_together(starts)
    pd, agg = out.get("pd"), out.get("agg")
    started = [*(pd.servers if isinstance(pd, h.Pair) else []), *([agg] if isinstance(agg, h.Server) else [])]
    try:
        if error is not None:
            raise error
        assert isinstance(pd, h.Pair) and isinstance(agg, h.Server)
        attach_logs(started)
        yield TP2(pd, switch, agg, release)
    finally:
        h.stop_all(list(reversed(started)))


def rows_settled(values: dict[str, float]) -> float:
    """Rows the recompute source settled: ``recomputed`` plus every ``fallback:*`` of it."""
    return sum(
        v
        for k, v in values.items()
        if 'part="recompute"' in k and ('event="recomputed"' in k or 'event="fallback:' in k)
    )


def events(pd: h.Pair, want: float) -> dict[str, float]:
    """The decode's ``pd_middleware_integration_events_total`` samples, once the rows the
    recompute source settled reach ``want`` (or the deadline passes)."""
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    while True:
        values = h.metric_values(h.get_text(pd.decode.url + "/metrics"), "pd_middleware_integration_events_total")
        if rows_settled(values) >= want or time.monotonic() > deadline:
            return values
        time.sleep(1.0)


def test_both_decode_ranks_run_recompute_overlapped_with_the_head_on_the_forward_stream(tp2: TP2) -> None:
    # The decode and the reference run the overlap scheduler (the prefill does not: the tier's
    # prefill_host_indices gap relies on it), and the drop-in accepted the TP 2 head under it.
    assert h.overlapped(tp2.pair.decode) and h.overlapped(tp2.agg)
    assert not h.overlapped(tp2.pair.prefill)
    log = tp2.pair.decode.log(10**7)
    for rank in (0, 1):
        assert f"TP{rank}] pd-middleware active: decode node, decode-only recompute" in log, f"rank {rank}"
        assert f"TP{rank}] pd-middleware recompute active on the decode" in log, f"rank {rank}"
    # 0.5.23: the seeded sampler a GPU runs (stand-in hash); 0.5.21: the drop-in's seeded draw.
    assert f"X' drawn by {SAMPLER[tp2.release]}, head issued on the forward stream" in log
    assert "test fault 'head' is armed for TP rank 1" in log
    assert "test fault 'head' is armed for TP rank 0" not in log


def test_a_fault_on_rank_1_alone_falls_back_on_both_ranks(tp2: TP2) -> None:
    pd = tp2.pair
    assert tp2.switch.exists()
    before = w.settled_events(pd.decode.url)
    t0 = time.monotonic()
    # A request stuck in a collective comes back as status 0 after REQUEST_BOUND_S.
    got = w.generate(
        pd.router.url, w.prompts(N_GREEDY, offset=1), temperature=0.0, max_new_tokens=12, timeout_s=REQUEST_BOUND_S
    )  # type: ignore[union-attr]
    hot = w.generate(  # type: ignore[union-attr]
        pd.router.url, w.prompts(N_ACCEPT, offset=2), temperature=1.0, max_new_tokens=2, timeout_s=REQUEST_BOUND_S
    )
    took = time.monotonic() - t0
    print(f"{len(got) + len(hot)} requests with rank 1's head failing: {took:.1f} s")
    assert all(r.status == 200 for r in got + hot), [(r.status, r.error) for r in got + hot if r.status != 200]
    n = len(got) + len(hot)
    after = events(pd, rows_settled(before) + n)
    peer = w.event(after, "recompute", "fallback:peer_failed") - w.event(before, "recompute", "fallback:peer_failed")
    recomputed = w.event(after, "recompute", "recomputed") - w.event(before, "recompute", "recomputed")
    probes = w.event(after, "recompute", "probe") - w.event(before, "recompute", "probe")
    print(f"rank 0's /metrics over {n} requests: peer_failed {peer}, recomputed {recomputed}, probes apart {probes}")
    # No row was recomputed: every one fell back on both ranks, once per request (a per-rank
    # count would read 2 n; health checks are counted apart).
    assert recomputed == 0
    assert peer == n, (peer, n)
    ours = [
        ln for ln in pd.decode.log(10**7).splitlines() if ln.lstrip().startswith('File "') and "pd_middleware" in ln
    ]
    assert ours == [], "a traceback through pd_middleware in the decode's log"
    tp2.greedy, tp2.onehot = [r.output_ids for r in got], w.first_verify_rate(hot)
    tp2.switch.unlink()  # the next batch recomputes on both ranks


def test_greedy_outputs_equal_the_fault_phases(tp2: TP2) -> None:
    if tp2.greedy is None:
        pytest.skip("the fault phase did not complete")
    assert not tp2.switch.exists()
    texts = w.prompts(N_GREEDY, offset=1)
    pd = w.generate(tp2.pair.router.url, texts, temperature=0.0, max_new_tokens=12, timeout_s=REQUEST_BOUND_S)  # type: ignore[union-attr]
    assert all(r.status == 200 for r in pd), [r.error for r in pd if r.status != 200]
    assert [r.output_ids for r in pd] == tp2.greedy


def test_tp2_recompute_matches_aggregated_and_beats_one_hot_counted_once(tp2: TP2) -> None:
    if tp2.onehot is None:
        pytest.skip("the fault phase did not complete")
    pd = tp2.pair
    before = w.settled_events(pd.decode.url)
    texts = w.prompts(N_ACCEPT, offset=2)
    a = w.first_verify_rate(w.generate(tp2.agg.url, texts, temperature=1.0, max_new_tokens=2))
    res = w.generate(pd.router.url, texts, temperature=1.0, max_new_tokens=2, timeout_s=REQUEST_BOUND_S)  # type: ignore[union-attr]
    r = w.first_verify_rate(res)
    o = tp2.onehot
    print(
        f"SGLang {tp2.release or 'venv'}, first-verify acceptance: aggregated {a}, decode TP 2 (overlapped) + "
        f"decode-only recompute {r}, its one-hot (fault phase) {o}"
    )
    assert all(x.status == 200 for x in res), [x.error for x in res if x.status != 200]
    assert abs(w.z_diff(r, a)) <= Z_SAME
    assert w.z_diff(r, o) >= Z_BETTER
    after = events(pd, rows_settled(before) + N_ACCEPT)
    recomputed = w.event(after, "recompute", "recomputed") - w.event(before, "recompute", "recomputed")
    fallbacks = {k: v - before.get(k, 0.0) for k, v in after.items() if 'event="fallback:' in k and v != before.get(k)}
    print(f"decode /metrics over {N_ACCEPT} requests: recomputed {recomputed}, fallbacks {fallbacks}")
    # Once per request (rank 0 reports; a per-rank count would read 2 * N), none fell back.
    assert recomputed == N_ACCEPT, (recomputed, fallbacks)
    assert fallbacks == {}
