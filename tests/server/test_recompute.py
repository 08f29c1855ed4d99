"""Decode-only recompute behind a prefill that ships a strategy: one pair, two claims.

The decode runs the shipped SGLang default, ``configs/sglang.toml`` (``synthesizer =
"recompute"``, ``channel = "none"``): it recomputes the first draft step's proposal from
the shipped hidden state with its own draft model, and registers no proposal row. The
prefill runs ``configs/sparse_floor.toml``, a strategy it would ship in-band: the
operator's case of a rolling move from a shipped strategy to the default, where some
nodes carry the old config. (A decode without the drop-in registers the same nothing, so
the prefill's side of that rolling upgrade is this very path.)

- **Recompute.** First-verify acceptance matches aggregated serving within the band of
  test_pd_pair.py (two-sided alpha 1e-3) and beats SGLang's one-hot (one-sided alpha
  1e-2), on the trained models; the references are the session's (``conftest.shared``).
- **SGLang's seeded sampler.** Both nodes run ``--enable-deterministic-inference``, so
  every request carries a ``sampling_seed`` and the decode draws X' with SGLang's seeded
  ``fast_sample`` from it (the GPU's sampling path; its hash from the tier's CPU ops
  stand-in), in the draft's stream, apart from the verify's coins. Two identical seeded
  requests give identical outputs (another seed gives another output: the control), and
  at T = 1 the committed token after the prefill's bonus has aggregated serving's law
  (a permutation test of the TV, alpha 1e-3): a draw that shared randomness with the
  verify's coins would bias it.
- **One side ships, the other does not.** The prefill serves the decode's session with
  SGLang's own metadata buffers (the shorter list; SGLang pairs them by position and ours
  is last). Every request is served, greedy outputs equal aggregated serving's, and the
  prefill says why in its log and counts ``inband:peer_without_dropin`` in ``/metrics``.
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
N = 128
N_EXACT = 192  # one prompt, T = 1, max_new_tokens = 2: the committed token after the bonus
Z_SAME, Z_BETTER = 3.29, 2.33


@pytest.fixture(scope="module")
def pair(
    shared: Shared, server_models: dict[str, Path], log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[h.Pair]:
    folder = tmp_path_factory.mktemp("cfg")
    decode_cfg = h.server_config(REPO / "configs" / "sglang.toml", folder / "sglang.toml")
    prefill_cfg = h.server_config(REPO / "configs" / "sparse_floor.toml", folder / "sparse_floor.toml")
    models = h.Models(server_models["target"], server_models["eagle3"])
    pd = h.start_pair(
        models,
        log_dir / "pd",
        prefill_config=prefill_cfg,
        decode_config=decode_cfg,
        extra_args=["--enable-metrics", "--enable-deterministic-inference"],
        sleep_on_idle=True,
    )
    attach_logs(pd.servers)
    try:
        yield pd
    finally:
        pd.stop()


def test_decode_only_recompute_matches_aggregated_and_beats_one_hot(shared: Shared, pair: h.Pair) -> None:
    texts = w.prompts(N, offset=2)
    a = w.first_verify_rate(w.generate(shared.agg.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[attr-defined]
    got = w.generate(pair.router.url, texts, temperature=1.0, max_new_tokens=2)  # type: ignore[union-attr]
    assert all(r.status == 200 for r in got), [r.error for r in got if r.status != 200]
    r = w.first_verify_rate(got)
    o = w.first_verify_rate(w.generate(shared.onehot.router.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[attr-defined]
    print(f"first-verify acceptance: aggregated {a}, PD + decode-only recompute {r}, PD one-hot {o}")
    assert abs(w.z_diff(r, a)) <= Z_SAME
    assert w.z_diff(r, o) >= Z_BETTER
    log = pair.decode.log(10**7)
    assert "decode-only recompute" in log, "the decode's activation line is missing"
    # The decode and the reference run SGLang's overlap scheduler (cpu_gaps' overlap_spec_cpu).
    assert h.overlapped(pair.decode) and h.overlapped(shared.agg)  # type: ignore[arg-type]


def test_a_prefill_that_ships_serves_a_decode_that_registers_no_row_and_says_so(shared: Shared, pair: h.Pair) -> None:
    before = w.settled_events(pair.decode.url)
    texts = w.prompts(8, offset=4)
    sampled = w.generate(pair.router.url, texts, temperature=1.0, max_new_tokens=4)  # type: ignore[union-attr]
    greedy = w.generate(pair.router.url, texts, temperature=0.0, max_new_tokens=8)  # type: ignore[union-attr]
    agg = w.generate(shared.agg.url, texts, temperature=0.0, max_new_tokens=8)  # type: ignore[attr-defined]
    assert [r.status for r in sampled + greedy] == [200] * 16, [r.error for r in sampled + greedy]
    assert [r.output_ids for r in greedy] == [r.output_ids for r in agg]
    assert "pd-middleware active: prefill node" in pair.prefill.log(10**7)
    assert "registered no proposal row" in pair.prefill.log(10**7)
    seen = h.metric_values(h.get_text(pair.prefill.url + "/metrics"), w.EVENTS)
    print(f"prefill events: {seen}")
    assert w.event(seen, "inband", "inband:peer_without_dropin") >= 1
    # Every one of this test's requests was recomputed on the decode, once (greedy ones
    # propose their argmax), none fell back, and no shipped row was read there.
    want = len(sampled + greedy)
    deadline = time.monotonic() + 30.0  # the copy into /metrics runs every second
    while True:
        after = w.settled_events(pair.decode.url)
        recomputed = w.event(after, "recompute", "recomputed") - w.event(before, "recompute", "recomputed")
        if recomputed >= want or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    fallbacks = {k: v - before.get(k, 0.0) for k, v in after.items() if 'event="fallback:' in k and v != before.get(k)}
    print(f"decode over {want} requests: recomputed {recomputed}, fallbacks {fallbacks}")
    assert recomputed == want and fallbacks == {}, after
    assert not [k for k in after if 'part="inband"' in k or 'event="proposal:prefill"' in k], after


def test_the_decode_draws_x_prime_with_sglangs_seeded_sampler(pair: h.Pair) -> None:
    log = pair.decode.log(10**7)
    assert "X' drawn by sglang.fast_sample" in log
    assert "'enable_deterministic_inference': True" in log  # SGLang's own print of its arguments


def test_identical_seeded_requests_give_identical_outputs(pair: h.Pair) -> None:
    texts = w.prompts(8, offset=5)
    url = pair.router.url  # type: ignore[union-attr]
    # One at a time: SGLang's batch-invariant kernels are GPU kernels (the tier skips them,
    # cpu_gaps batch_invariant_cpu), so on this CPU only equal batches promise equal sums.
    one = w.generate(url, texts, temperature=1.0, max_new_tokens=12, seed=4242, concurrency=1)
    two = w.generate(url, texts, temperature=1.0, max_new_tokens=12, seed=4242, concurrency=1)
    other = w.generate(url, texts, temperature=1.0, max_new_tokens=12, seed=9000, concurrency=1)
    assert all(r.status == 200 for r in one + two + other), [r.error for r in one + two + other if r.status != 200]
    assert [r.output_ids for r in one] == [r.output_ids for r in two]
    # The control, batched alike: the seed is what fixes them (another seed, other outputs).
    assert sum(a.output_ids != b.output_ids for a, b in zip(one, other)) >= 4


def test_the_token_after_the_bonus_has_aggregated_law_under_seeds(shared: Shared, pair: h.Pair) -> None:
    """One prompt, N_EXACT requests with seeds 0..N-1 on the pair, unseeded on aggregated,
    compared by the permutation test of their TV (``w.same_law``, alpha = 1e-3, as
    test_pd_pair.py)."""
    text = [w.prompts(1, offset=3)[0]] * N_EXACT
    agg = w.generate(shared.agg.url, text, temperature=1.0, max_new_tokens=2)  # type: ignore[attr-defined]
    pd = w.generate(pair.router.url, text, temperature=1.0, max_new_tokens=2, seed=0)  # type: ignore[union-attr]
    tv, p, k = w.same_law(agg, pd, 1)
    print(
        f"token after the bonus, seeded recompute decode: K = {k}, TV = {tv:.3f}, permutation p = {p:.4f} (alpha {w.LAW_ALPHA})"
    )
    assert p > w.LAW_ALPHA
