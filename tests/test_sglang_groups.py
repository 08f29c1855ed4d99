"""Every collective of the drop-in runs in the group SGLang uses for that draft (tier ``sglang``).

Two real processes (spawned; gloo on 127.0.0.1, a random port) with SGLang's real
``parallel_state`` at ``--tp 2``, plain or with DP attention (``tests/_sglang_groups.py``
says what is real in a rank). Recorded: the group the recompute head's gather resolves
at the moment of the call, and the group of the recompute vote. Also SGLang's real
``LogitsProcessor`` against ``check_placement``, with and without ``--enable-dp-lm-head``.

Under plain TP 2, batches where one rank differs from the other (``_tp2_scenarios``): its
head fails (bf16, and bf16 with an fp32 output), its hidden state is missing, it draws
another X', its row is invalid while its prefill X differs, staging its write fails, its
head fails in one chunk of rows of three. Each
shows both ranks leave every collective together, hand SGLang the same X, and count each
request once.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import queue
import socket
import time

import pytest

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed"),
]

#: The longest one case may take (two SGLang imports on a shared 2-core machine).
CASE_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_RESULTS: dict[str, list[dict]] = {}


def run_case(case: str) -> list[dict]:
    """Both ranks' results for ``case`` (run once per module); every process is gone when this returns."""
    if case not in _RESULTS:
        _RESULTS[case] = _run_case(case)
    return _RESULTS[case]


def _run_case(case: str) -> list[dict]:
    import _sglang_groups

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_sglang_groups.rank_main, args=(r, port, case, out, stop), daemon=True) for r in (0, 1)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    got: dict[int, tuple[str, object]] = {}
    try:
        while len(got) < 2:
            try:
                rank, status, value = out.get(timeout=1.0)
                got[rank] = (status, value)
                continue
            except queue.Empty:
                pass
            missing = sorted({0, 1} - set(got))
            gone = [r for r in missing if procs[r].exitcode is not None]
            if gone or time.monotonic() - t0 > CASE_TIMEOUT_S:
                codes = [p.exitcode for p in procs]
                raise AssertionError(
                    f"{case}: ranks {missing} gave no answer ({'exited' if gone else f'{CASE_TIMEOUT_S} s'}; "
                    f"exit codes {codes})"
                )
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    for rank in (0, 1):
        status, value = got[rank]
        assert status == "ok", f"{case}: rank {rank} failed:\n{value}"
    print(f"\n{case}: both ranks in {time.monotonic() - t0:.1f} s")
    return [got[0][1], got[1][1]]  # type: ignore[list-item]  # both checked "ok" above: dicts


def test_tp2_head_gathers_over_the_tp_group_and_the_vote_uses_the_attention_tp_cpu_group():
    r0, r1 = run_case("tp2")
    assert not r0.get("prepare_hung") and not r1.get("prepare_hung"), (r0, r1)
    for r in (r0, r1):
        assert (r["tp_size"], r["attn_tp_size"], r["attn_dp_size"]) == (2, 2, 1)
        assert r["layout_group_size"] is None  # plain TP: the draft shares the target's group
        assert r["head_lp_gathers"]  # SGLang's real LogitsProcessor of the TP 2 draft gathers
        # One gather per batch, in the draft's group, which here is the full TP group.
        assert r["gathers"] == [{"size": 2, "ranks": [0, 1], "draft_group": False}], r["gathers"]
        # One vote per batch, over SGLang's attention-TP CPU group.
        assert r["vote_group"] == [0, 1]
        assert r["votes"] == [{"ranks": [0, 1], "attn_tp_cpu_group": True}], r["votes"]
        assert r["agreed"] == [True, True] and r["counts"]["recomputed"] == 2, r["counts"]
    assert r0["x"] == r1["x"]  # both ranks hand SGLang the same X'


def test_dp_attention_head_gathers_in_the_drafts_own_group_and_never_across_dp_ranks():
    """Under DP attention (attention TP 1) SGLang gives an EAGLE3 draft a one-rank group.
    The DP ranks build different batches: rank 0 two requests, rank 1 one, each alone,
    and neither waits for the other. Negative control: the same gather on DP rank 0
    alone, outside SGLang's draft TP context, resolves the full TP group (size 2) and
    blocks (the hang of defect 1), bounded here by a wait."""
    r0, r1 = run_case("dp2")
    assert not r0.get("prepare_hung") and not r1.get("prepare_hung"), (r0, r1)
    for rank, r in enumerate((r0, r1)):
        assert (r["tp_size"], r["attn_tp_size"], r["attn_dp_size"]) == (2, 1, 2)
        assert r["layout_group_size"] == 1
        assert not r["head_lp_gathers"]  # the draft built in its own group has nothing to gather
        # The stand-in for a wider draft group: its gather resolves the draft's group, this rank alone.
        assert r["gathers"] == [{"size": 1, "ranks": [rank], "draft_group": True}], r["gathers"]
        assert r["vote_group"] is None and r["votes"] == []  # one attention-TP rank: nobody to vote with
        assert r["counts"]["recomputed"] == len(r["agreed"]), r["counts"]
    assert len(r0["agreed"]) == 2 and len(r1["agreed"]) == 1
    # Negative control.
    assert r0["outside_gathers"] == [{"size": 2, "ranks": [0, 1], "draft_group": False}], r0["outside_gathers"]
    assert r0["outside_returned"] is False, "the gather outside the draft TP context returned: no hang shown"
    print(f"outside draft_tp_context: the gather over TP ranks [0, 1] blocked for {r0['outside_waited_s']:.1f} s")


def test_check_placement_refuses_exactly_a_gather_across_dp_ranks():
    """SGLang's real LogitsProcessor, built where SGLang builds it (a TARGET_LAYOUT draft in
    the target's scope, a SINGLE_GROUP draft inside its draft TP context), per parallel
    setup: refused exactly when its gather would cross DP ranks (DP attention without
    --enable-dp-lm-head), with or without the overlap scheduler; a vocab-parallel head
    under overlap is accepted where the scheduler has a forward stream (ordering.py)."""
    dp, dp_lm, tp = run_case("dp2"), run_case("dp2_lm_head"), run_case("tp2")  # the first two: run above
    for r in dp:
        t, s = r["placement"]["target_layout"], r["placement"]["single_group"]
        assert t["gather_dp_attn"]
        for k in ("overlap=False", "overlap=True"):
            assert t[k].startswith("refused") and "--enable-dp-lm-head" in t[k], t
            assert s[k] == "accepted", s  # the draft's own one-rank group: nothing to gather
    for r in dp_lm:
        t = r["placement"]["target_layout"]
        assert not t["gather"] and not t["gather_dp_attn"]  # --enable-dp-lm-head at attention TP 1: no gather
        assert t["overlap=False"] == t["overlap=True"] == "accepted", t
        assert r["counts"]["recomputed"] == len(r["agreed"])
    for r in tp:
        for kind in ("target_layout", "single_group"):  # the same LP under plain TP
            p = r["placement"][kind]
            assert p["gather"] and not p["gather_dp_attn"]
            assert p["overlap=False"] == p["overlap=True"] == "accepted", p
            # Without a forward stream to issue it on, the gather under overlap is refused.
            assert p["overlap=True, no stream"].startswith("refused"), p
            assert "--disable-overlap-schedule" in p["overlap=True, no stream"], p


#: One turn of the overlapped loop on every rank: the forward's collective on the forward
#: stream, then the builder's head gather on the forward stream and its vote (CPU group).
ORDERED_TURN = [["forward", "forward"], ["head_gather", "forward"], ["vote", "schedule"]]


def _assert_ordered_loop(r0: dict, r1: dict, loop: dict) -> None:
    assert r0[loop] == r1[loop], (r0[loop], r1[loop])  # the same collectives in the same order on both ranks
    assert r0[loop] == ORDERED_TURN * 3, r0[loop]


def test_under_overlap_the_heads_gather_is_issued_on_the_forward_stream_in_loop_order_on_every_rank():
    """Plain TP 2 under the overlap scheduler: the scheduler-start capture accepts SGLang's
    real vocab-parallel head, and over three turns of the overlapped event loop (forward k
    launched on the forward stream with a collective over the TP group, then the prebuilt
    batch built with the drop-in's recompute) each rank records the same sequence of
    collectives: the head's gather issued on the forward stream, after forward k and
    before forward k + 1 (ordering.py: one stream's order, the same on every rank). The
    negative control: the same loop with the head left unordered (on the schedule stream)
    records the gather on the schedule stream, so this test tells the two apart."""
    r0, r1 = run_case("tp2")
    s0, s1 = r0["scenarios"], r1["scenarios"]
    assert s0["capture_under_overlap"] == s1["capture_under_overlap"] == "accepted", s0["capture_under_overlap"]
    _assert_ordered_loop(s0, s1, "overlap_loop")
    control = s0["overlap_loop_unordered"]
    assert control == s1["overlap_loop_unordered"]
    assert ["head_gather", "schedule"] in control and ["head_gather", "forward"] not in control, control


def test_an_attention_tp_gather_is_issued_on_the_forward_stream_under_the_overlap_scheduler():
    """``--enable-dp-lm-head`` at attention TP 2 (``--tp 2 --dp 1 --enable-dp-attention``):
    SGLang's real LogitsProcessor gathers its logits over the attention-TP group
    (``use_attn_tp_group``, ``_gather_attn_tp_logits``), which the forward's collectives
    share. ``check_placement`` accepts it under the overlap scheduler where the scheduler
    has a forward stream and refuses it without one (naming ``--disable-overlap-schedule``);
    the scheduler-start capture accepts it, and over three turns of the overlapped loop the
    head's gather is issued on the forward stream in the same order on both ranks.

    Without overlap the head calls SGLang's attention-TP gather once a batch on both ranks
    and the vote runs over the attention-TP CPU group. On this CPU that gather raises on both
    ranks alike (SGLang's ``attn_tp_all_gather_into_tensor`` dispatches to its custom op
    ``sglang::reg_all_gather_into_tensor``, which has no CPU kernel): both ranks fall back,
    counted ``failed`` once a request, and hand SGLang the same X; where the op runs, both
    recompute."""
    r0, r1 = run_case("attn_tp2_lm_head")
    for r in (r0, r1):
        assert (r["tp_size"], r["attn_tp_size"], r["attn_dp_size"]) == (2, 2, 1)
        for kind in ("target_layout", "single_group"):
            p = r["placement"][kind]
            assert p["gather"] and p["use_attn_tp_group"] and not p["gather_dp_attn"], p
            assert p["overlap=False"] == p["overlap=True"] == "accepted", p
            got = p["overlap=True, no stream"]
            assert got.startswith("refused") and "--disable-overlap-schedule" in got, p
        assert r["capture_under_overlap"] == "accepted", r["capture_under_overlap"]
        assert r["head_lp_gathers"] and not r.get("prepare_hung"), r
        assert r["gathers"] == [{"size": 2, "ranks": [0, 1], "draft_group": False}], r["gathers"]
        assert r["votes"] == [{"ranks": [0, 1], "attn_tp_cpu_group": True}], r["votes"]
        assert r["counts"] in ({"batches": 1, "recomputed": 2}, {"batches": 1, "fallback:failed": 2}), r["counts"]
    assert r0["counts"] == r1["counts"] and r0["x"] == r1["x"], (r0["counts"], r1["counts"])
    _assert_ordered_loop(r0, r1, "overlap_loop")


# ----------------------------------------------------------------------------- TP 2: one rank differs


def scenario(name: str) -> tuple[dict, dict]:
    """Both ranks' outcome of one scenario of ``_sglang_groups._tp2_scenarios`` (run with ``tp2``)."""
    r0, r1 = run_case("tp2")
    s0, s1 = r0["scenarios"].get(name), r1["scenarios"].get(name)
    assert s0 is not None and s1 is not None, f"{name} did not run: {r0['scenarios']} / {r1['scenarios']}"
    assert not s0["hung"] and not s1["hung"], f"{name}: a rank was left alone in a collective: {s0} / {s1}"
    assert s0["status"] == s1["status"] == "ok", (s0, s1)
    return s0, s1


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp32_output_head_fault", "torch.float32"), ("bf16_head_fault", "torch.bfloat16")]
)
def test_a_failing_head_on_one_rank_gathers_its_peers_dtype_and_both_fall_back_counted_once(name, dtype):
    """The head fails on rank 1 (its part before the gather raises, as the tier's switch
    ``head:1`` makes it, tests/server/site/recompute_fault.py). Its zeros enter SGLang's
    gather with the dtype and width of a real output of the head: fp32 for a bf16 head
    under ``enable_lm_head_fp32`` (``--enable-fp32-lm-head``'s switch), bf16 without. No
    rank is left in the gather; both hand SGLang the prefill's X, one-hot; each request is
    counted once on each rank (rank 1 ``failed``, rank 0 ``peer_failed``). Negative
    controls tried: zeros in the weight's dtype (the landed code) in the fp32 case, and
    fp32 zeros in the bf16 case, each make gloo abort a rank (SIGABRT) in the gather of
    mismatched sizes, and this test fails."""
    s0, s1 = scenario(name)
    for s in (s0, s1):
        assert s["weight_dtype"] == "torch.bfloat16" and s["out_dtype"] == dtype, s  # control: which head this is
        assert s["gathers"] == [[dtype, [2, 64]]], s["gathers"]  # one gather, the same bytes on both ranks
        assert s["x"] == [5, 5] and s["agreed"] is None, s
    assert s0["counts"] == {"batches": 1, "fallback:peer_failed": 2}, s0["counts"]
    assert s1["counts"] == {"batches": 1, "fallback:failed": 2}, s1["counts"]
    assert s1["guard"] == {"guard:recompute:RuntimeError": 1} and s0["guard"] == {}, (s0["guard"], s1["guard"])


def test_a_rank_without_a_hidden_state_still_enters_the_heads_gather():
    """Rank 1 has no hidden state for request 0: it votes "not ok" after running the head on
    zeros, so both ranks gather once and fall back to the prefill's X (rank 1 ``no_hidden``,
    rank 0 ``peer_failed``). Negative control tried: a rank that raises before the head
    (skipping its gather) fails this test."""
    s0, s1 = scenario("no_hidden_on_one_rank")
    for s in (s0, s1):
        assert len(s["gathers"]) == 1 and s["x"] == [5, 5] and s["agreed"] is None, s
    assert s0["counts"] == {"batches": 1, "fallback:peer_failed": 2}, s0["counts"]
    assert s1["counts"] == {"batches": 1, "fallback:no_hidden": 2}, s1["counts"]


def test_ranks_that_drew_different_x_prime_fall_back_and_the_others_keep_theirs():
    """Rank 1's sampler draws another X' for request 0: request 0 is not agreed (both ranks
    hand the prefill's X, counted ``rank_mismatch`` once each), request 1 is (the same X' on
    both). Negative control tried: treating the vote's ``ok`` alone as agreed (each rank
    keeps its own X') fails this test."""
    s0, s1 = scenario("x_prime_differs")
    for s in (s0, s1):
        assert s["agreed"] == [False, True] and s["x"][0] == 5, s
        assert s["counts"] == {"batches": 1, "recomputed": 1, "fallback:rank_mismatch": 1}, s["counts"]
    assert s0["x"] == s1["x"]


def test_a_rank_whose_prefill_x_differs_takes_the_agreed_x_and_counts_only_its_own_invalid_row():
    """Request 0: rank 1's row is invalid (NaN temperature) and its prefill X is 3, rank 0's
    is 5. Both hand SGLang X = 3 (the smallest any rank holds), rank 0 overwriting its own;
    rank 1 counts its row ``invalid_row`` (never also ``peer_failed``), rank 0 ``peer_failed``.
    Negative controls tried, each failing this test: a rank keeping its own prefill X;
    ``peer_failed`` counting this rank's own invalid rows."""
    s0, s1 = scenario("invalid_row_and_prefill_x_differ")
    for s in (s0, s1):
        assert s["agreed"] == [False, True] and s["x"][0] == 3, s
    assert s0["x"] == s1["x"]
    assert s0["counts"] == {"batches": 1, "recomputed": 1, "fallback:peer_failed": 1}, s0["counts"]
    assert s1["counts"] == {"batches": 1, "recomputed": 1, "fallback:invalid_row": 1}, s1["counts"]


def test_a_failure_staging_the_write_on_one_rank_is_its_vote_never_a_divergent_x():
    """Everything the write after the vote needs (X' and q'(X') on the host, q''s width) is
    staged before the vote: a failure there on rank 1 is its vote, and both ranks hand the
    prefill's X (rank 1 ``failed``, rank 0 ``peer_failed``). Negative control tried:
    staging after the vote (the landed order: rank 1 raises after the ranks agreed on X')
    fails this test."""
    s0, s1 = scenario("write_staging_fails_on_one_rank")
    for s in (s0, s1):
        assert s["x"] == [5, 5] and s["agreed"] is None, s
    assert s0["counts"] == {"batches": 1, "fallback:peer_failed": 2}, s0["counts"]
    assert s1["counts"] == {"batches": 1, "fallback:failed": 2}, s1["counts"]


def test_a_head_failing_in_one_chunk_on_one_rank_still_enters_every_chunks_gather():
    """Chunks of one row (the core's ``CHUNK_ROWS`` at 1 on both ranks), three requests:
    rank 1's head fails on the second chunk. Both ranks gather once a chunk, three times,
    the same bytes; both hand SGLang the prefill's X, each request counted once (rank 1
    ``failed``, rank 0 ``peer_failed``). Negative control tried: raising at the failing
    chunk (rank 1 skips the third gather) leaves rank 0 alone in it, and this test fails."""
    s0, s1 = scenario("head_fails_in_one_chunk")
    for s in (s0, s1):
        assert s["gathers"] == [["torch.bfloat16", [1, 64]]] * 3, s["gathers"]
        assert s["x"] == [5, 5, 5] and s["agreed"] is None, s
    assert s0["counts"] == {"batches": 1, "fallback:peer_failed": 3}, s0["counts"]
    assert s1["counts"] == {"batches": 1, "fallback:failed": 3}, s1["counts"]
    assert s1["guard"] == {"guard:recompute:RuntimeError": 1} and s0["guard"] == {}, (s0["guard"], s1["guard"])


def test_a_rank_whose_batch_fails_to_reach_the_heads_device_still_enters_the_gather():
    """Rank 1's copy of the batch's positions to the head's device raises (a rank-local error
    after its vote began, before the head's gather). It still enters SGLang's gather, on the
    bytes its peer sends, then votes "not ok": both ranks hand SGLang the prefill's X, one-hot,
    each request counted once on each rank (rank 1 ``failed``, rank 0 ``peer_failed``), and
    no rank is left in a collective (each wait bounded: a rank left alone is reported hung
    after ``SCENARIO_WAIT_S``). Negative control tried: the landed order (the copies made
    outside the vote's try, before the head) leaves rank 1 in the vote's all-reduce and
    rank 0 in the gather, and this test fails."""
    s0, s1 = scenario("device_copy_fails_on_one_rank")
    for s in (s0, s1):
        assert s["gathers"] == [["torch.float32", [2, 64]]], s["gathers"]  # once, the same bytes on both
        assert s["x"] == [5, 5] and s["agreed"] is None, s
    assert s0["counts"] == {"batches": 1, "fallback:peer_failed": 2}, s0["counts"]
    assert s1["counts"] == {"batches": 1, "fallback:failed": 2}, s1["counts"]
    assert s1["guard"] == {"guard:recompute:RuntimeError": 1} and s0["guard"] == {}, (s0["guard"], s1["guard"])


def test_a_split_that_fails_on_one_rank_in_the_builder_still_enters_the_heads_gather():
    """Through the drop-in's builder (``sources.wrap_build``): request 0 came back from a
    retraction, so the source is handed rows [1] of the batch, and on rank 1 reading the
    batch's positions raises. The split builds nothing that can fail (its rows are sliced
    when the source reads them, inside its vote): rank 1 still enters the head's gather and
    votes "not ok", both ranks hand SGLang the prefill's X, the returned request is counted
    ``retracted`` and the fresh one falls back once on each rank. Negative control tried:
    slicing the rows when the split is built (the landed ``BatchRows``) makes rank 1 skip
    prepare, rank 0 is reported hung in the gather, and this test fails."""
    r0, _ = run_case("tp2")
    assert r0["scenarios"]["builder_source_is_recompute"], r0["scenarios"]  # control: the builder's source
    s0, s1 = scenario("split_fails_on_one_rank")
    for s in (s0, s1):
        assert s["gathers"] == [["torch.float32", [1, 64]]], s["gathers"]  # once, one row, on both
        assert s["x"] == [5, 5], s
    assert s0["counts"] == {"batches": 1, "retracted": 1, "fallback:peer_failed": 1}, s0["counts"]
    assert s1["counts"] == {"batches": 1, "retracted": 1, "fallback:failed": 1}, s1["counts"]
    assert s1["guard"] == {"guard:recompute:RuntimeError": 1} and s0["guard"] == {}, (s0["guard"], s1["guard"])


def test_a_rank_that_cannot_build_blank_inputs_still_enters_the_heads_gather():
    """Rank 1's copy of the batch to the head's device fails, and then so does building the
    blank inputs that stand in for it (``RecomputeSource._blank`` raises
    ``torch.OutOfMemoryError``: an OOM on that rank alone). It still enters SGLang's gather,
    with rows that carry no features: its head refuses them before any kernel and sends
    zeros of the dtype and width its peer sends. Then it votes "not ok": both ranks hand
    SGLang the prefill's X, one-hot, each request counted once on each rank (rank 1
    ``failed``, its OOM counted apart, rank 0 ``peer_failed``). Negative control tried: the
    landed ``_votes`` (``_blank``'s failure raised out of the vote before the head's gather)
    leaves rank 1 in the vote's all-reduce and rank 0 in the gather; each rank's wait is
    bounded (``SCENARIO_WAIT_S``), so the scenario is reported hung and this test fails
    instead of hanging the run."""
    s0, s1 = scenario("blank_fails_on_one_rank")
    for s in (s0, s1):
        assert s["gathers"] == [["torch.float32", [2, 64]]], s["gathers"]  # once, the same bytes on both
        assert s["x"] == [5, 5] and s["agreed"] is None, s
    assert s0["counts"] == {"batches": 1, "fallback:peer_failed": 2}, s0["counts"]
    assert s1["counts"] == {"batches": 1, "fallback:failed": 2}, s1["counts"]
    assert s0["guard"] == {}, s0["guard"]
    # The copy's failure is the rank's vote; the OOM that followed it is counted too.
    assert s1["guard"] == {"guard:recompute:RuntimeError": 1, "guard:recompute_blank:OutOfMemoryError": 1}, s1["guard"]
