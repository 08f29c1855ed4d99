"""The metadata channel through SGLang 0.5.23's real code, in one process.

Real: ``MetadataBuffers`` (both nodes, with the drop-in's buffer), its ``set_buf`` /
``get_buf_infos`` / ``clear_slot``, ``DecodeTransferQueue._commit_transfer_to_req``,
``KVArgsRegisterInfo.from_zmq`` and ``MooncakeKVManager._validate_peer_state_layout`` (feature ``peer_check``),
and the builder ``build_eagle_disagg_draft_input``. Stand-ins, said where used: the copy
between the two nodes' buffers is ``send_aux``'s own loop (row i of each registered
buffer, prefill item lengths, ``ctypes.memmove`` instead of Mooncake; the two-process
Mooncake tier is tests/test_sglang_pd*.py), the queue/scheduler objects around
``_commit_transfer_to_req`` are namespaces with the attributes it reads, and the
prefill's ``process_batch_result_disagg_prefill`` body (it needs a whole scheduler) is a
function that copies the draft input onto the requests, as SGLang's does.
"""

from __future__ import annotations

import ctypes
import struct
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
import torch
from _sglang_builder import build_draft_input, namespace_batch

from pd_middleware import ConfigError
from pd_middleware.config import parse_config
from pd_middleware.core.payload import Payload, Provenance
from pd_middleware.integrations import sglang as S
from pd_middleware.integrations.sglang import metadata as sglang_metadata
from pd_middleware.integrations.sglang.metadata import wrap_metadata_init
from pd_middleware.integrations.sglang.prefill import wrap_prefill_result
from pd_middleware.integrations.sglang.registration import FRAME_MARK, wrap_registration
from pd_middleware.sampling.draws import request_uniforms
from pd_middleware.sampling.encodings import sparse_law_tensor

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sglang_context", "sglang_uninstall")]

V = 64
SEED = 77


@pytest.fixture
def sg(sglang_importable):
    import importlib

    return SimpleNamespace(
        utils=importlib.import_module("sglang.srt.disaggregation.utils"),
        decode=importlib.import_module("sglang.srt.disaggregation.decode"),
        mooncake=importlib.import_module("sglang.srt.disaggregation.mooncake.conn"),
        ed=importlib.import_module("sglang.srt.speculative.eagle_disaggregation"),
    )


def config(capacity=4096, **over):
    data = {
        "decode": {"max_batch": 8},
        "synthesizer": {"name": "sparse"},
        "encoder": {"name": "sparse", "options": {"mode": "topk", "k": 5, "value_dtype": "fp32"}},
        "sglang": {"capacity_bytes": capacity, "seed": SEED},
    }
    data.update(over)
    return parse_config(data)


def facts(role="decode", **over):
    return S.EngineFacts(
        **{**dict(role=role, vocab_size=V, num_steps=1, algorithm="EAGLE", topk=1, rejection_sampling=True), **over}
    )


def activate(cfg, role="decode", **over):
    return S.install(cfg, S.InstallOptions(channel="metadata", facts=facts(role, **over)))


def buffers(sg, size=8):
    return sg.utils.MetadataBuffers(size, hidden_size=4, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=4)


def prefill_req(room, idx):
    return SimpleNamespace(
        bootstrap_room=room,
        metadata_buffer_index=idx,
        origin_input_ids=[1, 2, 3],  # with output_ids: the draw's position (prefill.draw_position)
        output_ids=[5],
        cached_tokens=0,
        cached_tokens_device=0,
        cached_tokens_host=0,
        cached_tokens_storage=0,
        get_mm_token_counts=lambda: (0, 0, 0),
        return_logprob=False,
        return_sampling_mask=False,
        hidden_states_tensor=torch.ones(4),
        output_dsa_topk_indices=None,
        inflight_middle_chunks=0,
        to_finish=None,
        discard_output_reason=None,
    )


def sglang_copies_draft_input(self, batch, result):
    # What process_batch_result_disagg_prefill does for finished requests (prefill.py).
    di = result.next_draft_input
    for i, r in enumerate(batch.reqs):
        r.output_topk_p, r.output_topk_index = di.topk_p[i], di.topk_index[i]


def prefill(inst, reqs, q, pbuf):
    """The prefill of one batch: SGLang's draw, our wrapper, SGLang's copy, the real set_buf."""
    b = len(reqs)
    di = SimpleNamespace(
        topk_index=torch.zeros((b, 1), dtype=torch.int64), topk_p=torch.full((b, 1), 0.5), draft_probs=q
    )
    batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(temperatures=torch.ones((b, 1))))
    wrap_prefill_result(sglang_copies_draft_input, inst)(None, batch, SimpleNamespace(next_draft_input=di))
    for r in reqs:
        pbuf.set_buf(r)
    return di


def send_aux(src, src_idx, dst, dst_idx):
    """mooncake/conn.py send_aux: row src_idx of buffer i -> row dst_idx of the peer's buffer i."""
    sp, _, sl = src.get_buf_infos()
    dp, _, _ = dst.get_buf_infos()
    for i in range(min(len(sp), len(dp))):
        ctypes.memmove(dp[i] + sl[i] * dst_idx, sp[i] + sl[i] * src_idx, sl[i])


def commit(sg, dbuf, idx, room):
    req = SimpleNamespace(
        rid=f"r{room}",
        bootstrap_room=room,
        bootstrap_host="10.0.0.2",
        output_ids=[],
        return_logprob=False,
        return_sampling_mask=False,
        finished_reason=None,
        pd_rebootstrap_forced_output_id=None,
        time_stats=SimpleNamespace(set_wait_queue_entry_time=lambda: None),
    )
    queue = SimpleNamespace(
        scheduler=SimpleNamespace(
            kv_checksum_computer=None,
            batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda r, t: None),
        ),
        metadata_buffers=dbuf,
        spec_algorithm=SimpleNamespace(is_none=lambda: False),
        _commit_hicache_local_restore_to_req=lambda dr: None,
    )
    dreq = SimpleNamespace(
        req=req, metadata_buffer_index=idx, is_rebootstrap=False, kv_receiver=SimpleNamespace(clear=lambda: None)
    )
    sg.decode.DecodeTransferQueue._commit_transfer_to_req(queue, dreq)
    return req


def build(sg, reqs, steps=1, multi_layer=False):
    """SGLang's builder over ``reqs``: the ``draft_probs`` it hands the first draft step."""
    return build_draft_input(sg.ed, namespace_batch(reqs, V), steps=steps, multi_layer=multi_layer).draft_probs


def draft(b, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(b, V, generator=g) * 2, -1)


def test_buffer_is_appended_last_and_cleared(sg) -> None:
    plain = buffers(sg)
    n = len(plain.get_buf_infos()[0])
    activate(config())
    mine = buffers(sg)
    ptrs, lens, items = mine.get_buf_infos()
    assert len(ptrs) == n + 1 and items[-1] == 4096 and lens[-1] == 8 * 4096
    assert items[:-1] == plain.get_buf_infos()[2]
    row = mine.pd_proposal[3]
    row[:8] = 7
    mine.clear_slot(3)
    assert int(row[:48].sum()) == 0


def test_published_row_reaches_draft_probs_bit_identically(sg) -> None:
    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    pbuf, dbuf = buffers(sg), buffers(sg, 16)
    rooms = [2**62 + 11, 12, 13]  # SGLang stores rooms as uint64 through int64 assignment
    reqs = [prefill_req(r, i) for i, r in enumerate(rooms)]
    q = draft(3)
    prefill(inst, reqs, q, pbuf)
    enc_rows = [r.pd_middleware_row for r in reqs]
    for i in range(3):
        send_aux(pbuf, i, dbuf, 5 + i)
    dreqs = [commit(sg, dbuf, 5 + i, r) for i, r in enumerate(rooms)]
    assert [d.pd_middleware.reason for d in dreqs] == ["prefill"] * 3
    got = build(sg, dreqs)
    for i in range(3):
        want = sparse_law_tensor(enc_rows[i].proposal, 1, V)[0]
        assert torch.equal(got[i], want), f"seed {SEED} row {i}"
        assert int(dreqs[i].output_topk_index[0]) == enc_rows[i].draft_tokens[0]
    assert inst.counters()["inband"]["inband:read"] == 3
    assert all(d.pd_middleware.used and d.pd_middleware.proposal is None for d in dreqs)


def test_two_prefill_ranks_write_identical_rows_and_two_decode_ranks_build_identical_q(sg) -> None:
    inst = activate(config())
    pub = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    inst.publisher = pub
    q = draft(2, seed=SEED + 1)
    p0, p1 = buffers(sg), buffers(sg)
    r0 = [prefill_req(100 + i, i) for i in range(2)]
    r1 = [prefill_req(100 + i, 4 + i) for i in range(2)]  # another rank, other slots
    prefill(inst, r0, q.clone(), p0)
    prefill(inst, r1, q.clone(), p1)
    for i in range(2):
        assert p0.pd_proposal[i].numpy().tobytes() == p1.pd_proposal[4 + i].numpy().tobytes()
    # Decode TP 2: each rank reads its own row (TP 2 -> 2, one to one).
    d0, d1 = buffers(sg), buffers(sg)
    for i in range(2):
        send_aux(p0, i, d0, i)
        send_aux(p1, 4 + i, d1, i)
    a = build(sg, [commit(sg, d0, i, 100 + i) for i in range(2)])
    b = build(sg, [commit(sg, d1, i, 100 + i) for i in range(2)])
    assert torch.equal(a, b) and (a.max(-1).values < 1).all()
    # TP 2 -> 1 (MHA): both prefill ranks write the same decode row, the last one wins.
    d = buffers(sg)
    send_aux(p0, 0, d, 3)
    send_aux(p1, 4, d, 3)
    assert torch.equal(build(sg, [commit(sg, d, 3, 100)]), a[:1])


class LateCopy:
    """SGLang's ``copy_done`` (a device event on a GPU): the forward's X and q reach the
    draft input only once it is waited for. Until then the draft input holds another
    batch's values (here: another draft and another X)."""

    def __init__(self, draft_input, q, x):
        self.draft_input, self.q, self.x = draft_input, q, x
        self.waited = 0

    def synchronize(self):
        self.draft_input.draft_probs.copy_(self.q)
        self.draft_input.topk_index.copy_(self.x)
        self.waited += 1


def test_the_prefill_waits_for_copy_done_before_reading_x_and_q(sg) -> None:
    """The prefill wrapper reads X and q only after SGLang's ``copy_done``: what it publishes
    is the encoding of the forward's q, the same rows and X as a batch whose values were
    there from the start. Reading before the wait would encode the stale draft."""
    rooms = [81, 82, 83]
    q = draft(3)
    inst = activate(config(), role="prefill")
    want_reqs = [prefill_req(r, i) for i, r in enumerate(rooms)]
    prefill(inst, want_reqs, q.clone(), buffers(sg))  # the values present from the start
    want = [(r.pd_middleware_row.draft_tokens, r.pd_middleware_row.proposal) for r in want_reqs]
    reqs = [prefill_req(r, i) for i, r in enumerate(rooms)]
    di = SimpleNamespace(
        topk_index=torch.full((3, 1), 7, dtype=torch.int64),
        topk_p=torch.full((3, 1), 0.5),
        draft_probs=draft(3, seed=SEED + 9),  # stale: another batch's draft
    )
    late = LateCopy(di, q, torch.zeros((3, 1), dtype=torch.int64))
    batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(temperatures=torch.ones((3, 1))))
    result = SimpleNamespace(next_draft_input=di, copy_done=late)
    wrap_prefill_result(sglang_copies_draft_input, inst)(None, batch, result)
    got = [(r.pd_middleware_row.draft_tokens, r.pd_middleware_row.proposal) for r in reqs]
    assert got == want, f"seed {SEED}: the published rows are not the forward's"
    assert late.waited == 1
    assert [int(r.output_topk_index[0]) for r in reqs] == [x for (x,), _ in want]


def test_rank_divergence_falls_back_to_one_hot(sg) -> None:
    # Negative control: a row whose X is not SGLang's (another rank drew another X).
    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    pbuf, dbuf = buffers(sg), buffers(sg)
    reqs = [prefill_req(7, 0)]
    prefill(inst, reqs, draft(1), pbuf)
    x = int(reqs[0].output_topk_index[0])
    pbuf.output_topk_index[0, 0] = (x + 1) % V  # SGLang's metadata now carries another X
    send_aux(pbuf, 0, dbuf, 0)
    dreq = commit(sg, dbuf, 0, 7)
    assert dreq.pd_middleware.reason == "token_mismatch"
    got = build(sg, [dreq])
    assert torch.equal(got[0], torch.nn.functional.one_hot(torch.tensor((x + 1) % V), V).float())
    assert inst.proposer.counts["fallback:token_mismatch"] == 1


@pytest.mark.parametrize("how", ["room_mismatch", "not_ready"])
def test_a_request_sglang_aborts_at_commit_neither_reads_its_row_nor_gets_a_proposal(sg, how) -> None:
    """SGLang's real ``_commit_transfer_to_req`` aborts a request whose metadata row names
    another room (its "context corruption" check) or none (its "not ready after the gate"
    check): the drop-in's commit then reads no row, attaches nothing and counts nothing,
    for a request SGLang will never build. Control: the same row committed under its own
    room is read and attached."""
    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    reads = []
    real_read = inst.channel.read
    inst.channel.read = lambda *a: reads.append(a) or real_read(*a)
    pbuf, dbuf = buffers(sg), buffers(sg)
    prefill(inst, [prefill_req(71, 0)], draft(1), pbuf)
    send_aux(pbuf, 0, dbuf, 0)
    if how == "not_ready":
        dbuf.bootstrap_room[0] = 0
    before = dict(inst.channel.counts)  # the prefill's inband:written (one channel object plays both nodes)
    dreq = commit(sg, dbuf, 0, 72 if how == "room_mismatch" else 71)
    assert dreq.finished_reason is not None  # SGLang aborted it
    assert reads == [] and not hasattr(dreq, "pd_middleware")
    assert inst.channel.counts == before and inst.proposer.counts == {} and inst.guard.counts == {}
    send_aux(pbuf, 0, dbuf, 1)  # control: committed under its own room
    ok = commit(sg, dbuf, 1, 71)
    assert ok.finished_reason is None and len(reads) == 1 and ok.pd_middleware.reason == "prefill"


def test_x_and_row_from_different_prefill_writes_fall_back_to_one_hot(sg) -> None:
    """TP 2 -> 1 MHA: each aux buffer's last writer wins, buffer by buffer (docs/sglang_transfer.md).

    Rank B wrote its row and X'; rank A's publish failed, so it kept SGLang's own draw
    (X ~ q, here the same token as X') and no row. If A's ``output_topk_index`` lands last
    and B's row stays, X and q' come from different draws: a biased pair even though the
    tokens agree. The tag beside X binds X to its row, so this falls back to one-hot.
    """
    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    p_b, p_a, dbuf = buffers(sg), buffers(sg), buffers(sg)
    (req_b,) = [prefill_req(31, 0)]
    prefill(inst, [req_b], draft(1), p_b)
    x = int(req_b.output_topk_index[0])
    req_a = prefill_req(31, 0)
    req_a.output_topk_index = torch.tensor([x])  # SGLang's own draw, the same token
    req_a.output_topk_p = torch.tensor([0.27])
    inst.channel.stage(req_a, None)  # nothing staged on rank A
    p_a.set_buf(req_a)
    assert int(p_a.output_topk_index[0, 15]) == 0 and int(p_b.output_topk_index[0, 15]) != 0
    # Control: everything from rank B is B's exact pair.
    send_aux(p_b, 0, dbuf, 0)
    assert commit(sg, dbuf, 0, 31).pd_middleware.reason == "prefill"
    # A's X and q(X) buffers land after B's (interleaved writers), B's row stays.
    dbuf.output_topk_index[0] = p_a.output_topk_index[0]
    dbuf.output_topk_p[0] = p_a.output_topk_p[0]
    dreq = commit(sg, dbuf, 0, 31)
    assert dreq.pd_middleware.reason == "binding"
    assert torch.equal(build(sg, [dreq])[0], torch.nn.functional.one_hot(torch.tensor(x), V).float())
    assert inst.channel.counts["inband:binding"] == 1


def test_a_row_fault_on_one_decode_rank_keeps_the_committed_law_p(sg) -> None:
    """The in-band fallback is decided per rank (docs/sglang.md, "The in-band fallback is
    per rank"): a row torn on decode rank 1 only gives rank 1 the one-hot at X while rank 0
    hands the verifier the shipped q at the same X. Exact because SGLang's rejection-sampling
    verify broadcasts its result from rank 0, so every rank commits rank 0's verdict, and
    each rank's proposal is exact for X alone. Checked here: the two ranks' real builder
    outputs; SGLang's eagle_sample broadcasting predict/accept_index/num_correct_drafts from
    rank 0 (if a later SGLang drops it, this fails); the committed law under that broadcast,
    enumerated with Fraction under SGLang's kernel reading, equal to p whichever rank falls
    back. Negative control: without the broadcast the ranks' verdicts, even with one shared
    coin, differ with positive probability (each rank would commit its own token)."""
    import inspect

    from sglang.srt.speculative import eagle_utils

    from pd_middleware.evaluation.verify_exact import exact_accept_probability, exact_residual, exact_verify_law

    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    pbuf, d0, d1 = buffers(sg), buffers(sg), buffers(sg)
    prefill(inst, [prefill_req(91, 0)], draft(1, seed=SEED + 3), pbuf)
    send_aux(pbuf, 0, d0, 0)
    send_aux(pbuf, 0, d1, 0)
    inst.channel.rows(d1)[0, 60] ^= 0xFF  # rank 1's copy of the row is torn (a byte of its body)
    r0, r1 = commit(sg, d0, 0, 91), commit(sg, d1, 0, 91)
    assert (r0.pd_middleware.reason, r1.pd_middleware.reason) == ("prefill", "digest")
    x = int(r0.output_topk_index[0])
    assert int(r1.output_topk_index[0]) == x  # the same X on both ranks: only the proposal differs
    shipped, fallback = build(sg, [r0])[0], build(sg, [r1])[0]
    assert torch.equal(fallback, one_hot_rows([x])[0]) and int((shipped > 0).sum()) > 1

    # SGLang 0.5.23: under rejection sampling every rank commits attention-TP rank 0's verdict.
    body = inspect.getsource(eagle_utils.eagle_sample)
    tail = body[body.index("sampling_fn = chain_speculative_sampling_triton") :]
    for name in ("predict", "accept_index", "num_correct_drafts"):
        assert f"tp_group.broadcast({name}, src=0)" in tail, f"SGLang's verify no longer broadcasts {name}"

    s_law = _fractions(shipped)  # the law the prefill drew X from and shipped (normalised: float32 rounding)
    p = _fractions(draft(1, seed=SEED + 5)[0])
    one_hot_of = lambda y: [int(i == y) for i in range(V)]  # noqa: E731  # the fallback rank's q' given X = y
    # Rank 0 served the shipped q (rank 1 fell back), or the reverse: rank 0's verdict is committed.
    assert exact_verify_law(p, s_law, s_law, kernel="sglang") == p
    assert exact_verify_law(p, one_hot_of, s_law, kernel="sglang") == p
    # Negative control: per-rank verdicts with one shared coin u (accept iff u * q'(X) < p(X)):
    # the ranks disagree with probability sum_X s(X) |a_shipped(X) - a_one_hot(X)|.
    split = sum(
        s_law[y] * abs(exact_accept_probability(p[y], s_law[y], "sglang") - exact_accept_probability(p[y], 1, "sglang"))
        for y in range(V)
        if s_law[y]
    )
    assert split > 0
    # And rank 0's accept decision with another rank's residual draw (predict not broadcast
    # with accept_index) is biased: the enumeration tells an inexact mix from p.
    mixed = [Fraction(0)] * V
    for y in (y for y in range(V) if s_law[y]):
        a = exact_accept_probability(p[y], s_law[y], "sglang")
        mixed[y] += s_law[y] * a
        for z, r in enumerate(exact_residual(p, one_hot_of(y), "sglang")):
            mixed[z] += s_law[y] * (1 - a) * r
    assert mixed != p
    print(f"\nwithout SGLang's broadcast the two ranks' verdicts would differ with probability {float(split):.3f}")


def test_late_write_after_the_digest_check_is_not_read(sg) -> None:
    """The row is copied once before its digest is checked: a write landing afterwards (SGLang's
    TCP aux path writes from another thread) cannot reach the decoded payload unverified."""
    from pd_middleware.codecs.inband import read_row

    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    pbuf, dbuf = buffers(sg), buffers(sg)
    reqs = [prefill_req(41, 0)]
    prefill(inst, reqs, draft(1), pbuf)
    send_aux(pbuf, 0, dbuf, 0)
    live = inst.channel.rows(dbuf)[0]
    shared: list[bool] = []

    def read_watching(row, room, layout, request_id=None, *, copy=True):
        # read_row checks the digest, then decodes: both must see one snapshot, not the live row
        # (copy=False: the payload's buffers are views of that snapshot, never of the live row).
        shared.append(bool(np.shares_memory(row, live)))
        return read_row(row, room, layout, request_id, copy=copy)

    with patch.object(sglang_metadata, "read_row", read_watching):
        dreq = commit(sg, dbuf, 0, 41)
    assert dreq.pd_middleware.reason == "prefill"
    assert shared == [False]


def test_overflow_that_cannot_fit_even_x_never_raises_into_set_buf(sg) -> None:
    """A row so small that the X-only overflow row does not fit either: cleared, counted, no raise."""
    inst = activate(config(capacity=256), num_steps=15)
    long_name = Payload(
        request_id="51",
        draft_tokens=(1,) * 15,
        draft_probs=(0.5,) * 15,
        vocab_size=V,
        provenance=Provenance("sampled", 1.0, "x" * 40),
        proposal=None,
    )
    pbuf = buffers(sg)
    req = prefill_req(51, 0)
    req.output_topk_index, req.output_topk_p = torch.ones(15, dtype=torch.int64), torch.full((15,), 0.5)
    inst.channel.stage(req, long_name)
    pbuf.set_buf(req)  # must not raise
    assert not pbuf.pd_proposal[0, :48].any() and int(pbuf.output_topk_index[0, 15]) == 0
    assert inst.channel.counts["inband:write_failed:RowOverflowError"] == 1


@pytest.mark.parametrize("where", [60, 200, 3000])
def test_corrupt_row_falls_back_to_one_hot_counted(sg, where) -> None:
    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    pbuf, dbuf = buffers(sg), buffers(sg)
    reqs = [prefill_req(9, 0)]
    prefill(inst, reqs, draft(1), pbuf)
    send_aux(pbuf, 0, dbuf, 0)
    n = int(np.frombuffer(dbuf.pd_proposal[0, 24:28].numpy().tobytes(), "<u4")[0]) + 48
    at = min(where, n - 1)
    dbuf.pd_proposal[0, at] ^= 0x5A
    dreq = commit(sg, dbuf, 0, 9)
    assert dreq.pd_middleware.reason == "digest", at
    x = int(dreq.output_topk_index[0])
    assert torch.equal(build(sg, [dreq])[0], torch.nn.functional.one_hot(torch.tensor(x), V).float())
    assert inst.channel.counts["inband:digest"] == 1


def test_overflow_sends_x_only_counted(sg) -> None:
    cfg = config(capacity=256, encoder={"name": "sparse", "options": {"mode": "topk", "k": 40, "value_dtype": "fp32"}})
    inst = activate(cfg)
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    pbuf, dbuf = buffers(sg), buffers(sg)
    reqs = [prefill_req(21, 0)]
    prefill(inst, reqs, draft(1), pbuf)
    send_aux(pbuf, 0, dbuf, 0)
    dreq = commit(sg, dbuf, 0, 21)
    assert dreq.pd_middleware.reason == "overflow"
    assert inst.channel.counts["inband:overflow"] == 2  # counted on write (prefill) and on read (decode)
    x = int(dreq.output_topk_index[0])
    assert torch.equal(build(sg, [dreq])[0], torch.nn.functional.one_hot(torch.tensor(x), V).float())


def test_prefill_without_drop_in_reads_as_not_sent(sg) -> None:
    pbuf = buffers(sg)  # no drop-in on the prefill: one buffer fewer
    reqs = [prefill_req(31, 0)]
    for r in reqs:
        r.output_topk_p, r.output_topk_index = torch.tensor([0.5]), torch.tensor([3])
        pbuf.set_buf(r)
    inst = activate(config())
    dbuf = buffers(sg)
    send_aux(pbuf, 0, dbuf, 0)  # send_aux stops at the shorter list
    dreq = commit(sg, dbuf, 0, 31)
    assert dreq.pd_middleware.reason == "not_sent" and dreq.bootstrap_room == 31
    assert torch.equal(build(sg, [dreq])[0], torch.nn.functional.one_hot(torch.tensor(3), V).float())
    assert inst.channel.counts["inband:not_sent"] == 1


def _registration(aux_ptrs, extra=None):
    from sglang.srt.disaggregation.common.utils import pack_int_lists

    msg = [
        b"None",
        b"127.0.0.1",
        b"17000",
        b"127.0.0.1:17001",
        b"",
        struct.pack(f"{len(aux_ptrs)}Q", *aux_ptrs),
        pack_int_lists([], "Q"),
        b"0",
        b"1",
        b"0",
        pack_int_lists([], "I"),
        pack_int_lists([], "I"),
        b"",
        b"",
        b"",
        b"",
        b"1",
        b"0",
        b"",
        b"",
    ]
    return msg + ([extra] if extra is not None else [])


def _validate(sg, inst, local_aux, msg):
    info = sg.mooncake.KVArgsRegisterInfo.from_zmq(msg)
    mgr = SimpleNamespace(
        kv_args=SimpleNamespace(state_types=[], aux_data_ptrs=[0] * local_aux), state_tp_size=1, attn_tp_size=1
    )
    spec = SimpleNamespace(speculative_algorithm="EAGLE")
    with patch.object(sg.mooncake, "get_spec", return_value=spec):
        return sg.mooncake.MooncakeKVManager._validate_peer_state_layout(mgr, info)


def test_handshake_serves_a_decode_without_the_drop_in_and_rejects_other_layouts(sg) -> None:
    inst = activate(config(), role="prefill")
    mine = inst.channel.describe().encode()
    ok = _validate(sg, inst, 16, _registration([1] * 16, FRAME_MARK + mine))
    assert ok[1] is None
    # A decode without the drop-in (no frame, exactly our one buffer fewer): served, counted.
    assert _validate(sg, inst, 16, _registration([1] * 15))[1] is None
    assert inst.channel.counts["inband:peer_without_dropin"] == 1
    # No frame and another count (an optional SGLang buffer on one side too): rejected.
    _, why = _validate(sg, inst, 16, _registration([1] * 14))
    assert "the decode registered none (14 metadata buffers vs 16 here)" in why and "capacity=4096" in why
    theirs = b"rowv1 capacity=8192 vocab=64 steps=1 sig=0000000000000000"
    _, why = _validate(sg, inst, 16, _registration([1] * 16, FRAME_MARK + theirs))
    assert (
        why.startswith("pd-middleware proposal rows differ: prefill rowv1 capacity=4096")
        and "decode rowv1 capacity=8192" in why
    )
    _, why = _validate(sg, inst, 16, _registration([1] * 17, FRAME_MARK + mine))
    assert "metadata buffer count differs: prefill 16, decode 17" in why
    assert inst.channel.counts["inband:peer_rejected"] == 3


def test_decode_registration_carries_its_layout_last(sg) -> None:
    # The real builder needs a running engine; the wrapper around a stand-in original
    # shows the frame goes last, where SGLang's fixed-position parser never looks.
    inst = activate(config())
    out = wrap_registration(lambda self: [b"None", b"x"], inst)(SimpleNamespace())
    assert out[:2] == [b"None", b"x"] and out[-1] == FRAME_MARK + inst.channel.describe().encode()
    info = sg.mooncake.KVArgsRegisterInfo.from_zmq(_registration([1, 2], out[-1]))
    assert info.dst_aux_ptrs == [1, 2] and info.pd_middleware_layout == inst.channel.describe()


def test_uninstall_restores_every_sglang_attribute(sg) -> None:
    mb = sg.utils.MetadataBuffers
    before = {a: mb.__dict__[a] for a in ("__init__", "get_buf_infos", "set_buf", "clear_slot")}
    from_zmq = sg.mooncake.KVArgsRegisterInfo.__dict__["from_zmq"]
    activate(config())
    assert mb.__dict__["set_buf"] is not before["set_buf"]
    assert S.uninstall()
    assert {a: mb.__dict__[a] for a in before} == before
    assert sg.mooncake.KVArgsRegisterInfo.__dict__["from_zmq"] is from_zmq
    assert not hasattr(buffers(sg), "pd_proposal")


def test_metadata_on_a_device_is_refused(sg) -> None:
    inst = activate(config())

    def on_npu(self, *a, **k):  # SGLang puts metadata on the NPU (or a custom NVLink pool)
        self.bootstrap_room = SimpleNamespace(device=SimpleNamespace(type="npu"))

    with pytest.raises(ConfigError, match=r"at sglang\.channel.*PD metadata on .*needs CPU metadata buffers"):
        wrap_metadata_init(on_npu, inst)(SimpleNamespace(), 4)


def test_harness_activation_by_role_and_stage_requests(sg) -> None:
    # A two-process harness activates each process by its role, without a Scheduler.
    inst = activate(config(), role="prefill")
    assert inst.publisher is not None and inst.publisher.stage == inst.channel.stage and inst.proposer.bound is None
    pbuf = buffers(sg)
    reqs = [prefill_req(41 + i, i) for i in range(2)]
    for r in reqs:
        r.hidden_states_tensor = torch.ones(4)
    enc = inst.stage_requests(reqs, draft(2, seed=SEED + 3))
    for r in reqs:
        pbuf.set_buf(r)
    assert [int(r.output_topk_index[0]) for r in reqs] == enc.tokens[:, 0].tolist()
    # ... and this process's decode side (bound by hand: one process plays both here).
    inst.proposer.bind(V, 1)
    dbuf = buffers(sg)
    for i in range(2):
        send_aux(pbuf, i, dbuf, i)
    got = build(sg, [commit(sg, dbuf, i, 41 + i) for i in range(2)])
    for i in range(2):
        assert torch.equal(got[i], sparse_law_tensor(enc.proposals[i], 1, V)[0]), f"seed {SEED + 3} row {i}"


# ---------------------------------------------------------------- multi-layer chains

STEPS = 3


def multi_layer_stand_in():
    """Shaped like SGLang 0.5.23's multi_layer_eagle_worker_v2 (the real module imports on
    CPU, but its ``_draft_extend_for_prefill`` runs a draft model's forwards): the
    prefill's chain loop calls the module-global ``sample_draft_proposal`` per step and
    feeds each step's X into the next step's logits, as ``rotate_input_ids`` does."""
    import types

    m = types.ModuleType("multi_layer_stand_in")

    def step_logits(prev, b):
        g = torch.Generator().manual_seed(1000 + int(prev.sum()))
        return torch.randn(b, V, generator=g) * 2 + torch.nn.functional.one_hot(prev, V).float() * 3

    def sample_draft_proposal(
        next_token_logits, temperatures, top_ks=None, *, sampling_seed=None, positions=None, draft_step=0
    ):
        probs = torch.softmax(next_token_logits / temperatures.view(-1, 1), -1)
        x = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(5 + draft_step))
        return probs, probs.gather(1, x), x

    class MultiLayerEagleDraftWorker:
        def _draft_extend_for_prefill(self, batch, target_hidden_states, next_token_ids, kv_loc_plan=None):
            prev, ps, xs, qs = next_token_ids, [], [], []
            for step in range(STEPS):
                logits = step_logits(prev, len(batch.reqs))
                q, p, x = m.sample_draft_proposal(
                    logits, batch.sampling_info.temperatures, sampling_seed=None, positions=None, draft_step=step
                )
                ps.append(p)
                xs.append(x)
                qs.append(q)
                prev = x[:, 0]
            return SimpleNamespace(topk_p=torch.cat(ps, 1), topk_index=torch.cat(xs, 1), draft_probs=torch.stack(qs, 1))

    m.step_logits = step_logits
    m.sample_draft_proposal = sample_draft_proposal
    m.MultiLayerEagleDraftWorker = MultiLayerEagleDraftWorker
    return m


def test_multi_layer_chain_is_drawn_step_by_step_and_reaches_the_decode(sg) -> None:
    mod = multi_layer_stand_in()
    orig_sample = mod.sample_draft_proposal
    cfg = config(capacity=8192)
    inst = S.install(
        cfg,
        S.InstallOptions(
            channel="metadata", facts=facts("prefill", num_steps=STEPS), modules=S.SGLangModules(multi_layer=mod)
        ),
    )
    assert mod.sample_draft_proposal is not orig_sample
    pbuf = buffers(sg)
    rooms = [501, 502]
    reqs = [prefill_req(r, i) for i, r in enumerate(rooms)]
    batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(temperatures=torch.ones((2, 1))))
    di = mod.MultiLayerEagleDraftWorker()._draft_extend_for_prefill(batch, None, torch.tensor([1, 2]))
    payloads = di.pd_middleware_payloads
    # Each step k was drawn from the encoding of q_k given the chain's own X_{<k}.
    prev = torch.tensor([1, 2])
    for k in range(STEPS):
        q = torch.softmax(mod.step_logits(prev, 2), -1)
        for i in range(2):
            salt = f"{getattr(reqs[i], 'rid', '')}:{k}"
            u = request_uniforms(SEED, [rooms[i]], [salt], positions=[4])  # 3 prompt + 1 output tokens
            e = inst.publisher.encoder.encode(q[i : i + 1], temperature=1.0, uniforms=u)
            assert payloads[i].draft_tokens[k] == int(e.tokens[0, 0]) == int(di.topk_index[i, k]), (i, k)
            assert torch.equal(
                sparse_law_tensor(payloads[i].proposal, STEPS, V)[k], sparse_law_tensor(e.proposals[0], 1, V)[0]
            )
        prev = di.topk_index[:, k]
    # The prefill wrapper hands those payloads on (no second draw), set_buf writes them.
    wrap_prefill_result(sglang_copies_draft_input, inst)(None, batch, SimpleNamespace(next_draft_input=di))
    for r in reqs:
        pbuf.set_buf(r)
    assert inst.publisher.counts["chain:published"] == 2
    # Decode: a multi-layer chain of 3 proposals per request, each exact.
    inst.proposer.bind(V, STEPS)
    inst.channel.bind(V, STEPS)
    dbuf = buffers(sg)
    dreqs = []
    for i, r in enumerate(rooms):
        send_aux(pbuf, i, dbuf, i)
        dreqs.append(commit(sg, dbuf, i, r))
    assert [d.pd_middleware.reason for d in dreqs] == ["prefill", "prefill"]
    got = build(sg, dreqs, STEPS, multi_layer=True)
    assert got.shape == (2, STEPS, V)
    for i in range(2):
        assert torch.equal(got[i], sparse_law_tensor(payloads[i].proposal, STEPS, V)), f"row {i}"
    assert S.uninstall() and mod.sample_draft_proposal is orig_sample


def test_redrawing_a_chain_after_the_fact_is_not_its_law() -> None:
    # Negative control for the test above: q_1 depends on X_0, so a chain whose X_0 is
    # redrawn after SGLang drafted step 1 pairs step 1's q with another prefix.
    mod = multi_layer_stand_in()
    q_after_3 = torch.softmax(mod.step_logits(torch.tensor([3]), 1), -1)
    q_after_4 = torch.softmax(mod.step_logits(torch.tensor([4]), 1), -1)
    assert not torch.equal(q_after_3, q_after_4)


def test_multi_layer_without_chain_draws_sends_sglangs_chain_without_a_distribution(sg) -> None:
    # A multi-layer batch whose chain was not drawn through the encoder (no chain patch):
    # the row carries SGLang's own X chain and no q, so the decode answers one-hot.
    inst = activate(config(capacity=8192), role="prefill", num_steps=1)
    inst.channel.bind(V, STEPS)
    inst.publisher.vocab_size = V
    inst.publisher.num_steps = STEPS  # the engine's S (activation takes it from the facts)
    pbuf = buffers(sg)
    reqs = [prefill_req(601, 0)]
    di = SimpleNamespace(
        topk_index=torch.tensor([[4, 9, 2]]),
        topk_p=torch.tensor([[0.5, 0.25, 0.125]]),
        draft_probs=torch.full((1, STEPS, V), 1.0 / V),
    )
    batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(temperatures=torch.ones((1, 1))))
    wrap_prefill_result(sglang_copies_draft_input, inst)(None, batch, SimpleNamespace(next_draft_input=di))
    pbuf.set_buf(reqs[0])
    assert inst.publisher.counts["skipped:multi_layer"] == 1
    inst.proposer.bind(V, STEPS)
    dbuf = buffers(sg)
    send_aux(pbuf, 0, dbuf, 0)
    dreq = commit(sg, dbuf, 0, 601)
    assert dreq.pd_middleware.reason == "no_distribution" and dreq.pd_middleware.tokens == (4, 9, 2)
    got = build(sg, [dreq], STEPS, multi_layer=True)
    assert torch.equal(got[0], torch.nn.functional.one_hot(torch.tensor([4, 9, 2]), V).float())


MULTI_LAYER_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "multi_layer.yaml"


@pytest.mark.parametrize("steps", [3, 4, 5])
def test_the_shipped_multi_layer_config_ships_an_exact_compressed_chain_whose_largest_row_fits(steps) -> None:
    """configs/multi_layer.yaml: no shapes declared (V and S from the engine), sparse with a
    floor per step on both sides, and the largest row of an S-step chain at V = 152064 (a
    flat draft: k_max entries per step) within its capacity, for the tier's S = 3 and
    larger; the same row with twice the steps does not fit (the capacity is what decides)."""
    from pd_middleware.codecs.inband import row_bytes
    from pd_middleware.config import load_config

    cfg = load_config(MULTI_LAYER_CONFIG)
    assert cfg.model.declared_vocab_size is None and cfg.model.declared_num_steps is None
    assert cfg.synthesizer.name == "sparse" and cfg.encoder.name == "sparse" and cfg.encoder.options["floor"]
    assert cfg.sglang.channel == "metadata"
    v = 152064

    def largest(s):
        pub = S.ProposalPublisher.from_config(cfg, stage=lambda *a: None, vocab_size=v, num_steps=s)
        _, payloads = pub.encode([0], torch.full((1, s, v), 1.0 / v))
        assert payloads[0].proposal is not None and payloads[0].proposal.kind == "sparse"
        return row_bytes(payloads[0])

    assert largest(steps) <= cfg.sglang.capacity_bytes
    assert largest(2 * steps) > cfg.sglang.capacity_bytes  # negative control


def test_a_multi_layer_decode_behind_a_prefill_that_ships_nothing_keeps_sglangs_one_hot_chain(sg) -> None:
    """configs/multi_layer.yaml on the decode only: a stock prefill writes SGLang's X chain
    and no row; the decode reads ``not_sent`` and SGLang's builder gets the exact one-hot
    chain (B, S, V) at that X chain."""
    from pd_middleware.config import load_config

    pbuf = buffers(sg)  # no drop-in on the prefill: one buffer fewer
    r = prefill_req(41, 0)
    r.output_topk_p, r.output_topk_index = torch.tensor([0.5, 0.25, 0.125]), torch.tensor([4, 9, 2])
    pbuf.set_buf(r)
    inst = S.install(
        load_config(MULTI_LAYER_CONFIG), S.InstallOptions(channel="metadata", facts=facts(num_steps=STEPS))
    )
    dbuf = buffers(sg)
    send_aux(pbuf, 0, dbuf, 0)
    dreq = commit(sg, dbuf, 0, 41)
    assert dreq.pd_middleware.reason == "not_sent" and dreq.pd_middleware.tokens == (4, 9, 2)
    got = build(sg, [dreq], STEPS, multi_layer=True)
    assert torch.equal(got[0], torch.nn.functional.one_hot(torch.tensor([4, 9, 2]), V).float())
    assert inst.channel.counts["inband:not_sent"] == 1


def test_fake_transfer_is_not_counted_as_a_missing_row(sg) -> None:
    # SGLang's warmup requests use a fake bootstrap host: no prefill ever writes them.
    inst = activate(config())
    dbuf = buffers(sg)
    room = 77
    dbuf.bootstrap_room[0, 0] = room
    req = SimpleNamespace(
        rid="warm",
        bootstrap_room=room,
        bootstrap_host=sg.utils.FAKE_BOOTSTRAP_HOST,
        output_ids=[],
        return_logprob=False,
        return_sampling_mask=False,
        finished_reason=None,
        pd_rebootstrap_forced_output_id=None,
        time_stats=SimpleNamespace(set_wait_queue_entry_time=lambda: None),
        origin_input_ids=[1, 2],
        sampling_params=SimpleNamespace(),
    )
    queue = SimpleNamespace(
        scheduler=SimpleNamespace(
            kv_checksum_computer=None,
            batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda r, t: None),
        ),
        metadata_buffers=dbuf,
        spec_algorithm=SimpleNamespace(is_none=lambda: False),
        _commit_hicache_local_restore_to_req=lambda dr: None,
    )
    dreq = SimpleNamespace(
        req=req, metadata_buffer_index=0, is_rebootstrap=False, kv_receiver=SimpleNamespace(clear=lambda: None)
    )
    with patch.object(sg.decode, "_generate_fake_prefill_handoff_output_id", return_value=3):
        sg.decode.DecodeTransferQueue._commit_transfer_to_req(queue, dreq)
    assert not hasattr(req, "pd_middleware") and inst.channel.counts["inband:not_sent"] == 0


def scheduler_module(sg):
    """A ``Scheduler`` whose ``init_disaggregation`` allocates SGLang's real MetadataBuffers,
    as SGLang's does. The real module imports here (tests/test_sglang.py wraps its
    ``Scheduler.init_disaggregation``), but its body builds KV managers and queues over a
    model runner, so these tests give the wrapper this body instead."""
    import types

    mod = types.ModuleType("scheduler_with_buffers")

    class Scheduler:
        def __init__(self, vocab):
            self.model_config = SimpleNamespace(vocab_size=vocab)

        def init_disaggregation(self):
            self.disagg_metadata_buffers = buffers(sg)

    mod.Scheduler = Scheduler
    return mod


def runtime(**over):
    import contextlib

    from sglang.srt.runtime_context import get_context, get_parallel

    args = dict(
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        speculative_num_steps=3,
        enable_multi_layer_eagle=False,
        speculative_use_rejection_sampling=True,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="mooncake",
        tp_size=2,
    )
    args.update(over)
    stack = contextlib.ExitStack()
    stack.enter_context(get_context().override_server_args(**args))
    stack.enter_context(get_parallel().override(tp_rank=1))
    return stack


def test_scheduler_start_reads_sglangs_runtime_context_and_binds_before_allocation(sg) -> None:
    mod = scheduler_module(sg)
    inst = S.install(config(), S.InstallOptions(modules=S.SGLangModules(scheduler=mod)))
    sched = mod.Scheduler(vocab=V)
    with runtime():
        sched.init_disaggregation()
    assert inst.facts == S.EngineFacts(
        role="decode",
        vocab_size=V,
        num_steps=1,
        algorithm="EAGLE",
        topk=1,
        rejection_sampling=True,
        backend="mooncake",
        tp_rank=1,
    )
    assert inst.proposer.bound == (V, 1) and inst.channel.layout.vocab_size == V
    assert sched.disagg_metadata_buffers.pd_proposal.shape == (8, 4096)  # TP rank 1: no rank-0 restriction


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"speculative_eagle_topk": 4}, "--speculative-eagle-topk is 4"),
        ({"speculative_use_rejection_sampling": False}, "without --speculative-use-rejection-sampling"),
        ({"disaggregation_transfer_backend": "nixl"}, "mooncake transfer backend only"),
        ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm is NGRAM"),
    ],
)
def test_misconfigured_scheduler_stops_at_startup(sg, over, message) -> None:
    mod = scheduler_module(sg)
    S.install(config(), S.InstallOptions(modules=S.SGLangModules(scheduler=mod)))
    sched = mod.Scheduler(vocab=V)
    with runtime(**over), pytest.raises(ConfigError, match=message):
        sched.init_disaggregation()
    assert not hasattr(sched, "disagg_metadata_buffers")  # before SGLang allocated anything


class EagleDraftWorker:
    """Stand-in for SGLang's ``EagleDraftWorker`` (``scheduler.draft_worker.draft_worker``):
    EAGLE keeps ``--speculative-token-map`` here as ``hot_token_id`` (``eagle_worker_v2.py``
    around 332 and 372), not on the draft model."""

    def __init__(self, hot_token_id):
        self.hot_token_id = hot_token_id
        self.draft_runner = SimpleNamespace(model=SimpleNamespace())


def permuted_map():
    return torch.randperm(V, generator=torch.Generator().manual_seed(9))


SHIPPED_AND_NOT = {
    "sparse": {},
    "full": {"synthesizer": {"name": "full_distribution"}, "encoder": {"name": "full", "options": {"dtype": "fp32"}}},
    "one_hot": {"synthesizer": {"name": "one_hot"}, "encoder": {"name": "softmax"}},
}


@pytest.mark.parametrize("role", ["decode", "prefill"])
@pytest.mark.parametrize("strategy", list(SHIPPED_AND_NOT))
def test_a_non_identity_token_map_is_refused_at_start_for_every_strategy(sg, strategy, role) -> None:
    """A full-size permuted --speculative-token-map (EAGLE-1: the worker's hot_token_id) stops
    the scheduler at start, naming the flag, for a shipped q (sparse, full) and for one-hot
    alike, on either node, before SGLang allocates anything: the first verify would read the
    proposal at hot[X] (``test_a_token_map_makes_the_first_verify_inexact_for_every_strategy``)
    and every later step's draft_probs is in draft-id order. Controls: the identity map and no
    map start."""
    cfg = config(**SHIPPED_AND_NOT[strategy])
    for hot, refused in ((permuted_map(), True), (torch.arange(V), False), (None, False)):
        mod = scheduler_module(sg)
        inst = S.install(cfg, S.InstallOptions(modules=S.SGLangModules(scheduler=mod)))
        sched = mod.Scheduler(vocab=V)
        sched.draft_worker = SimpleNamespace(draft_worker=EagleDraftWorker(hot))
        with runtime(disaggregation_mode=role):
            if refused:
                with pytest.raises(ConfigError, match=r"not the identity \(--speculative-token-map"):
                    sched.init_disaggregation()
                assert not hasattr(sched, "disagg_metadata_buffers") and inst.facts is None
            else:
                sched.init_disaggregation()
                assert inst.facts is not None and inst.facts.role == role
                assert sched.disagg_metadata_buffers.pd_proposal.shape == (8, 4096)
        S.uninstall()


def _fractions(row) -> list:
    """A float32 law as exact fractions, normalised (float32 sums miss 1 by rounding)."""
    f = [Fraction(float(v)) for v in row.tolist()]
    total = sum(f)
    return [v / total for v in f]


def test_a_token_map_makes_the_first_verify_inexact_for_every_strategy(sg) -> None:
    """Why the refusal above covers every strategy: with a permuted map SGLang verifies
    t = hot[X] (X the draft id the prefill drew) against whatever the builder handed it.
    Exact enumeration (Fraction, SGLang's kernel reading) of the first verify's committed
    law with the builder's real output: the shipped q (in-band, sparse) and the one-hot at
    the received X (the builder's answer with no row) both commit a law other than p.
    Control: the shipped q scattered into target ids (q'[hot[j]] = q[j]) commits p, so the
    enumeration does see an exact proposal; that repair would hold for this step only
    (SGLang's later draft steps keep draft-id order), hence a refusal, not a scatter."""
    from pd_middleware.evaluation.verify_exact import exact_verify_law

    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    (dreq,) = committed(sg, inst, [61])
    shipped = build(sg, [dreq])[0]
    assert dreq.pd_middleware.reason == "prefill" and int((shipped > 0).sum()) > 1  # a real shipped q
    one_hots = build(sg, [decode_req([j]) for j in range(V)])  # the builder's one-hot at each received X
    assert torch.equal(one_hots, one_hot_rows(list(range(V))))
    hot = permuted_map().tolist()
    inv = [0] * V
    for j, t in enumerate(hot):
        inv[t] = j
    q = _fractions(shipped)  # the law the prefill drew X from, in draft-id order
    s_t = [q[inv[t]] for t in range(V)]  # the law of the verified token t = hot[X]
    p = _fractions(draft(1, seed=SEED + 5)[0])  # the target's law at that position
    scattered = [q[inv[t]] for t in range(V)]
    assert exact_verify_law(p, scattered, s_t, kernel="sglang") == p  # control: exact
    assert exact_verify_law(p, q, s_t, kernel="sglang") != p  # the shipped q, read at hot[X]
    one_hot_law = exact_verify_law(p, lambda t: _fractions(one_hots[inv[t]]), s_t, kernel="sglang")
    assert one_hot_law != p
    # Without the map (hot = identity) both are exact: the defect is the map alone.
    assert exact_verify_law(p, q, q, kernel="sglang") == p
    assert exact_verify_law(p, lambda x: _fractions(one_hots[x]), q, kernel="sglang") == p


def test_prefill_start_warns_when_the_encoders_largest_row_exceeds_capacity(sg, caplog) -> None:
    """A full-distribution encoder behind a too-small row would send X-only every time: say so at start."""
    from pd_middleware.codecs.inband import row_bytes

    with caplog.at_level("WARNING", logger="pd_middleware.integrations.sglang"):
        inst = activate(config(capacity=256, encoder={"name": "full", "options": {"dtype": "fp32"}}), role="prefill")
    msg = [r.getMessage() for r in caplog.records if "largest row" in r.getMessage()]
    _, (flat,) = inst.publisher.encode([0], torch.full((1, V), 1.0 / V))
    need = row_bytes(flat)
    assert need > 256 and len(msg) == 1
    assert f"largest row is {need} bytes" in msg[0] and "capacity_bytes is 256" in msg[0]
    S.uninstall()
    caplog.clear()
    # Control: a top-5 sparse row fits in 256 bytes, nothing is said.
    with caplog.at_level("WARNING", logger="pd_middleware.integrations.sglang"):
        activate(config(capacity=256), role="prefill")
    assert not [r for r in caplog.records if "largest row" in r.getMessage()]


# ----------------------------------------------------------------- nothing raises into SGLang
# Fault injection, one case per per-batch wrapper: the wrapper is SGLang's real function
# patched by the drop-in; each fault is first shown to raise when our code is called bare
# (the negative control), then SGLang gets a valid result through the wrapper, counted.


def one_hot_rows(xs):
    return torch.nn.functional.one_hot(torch.tensor(xs), V).float()


def decode_req(xs):
    """A committed request's fields that SGLang's builder reads (X in its 16-wide row)."""
    row = torch.zeros(16, dtype=torch.int64)
    row[: len(xs)] = torch.tensor(xs)
    return SimpleNamespace(
        output_topk_index=row,
        output_topk_p=torch.ones(16),
        hidden_states_tensor=torch.zeros(4),
        output_dsa_topk_indices=None,
        rid="r",
        bootstrap_room=None,
    )


def committed(sg, inst, rooms, q=None):
    pbuf, dbuf = buffers(sg), buffers(sg)
    reqs = [prefill_req(r, i) for i, r in enumerate(rooms)]
    prefill(inst, reqs, draft(len(rooms)) if q is None else q, pbuf)
    for i in range(len(rooms)):
        send_aux(pbuf, i, dbuf, i)
    return [commit(sg, dbuf, i, r) for i, r in enumerate(rooms)]


def test_fault_propose_plugin_that_raises_gives_sglangs_one_hot(sg) -> None:
    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    dreqs = committed(sg, inst, [31, 32])
    xs = [int(d.output_topk_index[0]) for d in dreqs]

    def broken(proposals):
        raise RuntimeError("assembler plugin bug")

    inst.proposer.middleware.assembler.build_fresh = broken
    batch = SimpleNamespace(reqs=dreqs)
    with pytest.raises(RuntimeError, match="assembler plugin bug"):  # negative control: bare, it raises
        inst.proposer.propose(batch, torch.tensor([[x] for x in xs]), V)
    for d in dreqs:
        d.pd_middleware.proposal, d.pd_middleware.used = object(), False  # as attached again
    got = build(sg, dreqs)
    assert torch.equal(got, one_hot_rows(xs))
    assert inst.guard.counts == {"guard:propose:RuntimeError": 1}


def test_fault_propose_unseen_step_count_gives_sglangs_one_hot(sg) -> None:
    inst = activate(config(model={"num_steps": 1}))
    req = decode_req([3, 4])
    with pytest.raises(ConfigError, match="num_steps = 2, the config says 1"):  # negative control
        inst.proposer.propose(SimpleNamespace(reqs=[req]), torch.tensor([[3, 4]]), V)
    batch = SimpleNamespace(
        reqs=[req], device="cpu", enable_overlap=False, model_config=SimpleNamespace(vocab_size=V, hf_config=None)
    )
    out = build_draft_input(sg.ed, batch, steps=2, multi_layer=True)
    assert torch.equal(out.draft_probs, one_hot_rows([[3, 4]]))
    assert inst.guard.counts == {"guard:propose:ConfigError": 1}


@pytest.mark.parametrize("bad_x", [V, -1])
def test_fault_x_outside_the_vocabulary_at_commit_and_build_never_raises(sg, bad_x) -> None:
    # An attack or a bug hands the decode X = V (or -1) in SGLang's own row.
    inst = activate(config())
    inst.publisher = S.ProposalPublisher.from_config(inst.config, stage=inst.channel.stage, vocab_size=V, num_steps=1)
    pbuf, dbuf = buffers(sg), buffers(sg)
    reqs = [prefill_req(41, 0)]
    prefill(inst, reqs, draft(1), pbuf)
    pbuf.output_topk_index[0, 0] = bad_x
    send_aux(pbuf, 0, dbuf, 0)
    from pd_middleware import ValidationError

    req = SimpleNamespace(
        bootstrap_room=41, output_topk_index=dbuf.output_topk_index[0].clone(), output_topk_p=torch.ones(16)
    )
    with pytest.raises(ValidationError):  # negative control: the proposer's own path raises
        inst.proposer.on_row(req, inst.channel.read(dbuf, 0, req))
    dreq = commit(sg, dbuf, 0, 41)  # SGLang's real commit, wrapped: no exception
    assert inst.guard.counts["guard:commit:ValidationError"] == 1
    got = build(sg, [dreq])  # the drop-in's own one-hot, clamped into range (SGLang's fails on X = V)
    assert tuple(got.shape) == (1, V) and got.dtype == torch.float32 and float(got.sum()) == 1.0
    assert inst.guard.counts["guard:propose:ValidationError"] == 1


def test_fault_propose_corrupt_shape_gives_sglangs_one_hot(sg) -> None:
    inst = activate(config())
    req = decode_req([9])
    real = inst.proposer._assemble
    inst.proposer._assemble = lambda *a: real(*a)[..., :-1]  # one column short
    from pd_middleware.integrations.sglang.common import check_proposal

    bad = inst.proposer.propose(SimpleNamespace(reqs=[req]), torch.tensor([[9]]), V)
    with pytest.raises(ValueError, match=r"proposal shape torch.Size\(\[1, 1, 63\]\), expected \(1, 1, 64\)"):
        check_proposal(bad, torch.tensor([[9]]), V)  # negative control: that is what SGLang would get
    assert torch.equal(build(sg, [req]), one_hot_rows([9]))
    assert inst.guard.counts == {"guard:propose:ValueError": 1}


def test_fault_prefill_encoder_that_raises_keeps_sglangs_x_and_sends_it_x_only(sg) -> None:
    inst = activate(config(), role="prefill")

    def broken(*a, **k):
        raise RuntimeError("encoder plugin bug")

    inst.publisher.encoder.encode = broken
    with pytest.raises(RuntimeError, match="encoder plugin bug"):  # negative control
        inst.publisher.encode([1], draft(1))
    pbuf = buffers(sg)
    reqs = [prefill_req(51, 0), prefill_req(52, 1)]
    di = prefill(inst, reqs, draft(2), pbuf)
    assert di.topk_index[:, 0].tolist() == [0, 0]  # SGLang's own X, untouched
    assert [r.pd_middleware_row.draft_tokens for r in reqs] == [(0,), (0,)]
    assert all(r.pd_middleware_row.proposal is None for r in reqs)  # X only: the decode answers one-hot
    assert inst.guard.counts == {"guard:prefill_encode:RuntimeError": 1}
    assert inst.publisher.counts["agreement:local_failed"] == 2


def test_fault_prefill_corrupt_shape_never_raises(sg) -> None:
    inst = activate(config(), role="prefill")
    reqs = [prefill_req(61, 0), prefill_req(62, 1)]
    q = draft(1)  # one row for a batch of two: a corrupt shape
    b = 2
    di = SimpleNamespace(
        topk_index=torch.zeros((b, 1), dtype=torch.int64), topk_p=torch.full((b, 1), 0.5), draft_probs=q
    )
    batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(temperatures=torch.ones((b, 1))))
    out = wrap_prefill_result(lambda self, bt, r: "sglang's", inst)(None, batch, SimpleNamespace(next_draft_input=di))
    assert out == "sglang's" and di.topk_index[:, 0].tolist() == [0, 0]
    assert inst.guard.counts == {"guard:prefill_encode:IndexError": 1}


def test_fault_metadata_wrappers_never_raise_and_sglangs_part_still_runs(sg) -> None:
    inst = activate(config(), role="prefill")
    pbuf = buffers(sg)
    req = prefill_req(71, 2)
    req.output_topk_index, req.output_topk_p = torch.zeros(16, dtype=torch.int64), torch.ones(16)

    def broken(*a, **k):
        raise RuntimeError("channel bug")

    for name in ("write", "clear", "registration_frame", "validate"):
        setattr(inst.channel, name, broken)
    with pytest.raises(RuntimeError):  # negative control
        inst.channel.write(pbuf, req)
    pbuf.set_buf(req)  # SGLang's own set_buf still ran
    assert int(pbuf.bootstrap_room[2, 0]) == 71
    pbuf.clear_slot(2)
    assert int(pbuf.bootstrap_room[2, 0]) == 0
    from pd_middleware.integrations.sglang.draft_kv import wrap_validate

    msg = wrap_registration(lambda self: [b"None", b"x"], inst)(SimpleNamespace())
    assert msg == [b"None", b"x"]  # without our frame: the prefill rejects such a decode
    fully, why = wrap_validate(lambda self, info: (True, None), inst)(None, SimpleNamespace())
    assert fully is True and why.startswith("pd-middleware could not check the decode's registration")
    assert inst.guard.counts == {
        "guard:set_buf:RuntimeError": 1,
        "guard:clear_slot:RuntimeError": 1,
        "guard:registration:RuntimeError": 1,
        "guard:validate_peer:RuntimeError": 1,
    }


def test_fault_from_zmq_with_a_corrupt_trailing_frame_reads_as_no_layout(sg) -> None:
    inst = activate(config(), role="prefill")
    from pd_middleware.integrations.sglang.registration import layout_of

    msg = _registration([1, 2], object())  # not bytes: a corrupt frame
    with pytest.raises(TypeError):  # negative control
        layout_of(msg)
    info = sg.mooncake.KVArgsRegisterInfo.from_zmq(msg)
    assert info.dst_aux_ptrs == [1, 2] and info.pd_middleware_layout is None
    assert inst.guard.counts == {"guard:from_zmq:TypeError": 1}


def test_fault_chain_step_whose_encoder_raises_keeps_sglangs_chain_x_only(sg) -> None:
    mod = multi_layer_stand_in()
    inst = S.install(
        config(capacity=8192),
        S.InstallOptions(
            channel="metadata", facts=facts("prefill", num_steps=STEPS), modules=S.SGLangModules(multi_layer=mod)
        ),
    )
    calls = {"n": 0}
    real = inst.publisher.encoder.encode

    def fail_at_step_1(*a, **k):
        calls["n"] += 1
        if calls["n"] > 2:  # two rows: step 0 encodes, step 1 fails
            raise RuntimeError("encoder bug at step 1")
        return real(*a, **k)

    inst.publisher.encoder.encode = fail_at_step_1
    reqs = [prefill_req(r, i) for i, r in enumerate([81, 82])]
    batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(temperatures=torch.ones((2, 1))))
    di = mod.MultiLayerEagleDraftWorker()._draft_extend_for_prefill(batch, None, torch.tensor([1, 2]))
    assert di.pd_middleware_payloads == [None, None]  # the chain is no longer the encoder's: nothing published
    assert inst.guard.counts == {"guard:chain_step:RuntimeError": 1}
    wrap_prefill_result(sglang_copies_draft_input, inst)(None, batch, SimpleNamespace(next_draft_input=di))
    assert [r.pd_middleware_row.draft_tokens for r in reqs] == [tuple(di.topk_index[i].tolist()) for i in range(2)]
    assert all(r.pd_middleware_row.proposal is None for r in reqs)


def test_patches_are_logged_once_in_hook_registrys_format(sg, caplog) -> None:
    with caplog.at_level("INFO", logger="pd_middleware.integrations.sglang"):
        inst = activate(config())
        inst.announce()  # a second call says nothing
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Applied 1 hook(s) to ")]
    paths = [p.target.path for p in inst.patches]
    assert len(lines) == len(paths) == len(set(paths))
    assert (
        "Applied 1 hook(s) to sglang.srt.disaggregation.utils.MetadataBuffers.set_buf "
        "(from: plugin=pd_middleware, dist=pd-middleware) [around]" in lines
    )
    assert sum("pd-middleware installed into SGLang" in r.getMessage() for r in caplog.records) == 1


# ----------------------------------------------------------------- startup self-check of SGLang's layout


def test_layout_self_check_passes_on_this_sglang_and_names_a_changed_field(sg) -> None:
    from pd_middleware import PluginError
    from pd_middleware.integrations.sglang.startup import check_layout, check_registration

    inst = activate(config())  # activation ran the self-check on SGLang 0.5.23: it passed
    assert inst.self_checked
    mb = sg.utils.MetadataBuffers
    # A future SGLang with a narrower output_topk_index (no spare column 15 for our tag).
    real_init = mb.__init__

    def narrower(self, *a, **k):
        real_init(self, *a, **k)
        self.output_topk_index = torch.zeros((self.output_ids.shape[0], 8), dtype=torch.int64)

    with (
        patch.object(mb, "__init__", narrower),
        pytest.raises(
            PluginError,
            match=r"MetadataBuffers\.output_topk_index\.shape is \(2, 8\), the metadata channel needs \(2, 16\)",
        ),
    ):
        check_layout(mb, inst.channel)
    # A get_buf_infos that no longer lists output_topk_index (pairing by position broke).
    real_infos = mb.get_buf_infos

    def without_topk(self):
        ptrs, lens, items = real_infos(self)
        at = ptrs.index(self.output_topk_index.data_ptr())
        return (
            [p for i, p in enumerate(ptrs) if i != at],
            [x for i, x in enumerate(lens) if i != at],
            [x for i, x in enumerate(items) if i != at],
        )

    with (
        patch.object(mb, "get_buf_infos", without_topk),
        pytest.raises(PluginError, match=r"get_buf_infos\(\) ptrs is without output_topk_index"),
    ):
        check_layout(mb, inst.channel)
    # A from_zmq that reads one more frame (ours) into a field of its own.
    info = sg.mooncake.KVArgsRegisterInfo
    ours = info.__dict__["from_zmq"]
    real_from_zmq = ours.__func__.__wrapped__

    def reads_frame_20(cls, msg):
        got = real_from_zmq(cls, msg)
        got.dst_dcp_rank = len(msg)  # stands for "a new trailing field"
        return got

    from pd_middleware.core.events import Events
    from pd_middleware.integrations.sglang.registration import wrap_from_zmq

    shim = classmethod(wrap_from_zmq(reads_frame_20, SimpleNamespace(events=Events("guard"))))
    with (
        patch.object(info, "from_zmq", shim),
        pytest.raises(PluginError, match=r"reads the drop-in's trailing registration frame into dst_dcp_rank"),
    ):
        check_registration(info, inst.channel)
    check_registration(info, inst.channel)  # negative control: the real one passes


def test_a_fallback_row_counts_its_local_proposal_once() -> None:
    """A row that gave no payload (here not_sent) is counted once as proposal:local, not again at the builder."""
    from pd_middleware.codecs.inband import RowFault
    from pd_middleware.integrations.sglang.proposer import DecodeProposer

    cfg = parse_config({"decode": {"rejection_sampling": True}, "synthesizer": {"name": "one_hot"}})
    proposer = DecodeProposer(cfg)
    proposer.bind(16, 1)
    reqs = [
        SimpleNamespace(
            output_topk_index=torch.tensor([3], dtype=torch.int64), output_topk_p=[0.5], bootstrap_room=7, rid="a"
        ),
        SimpleNamespace(
            output_topk_index=torch.tensor([5], dtype=torch.int64), output_topk_p=[0.5], bootstrap_room=8, rid="b"
        ),
    ]
    for r in reqs:
        proposer.on_row(r, RowFault("not_sent"))
    probs = proposer.propose(SimpleNamespace(reqs=reqs), torch.tensor([[3], [5]]), 16)
    assert probs.shape == (2, 1, 16)
    assert proposer.counts["proposal:local"] == 2
    assert proposer.counts["fallback:not_sent"] == 2
    proposer.close()


@pytest.mark.parametrize(
    "probe",
    [{"bootstrap_host": "2.2.2.2", "rid": "w"}, {"bootstrap_host": "127.0.0.1", "rid": "HEALTH_CHECK_abc"}],
    ids=["warmup", "health_check"],
)
def test_sglang_warmups_and_health_checks_are_served_one_hot_and_never_counted(probe) -> None:
    from pd_middleware.codecs.inband import RowFault
    from pd_middleware.integrations.sglang.live_ab import FirstVerifyRecorder
    from pd_middleware.integrations.sglang.proposer import DecodeProposer

    cfg = parse_config({"decode": {"rejection_sampling": True}, "synthesizer": {"name": "one_hot"}})
    proposer = DecodeProposer(cfg)
    proposer.bind(16, 1)
    tok = torch.tensor([3], dtype=torch.int64)
    user = SimpleNamespace(
        output_topk_index=tok, output_topk_p=[0.5], bootstrap_room=7, rid="u", bootstrap_host="127.0.0.1"
    )
    probe_req = SimpleNamespace(output_topk_index=tok.clone(), output_topk_p=[0.5], bootstrap_room=0, **probe)
    proposer.on_row(user, RowFault("not_sent"))
    proposer.on_row(probe_req, RowFault("not_sent"))
    probs = proposer.propose(SimpleNamespace(reqs=[user, probe_req]), torch.tensor([[3], [3]]), 16)
    assert torch.equal(probs[1, 0], torch.nn.functional.one_hot(torch.tensor(3), 16).float())
    assert proposer.metrics.received == 1  # the user request only
    assert proposer.counts["probe"] == 1 and proposer.counts["fallback:not_sent"] == 1
    rec = FirstVerifyRecorder(proposer.metrics)
    user.spec_verify_ct = probe_req.spec_verify_ct = 0
    batch = SimpleNamespace(reqs=[user, probe_req])
    before = rec.before(batch)
    user.spec_verify_ct = probe_req.spec_verify_ct = 1
    assert rec.after(batch, SimpleNamespace(num_correct_drafts_per_req_cpu=[1, 2]), before) == 1
    proposer.close()


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_activation_copies_every_counter_into_sglangs_metrics_without_arms(sg, role, monkeypatch) -> None:
    """At scheduler start, on either role and with no [[arms]], the copy into SGLang's /metrics
    starts with the integration's parts (not only once a live A/B hook runs)."""
    from pd_middleware.integrations.sglang import live_ab as sglang_ab

    calls = []
    monkeypatch.setattr(
        sglang_ab, "start_sglang_export", lambda src, interval, exporters, enabled: calls.append((src, interval))
    )
    inst = activate(config(), role=role)
    ((source, interval),) = calls
    assert isinstance(source, sglang_ab.CounterSource) and interval == inst.config.metrics.sync_interval_s
    assert inst.recorder is None  # no [[arms]]: no first-verify hook on every decode step
    inst.channel.counts["inband:written"] += 2
    parts = source.events()
    assert parts["inband"]["inband:written"] == 2 and "decode" in parts and "guard" in parts
    assert ("prefill" in parts) == (role == "prefill")
