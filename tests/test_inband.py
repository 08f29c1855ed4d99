"""The in-band row codec: round trips with the shipped encoders, and every fault reason."""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
import torch

from pd_middleware.codecs.inband import (
    HEADER_BYTES,
    RowFault,
    RowLayout,
    RowOverflowError,
    clear_row,
    mark_overflow,
    read_row,
    row_bytes,
    row_extent,
    write_row,
)
from pd_middleware.config import parse_config
from pd_middleware.core.payload import Payload, Provenance
from pd_middleware.middleware import build_encoders
from pd_middleware.sampling.encodings import dense_law_tensor, sparse_law_tensor

V = 1000


def _payloads(encoder: dict, steps: int, n: int = 4, seed: int = 0) -> list[Payload]:
    cfg = parse_config({"model": {"vocab_size": V, "num_steps": steps}, "encoder": encoder})
    enc = build_encoders(cfg)["default"]
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(n, steps, V, generator=g) * 3, -1)
    out = enc.encode(probs if steps > 1 else probs[:, 0], temperature=0.7, generator=g)
    return [
        Payload(
            request_id=str(i),
            draft_tokens=tuple(out.tokens[i].tolist()),
            draft_probs=tuple(min(1.0, p) for p in out.token_probs[i].tolist()),
            vocab_size=V,
            provenance=out.provenance,
            proposal=out.proposals[i],
        )
        for i in range(n)
    ]


ENCODERS = {
    "softmax": {"name": "softmax"},
    "greedy": {"name": "greedy"},
    "full_fp32": {"name": "full", "options": {"dtype": "fp32"}},
    "full_bf16": {"name": "full", "options": {"dtype": "bf16"}},
    "sparse_topk": {"name": "sparse", "options": {"mode": "topk", "k": 50}},
    "sparse_floor_u16": {
        "name": "sparse",
        "options": {"mode": "topp", "epsilon": 0.01, "floor": True, "index_format": "u16"},
    },
}


def _law(p: Payload, steps: int) -> torch.Tensor:
    if p.proposal is None:
        return torch.zeros(0)
    if p.proposal.kind == "dense":
        return dense_law_tensor(p.proposal, steps, V)
    return sparse_law_tensor(p.proposal, steps, V)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("name", sorted(ENCODERS))
def test_round_trip_keeps_tokens_provenance_and_law(name: str, steps: int) -> None:
    payloads = _payloads(ENCODERS[name], steps)
    layout = RowLayout(1 << 16, V, steps)
    row = np.zeros(layout.capacity_bytes, np.uint8)
    for i, p in enumerate(payloads):
        room = 2**63 + i  # rooms are uint64: the high bit must survive
        n = write_row(row, room, p, layout)
        assert n == row_bytes(p) <= layout.capacity_bytes
        got = read_row(row, room, layout, request_id=p.request_id)
        assert isinstance(got, Payload), got
        assert got.draft_tokens == p.draft_tokens
        assert got.draft_probs == tuple(float(np.float32(x)) for x in p.draft_probs)
        assert got.provenance == p.provenance
        assert (got.proposal is None) == (p.proposal is None)
        assert torch.equal(_law(got, steps), _law(p, steps))


def test_row_is_a_copy_the_engine_may_reuse() -> None:
    (p,) = _payloads(ENCODERS["sparse_topk"], 1, n=1)
    layout = RowLayout(4096, V, 1)
    row = np.zeros(4096, np.uint8)
    write_row(row, 7, p, layout)
    got = read_row(row, 7, layout)
    row[:] = 0xFF
    assert torch.equal(_law(got, 1), _law(p, 1))


@pytest.mark.parametrize("name", ["sparse_floor_u16", "full_bf16"])
def test_snapshot_read_views_the_row_and_decodes_the_same_law(name: str) -> None:
    """copy=False (a caller's own snapshot): same payload and law, buffers are views of the
    row; the default copies (negative control: a write into the row then shows or not)."""
    (p,) = _payloads(ENCODERS[name], 1, n=1)
    layout = RowLayout(1 << 16, V, 1)
    row = np.zeros(layout.capacity_bytes, np.uint8)
    write_row(row, 9, p, layout)
    copied, viewed = read_row(row, 9, layout), read_row(row, 9, layout, copy=False)
    assert isinstance(copied, Payload) and isinstance(viewed, Payload)
    assert viewed == copied and torch.equal(_law(viewed, 1), _law(p, 1))
    bufs = [viewed.proposal.data] if name == "full_bf16" else [viewed.proposal.indices, viewed.proposal.values]
    assert all(isinstance(b, memoryview) and np.shares_memory(np.frombuffer(b, np.uint8), row) for b in bufs)
    cbufs = [copied.proposal.data] if name == "full_bf16" else [copied.proposal.indices, copied.proposal.values]
    before = [bytes(b) for b in cbufs]
    assert [bytes(b) for b in bufs] == before and any(any(b) for b in before)
    row[48:] = 0
    assert [bytes(b) for b in cbufs] == before
    assert not any(any(bytes(b)) for b in bufs)


@pytest.mark.parametrize("steps", [1, 3])
def test_the_rows_extent_is_all_a_read_needs(steps: int) -> None:
    """``row_extent``: the header plus the body length it declares. A copy of that many
    bytes reads as the whole row does (the decode copies no more); one byte fewer is a
    length fault (negative control); an unwritten row needs its header only."""
    layout = RowLayout(1 << 16, V, steps)
    for p in _payloads(ENCODERS["sparse_floor_u16"], steps):
        row = np.zeros(layout.capacity_bytes, dtype=np.uint8)
        write_row(row, 11, p, layout)
        n = row_extent(row)
        assert n == row_bytes(p) < row.size
        got = read_row(row[:n].copy(), 11, layout)
        assert isinstance(got, Payload) and got == read_row(row, 11, layout)
        short = read_row(row[: n - 1].copy(), 11, layout)
        assert isinstance(short, RowFault) and short.reason == "length"
    assert row_extent(np.zeros(layout.capacity_bytes, dtype=np.uint8)) == HEADER_BYTES
    assert row_extent(np.zeros(HEADER_BYTES - 1, dtype=np.uint8)) == HEADER_BYTES - 1


def test_identical_bytes_for_identical_input() -> None:
    # Two prefill ranks writing the same request must produce the same row.
    (p,) = _payloads(ENCODERS["sparse_floor_u16"], 1, n=1)
    layout = RowLayout(8192, V, 1)
    a, b = np.zeros(8192, np.uint8), np.full(8192, 0xAB, np.uint8)
    n = write_row(a, 5, p, layout)
    assert write_row(b, 5, p, layout) == n
    assert a[:n].tobytes() == b[:n].tobytes()
    # The whole row travels: nothing of the slot's earlier contents (b was 0xAB) goes with it.
    assert a.tobytes() == b.tobytes()
    assert not b[n:].any()


def _written(layout: RowLayout | None = None, room: int = 11) -> tuple[np.ndarray, RowLayout, Payload]:
    (p,) = _payloads(ENCODERS["sparse_topk"], 1, n=1)
    layout = layout or RowLayout(4096, V, 1)
    row = np.zeros(layout.capacity_bytes, np.uint8)
    write_row(row, room, p, layout)
    return row, layout, p


def _fault(row: np.ndarray, layout: RowLayout, room: int = 11) -> RowFault:
    got = read_row(row, room, layout)
    assert isinstance(got, RowFault), got
    return got


def test_zero_row_and_other_room_are_not_sent() -> None:
    layout = RowLayout(4096, V, 1)
    assert _fault(np.zeros(4096, np.uint8), layout).reason == "not_sent"
    row, layout, _ = _written()
    assert _fault(row, layout, room=12).reason == "not_sent"
    clear_row(row)
    assert _fault(row, layout).reason == "not_sent"


def test_bad_magic_version_layout_length_digest() -> None:
    row, layout, _ = _written()
    bad = row.copy()
    bad[0] ^= 1
    assert _fault(bad, layout).reason == "magic"
    bad = row.copy()
    bad[4] = 9
    assert _fault(bad, layout).reason == "version"
    f = _fault(row, RowLayout(8192, V, 1))
    assert f.reason == "layout" and "capacity=8192" in f.detail
    assert _fault(row, RowLayout(4096, V + 1, 1)).reason == "layout"
    bad = row.copy()
    bad[24:28] = np.frombuffer(struct.pack("<I", 10_000), np.uint8)
    assert _fault(bad, layout).reason == "length"
    bad = row.copy()
    bad[24:28] = np.frombuffer(struct.pack("<I", 100), np.uint8)
    assert _fault(bad, layout).reason == "digest"
    for at in (HEADER_BYTES + 1, 40, 200):  # a token, the temperature, the body
        bad = row.copy()
        bad[at] ^= 0x10
        assert _fault(bad, layout).reason == "digest", at


def test_negative_control_unchecked_flip_would_change_the_law() -> None:
    # Proves the digest test above is meaningful: the flipped byte is part of the law.
    row, layout, _p = _written()
    bad = row.copy()
    bad[300] ^= 0x10
    assert bad.tobytes() != row.tobytes()
    assert _fault(bad, layout).reason == "digest"


def test_overflow_raises_and_leaves_row_untouched_then_marks() -> None:
    (p,) = _payloads(ENCODERS["full_fp32"], 1, n=1)  # dense fp32: 4000 bytes
    layout = RowLayout(1024, V, 1)
    row = np.full(1024, 3, np.uint8)
    with pytest.raises(RowOverflowError, match="needs 4[0-9]{3} bytes, the row holds 1024") as ei:
        write_row(row, 1, p, layout)
    assert ei.value.field == "proposal" and ei.value.needed > 1024
    assert (row == 3).all()
    mark_overflow(row, 1, p, layout)
    f = _fault(row, layout, room=1)
    assert f.reason == "overflow"


def test_corrupt_body_structure_is_a_decode_fault() -> None:
    # A writer bug (valid digest, bad structure) must still not raise: decode:<field>.
    (p,) = _payloads(ENCODERS["sparse_topk"], 1, n=1)
    bad_p = msgspec.structs.replace(p, proposal=msgspec.structs.replace(p.proposal, lengths=(V + 1,)))
    layout = RowLayout(8192, V, 1)
    row = np.zeros(8192, np.uint8)
    write_row(row, 3, bad_p, layout)
    f = _fault(row, layout, room=3)
    assert f.reason.startswith("decode:proposal"), f


def test_layout_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        RowLayout(1000, V, 1)
    with pytest.raises(ValueError, match="num_steps"):
        RowLayout(4096, V, 17)
    assert RowLayout(4096, V, 1).signature != RowLayout(4096, V, 2).signature
    assert RowLayout(4096, V, 1).signature == RowLayout(4096, V, 1).signature


def test_greedy_provenance_round_trips() -> None:
    p = Payload(
        request_id="g",
        draft_tokens=(3,),
        draft_probs=(1.0,),
        vocab_size=V,
        provenance=Provenance(rule="greedy", temperature=0.0),
    )
    layout = RowLayout(256, V, 1)
    row = np.zeros(256, np.uint8)
    write_row(row, 1, p, layout)
    got = read_row(row, 1, layout, request_id="g")
    assert got == p


@pytest.mark.parametrize("name", ["sparse_topk", "sparse_floor_u16", "full_bf16"])
def test_resealed_mutations_never_raise(name: str) -> None:
    """Structure fuzz behind the digest: mutate a valid row, then recompute its CRC (as a
    buggy or hostile writer would), so the body parser itself sees the damage. Every
    outcome must be a RowFault or a Payload that passed its own validation; never an
    exception. Seeded; 400 mutations per encoding."""
    from pd_middleware.codecs.inband import _seal

    (p,) = _payloads(ENCODERS[name], 2 if name != "full_bf16" else 1, n=1, seed=5)
    steps = len(p.draft_tokens)
    layout = RowLayout(1 << 14, V, steps)
    base = np.zeros(layout.capacity_bytes, np.uint8)
    n = write_row(base, 9, p, layout)
    rng = np.random.default_rng(20261201)
    reasons: dict[str, int] = {}
    for _ in range(400):
        row = base.copy()
        for at in rng.integers(32, n, size=int(rng.integers(1, 4))):  # after the digest field
            row[at] = rng.integers(0, 256)
        if rng.random() < 0.3:  # also lie about the length
            row[24:28] = np.frombuffer(struct.pack("<I", int(rng.integers(0, layout.capacity_bytes))), np.uint8)
        end = HEADER_BYTES + int(np.frombuffer(row[24:28].tobytes(), "<u4")[0])
        _seal(row, min(end, layout.capacity_bytes))
        got = read_row(row, 9, layout)
        key = got.reason.split(":")[0] if isinstance(got, RowFault) else "payload"
        reasons[key] = reasons.get(key, 0) + 1
        if isinstance(got, Payload):
            assert got.vocab_size == V and len(got.draft_tokens) == steps
    # The fuzz reached the parser (not only the header checks).
    assert reasons.get("decode", 0) + reasons.get("payload", 0) > 100, reasons
