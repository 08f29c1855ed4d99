"""SGLang 0.5.23's own PD transfer, unpatched, between processes on CPU (tier ``sglang``).

One process per engine rank (``tests/_sglang_pd.py`` says what is real and what stands
in). The four rank processes start once for the module and are rebuilt per topology.

Baseline (no drop-in): KV pages and the first-token metadata row arrive, SGLang's
metadata gate passes, and the aux routing of ``docs/sglang_transfer.md`` holds for
prefill TP 1 -> decode TP 2, TP 2 -> 1 (MHA and MLA) and 2 -> 2.
"""

from __future__ import annotations

import statistics
import tomllib
from pathlib import Path

import _sglang_pd as H
import numpy as np
import pytest
import torch

from pd_middleware.codecs.inband import RowLayout, read_row
from pd_middleware.config import parse_config
from pd_middleware.core.payload import Payload
from pd_middleware.decode.pipeline import Delivery
from pd_middleware.middleware import DecodeMiddleware

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


@pytest.fixture
def plain(dep):
    """The deployment without the drop-in (SGLang as shipped)."""
    dep.install(None, None)
    return dep


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


def test_one_to_one_kv_and_row_arrive_through_the_metadata_gate(plain):
    dep = plain
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
    send_ms = [1e3 * o["prefill"][0]["send_s"] for o in outs[1:]]
    print(
        f"\n1->1 per request, 4 IPC round trips included: median {statistics.median(per_request_ms):.1f} ms, "
        f"max {max(per_request_ms):.1f} ms; prefill send -> Success: median {statistics.median(send_ms):.1f} ms"
    )
    assert statistics.median(per_request_ms) < 1000, per_request_ms  # sanity only: timing is not a test here


def test_negative_control_gate_holds_when_the_prefill_never_sends(plain):
    dep = plain
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


def test_prefill_tp1_to_decode_tp2_sends_the_row_to_both_decode_ranks(plain):
    dep = plain
    info = dep.configure(1, 2)
    decode_eps = sorted((f"127.0.0.1:{info[n]['rank_port']}", False) for n in ("D0", "D1"))
    for out in run(dep):
        (p,) = out["prefill"]
        assert targets(p) == decode_eps  # one prefill rank, two real (non-dummy) targets
        for got in out["decode"]:
            assert committed_as(got, out["firsts"][0])
        assert out["decode"][0]["row"] == out["decode"][1]["row"]  # identical rows, byte for byte


def test_prefill_tp2_to_decode_tp1_mha_both_prefill_ranks_write_the_same_row(plain):
    """Both prefill ranks write the one decode row. The rows differ per rank here, so the
    arrival names its writers: each aux BUFFER comes whole from one rank (the last writer
    of that buffer), but the two ranks' buffers may interleave within one row."""
    dep = plain
    info = dep.configure(2, 1)
    d0 = (f"127.0.0.1:{info['D0']['rank_port']}", False)
    writers = []
    for out in run(dep, 8):
        p0, p1 = out["prefill"]
        assert targets(p0) == targets(p1) == [d0]  # both real, one destination
        assert p0["targets"][0]["aux_index"] == p1["targets"][0]["aux_index"] == out["decode"][0]["aux_index"]
        rows, got = (p0["row"], p1["row"]), out["decode"][0]["row"]
        assert rows[0] != rows[1]
        by_buffer = []
        for i, buf in enumerate(got):
            who = {r for r in (0, 1) if rows[r][i] == buf}
            assert who, f"room {out['room']}: aux buffer {i} matches neither prefill rank's row"
            by_buffer.append(who)
        whole = set.intersection(*by_buffer)  # ranks whose entire row arrived
        writers.append(str(min(whole)) if whole else "mixed")
        if whole:
            assert committed_as(out["decode"][0], out["firsts"][min(whole)])
    print(f"\nTP2->TP1 MHA: row writer per request {writers}")


def test_prefill_tp2_to_decode_tp1_mla_one_prefill_rank_is_dummy(plain):
    dep = plain
    info = dep.configure(2, 1, H.Shape(mla=True))
    d0 = f"127.0.0.1:{info['D0']['rank_port']}"
    for out in run(dep, 4):
        p0, p1 = out["prefill"]
        assert targets(p0) == [(d0, False)] and targets(p1) == [(d0, True)]
        assert out["opened"][0]["is_dummy"] == [False, True]
        assert committed_as(out["decode"][0], out["firsts"][0])  # only rank 0 ever writes


def test_prefill_tp2_to_decode_tp2_is_one_to_one(plain):
    dep = plain
    info = dep.configure(2, 2)
    for out in run(dep):
        for r in range(2):
            assert targets(out["prefill"][r]) == [(f"127.0.0.1:{info[f'D{r}']['rank_port']}", False)]
            assert committed_as(out["decode"][r], out["firsts"][r])


def test_prefill_tp1_to_decode_tp2_mla_replicates_kv_and_row(plain):
    dep = plain
    info = dep.configure(1, 2, H.Shape(mla=True))
    decode_eps = sorted((f"127.0.0.1:{info[n]['rank_port']}", False) for n in ("D0", "D1"))
    for out in run(dep):
        assert targets(out["prefill"][0]) == decode_eps
        assert all(committed_as(got, out["firsts"][0]) for got in out["decode"])


# ------------------------------------------------------------------------------ the drop-in
#
# The pd-middleware drop-in (metadata channel) active in the rank processes: SGLang's own
# set_buf and transfer, the decode's real _commit_transfer_to_req, then SGLang's
# build_eagle_disagg_draft_input. Strategy: configs/sparse_floor.toml with the shape keys
# left out (V and S come from the engine), at a small V for speed.

V = 4096
ROOT = Path(__file__).resolve().parents[1]


def sparse_config(capacity: int = 20480) -> dict:
    with open(ROOT / "configs" / "sparse_floor.toml", "rb") as f:
        data = tomllib.load(f)
    del data["model"]  # shapes from the engine
    data["sglang"] = {"channel": "metadata", "capacity_bytes": capacity}
    return data


@pytest.fixture(scope="module")
def reference():
    """The decode pipeline of sparse_floor at V, run locally: the row -> draft_probs law."""
    cfg = sparse_config()
    mw = DecodeMiddleware.from_config(parse_config({**cfg, "model": {"vocab_size": V, "num_steps": 1}}))
    layout = RowLayout(cfg["sglang"]["capacity_bytes"], V, 1)

    def expected(room: int, row: bytes) -> torch.Tensor:
        payload = read_row(np.frombuffer(row, dtype=np.uint8).copy(), room, layout)
        assert isinstance(payload, Payload), payload
        d = mw.receive(payload)
        assert isinstance(d, Delivery), d
        return mw.assemble([d]).reshape(1, V).clone()

    yield expected
    mw.close()


def dropin_first(room: int, q_seed: int | None = None) -> dict:
    """One first-token row with the draft distribution's seed; identical on every prefill rank
    (TP replicas compute the same draft distribution)."""
    return {**first_row(0, room), "q_seed": room if q_seed is None else q_seed}


def written(row: bytes) -> bytes:
    """The part of a proposal row its writer wrote: the 48-byte header and the body."""
    return row[: 48 + int.from_bytes(row[24:28], "little")]


def row_diff(a: list[bytes], b: list[bytes]) -> str:
    """Where two aux row lists first differ (buffer, byte offset), for failure messages."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            off = next(k for k in range(min(len(x), len(y))) if x[k] != y[k])
            return f"buffer {i} differs first at byte {off}: {x[off : off + 16].hex()} vs {y[off : off + 16].hex()}"
    return f"{len(a)} vs {len(b)} buffers"


def one_hot(x: int) -> torch.Tensor:
    row = torch.zeros((1, V), dtype=torch.float32)
    row[0, x] = 1.0
    return row


def transfer_and_build(dep, room: int, firsts, **kw) -> tuple[dict, list[dict]]:
    out = dep.transfer(room, n_pages=N_PAGES, first=firsts, **kw)
    for d, got in enumerate(out["decode"]):
        assert got["status"] == "Success", (
            f"room {room}: decode rank {d}: {got['status']} ({got['reason']}); prefill {out['prefill']}"
        )
    built = H.gather(dep.decode, "build", rooms=[room])
    return out, built


def test_dropin_published_row_reaches_draft_probs_bit_identically(dep, reference):
    cfg = sparse_config()
    dep.install(cfg, cfg, V)
    dep.configure(1, 1)
    for _ in range(4):
        room = rooms()
        out, (b,) = transfer_and_build(dep, room, dropin_first(room))
        (p,), (got,) = out["prefill"], out["decode"]
        assert got["row"] == p["row"]  # every aux buffer, the proposal row included, byte for byte
        assert got["req"]["attached"] == "prefill"
        x = p["x"]  # the encoder's draw, which SGLang's own row carries
        assert b["topk_index"].reshape(-1).tolist() == [x]
        want = reference(room, got["row"][-1])
        assert torch.equal(b["draft_probs"], want)
        assert (want > 0).sum() > 1 and not torch.equal(want, one_hot(x))  # a real proposal, not the fallback
    c = b["counters"]
    assert c["decode"]["attached:prefill"] == 4 and c["decode"]["proposal:prefill"] == 4
    assert not any(k.startswith("fallback:") for k in c["decode"]), c


def test_dropin_decode_tp2_ranks_get_identical_rows_and_draft_probs(dep, reference):
    cfg = sparse_config()
    dep.install(cfg, cfg, V)
    dep.configure(1, 2)
    for _ in range(3):
        room = rooms()
        out, (b0, b1) = transfer_and_build(dep, room, dropin_first(room))
        g0, g1 = out["decode"]
        assert g0["row"] == g1["row"] == out["prefill"][0]["row"]
        assert torch.equal(b0["draft_probs"], b1["draft_probs"])
        assert torch.equal(b0["draft_probs"], reference(room, g0["row"][-1]))
        assert g0["req"]["attached"] == g1["req"]["attached"] == "prefill"


def test_dropin_prefill_tp2_ranks_write_the_same_row_and_the_right_proposal(dep, reference):
    cfg = sparse_config()
    dep.install(cfg, cfg, V)
    dep.configure(2, 1)
    for _ in range(4):
        room = rooms()
        out, (b,) = transfer_and_build(dep, room, dropin_first(room))
        p0, p1 = out["prefill"]
        # The draw is seeded by the room: both ranks wrote the same bytes (SGLang's buffers
        # whole; the proposal row over its header and body; past the body a row keeps
        # whatever an earlier request left there, which no reader looks at).
        assert p0["row"][:-1] == p1["row"][:-1], row_diff(p0["row"], p1["row"])
        assert written(p0["row"][-1]) == written(p1["row"][-1])
        (got,) = out["decode"]
        assert got["row"][:-1] == p0["row"][:-1] and written(got["row"][-1]) == written(p0["row"][-1])
        assert got["req"]["attached"] == "prefill"
        assert torch.equal(b["draft_probs"], reference(room, got["row"][-1]))


def test_dropin_on_the_prefill_only_serves_with_sglangs_one_hot_and_says_so(dep):
    """A decode without the drop-in behind a prefill with it: the session is served (SGLang
    transfers its own buffers, the shorter list), the decode verifies with SGLang's own
    one-hot at the X it committed, and the prefill counts and logs the peer."""
    dep.install(sparse_config(), None, V)
    dep.configure(1, 1)
    room = rooms()
    out, (b,) = transfer_and_build(dep, room, dropin_first(room))
    (p,), (got,) = out["prefill"], out["decode"]
    assert p["status"] == "Success", p
    x = int(got["req"]["output_topk_index"][0])
    assert x == p["x"]  # the prefill's X, drawn from its encoded law
    assert torch.equal(b["draft_probs"], one_hot(x)) and got["req"]["attached"] is None
    assert got["row"] == p["row"][:-1]  # SGLang's buffers, whole; the proposal row stayed home
    counts = H.gather(dep.prefill, "counters")[0]["inband"]
    assert counts["inband:peer_without_dropin"] >= 1 and counts.get("inband:peer_rejected", 0) == 0


def test_dropin_on_the_decode_only_counts_not_sent_and_answers_one_hot(dep):
    dep.install(None, sparse_config(), V)
    dep.configure(1, 1)
    room = rooms()
    _out, (b,) = transfer_and_build(dep, room, first_row(0, room))
    x = first_row(0, room)["topk_index"][0]
    assert torch.equal(b["draft_probs"], one_hot(x)) and b["reasons"] == ["not_sent"]
    assert b["counters"]["inband"]["inband:not_sent"] == 1 and b["counters"]["decode"]["fallback:not_sent"] == 1


def test_dropin_capacity_mismatch_fails_fast_naming_both_layouts(dep):
    dep.install(sparse_config(20480), sparse_config(8192), V)
    dep.configure(1, 1)
    room = rooms()
    # The decode waits 50 s at most (under the 60 s call timeout): only a mismatch found by
    # waiting that out crosses the bound below; the time it takes is printed.
    out = dep.transfer(room, n_pages=N_PAGES, first=dropin_first(room), wait_kw={"timeout": 50.0})
    (p,), (got,) = out["prefill"], out["decode"]
    assert p["status"] == "Failed" and got["status"] == "Failed"
    assert "capacity=20480" in p["reason"] and "capacity=8192" in p["reason"], p["reason"]
    assert out["seconds"] < 30, f"the request failed after {out['seconds']:.0f} s: the decode waited for its timeout"
    print(f"\ncapacity mismatch: request failed after {1e3 * out['seconds']:.0f} ms: {p['reason']}")


def test_dropin_corrupt_row_falls_back_to_one_hot_counted(dep):
    cfg = sparse_config()
    dep.install(cfg, cfg, V)
    dep.configure(1, 1)
    room = rooms()
    out, (b,) = transfer_and_build(
        dep, room, dropin_first(room), wait_kw={"before_commit": "flip_proposal_byte", "hook_kw": {"offset": 200}}
    )
    x = out["prefill"][0]["x"]
    assert torch.equal(b["draft_probs"], one_hot(x)) and b["reasons"] == ["digest"]
    assert b["counters"]["inband"]["inband:digest"] == 1 and b["counters"]["decode"]["fallback:digest"] == 1


def test_dropin_capacity_overflow_falls_back_to_one_hot_counted(dep):
    cfg = sparse_config(256)  # far below a sparse_floor row at this V
    dep.install(cfg, cfg, V)
    dep.configure(1, 1)
    room = rooms()
    out, (b,) = transfer_and_build(dep, room, dropin_first(room))
    x = out["prefill"][0]["x"]
    assert torch.equal(b["draft_probs"], one_hot(x)) and b["reasons"] == ["overflow"]
    assert H.gather(dep.prefill, "counters")[0]["inband"]["inband:overflow"] == 1
    assert b["counters"]["decode"]["fallback:overflow"] == 1


def test_dropin_rank_divergence_never_pairs_a_proposal_with_another_draw(dep, reference):
    """Prefill rank 1 encodes another distribution (another X): each request either keeps a
    consistent (X, proposal) pair from one rank or falls back to one-hot, counted; and a
    row whose X SGLang's own buffer contradicts always falls back."""
    cfg = sparse_config()
    dep.install(cfg, cfg, V)
    dep.configure(2, 1)
    seen = []
    for _ in range(6):
        room = rooms()
        out, (b,) = transfer_and_build(dep, room, [dropin_first(room), dropin_first(room, q_seed=room + 77)])
        (got,) = out["decode"]
        xs = [p["x"] for p in out["prefill"]]
        x = b["topk_index"].item()
        assert x in xs
        if b["reasons"] == ["prefill"]:
            assert torch.equal(b["draft_probs"], reference(room, got["row"][-1]))
            assert written(got["row"][-1]) == written(
                out["prefill"][xs.index(x)]["row"][-1]
            )  # the proposal of the X verified
        else:
            # X from one rank, the row from the other (caught by X itself, or by the binding tag
            # beside X); or a row torn between the two writers.
            # Or both ranks kept their own X, sent X only, because their draws differed
            # (the prefill's per-batch agreement: no_distribution).
            assert b["reasons"][0] in ("token_mismatch", "binding", "digest", "no_distribution") and torch.equal(
                b["draft_probs"], one_hot(x)
            ), b["reasons"]
            key = "attached:no_distribution" if b["reasons"][0] == "no_distribution" else f"fallback:{b['reasons'][0]}"
            assert b["counters"]["decode"][key] >= 1
        seen.append(b["reasons"][0])
    # Deterministic mismatch: SGLang's row says X' != the proposal row's X.
    room = rooms()
    other = 1 + dropin_first(room)["q_seed"] % (V - 1)
    out, (b,) = transfer_and_build(
        dep, room, dropin_first(room), wait_kw={"before_commit": "set_x", "hook_kw": {"x": other}}
    )
    if other != out["prefill"][0]["x"]:
        assert b["reasons"] == ["token_mismatch"] and torch.equal(b["draft_probs"], one_hot(other))
        assert b["counters"]["decode"]["fallback:token_mismatch"] >= 1
    print(f"\nrank divergence outcomes: {seen}")


# ------------------------------------------------------------------------------ decode-only recompute


def recompute_config() -> dict:
    with open(ROOT / "configs" / "sglang.toml", "rb") as f:
        data = tomllib.load(f)
    assert data["synthesizer"]["name"] == "recompute" and data["sglang"]["channel"] == "none"
    return data


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_recompute_decode_only_against_a_plain_prefill(dep, decode_tp):
    """The prefill runs SGLang as shipped (no drop-in, no extra buffer); the decode's drop-in
    recomputes q' from the hidden state SGLang's own aux transfer delivered and redraws X'
    from it: the verifier gets q' = softmax(head(h)) and X' ~ q', the same on every decode
    rank; the prefill's X is replaced."""
    from _recompute_head import HEAD_HIDDEN, MatrixHead

    from pd_middleware.decode.recompute import inverse_cdf, proposal_probs, seed_from_room

    dep.install(None, recompute_config(), V)
    dep.configure(1, decode_tp)
    head = MatrixHead(V, HEAD_HIDDEN)
    changed = 0
    for _ in range(4):
        room = rooms()
        row = first_row(0, room)
        out, built = transfer_and_build(dep, room, row)
        assert len(out["prefill"][0]["row"]) == len(out["decode"][0]["row"])  # SGLang's own aux list, both sides
        h = torch.tensor([row["hidden"]], dtype=torch.float32)
        q = proposal_probs(head.logits(h), torch.ones(1))
        for b in built:
            assert torch.equal(b["hidden"], h)  # arrived bit-exact through SGLang's transfer
            assert torch.equal(b["draft_probs"], q)
            x = int(b["topk_index"][0, 0])
            assert float(b["topk_p"][0, 0]) == float(q[0, x]) > 0  # X' and q'(X') from the same q'
            # Drawn with the room-derived seed (no sampling seed here): the core's seeded inverse-CDF draw
            # on this CPU (no sgl-kernel CPU build for SGLang's seeded fast_sample).
            assert x == int(inverse_cdf(q, seed_from_room([room]), torch.tensor([10]))[1][0, 0])
        assert all(torch.equal(b["topk_index"], built[0]["topk_index"]) for b in built)  # rank agreement
        assert all(b["counters"]["recompute"]["recomputed"] >= 1 for b in built)
        changed += int(built[0]["topk_index"][0, 0]) != row["topk_index"][0]
    assert changed >= 3  # the prefill's X (300 + room % 11) is redrawn, not kept


# ----------------------------------------------------------------- ranks agree or nobody publishes


def disagreeing_first(room: int) -> dict:
    """A row whose SGLang-own X is the draft's LEAST likely token: the encoder (top-k with a
    floor over a peaked q) practically never draws it, so a rank that keeps SGLang's X and
    a rank that publishes the encoder's X hand the decode different X."""
    q = torch.softmax(3.0 * torch.randn((1, V), generator=torch.Generator().manual_seed(room)), dim=-1)
    return {**dropin_first(room), "own_x": int(q.argmin())}


def test_prefill_tp2_one_encoder_failing_gives_both_decode_ranks_the_same_x_one_hot(dep):
    cfg = sparse_config()
    dep.install(cfg, cfg, V)
    dep.configure(2, 2)
    dep.fault(dep.P[1:], "encoder_fails")
    try:
        for _ in range(3):
            room = rooms()
            first = disagreeing_first(room)
            out, (b0, b1) = transfer_and_build(dep, room, first)
            p0, p1 = out["prefill"]
            # Rank 1's encoder failed: after the all-reduce neither rank overwrote X.
            assert p0["x"] == p1["x"] == first["own_x"]
            assert b0["topk_index"].tolist() == b1["topk_index"].tolist() == [[first["own_x"]]]
            assert b0["reasons"] == b1["reasons"] == ["no_distribution"]
            assert torch.equal(b0["draft_probs"], one_hot(first["own_x"]))
            assert torch.equal(b1["draft_probs"], one_hot(first["own_x"]))
        c0, c1 = H.gather(dep.prefill, "counters")
        assert c0["prefill"]["agreement:peer_failed"] == 3 and c1["prefill"]["agreement:local_failed"] == 3
        assert c1["guard"]["guard:prefill_encode:RuntimeError"] == 3
    finally:
        dep.fault(dep.ranks, "reset")


def test_prefill_tp2_ranks_that_encode_different_x_publish_nothing(dep):
    """Prefill TP 2 -> decode TP 2, both encoders healthy but rank 1's draft distribution
    differs (so does its draw): the per-batch agreement sees two X (``x_differs``), neither
    rank publishes its row or overwrites SGLang's X, and both decode ranks verify SGLang's
    own X with a one-hot proposal (X only). Publishing anyway would hand the two decode
    ranks different X (each with its own rank's proposal)."""
    cfg = sparse_config()
    dep.install(cfg, cfg, V)
    dep.configure(2, 2)
    room = rooms()
    first = disagreeing_first(room)
    # The ranks' counters may hold earlier tests' counts: compare the increase.
    before = [c["prefill"].get("agreement:x_differs", 0) for c in H.gather(dep.prefill, "counters")]
    before += [c["decode"].get("attached:no_distribution", 0) for c in H.gather(dep.decode, "counters")]
    out, (b0, b1) = transfer_and_build(dep, room, [first, {**first, "q_seed": room + 77}])
    p0, p1 = out["prefill"]
    own = first["own_x"]
    assert p0["x"] == p1["x"] == own, (p0["x"], p1["x"], own)  # SGLang's X kept on both ranks
    assert b0["topk_index"].tolist() == b1["topk_index"].tolist() == [[own]]
    assert b0["reasons"] == b1["reasons"] == ["no_distribution"]
    assert torch.equal(b0["draft_probs"], one_hot(own)) and torch.equal(b1["draft_probs"], one_hot(own))
    c0, c1 = H.gather(dep.prefill, "counters")
    after = [c0["prefill"]["agreement:x_differs"], c1["prefill"]["agreement:x_differs"]]
    after += [b["counters"]["decode"]["attached:no_distribution"] for b in (b0, b1)]  # the row carried X only
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1, 1], (before, after)
    # The ranks' draws did differ: each rank's encoder, run here on its distribution with the
    # request's (seed, room, rid), as the rank process does (tests/_sglang_pd_dropin.py).
    from pd_middleware.integrations.sglang.prefill import ProposalPublisher

    pub = ProposalPublisher.from_config(parse_config(cfg), stage=lambda *a: None, vocab_size=V, num_steps=1)
    xs = [int(pub.encode([room], H.draft_q(s, V), 1.0, [f"req-{room}"])[0].tokens[0, 0]) for s in (room, room + 77)]
    assert xs[0] != xs[1] and own not in xs, f"room {room}: draws {xs}, SGLang's X {own}; pick another room"


def test_negative_control_without_the_agreement_the_decode_ranks_get_a_mix(dep):
    """The same fault with the prefill's all-reduce AND the decode's canary bypassed: decode
    rank 0 verifies the encoder's X with its proposal, rank 1 SGLang's X one-hot. Under TP
    the sharded target forward would embed a different token on each rank."""
    cfg = sparse_config()
    dep.install(cfg, cfg, V)
    dep.configure(2, 2)
    dep.fault(dep.P[1:], "encoder_fails")
    dep.fault(dep.ranks, "agreement_off")
    try:
        room = rooms()
        first = disagreeing_first(room)
        out, (b0, b1) = transfer_and_build(dep, room, first)
        p0, p1 = out["prefill"]
        assert p0["x"] != p1["x"] == first["own_x"], f"room {room}: the encoder drew SGLang's X; pick another room"
        assert b0["topk_index"].tolist() == [[p0["x"]]] and b1["topk_index"].tolist() == [[p1["x"]]]
        assert b0["reasons"] == ["prefill"] and b1["reasons"] == ["no_distribution"]
    finally:
        dep.fault(dep.ranks, "reset")


def test_decode_canary_catches_ranks_that_disagree_on_x(dep):
    """The prefill's agreement bypassed, the decode's X canary on: the decode ranks compare
    X (MIN/MAX over their attention-TP group) and both verify the smallest, one-hot."""
    cfg = sparse_config()
    dep.install(cfg, cfg, V)
    dep.configure(2, 2)
    dep.fault(dep.P[1:], "encoder_fails")
    dep.fault(dep.prefill, "agreement_off")
    try:
        room = rooms()
        first = disagreeing_first(room)
        out, (b0, b1) = transfer_and_build(dep, room, first)
        xs = sorted({p["x"] for p in out["prefill"]})
        assert len(xs) == 2, f"room {room}: the encoder drew SGLang's X; pick another room"
        assert b0["topk_index"].tolist() == b1["topk_index"].tolist() == [[xs[0]]]
        assert b0["reasons"] == b1["reasons"] == ["rank_mismatch"]
        assert torch.equal(b0["draft_probs"], one_hot(xs[0])) and torch.equal(b1["draft_probs"], one_hot(xs[0]))
        assert b0["counters"]["decode"]["fallback:rank_mismatch"] == 1
        assert b1["counters"]["decode"]["fallback:rank_mismatch"] == 1
    finally:
        dep.fault(dep.ranks, "reset")
