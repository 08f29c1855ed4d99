"""SlotPool: generations, admission (generation and digest) and generation-checked release.

Pure unit tests on the pool (no sockets, no engine); the end-to-end cases through a real
receiver and real Mooncake engines are in test_bulk.py.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from pd_middleware import DenseEncoding, IntegrityError, Payload
from pd_middleware.transport import integrity, payload_codec, wire
from pd_middleware.transport.slots import SlotPool


def _payload(rid: str, vocab: int = 64, seed: int = 0) -> Payload:
    rng = random.Random(seed)
    data = bytes(rng.getrandbits(8) for _ in range(vocab * 4))
    return Payload(rid, (3,), (0.5,), vocab, hidden=bytes(128), proposal=DenseEncoding("fp32", data))


def _place(pool: SlotPool, slot: int, parts: list) -> None:
    for b, off in parts:
        n = memoryview(b).nbytes
        base = slot * pool.size + off
        pool.view[base : base + n] = bytes(b)


def _admit(pool: SlotPool, slot: int, header: wire.PayloadHeader) -> int:
    return pool.admit(slot, payload_codec.slot_refs(header), header.request_id)


def test_grant_sets_a_new_generation_every_time() -> None:
    pool = SlotPool(4, 1024)
    (a,) = pool.grant("p1", 1)
    g1 = pool.gen[a]
    pool.reclaim("p1")
    (b,) = pool.grant("p2", 1)
    assert b == a and pool.gen[b] > g1 and pool.gen[b] >> integrity.USE_BITS != g1 >> integrity.USE_BITS


def test_admit_accepts_the_written_bytes_once_and_refuses_a_replay() -> None:
    pool = SlotPool(2, 4096)
    (s,) = pool.grant("p", 1)
    h, parts = payload_codec.build_header(_payload("r"), 0, s, gen=pool.gen[s] + 1, digest=integrity.Binder("xxh3_128"))
    _place(pool, s, parts)
    assert _admit(pool, s, h) == pool.gen[s]
    with pytest.raises(IntegrityError, match="stale") as info:  # the same header again: a replay
        _admit(pool, s, h)
    assert info.value.field == "hidden.gen" and info.value.request_id == "r"


def test_unwritten_or_stale_bytes_are_refused_with_a_control() -> None:
    pool = SlotPool(2, 4096)
    (s,) = pool.grant("p", 1)
    old, parts = payload_codec.build_header(
        _payload("old", seed=1), 0, s, gen=pool.gen[s] + 1, digest=integrity.Binder("xxh3_128")
    )
    _place(pool, s, parts)
    _admit(pool, s, old)
    # The next header names the slot, but its write never happened: the old bytes are there.
    new, _new_parts = payload_codec.build_header(
        _payload("new", seed=2), 1, s, gen=pool.gen[s] + 1, digest=integrity.Binder("xxh3_128")
    )
    with pytest.raises(IntegrityError, match="do not match") as info:
        _admit(pool, s, new)
    assert info.value.field == "proposal.data.digest"
    # Control: once the bytes are written, a header at the next generation is admitted.
    new2, parts2 = payload_codec.build_header(
        _payload("new", seed=2), 2, s, gen=pool.gen[s] + 1, digest=integrity.Binder("xxh3_128")
    )
    _place(pool, s, parts2)
    _admit(pool, s, new2)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "blake3"])
def test_one_flipped_bit_is_refused(algorithm: str) -> None:
    pool = SlotPool(1, 4096, digest=algorithm)
    (s,) = pool.grant("p", 1)
    h, parts = payload_codec.build_header(_payload("r"), 0, s, gen=pool.gen[s] + 1, digest=integrity.Binder(algorithm))
    _place(pool, s, parts)
    off = h.proposal.data.offset + 17  # type: ignore[union-attr]
    pool.view[off] ^= 0x01
    with pytest.raises(IntegrityError, match=algorithm):
        _admit(pool, s, h)


def test_strong_mode_refuses_a_fast_digest_and_a_missing_one() -> None:
    pool = SlotPool(1, 4096, digest="blake3")
    (s,) = pool.grant("p", 1)
    h, parts = payload_codec.build_header(_payload("r"), 0, s, gen=pool.gen[s] + 1, digest=integrity.Binder("xxh3_128"))
    _place(pool, s, parts)
    with pytest.raises(IntegrityError, match="requires BLAKE3"):
        _admit(pool, s, h)
    h, parts = payload_codec.build_header(_payload("r"), 0, s, gen=pool.gen[s] + 1)  # no digest at all
    with pytest.raises(IntegrityError, match="no digest"):
        _admit(pool, s, h)


def test_a_generation_of_another_grant_or_mixed_generations_are_refused() -> None:
    pool = SlotPool(2, 4096)
    (s,) = pool.grant("p", 1)
    old_grant = pool.gen[s]
    pool.reclaim("p")
    pool.grant("p", 1)
    p = _payload("r")
    h, parts = payload_codec.build_header(p, 0, s, gen=old_grant + 1, digest=integrity.Binder("xxh3_128"))
    _place(pool, s, parts)
    with pytest.raises(IntegrityError, match="not of this grant"):
        _admit(pool, s, h)
    h, _ = payload_codec.build_header(p, 0, s, gen=pool.gen[s] + 1, digest=integrity.Binder("xxh3_128"))
    mixed = msgspec.structs.replace(h, hidden=msgspec.structs.replace(h.hidden, gen=pool.gen[s] + 2))
    with pytest.raises(IntegrityError, match="differs") as info:
        _admit(pool, s, mixed)
    assert info.value.field == "proposal.data.gen"


def test_release_is_generation_checked() -> None:
    """A release issued for an earlier use is a no-op: it must never free a later use."""
    pool = SlotPool(2, 4096)
    (s,) = pool.grant("p", 1)
    first = pool.gen[s] + 1
    h, parts = payload_codec.build_header(_payload("a"), 0, s, gen=first, digest=integrity.Binder("xxh3_128"))
    _place(pool, s, parts)
    _admit(pool, s, h)
    pool.hold(s)
    assert pool.release(s, first) == (True, "p")
    h, parts = payload_codec.build_header(_payload("b"), 1, s, gen=first + 1, digest=integrity.Binder("xxh3_128"))
    _place(pool, s, parts)
    _admit(pool, s, h)
    pool.hold(s)
    assert pool.release(s, first) == (False, None)  # stale: the slot stays held by "b"
    assert pool.held[s] and pool.is_held(s, first + 1)
    assert pool.release(s, first + 1) == (True, "p")  # control: the current use frees it
    assert pool.release(s, first + 1) == (False, None)  # and only once


def test_an_orphaned_slot_returns_to_the_pool_only_on_its_own_release() -> None:
    pool = SlotPool(1, 4096)
    (s,) = pool.grant("p", 1)
    h, parts = payload_codec.build_header(_payload("a"), 0, s, gen=pool.gen[s] + 1, digest=integrity.Binder("xxh3_128"))
    _place(pool, s, parts)
    g = _admit(pool, s, h)
    pool.hold(s)
    assert pool.reclaim("p") == [] and pool.available == 0  # held: an orphan until released
    assert pool.release(s, g - 1) == (False, None) and pool.available == 0
    assert pool.release(s, g) == (True, None) and pool.available == 1
