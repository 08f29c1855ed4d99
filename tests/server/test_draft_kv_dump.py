"""The tier's draft KV dump (site/draft_kv_dump.py, switched on by PDM_TEST_DRAFT_KV_DUMP), without a server.

Real: SGLang's ``MHATokenToKVPool`` (one per chain step, on the CPU) where SGLang is
installed; the scheduler, batch, queue and requests are namespaces with the attributes
the hook reads.
"""

from __future__ import annotations

import importlib.util
import inspect
import types
from pathlib import Path
from types import SimpleNamespace

import cpu_gaps  # tests/server/site is on sys.path (conftest.py)
import draft_kv_dump as dkd
import pytest
import torch

STEPS, SLOTS, HEADS, DIM = 3, 16, 2, 4


def _pools(real: bool) -> list[object]:
    if real:
        if importlib.util.find_spec("sglang") is None:
            pytest.skip("SGLang is not installed (make setup-sglang)")
        from _sglang_import import import_sglang

        mp = import_sglang("sglang.srt.mem_cache.memory_pool")
        return [mp.MHATokenToKVPool(SLOTS, 1, torch.bfloat16, HEADS, DIM, 1, "cpu", False) for _ in range(STEPS)]
    return [
        SimpleNamespace(k_buffer=[torch.zeros(SLOTS + 1, HEADS, DIM)], v_buffer=[torch.zeros(SLOTS + 1, HEADS, DIM)])
        for _ in range(STEPS)
    ]


def _node(pools: list[object], slots: list[int]) -> SimpleNamespace:
    req_to_token = torch.zeros((4, SLOTS), dtype=torch.int32)
    req_to_token[1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    runners = [SimpleNamespace(token_to_kv_pool=p) for p in pools]
    return SimpleNamespace(
        draft_worker=SimpleNamespace(draft_worker=SimpleNamespace(draft_runners=runners)),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
    )


def _req(room: int, n: int, **over: object) -> SimpleNamespace:
    return SimpleNamespace(
        bootstrap_room=room,
        origin_input_ids=list(range(100, 100 + n)),
        kv=SimpleNamespace(req_pool_idx=1),
        finished_reason=None,
        **over,
    )


def _fill(pools: list[object], slots: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in pools:
        for buf in [*p.k_buffer, *p.v_buffer]:  # type: ignore[attr-defined]
            buf[slots] = torch.randn(buf[slots].shape, generator=gen).to(buf.dtype)


def _copy(src: list[object], dst: list[object], s: list[int], d: list[int], steps: int) -> None:
    for p, q in list(zip(src, dst))[:steps]:
        for a, b in zip([*p.k_buffer, *p.v_buffer], [*q.k_buffer, *q.v_buffer]):  # type: ignore[attr-defined]
            b[d] = a[s]


@pytest.mark.parametrize("real", [False, True])
def test_both_nodes_dump_and_compare_per_chain_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real: bool
) -> None:
    out = tmp_path / "kv"
    monkeypatch.setenv(dkd.ENV, str(out))
    src_slots, dst_slots, room = [3, 4, 5, 6], [9, 2, 11, 7], 4242
    prefill, decode = _pools(real), _pools(real)
    _fill(prefill, src_slots, seed=1)
    p_node, d_node = _node(prefill, src_slots), _node(decode, dst_slots)
    batch = SimpleNamespace(reqs=[_req(room, 4)])
    assert dkd.on_prefill(p_node, batch) == []  # not armed: the folder does not exist
    out.mkdir()
    # What SGLang transfers: step 1 only (stock), then every step (the drop-in).
    _copy(prefill, decode, src_slots, dst_slots, steps=1)
    assert len(dkd.on_prefill(p_node, batch)) == STEPS
    queue = SimpleNamespace(scheduler=d_node)
    assert len(dkd.on_decode(queue, SimpleNamespace(req=_req(room, 4)))) == STEPS
    records = dkd.load(out)
    assert sorted(records) == sorted((role, room, k) for role in ("prefill", "decode") for k in range(1, STEPS + 1))
    rec = records[("decode", room, 2)]
    assert rec["k"].shape == (1, 4, HEADS, DIM) and rec["input_ids"] == [100, 101, 102, 103]
    assert dkd.compare(records) == {room: [True, False, False]}  # negative control of "equal"
    assert dkd.nonzero_steps(r for (role, _, _), r in records.items() if role == "prefill") == {1, 2, 3}
    _copy(prefill, decode, src_slots, dst_slots, steps=STEPS)
    dkd.on_decode(queue, SimpleNamespace(req=_req(room, 4)))
    assert dkd.compare(dkd.load(out)) == {room: [True, True, True]}


def test_what_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dkd.ENV, str(tmp_path))
    node = _node(_pools(False), [1, 2])
    chunked = _req(1, 2, is_chunked=1)
    no_room = _req(2, 2)
    no_room.bootstrap_room = None
    assert dkd.on_prefill(node, SimpleNamespace(reqs=[chunked, no_room])) == []
    queue = SimpleNamespace(scheduler=node)
    aborted = _req(3, 2)
    aborted.finished_reason = "abort"
    assert dkd.on_decode(queue, SimpleNamespace(req=aborted)) == []
    assert dkd.on_decode(queue, SimpleNamespace(req=_req(4, 2)), is_fake=lambda r: True) == []
    assert list(tmp_path.iterdir()) == []
    assert len(dkd.on_decode(queue, SimpleNamespace(req=_req(5, 2)), is_fake=lambda r: False)) == STEPS


def test_compare_refuses_records_of_different_requests(tmp_path: Path) -> None:
    rec = {"k": torch.zeros(1, 2, 1, 1), "v": torch.zeros(1, 2, 1, 1)}
    records = {
        ("decode", 7, 1): {**rec, "input_ids": [1, 2]},
        ("prefill", 7, 1): {**rec, "input_ids": [1, 3]},
    }
    with pytest.raises(AssertionError, match="room 7: the nodes' records are different requests"):
        dkd.compare(records)
    with pytest.raises(AssertionError, match="room 7 step 1: the decode dumped it, the prefill did not"):
        dkd.compare({("decode", 7, 1): {**rec, "input_ids": [1, 2]}})


def test_the_switch_adds_the_two_overrides_only_when_set() -> None:
    names = [o.name for o in cpu_gaps.selected({})]
    assert "draft_kv_prefill" not in names and "draft_kv_decode" not in names
    names = [o.name for o in cpu_gaps.selected({cpu_gaps.ENV_DRAFT_KV: "/x"})]
    assert names[-2:] == ["draft_kv_prefill", "draft_kv_decode"]


def _override(name: str) -> cpu_gaps.Override:
    return next(o for o in cpu_gaps.DRAFT_KV_DUMP if o.name == name)


def test_the_overrides_wrap_sglangs_methods_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(dkd, "on_prefill", lambda sched, batch: calls.append("dump prefill"))
    monkeypatch.setattr(dkd, "on_decode", lambda q, dr, fake: calls.append(f"dump decode fake={fake(None)}"))

    class Mixin:
        def process_batch_result_disagg_prefill(self, batch, result):  # type: ignore[no-untyped-def]
            calls.append("sglang prefill")
            return "p"

    class Queue:
        def _commit_transfer_to_req(self, decode_req):  # type: ignore[no-untyped-def]
            calls.append("sglang commit")
            return "d"

    pm = types.ModuleType("p")
    pm.SchedulerDisaggregationPrefillMixin = Mixin  # type: ignore[attr-defined]
    dm = types.ModuleType("d")
    dm.DecodeTransferQueue = Queue  # type: ignore[attr-defined]
    dm._is_fake_transfer = lambda req: False  # type: ignore[attr-defined]
    cpu_gaps.apply(_override("draft_kv_prefill"), pm)
    cpu_gaps.apply(_override("draft_kv_decode"), dm)
    assert Mixin().process_batch_result_disagg_prefill(None, None) == "p"
    assert Queue()._commit_transfer_to_req(None) == "d"
    # The prefill dumps before SGLang processes the result, the decode after its commit.
    assert calls == ["dump prefill", "sglang prefill", "sglang commit", "dump decode fake=False"]


def test_the_overrides_are_refused_when_sglangs_method_changed() -> None:
    class Mixin:
        def process_batch_result_disagg_prefill(self, batch):  # type: ignore[no-untyped-def]
            return None

    pm = types.ModuleType("p")
    pm.SchedulerDisaggregationPrefillMixin = Mixin  # type: ignore[attr-defined]
    with pytest.raises(cpu_gaps.OverrideRefused, match=r"has parameters \('self', 'batch'\)"):
        cpu_gaps.apply(_override("draft_kv_prefill"), pm)


@pytest.mark.sglang
@pytest.mark.server  # SGLang's prefill/decode scheduler modules: make setup-server
def test_the_targets_match_sglang_0_5_23() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (make setup-sglang)")
    from _sglang_import import import_sglang

    for ov in cpu_gaps.DRAFT_KV_DUMP:
        assert cpu_gaps._refusal(ov, getattr(import_sglang(ov.module), ov.attr)) == "", ov.name
    assert hasattr(import_sglang("sglang.srt.disaggregation.decode"), "_is_fake_transfer")
    # The request's req_to_token row, where prompt_slots reads it: Req.kv (a ReqKvInfo), not Req.
    sb = import_sglang("sglang.srt.managers.schedule_batch")
    assert sb.ReqKvInfo().req_pool_idx is None
    assert "self.kv = ReqKvInfo()" in inspect.getsource(sb.Req.__init__)
