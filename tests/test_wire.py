"""Wire schema: round trips, every rejection names its field, and a seeded fuzz."""

from __future__ import annotations

import pathlib
import random
import re

import msgspec
import pytest
from _helpers import (  # tests/ is on sys.path
    BIG_VOCAB,
    LIMITS,
    VOCAB,
    inline_frames,
    make,
    mutations,
    same,
)

from pd_middleware import Payload, WireError
from pd_middleware.transport import LimitsConfig, payload_codec, wire
from pd_middleware.transport.auth import Signer
from pd_middleware.transport.slots import SlotPool


def decode(frames: list[bytes], resolver=None) -> Payload:
    msg = wire.decode_frame(frames[0], LIMITS)
    assert isinstance(msg, wire.PayloadHeader)
    return payload_codec.payload_from_header(msg, frames, LIMITS, resolver)[0]


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("hidden_dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("proposal", [None, "dense", "dense16", "sparse", "sparse_u16", "sparse_u16_big"])
def test_inline_round_trip_is_bit_exact(steps: int, hidden_dtype: str, proposal: str | None) -> None:
    p = make(steps, hidden_dtype, proposal)
    same(p, decode(inline_frames(p)))


@pytest.mark.parametrize("proposal", ["sparse", "sparse_u16_big"])
def test_slot_round_trip_is_zero_copy_and_aligned(proposal: str) -> None:
    pool = SlotPool(2, 4096)
    (slot,) = pool.grant("peer", 1)
    p = make(2, "fp32", proposal)
    header, parts = payload_codec.build_header(p, 7, slot)
    for buf, off in parts:
        assert off % wire.SLOT_ALIGN == 0
        pool.view[slot * 4096 + off : slot * 4096 + off + len(buf)] = buf
    msg = wire.decode_frame(wire.encode(header), LIMITS)
    got, s = payload_codec.payload_from_header(msg, [b""], LIMITS, lambda *a: pool.view_of("peer", *a))
    assert s == slot
    same(p, got)
    assert isinstance(got.hidden, memoryview) and not got.hidden.readonly  # a view of the slot, no copy


def reject(frames: list[bytes], field: str, resolver=None, limits: LimitsConfig = LIMITS) -> WireError:
    with pytest.raises(WireError) as info:
        msg = wire.decode_frame(frames[0], limits)
        payload_codec.payload_from_header(msg, frames, limits, resolver)  # type: ignore[arg-type]
    assert info.value.field == field, str(info.value)
    return info.value


def mutate(p: Payload, **changes) -> list[bytes]:
    frames = inline_frames(p)
    raw = msgspec.msgpack.decode(frames[0])
    for key, value in changes.items():
        node = raw
        *path, last = key.split("__")
        for k in path:
            node = node[k]
        node[last] = value
    return [msgspec.msgpack.encode(raw), *frames[1:]]


def test_rejections_name_field_and_request() -> None:
    p = make(2, "bf16", "dense")
    e = reject(mutate(p, draft_probs=[0.5, 1.5]), "draft_probs")
    assert "'req-1'" in str(e) and "1.5" in str(e) and e.request_id == "req-1"
    e = reject(mutate(p, draft_tokens=[1, VOCAB]), "draft_tokens")
    assert f"not an int in [0, {VOCAB})" in str(e)
    e = reject(mutate(p, draft_tokens=[1, "x"]), "draft_tokens")
    assert "Expected `int`, got `str`" in str(e) and e.request_id == "req-1"
    e = reject(mutate(p, v=2), "v")
    assert "wire version 2 is not supported (expected 1)" in str(e)
    e = reject(mutate(p, kind="grant"), "kind")
    assert "Invalid value 'grant'" in str(e)
    e = reject(mutate(p, hidden__dtype="fp32"), "hidden.dtype")
    assert "does not match bf16" in str(e)
    e = reject(mutate(p, hidden__nbytes=10), "hidden.nbytes")
    assert "declares 10 bytes" in str(e)
    e = reject(mutate(p, proposal__data__shape=[2, VOCAB + 1]), "proposal.data.shape")
    assert f"does not match (2, {VOCAB})" in str(e)
    e = reject(mutate(p, hidden__frame=9), "hidden.frame")
    assert "names frame 9" in str(e)
    e = reject(mutate(p, proposal__kind="bogus"), "proposal.kind")
    e = reject(mutate(p, surprise=1), "surprise")
    assert "unknown field `surprise`" in str(e)
    e = reject(mutate(p, provenance__temperature=-1.0), "provenance.temperature")
    assert "finite number >= 0" in str(e) and e.request_id == "req-1"


def test_int32_sparse_header_is_unchanged_and_u16_carries_its_fields() -> None:
    """omit_defaults: an int32 header has no new keys (older peers read it as before);
    a u16 header carries both, and the index tensor is uint16."""
    raw = msgspec.msgpack.decode(inline_frames(make(2, proposal="sparse"))[0])["proposal"]
    assert sorted(raw) == ["indices", "kind", "lengths", "tail_mass", "value_dtype", "values"]
    assert raw["indices"]["dtype"] == "int32"
    raw = msgspec.msgpack.decode(inline_frames(make(2, proposal="sparse_u16_big"))[0])["proposal"]
    assert raw["index_format"] == "u16" and raw["bucket_counts"] == [3, 1, 1] * 2
    assert raw["indices"]["dtype"] == "uint16" and raw["indices"]["nbytes"] == 2 * 5 * 2


def test_u16_rejections_name_the_field() -> None:
    p = make(2, "bf16", "sparse_u16_big")  # 5 entries per step, counts (3, 1, 1) per step
    e = reject(mutate(p, proposal__bucket_counts=[3, 1, 1, 3, 1]), "proposal.bucket_counts")
    assert "has 5 counts, expected 2 steps x 3 buckets = 6" in str(e) and e.request_id == "req-1"
    e = reject(mutate(p, proposal__bucket_counts=[3, 1, 1, 3, 1, 0]), "proposal.bucket_counts")
    assert "step 1: counts sum to 4, but the step lists 5 entries" in str(e)
    e = reject(mutate(p, proposal__bucket_counts=[3, 1, 1, 3, 3, -1]), "proposal.bucket_counts")
    assert "Expected `int` >= 0" in str(e)
    e = reject(mutate(p, proposal__index_format="u8"), "proposal.index_format")
    assert "Invalid enum value 'u8'" in str(e)
    e = reject(mutate(p, proposal__indices__dtype="int32"), "proposal.indices.dtype")
    assert "dtype int32 does not match uint16" in str(e)
    e = reject(mutate(p, proposal__indices__nbytes=40), "proposal.indices.nbytes")
    assert "declares 40 bytes for shape (10,) uint16" in str(e)
    e = reject(mutate(make(2, "bf16", "sparse"), proposal__bucket_counts=[3, 3]), "proposal.bucket_counts")
    assert "has 2 counts, but int32 indices take none" in str(e)
    # An int32 header declaring uint16 indices (or the reverse) is a dtype mismatch.
    e = reject(mutate(make(2, "bf16", "sparse"), proposal__indices__dtype="uint16"), "proposal.indices.dtype")
    assert "dtype uint16 does not match int32" in str(e)
    # The u16 tensor obeys the tensor limit before any allocation.
    e = reject(
        mutate(
            p,
            proposal__lengths=[BIG_VOCAB, 5],
            proposal__bucket_counts=[65536, 65536, BIG_VOCAB - 131072, 3, 1, 1],
            proposal__indices__shape=[BIG_VOCAB + 5],
            proposal__indices__nbytes=2 * (BIG_VOCAB + 5),
        ),
        "proposal.indices.nbytes",
        limits=LimitsConfig(max_tensor_bytes=1024),
    )
    assert f"{2 * (BIG_VOCAB + 5)} bytes exceeds max_tensor_bytes 1024" in str(e)
    # Negative control: the unmutated header decodes.
    same(p, decode(inline_frames(p)))


def test_missing_field_and_truncation() -> None:
    frames = inline_frames(make())
    raw = msgspec.msgpack.decode(frames[0])
    del raw["vocab_size"]
    e = reject([msgspec.msgpack.encode(raw), *frames[1:]], "vocab_size")
    assert "missing required field `vocab_size`" in str(e)
    e = reject([frames[0][:-3], *frames[1:]], "message")
    assert "malformed msgpack" in str(e)
    e = reject([frames[0], frames[1][:-2]], "hidden.nbytes")
    assert "frame 1 holds 126 bytes, declared 128" in str(e)


def test_limits_apply_before_allocation() -> None:
    small = LimitsConfig(max_message_bytes=1024, max_tensor_bytes=64, max_steps=2, max_vocab=40, max_request_id=4)
    p = make(1)
    e = reject([b"\x00" * 2000], "message", limits=small)
    assert "control frame of 2000 bytes exceeds max_message_bytes 1024" in str(e)
    e = reject(inline_frames(p), "request_id", limits=small)
    assert "length 5 is not in [1, 4]" in str(e)
    e = reject(inline_frames(make(1, rid="r1")), "vocab_size", limits=small)
    e = reject(inline_frames(make(4, rid="r1")), "draft_tokens", limits=small)
    assert "4 steps is not in [1, 2]" in str(e)
    # A huge declared tensor is refused from its declaration, with no frame that big anywhere.
    e = reject(
        mutate(make(1, rid="r1"), hidden__shape=[1 << 38], hidden__nbytes=1 << 39),
        "hidden.nbytes",
        limits=LimitsConfig(max_tensor_bytes=64),
    )
    assert f"{1 << 39} bytes exceeds max_tensor_bytes 64" in str(e)


def test_slot_checks() -> None:
    pool = SlotPool(2, 256)
    (mine,) = pool.grant("me", 1)
    pool.grant("other", 1)
    res = lambda *a: pool.view_of("me", *a)  # noqa: E731  # a one-line resolver
    p = make(1)
    header, _ = payload_codec.build_header(p, 0, 1 - mine)
    e = reject([wire.encode(header)], "hidden.slot", res)
    assert "is not granted to this peer" in str(e)
    header, _ = payload_codec.build_header(make(1, "fp32", "dense"), 0, mine)
    e = reject([wire.encode(header)], "proposal.data.offset", res)
    assert "exceeds the 256-byte slot" in str(e)
    pool.hold(mine)
    header, _ = payload_codec.build_header(p, 0, mine)
    e = reject([wire.encode(header)], "hidden.slot", res)
    assert "still in use" in str(e)
    e = reject([wire.encode(header)], "hidden.slot", None)
    assert "no slots" in str(e)


def test_hmac_signer() -> None:
    s = Signer(b"k" * 32)
    frames = [b"header", b"tensor"]
    nonce = bytes(range(16))
    tail, sig = s.sign(frames, nonce, 7, b"P")
    assert s.open([*frames, tail, sig], b"P") == (nonce, 7)  # negative control: valid opens
    assert s.open(frames, b"P") is None  # unsigned
    assert s.open([b"headert", b"ensor", tail, sig], b"P") is None  # bytes moved across a frame boundary
    assert s.open([*frames, tail, sig], b"D") is None  # reflected back in the other direction
    assert s.open([*frames, nonce + (8).to_bytes(8, "big"), sig], b"P") is None  # sequence rewritten
    assert Signer(b"x" * 32).open([*frames, tail, sig], b"P") is None  # wrong key


def test_no_pickle_in_package() -> None:
    root = pathlib.Path(__file__).resolve().parents[1] / "pd_middleware"
    use = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle)\b|\bpickle\.(loads?|dumps?)\b", re.M)
    offenders = [str(f) for f in root.rglob("*.py") if use.search(f.read_text())]
    assert offenders == []


# ---- fuzz ------------------------------------------------------------------------

FUZZ_SEED = 20240611
FUZZ_CASES = 12_000


def test_fuzz_every_message_is_rejected_with_a_field_or_valid() -> None:
    rng = random.Random(FUZZ_SEED)
    pool = SlotPool(4, 4096)
    pool.grant("peer", 4)
    resolver = lambda *a: pool.view_of("peer", *a)  # noqa: E731  # a one-line resolver
    corpus = []
    for steps in (1, 3):
        for hd in ("bf16", "fp32"):
            for prop in (None, "dense", "sparse", "sparse_u16_big"):
                p = make(steps, hd, prop)
                corpus.append(inline_frames(p, 3))
                header, _ = payload_codec.build_header(p, 3, slot=1)
                corpus.append([wire.encode(header)])
    corpus.append([wire.encode(wire.Hello(name="p", want_slots=4))])
    corpus.append([wire.encode(wire.Heartbeat())])
    accepted = rejected = 0
    fields: set[str] = set()
    for case in range(FUZZ_CASES):
        frames = mutations(rng, rng.choice(corpus))
        try:
            msg = wire.decode_frame(frames[0], LIMITS)
            if isinstance(msg, wire.PayloadHeader):
                payload, _ = payload_codec.payload_from_header(msg, frames, LIMITS, resolver)
                assert isinstance(payload, Payload)
            accepted += 1
        except WireError as exc:
            assert isinstance(exc.field, str) and exc.field, f"seed {FUZZ_SEED} case {case}: no field in {exc}"
            assert repr(exc.field) in str(exc)
            fields.add(exc.field.split(".")[0])
            rejected += 1
        except Exception as exc:  # pragma: no cover - the failure we are looking for
            pytest.fail(f"seed {FUZZ_SEED} case {case}: {type(exc).__name__}: {exc} for frames {frames!r:.300}")
    assert accepted + rejected == FUZZ_CASES, (accepted, rejected)
    # Negative controls: the fuzz must exercise both outcomes and many distinct fields.
    assert accepted > 100 and rejected > FUZZ_CASES // 2, (accepted, rejected)
    assert {"message", "draft_tokens", "hidden", "proposal", "kind"} <= fields, fields
