"""Both nodes at ``--tp 2`` under a strategy the prefill publishes: real collectives on each side.

The pair runs ``configs/sglang_live_ab.toml`` on both nodes, each at ``--tp-size 2`` (two
scheduler ranks per node on this machine's two cores, all-reduces and all-gathers over
gloo on 127.0.0.1). The prefill encodes every request with the sparse-with-floor
encoding (``sparse_floor.toml``'s) and its two ranks agree per batch (the MIN
all-reduce) before the in-band rows go into SGLang's metadata buffers; the decode's ranks read
them from there (Mooncake over TCP), and the decode splits the traffic live between the arms
``sparse`` (the shipped distribution) and ``one_hot`` (SGLang's own proposal, the
same-topology baseline).

- Every rank of both nodes runs the drop-in.
- Greedy outputs: each prompt sent four times (the arms are drawn per request, so the
  sends fall in both arms) gives one output, token for token. Not compared with
  aggregated serving at TP 1: the TP 2 all-reduce order alone changes a greedy token of
  one prompt in twelve on these models (test_recompute_tp2.py).
- First-verify acceptance, per arm from the decode's ``/metrics``: the ``sparse`` arm
  within aggregated serving's band (two-sided alpha 1e-3) and above the ``one_hot`` arm
  (one-sided alpha 1e-2).
- Counters count each request once, not once per rank: the decode's
  ``payloads_received`` and ``proposal:prefill``, the prefill's ``staged``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from server import harness as h
from server import workload as w
from server.conftest import Shared, attach_logs

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]
N_ACCEPT = 160
N_GREEDY, SENDS = 8, 4
Z_SAME, Z_BETTER = 3.29, 2.33
SCRAPE_DEADLINE_S = 30.0
REQUEST_BOUND_S = 120.0  # a request stuck in a collective comes back as status 0


class Pair:
    def __init__(self, pd: h.Pair) -> None:
        self.pd = pd
        self.sent = 0
        #: Of those, greedy (temperature 0): both arms ship, so each is the one-hot at the argmax.
        self.greedy = 0

    @property
    def decode_metrics(self) -> str:
        return self.pd.decode.url + "/metrics"


@pytest.fixture(scope="module")
def pair(
    shared: Shared, server_models: dict[str, Path], log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    cfg = h.server_config(
        REPO / "configs" / "sglang_live_ab.toml", tmp_path_factory.mktemp("cfg") / "sglang_live_ab.toml"
    )
    pd = h.start_pair(
        h.Models(server_models["target"], server_models["eagle3"]),
        log_dir / "tp2-both",
        prefill_config=cfg,
        decode_config=cfg,
        tp=2,
        extra_args=["--enable-metrics"],
        sleep_on_idle=True,
    )
    attach_logs(pd.servers)
    try:
        yield Pair(pd)
    finally:
        pd.stop()


def test_every_rank_of_both_nodes_runs_the_drop_in(pair: Pair) -> None:
    for node, log in (("prefill", pair.pd.prefill.log(10**7)), ("decode", pair.pd.decode.log(10**7))):
        for rank in (0, 1):
            assert f"TP{rank}] pd-middleware active: {node} node" in log, f"{node} rank {rank}"


def test_greedy_outputs_are_one_per_prompt_across_both_arms(pair: Pair) -> None:
    texts = w.prompts(N_GREEDY, offset=1)
    before = w.arm_counts(pair.decode_metrics)
    got = w.generate(pair.pd.router.url, texts * SENDS, temperature=0.0, max_new_tokens=12, timeout_s=REQUEST_BOUND_S)  # type: ignore[union-attr]
    pair.sent += len(got)
    pair.greedy += len(got)
    assert all(r.status == 200 for r in got), [(r.status, r.error) for r in got if r.status != 200]
    by_prompt: dict[int, set[tuple[int, ...]]] = {}
    for i, r in enumerate(got):
        by_prompt.setdefault(i % N_GREEDY, set()).add(r.output_ids)
    assert {i: len(outs) for i, outs in by_prompt.items()} == dict.fromkeys(range(N_GREEDY), 1)
    arms = w.arm_rates_since(pair.decode_metrics, before, len(got))
    print(f"greedy sends by arm: { {a: r.n for a, r in arms.items()} }")
    assert sorted(a for a, r in arms.items() if r.n) == ["one_hot", "sparse"]


def test_the_shipped_arm_matches_aggregated_and_beats_the_one_hot_arm(shared: Shared, pair: Pair) -> None:
    texts = w.prompts(N_ACCEPT, offset=2)
    agg = w.first_verify_rate(w.generate(shared.agg.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[attr-defined]
    before = w.arm_counts(pair.decode_metrics)
    res = w.generate(pair.pd.router.url, texts, temperature=1.0, max_new_tokens=2, timeout_s=REQUEST_BOUND_S)  # type: ignore[union-attr]
    pair.sent += len(res)
    assert all(r.status == 200 for r in res), [(r.status, r.error) for r in res if r.status != 200]
    pd = w.first_verify_rate(res)
    arms = w.arm_rates_since(pair.decode_metrics, before, N_ACCEPT)
    print(
        f"first-verify acceptance: aggregated {agg}, both nodes TP 2 {pd}, arms { {a: str(r) for a, r in arms.items()} }"
    )
    assert sum(r.n for r in arms.values()) == N_ACCEPT  # each request once, not once per rank
    assert sum(r.hits for r in arms.values()) == pd.hits
    shipped, onehot = arms["sparse"], arms["one_hot"]
    assert shipped.n and onehot.n, arms  # both arms served some of the traffic
    assert abs(w.z_diff(shipped, agg)) <= Z_SAME, f"arm sparse {shipped} vs aggregated {agg}"
    assert w.z_diff(shipped, onehot) >= Z_BETTER, f"arm sparse {shipped} not above arm one_hot {onehot}"


def test_counters_count_each_request_once_on_both_nodes(pair: Pair) -> None:
    sent = pair.sent
    if sent == 0:
        pytest.skip("counts the requests of the module's earlier tests, and none ran")
    deadline = time.monotonic() + SCRAPE_DEADLINE_S
    while True:
        dec = h.get_text(pair.decode_metrics)
        pre = h.get_text(pair.pd.prefill.url + "/metrics")
        received = sum(h.metric_values(dec, "pd_middleware_payloads_received_total").values())
        events = h.metric_values(dec, w.EVENTS)
        published = h.metric_values(pre, w.EVENTS)
        # A greedy request is staged X-only at its argmax and verified one-hot (proposal:local).
        proposals = w.event(events, "decode", "proposal:prefill") + w.event(events, "decode", "proposal:local")
        counts = (received, proposals, w.event(published, "prefill", "staged"))
        if min(counts) >= sent or time.monotonic() > deadline:
            break
        time.sleep(2.5)
    print(f"decode: payloads_received {received}, events {events}; prefill: {published}")
    # Each request once (rank 0 reports; a per-rank count would read 2 * sent).
    assert counts == (sent, sent, sent), counts
    assert w.event(events, "decode", "proposal:local") == pair.greedy, events
    ours = [
        ln
        for srv in (pair.pd.prefill, pair.pd.decode)
        for ln in srv.log(10**7).splitlines()
        if ln.lstrip().startswith('File "') and "pd_middleware" in ln
    ]
    assert ours == [], "a traceback through pd_middleware in a node's log"
