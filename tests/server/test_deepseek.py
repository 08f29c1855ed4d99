"""The flagship shape: a DeepSeek-V3-style target (MLA, MoE) with its native NextN MTP draft.

The tier's trained DeepSeek-V3-style target (MLA with q and kv LoRA ranks, a dense first
layer and MoE layers with routed and shared experts, ``noaux_tc`` routing) and the NextN
layer distilled from it (``DeepseekV3ForCausalLMNextN``), served by SGLang's EAGLE worker
with rejection sampling. One stock prefill (TP 1, no drop-in) serves three decodes, each
request sent to the prefill and one decode without a router (``workload.generate_pd``):

- ``stock``: a decode without the drop-in: SGLang's own one-hot proposal;
- ``recompute``: the shipped default ``configs/sglang.toml`` (decode-only recompute);
- ``dp``: the same default on a decode with DP attention (``--enable-dp-attention
  --tp-size 2 --dp-size 2 --enable-dp-lm-head``: two DP ranks, one core each; the drop-in
  refuses recompute under DP attention without ``--enable-dp-lm-head``), with the tier's
  fault switch on its head, whose gating file holds the spec in force: ``head`` (every
  rank's head fails: every request falls back to the one-hot at the prefill's X, which is
  SGLang's own proposal, so this phase is the same-topology stock reference), then
  ``head:1`` (one DP rank's head fails), then no file (recompute everywhere);
- ``attn_tp2``: the same default on a decode with attention TP 2 (``--tp-size 2 --dp-size 1
  --enable-dp-attention --enable-dp-lm-head``): the draft head gathers its logits over the
  attention-TP group, under the overlap scheduler issued on the forward stream.

Every decode and the aggregated reference run SGLang's overlap scheduler (the tier's
``overlap_spec_cpu``), as on a GPU.

An aggregated server on the same models is the reference for outputs and acceptance.

- TP 1: greedy outputs of both decodes equal aggregated serving's, token for token up to
  bf16 near-ties of aggregated serving (its two best within 0.1 nats, where the output
  takes its runner-up: ``workload.greedy_mismatches``); first-verify acceptance with recompute within aggregated's band (two-sided alpha 1e-3) and above the stock
  one-hot's (one-sided alpha 1e-2); each request counted once, none ``unknown_head``.
- DP attention: every request ends within its bound, single requests included (one DP
  rank then runs an idle batch while the other recomputes); greedy outputs of the
  same-topology stock phase and of recompute equal aggregated serving's up to its
  near-ties; acceptance within aggregated's band and above the stock phase's one-hot; a fault on one rank's head: that rank's requests fall back, the other's
  recompute, no hang, each request counted once in ``/metrics``.
- Attention TP 2: every request served, greedy outputs equal aggregated serving's up to its
  near-ties, acceptance within aggregated's band and above the stock decode's one-hot
  (a rate whose law depends only on the models), each request recomputed once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from server import harness as h
from server import workload as w
from server.conftest import attach_logs

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]
N = 80  # T = 1, max_new_tokens = 2: one first verify each
N_GREEDY = 8
GREEDY_TOKENS = 12
Z_SAME, Z_BETTER = 3.29, 2.33
REQUEST_BOUND_S = 180.0  # per request: a hang fails the test instead of stalling the tier
FAULT = "PDM_TEST_RECOMPUTE_FAULT"
FAULT_WHILE = "PDM_TEST_RECOMPUTE_FAULT_WHILE"


@dataclass
class DeepSeek:
    agg: h.Server
    prefill: h.Server
    stock: h.Server
    recompute: h.Server
    dp: h.Server
    attn_tp2: h.Server
    switch: Path
    #: figures a later test compares with (module order: TP 1 first, then the DP phases)
    seen: dict[str, object] = field(default_factory=dict)

    @property
    def servers(self) -> list[h.Server]:
        return [self.agg, self.prefill, self.stock, self.recompute, self.dp, self.attn_tp2]


def deepseek_models(server_models: dict[str, Path]) -> h.Models:
    """The trained DeepSeek target, its own draft: the NextN layer ships in the target's
    checkpoint (``model.layers.{num_hidden_layers}``), as DeepSeek publishes it, and SGLang's
    EAGLE worker builds ``DeepseekV3ForCausalLMNextN`` from it (``--speculative-algorithm EAGLE``)."""
    if "trained_deepseek" not in server_models:
        pytest.skip("no DeepSeek model in this model set (PDM_SERVER_MODELS holds only target/ and eagle3/)")
    target = server_models["trained_deepseek"]
    return h.Models(target, target, "EAGLE")


@pytest.fixture(scope="module")
def ds(server_models: dict[str, Path], log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DeepSeek]:
    models = deepseek_models(server_models)
    folder = tmp_path_factory.mktemp("cfg")
    cfg = h.server_config(REPO / "configs" / "sglang.toml", folder / "sglang.toml")
    switch = folder / "fault"
    switch.write_text("head")  # phase 1 of the DP decode: every rank's head fails
    metrics = ["--enable-metrics"]
    dp_args = [*metrics, "--enable-dp-attention", "--dp-size", "2", "--enable-dp-lm-head"]
    started: list[h.Server] = []
    try:
        for name, kw in (
            ("ds-aggregated", {"extra_args": metrics}),
            ("ds-prefill", {"role": "prefill", "extra_args": metrics}),
            ("ds-decode-stock", {"role": "decode", "extra_args": metrics}),
            ("ds-decode-recompute", {"role": "decode", "config": cfg, "extra_args": metrics}),
            (
                "ds-decode-dp",
                {
                    "role": "decode",
                    "config": cfg,
                    "tp": 2,
                    "extra_args": dp_args,
                    "env_extra": {FAULT: "head", FAULT_WHILE: str(switch)},
                },
            ),
            (
                "ds-decode-attn-tp2",
                {
                    "role": "decode",
                    "config": cfg,
                    "tp": 2,
                    "extra_args": [*metrics, "--enable-dp-attention", "--dp-size", "1", "--enable-dp-lm-head"],
                },
            ),
        ):
            started.append(h.start_server(name, models, log_dir, wait=False, sleep_on_idle=True, **kw))  # type: ignore[arg-type]
        for srv in started:
            h.wait_healthy(srv)
    except BaseException:
        h.stop_all(started)
        raise
    out = DeepSeek(*started, switch=switch)  # type: ignore[misc]
    attach_logs(out.servers)
    try:
        yield out
    finally:
        h.stop_all(out.servers)


def _pd(ds: DeepSeek, decode: h.Server, texts: list[str], *, temperature: float, max_new_tokens: int) -> list[w.Result]:
    got = w.generate_pd(
        ds.prefill, decode, texts, temperature=temperature, max_new_tokens=max_new_tokens, timeout_s=REQUEST_BOUND_S
    )
    bad = [(i, r.status, r.error) for i, r in enumerate(got) if r.status != 200]
    assert not bad, f"{len(bad)} of {len(got)} requests to {decode.name} failed or hung: {bad[:3]}"
    return got


def _events_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def _rc(delta: dict[str, float], name: str) -> float:
    return w.event(delta, "recompute", name)


def _agree(name: str, got: list[w.Result], ref: list[w.Result]) -> None:
    exact = sum(g.output_ids == r.output_ids for g, r in zip(got, ref, strict=True))
    print(f"greedy, {name}: {exact} of {len(ref)} outputs equal aggregated serving's token for token")
    bad = w.greedy_mismatches(got, ref)
    assert not bad, f"{name}: " + "; ".join(bad)


def test_every_decode_and_the_reference_run_the_overlap_scheduler(ds: DeepSeek) -> None:
    """The production path: every decode (the DP-attention one included) and the aggregated
    reference run SGLang's overlap scheduler (cpu_gaps' ``overlap_spec_cpu``); the prefill
    does not (the tier's ``prefill_host_indices`` gap relies on it)."""
    for srv in (ds.agg, ds.stock, ds.recompute, ds.dp, ds.attn_tp2):
        assert h.overlapped(srv), srv.name
    assert not h.overlapped(ds.prefill)
    # The attention-TP 2 head gathers, so it is issued on the forward stream on both ranks;
    # the DP decode's (attention TP 1) gathers nothing and runs where it is called.
    log = ds.attn_tp2.log(10**8)
    for rank in (0, 1):
        line = f"TP{rank}] pd-middleware recompute active on the decode: draft DeepseekV3ForCausalLMNextN"
        assert line in log and "head issued on the forward stream" in log, rank
    assert "head issued on the scheduler's stream" in ds.dp.log(10**8)


def test_greedy_outputs_of_both_decodes_equal_aggregated(ds: DeepSeek) -> None:
    """Token for token, up to bf16 near-ties of aggregated serving (``workload.greedy_mismatches``:
    a verify over other drafts is a batch of another shape, and on this MoE model one prompt
    in eight has shown a tie of 0.03 nats flip, the stock decode's and the drop-in's alike)."""
    texts = w.prompts(N_GREEDY, offset=7)
    agg = w.generate(ds.agg.url, texts, temperature=0.0, max_new_tokens=GREEDY_TOKENS, top_logprobs=2)
    assert all(r.status == 200 for r in agg), [r.error for r in agg if r.status != 200]
    ds.seen["greedy"] = agg
    stock = _pd(ds, ds.stock, texts, temperature=0.0, max_new_tokens=GREEDY_TOKENS)
    rec = _pd(ds, ds.recompute, texts, temperature=0.0, max_new_tokens=GREEDY_TOKENS)
    _agree("stock decode", stock, agg)
    _agree("recompute decode", rec, agg)
    assert len({r.output_ids for r in agg}) > 1  # the prompts lead somewhere different: not a degenerate model
    # The negative control of the comparison: another prompt's output is not "equal up to ties".
    assert w.greedy_mismatches(rec[1:] + rec[:1], agg)


def test_recompute_matches_aggregated_acceptance_and_beats_sglangs_one_hot(ds: DeepSeek) -> None:
    texts = w.prompts(N, offset=2)
    before = w.settled_events(ds.recompute.url)
    a = w.first_verify_rate(w.generate(ds.agg.url, texts, temperature=1.0, max_new_tokens=2))
    o = w.first_verify_rate(_pd(ds, ds.stock, texts, temperature=1.0, max_new_tokens=2))
    r = w.first_verify_rate(_pd(ds, ds.recompute, texts, temperature=1.0, max_new_tokens=2))
    ds.seen["aggregated"], ds.seen["one_hot"] = a, o
    print(f"DeepSeek + NextN, first-verify acceptance: aggregated {a}, PD + recompute {r}, PD stock one-hot {o}")
    assert 0.2 < a.p < 0.9, f"the trained pair's aggregated acceptance {a} cannot tell one-hot from recompute"
    assert abs(w.z_diff(r, a)) <= Z_SAME
    assert w.z_diff(r, o) >= Z_BETTER
    delta = _events_delta(before, w.settled_events(ds.recompute.url))
    assert _rc(delta, "recomputed") == N, delta  # each request once, as a row recomputed
    assert not [k for k in delta if "fallback" in k], delta  # no unknown_head, no other fallback
    log = ds.recompute.log(10**7)
    assert "recompute active on the decode: draft DeepseekV3ForCausalLMNextN" in log


def _dp_round(ds: DeepSeek, *, label: str) -> tuple[list[w.Result], w.Rate, dict[str, float], int]:
    """One phase on the DP decode: a request alone (the other DP rank runs an idle batch),
    the greedy prompts, the T = 1 prompts; its event delta and request count."""
    before = w.settled_events(ds.dp.url)
    alone = _pd(ds, ds.dp, w.prompts(1, offset=11), temperature=1.0, max_new_tokens=4)
    greedy = _pd(ds, ds.dp, w.prompts(N_GREEDY, offset=7), temperature=0.0, max_new_tokens=GREEDY_TOKENS)
    rate = w.first_verify_rate(_pd(ds, ds.dp, w.prompts(N, offset=2), temperature=1.0, max_new_tokens=2))
    delta = _events_delta(before, w.settled_events(ds.dp.url))
    print(f"DP attention decode, {label}: first-verify acceptance {rate}, events {delta}")
    return greedy, rate, delta, len(alone) + len(greedy) + N


def test_dp_attention_every_head_failing_is_sglangs_one_hot_on_that_topology(ds: DeepSeek) -> None:
    greedy, rate, delta, n = _dp_round(ds, label="every head failing")
    ds.seen["dp_greedy"], ds.seen["dp_one_hot"] = greedy, rate
    if "greedy" in ds.seen:
        _agree("DP decode, every head failing (SGLang's one-hot)", greedy, ds.seen["greedy"])  # type: ignore[arg-type]
    assert _rc(delta, "fallback:failed") == n and _rc(delta, "recomputed") == 0, delta


def test_dp_attention_a_fault_on_one_ranks_head_falls_back_there_only(ds: DeepSeek) -> None:
    ds.switch.write_text("head:1")
    texts = w.prompts(24, offset=13)
    before = w.settled_events(ds.dp.url)
    _pd(ds, ds.dp, texts[:1], temperature=1.0, max_new_tokens=4)  # alone: one rank idle
    _pd(ds, ds.dp, texts[1:], temperature=1.0, max_new_tokens=4)
    delta = _events_delta(before, w.settled_events(ds.dp.url))
    print(f"DP attention decode, rank 1's head failing: events {delta}")
    failed, recomputed = _rc(delta, "fallback:failed"), _rc(delta, "recomputed")
    assert failed + recomputed == len(texts), delta  # each request once, on the rank that holds it
    assert failed >= 1 and recomputed >= 1, delta  # both DP ranks served (P(all on one) = 2**-23)
    assert not [k for k in delta if "fallback" in k and 'event="fallback:failed"' not in k], delta


def test_dp_attention_recompute_matches_aggregated_and_its_stock_outputs(ds: DeepSeek) -> None:
    if "dp_greedy" not in ds.seen or "aggregated" not in ds.seen or "greedy" not in ds.seen:
        pytest.skip("needs the aggregated rate and the DP decode's stock phase (earlier tests of this module)")
    os.unlink(ds.switch)
    greedy, r, delta, n = _dp_round(ds, label="recompute")
    a, o = ds.seen["aggregated"], ds.seen["dp_one_hot"]
    assert isinstance(a, w.Rate) and isinstance(o, w.Rate)
    print(f"DP attention: aggregated {a}, recompute {r}, stock one-hot on this topology {o}")
    _agree("DP decode, recompute", greedy, ds.seen["greedy"])  # type: ignore[arg-type]
    same = sum(a.output_ids == b.output_ids for a, b in zip(greedy, ds.seen["dp_greedy"]))  # type: ignore[call-overload]
    print(f"greedy, DP decode: {same} of {len(greedy)} outputs equal its stock phase's token for token")
    assert abs(w.z_diff(r, a)) <= Z_SAME
    assert w.z_diff(r, o) >= Z_BETTER
    assert _rc(delta, "recomputed") == n, delta  # /metrics counts each request once, both DP ranks summed
    assert not [k for k in delta if "fallback" in k], delta


def test_attention_tp2_recompute_serves_at_aggregated_level(ds: DeepSeek) -> None:
    """``--tp 2 --dp 1 --enable-dp-attention --enable-dp-lm-head``, overlapped: the draft
    head's attention-TP gather is a real collective between the two ranks, issued on the
    forward stream. Every request served; greedy outputs equal aggregated serving's up to
    its near-ties; first-verify acceptance within aggregated's band and above the stock
    decode's one-hot; each request recomputed once (rank 0 reports), none fell back."""
    if "aggregated" not in ds.seen or "one_hot" not in ds.seen or "greedy" not in ds.seen:
        pytest.skip("needs the aggregated outputs and rate and the stock one-hot rate (earlier tests of this module)")
    before = w.settled_events(ds.attn_tp2.url)
    greedy = _pd(ds, ds.attn_tp2, w.prompts(N_GREEDY, offset=7), temperature=0.0, max_new_tokens=GREEDY_TOKENS)
    r = w.first_verify_rate(_pd(ds, ds.attn_tp2, w.prompts(N, offset=2), temperature=1.0, max_new_tokens=2))
    delta = _events_delta(before, w.settled_events(ds.attn_tp2.url))
    a, o = ds.seen["aggregated"], ds.seen["one_hot"]
    assert isinstance(a, w.Rate) and isinstance(o, w.Rate)
    print(f"attention TP 2 (overlapped): aggregated {a}, recompute {r}, stock one-hot {o}; events {delta}")
    _agree("attention-TP 2 decode, recompute", greedy, ds.seen["greedy"])  # type: ignore[arg-type]
    assert abs(w.z_diff(r, a)) <= Z_SAME
    assert w.z_diff(r, o) >= Z_BETTER
    assert _rc(delta, "recomputed") == N_GREEDY + N, delta
    assert not [k for k in delta if "fallback" in k], delta
