"""SGLang 0.5.23's own PD transfer, unpatched, between processes on CPU (tier ``sglang``).

One process per engine rank (``tests/_sglang_pd.py`` says what is real and what stands
in). The four rank processes start once for the module and are rebuilt per topology.

Baseline (no drop-in): KV pages and the first-token metadata row arrive, SGLang's
metadata gate passes, and the aux routing of ``docs/sglang_transfer.md`` holds for
prefill TP 1 -> decode TP 2, TP 2 -> 1 (MHA and MLA) and 2 -> 2.
"""

from __future__ import annotations

import statistics

import pytest
import torch

import _sglang_pd as H

REASON = H.unavailable()
pytestmark = [pytest.mark.sglang, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

N_PAGES = 3


def first_row(rank: int, room: int, hidden: int = 16) -> dict:
    """A first-token row distinct per (prefill rank, room), so the arriving row names its writer."""
    return {
        "token": 1000 + 10 * rank + room % 7,
        "cached": rank + 1,
        "topk_p": [0.25 + rank / 8],
        "topk_index": [300 + rank * 50 + room % 11],
        "hidden": [float(room % 13) + 0.5 * i + 100 * rank for i in range(hidden)],
    }


def committed_as(got: dict, row: dict) -> bool:
    """Whether a decode rank's committed request carries exactly ``row``."""
    req = got["req"]
    return (
        req["output_ids"] == [row["token"]]
        and req["output_topk_p"][0].item() == row["topk_p"][0]
        and req["output_topk_index"][0].item() == row["topk_index"][0]
        and torch.equal(req["hidden_states_tensor"], torch.tensor(row["hidden"], dtype=torch.float32))
    )


@pytest.fixture(scope="module")
def dep():
    d = H.Deployment()
    try:
        yield d
    finally:
        d.close()


class Rooms:
    """Fresh bootstrap rooms for the module (SGLang rooms are per-request ids, never 0)."""

    def __init__(self) -> None:
        self.n = 5000

    def __call__(self) -> int:
        self.n += 1
        return self.n


rooms = Rooms()


def run(dep, k: int = 3) -> list[dict]:
    """``k`` requests through the current topology; each checked for status and KV."""
    outs = []
    for _ in range(k):
        room = rooms()
        firsts = [first_row(r, room) for r in range(len(dep.prefill))]
        out = dep.transfer(room, n_pages=N_PAGES, first=firsts)
        out["room"], out["firsts"] = room, firsts
        for p in out["prefill"]:
            assert p["status"] == "Success", f"room {room}: prefill {p}"
        for d, got in enumerate(out["decode"]):
            assert got["status"] == "Success", f"room {room}: decode rank {d}: {got['status']} ({got['reason']})"
            want = dep.expected_kv(room, N_PAGES, d)
            for b, (have, exp) in enumerate(zip(got["kv"], want)):
                assert torch.equal(have, exp), f"room {room}: decode rank {d} KV buffer {b} differs"
            # The gate read the room from the row; the commit kept it.
            assert got["row_room"] == room
        outs.append(out)
    return outs


def targets(p: dict) -> list[tuple[str, bool]]:
    return sorted((t["endpoint"], t["dummy"]) for t in p["targets"])


# ------------------------------------------------------------------------------ baseline


def test_one_to_one_kv_and_row_arrive_through_the_metadata_gate(dep):
    info = dep.configure(1, 1)
    outs = run(dep, 8)
    for out in outs:
        (got,) = out["decode"]
        assert committed_as(got, out["firsts"][0])
        assert got["polls"] >= 1
    # SGLang's own aux list: 10 buffers here (no sampling mask, no DSA, no checksum),
    # the room buffer last; both sides registered the same item lengths.
    assert info["P0"]["aux_item_lens"] == info["D0"]["aux_item_lens"]
    assert len(info["D0"]["aux_item_lens"]) == 10
    per_request_ms = [1e3 * o["seconds"] for o in outs[1:]]  # the first pays the Mooncake handshake
    print(f"\n1->1 per request (4 IPC round trips included): median {statistics.median(per_request_ms):.1f} ms, max {max(per_request_ms):.1f} ms")
    assert statistics.median(per_request_ms) < 1000, per_request_ms  # sanity only: timing is not a test here


def test_negative_control_gate_holds_when_the_prefill_never_sends(dep):
    """Proves the checks above can fail: without the prefill's send the gate never says
    Success, the row's room stays 0 and the decode's pages keep their zeros."""
    dep.configure(1, 1)
    room = rooms()
    (P0,), (D0,) = dep.prefill, dep.decode
    P0.call("open", room=room)
    D0.call("recv_open", room=room, n_pages=N_PAGES)
    got = D0.call("recv_wait", room=room, timeout=0.3)
    P0.call("drop", room=room)
    assert got["status"] != "Success" and "req" not in got
    assert got["row_room"] == 0
    assert not any(torch.equal(h, e) for h, e in zip(got["kv"], dep.expected_kv(room, N_PAGES, 0)))
    assert all(not h.any() for h in got["kv"])


def test_prefill_tp1_to_decode_tp2_sends_the_row_to_both_decode_ranks(dep):
    info = dep.configure(1, 2)
    decode_eps = sorted((f"127.0.0.1:{info[n]['rank_port']}", False) for n in ("D0", "D1"))
    for out in run(dep):
        (p,) = out["prefill"]
        assert targets(p) == decode_eps  # one prefill rank, two real (non-dummy) targets
        for got in out["decode"]:
            assert committed_as(got, out["firsts"][0])
        assert out["decode"][0]["row"] == out["decode"][1]["row"]  # identical rows, byte for byte


def test_prefill_tp2_to_decode_tp1_mha_both_prefill_ranks_write_the_same_row(dep):
    info = dep.configure(2, 1)
    d0 = (f"127.0.0.1:{info['D0']['rank_port']}", False)
    writers = []
    for out in run(dep, 6):
        p0, p1 = out["prefill"]
        assert targets(p0) == targets(p1) == [d0]  # both real, one destination
        assert p0["targets"][0]["aux_index"] == p1["targets"][0]["aux_index"] == out["decode"][0]["aux_index"]
        (got,) = out["decode"]
        # The rows differ per prefill rank here, so the arrival names the last writer.
        hits = [committed_as(got, f) for f in out["firsts"]]
        assert sum(hits) == 1, hits
        writers.append(hits.index(True))
    print(f"\nTP2->TP1 MHA: last writer per request {writers}")


def test_prefill_tp2_to_decode_tp1_mla_one_prefill_rank_is_dummy(dep):
    info = dep.configure(2, 1, H.Shape(mla=True))
    d0 = f"127.0.0.1:{info['D0']['rank_port']}"
    for out in run(dep, 4):
        p0, p1 = out["prefill"]
        assert targets(p0) == [(d0, False)] and targets(p1) == [(d0, True)]
        assert out["opened"][0]["is_dummy"] == [False, True]
        assert committed_as(out["decode"][0], out["firsts"][0])  # only rank 0 ever writes


def test_prefill_tp2_to_decode_tp2_is_one_to_one(dep):
    info = dep.configure(2, 2)
    for out in run(dep):
        for r in range(2):
            assert targets(out["prefill"][r]) == [(f"127.0.0.1:{info[f'D{r}']['rank_port']}", False)]
            assert committed_as(out["decode"][r], out["firsts"][r])


def test_prefill_tp1_to_decode_tp2_mla_replicates_kv_and_row(dep):
    dep.configure(1, 2, H.Shape(mla=True))
    for out in run(dep):
        assert all(committed_as(got, out["firsts"][0]) for got in out["decode"])
