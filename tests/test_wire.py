"""Wire schema: round trips, every rejection names its field, and a seeded fuzz."""

from __future__ import annotations

import pathlib
import random
import re
import struct

import msgspec
import pytest

from pd_middleware import DenseEncoding, Payload, Provenance, SparseEncoding, WireError
from pd_middleware.transport import LimitsConfig, wire
from pd_middleware.transport.auth import Signer
from pd_middleware.transport.slots import SlotPool

LIMITS = LimitsConfig()
VOCAB = 50


def dense(steps: int, dtype: str = "fp32") -> DenseEncoding:
    fmt = {"fp32": "f", "fp16": "e"}[dtype]
    return DenseEncoding(dtype, struct.pack(f"<{steps * VOCAB}{fmt}", *([1.0 / VOCAB] * (steps * VOCAB))))


def sparse(steps: int) -> SparseEncoding:
    idx = [i * 7 % VOCAB for i in range(3)] * steps
    return SparseEncoding(
        lengths=(3,) * steps,
        indices=struct.pack(f"<{3 * steps}i", *idx),
        values=struct.pack(f"<{3 * steps}f", *([0.25] * 3 * steps)),
        value_dtype="fp32",
        tail_mass=(0.25,) * steps,
    )


BIG_VOCAB = 152064  # three 65536-token buckets


def sparse_u16(steps: int, vocab: int = VOCAB) -> SparseEncoding:
    """u16 indices: per step, ids sorted ascending, low 16 bits, counts per 65536-token bucket."""
    ids = sorted({(i * 48611 + 7) % vocab for i in range(5)})
    nb = -(-vocab // 65536)
    return SparseEncoding(
        lengths=(len(ids),) * steps,
        indices=struct.pack(f"<{len(ids) * steps}H", *([i & 0xFFFF for i in ids] * steps)),
        values=struct.pack(f"<{len(ids) * steps}e", *([0.125] * len(ids) * steps)),
        value_dtype="fp16",
        tail_mass=(1 - 0.125 * len(ids),) * steps,
        index_format="u16",
        bucket_counts=tuple(sum(1 for i in ids if i >> 16 == b) for b in range(nb)) * steps,
    )


def make(steps: int = 1, hidden_dtype: str = "bf16", proposal: str | None = None, rid: str = "req-1") -> Payload:
    rng = random.Random(f"{steps}/{hidden_dtype}/{proposal}")
    hidden = bytes(rng.getrandbits(8) for _ in range(32 * 4))
    vocab = BIG_VOCAB if proposal == "sparse_u16_big" else VOCAB
    enc = {
        None: None, "dense": lambda: dense(steps), "dense16": lambda: dense(steps, "fp16"), "sparse": lambda: sparse(steps),
        "sparse_u16": lambda: sparse_u16(steps), "sparse_u16_big": lambda: sparse_u16(steps, BIG_VOCAB),
    }[proposal]
    return Payload(
        rid,
        tuple(rng.randrange(vocab) for _ in range(steps)),
        tuple(rng.random() for _ in range(steps)),
        vocab,
        hidden=hidden,
        hidden_dtype=hidden_dtype,  # type: ignore[arg-type]
        provenance=Provenance("sampled", 0.7, None),
        proposal=enc() if enc is not None else None,
    )


def inline_frames(p: Payload, seq: int = 0) -> list[bytes]:
    header, parts = wire.build_header(p, seq)
    return [wire.encode(header), *(bytes(b) for b, _ in parts)]


def decode(frames: list[bytes], resolver=None) -> Payload:
    msg = wire.decode_frame(frames[0], LIMITS)
    assert isinstance(msg, wire.PayloadHeader)
    return wire.payload_from_header(msg, frames, LIMITS, resolver)[0]


def same(a: Payload, b: Payload) -> None:
    assert (a.request_id, a.draft_tokens, a.draft_probs, a.vocab_size) == (b.request_id, b.draft_tokens, b.draft_probs, b.vocab_size)
    assert bytes(a.hidden) == bytes(b.hidden) and a.hidden_dtype == b.hidden_dtype
    assert a.provenance == b.provenance
    if a.proposal is None:
        assert b.proposal is None
    elif isinstance(a.proposal, DenseEncoding):
        assert isinstance(b.proposal, DenseEncoding) and a.proposal.dtype == b.proposal.dtype
        assert bytes(a.proposal.data) == bytes(b.proposal.data)
    else:
        assert isinstance(b.proposal, SparseEncoding)
        assert (a.proposal.lengths, a.proposal.value_dtype, a.proposal.tail_mass) == (b.proposal.lengths, b.proposal.value_dtype, b.proposal.tail_mass)
        assert (a.proposal.index_format, a.proposal.bucket_counts) == (b.proposal.index_format, b.proposal.bucket_counts)
        assert bytes(a.proposal.indices) == bytes(b.proposal.indices) and bytes(a.proposal.values) == bytes(b.proposal.values)


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
    header, parts = wire.build_header(p, 7, slot)
    for buf, off in parts:
        assert off % wire.SLOT_ALIGN == 0
        pool.view[slot * 4096 + off : slot * 4096 + off + len(buf)] = buf
    msg = wire.decode_frame(wire.encode(header), LIMITS)
    got, s = wire.payload_from_header(msg, [b""], LIMITS, lambda *a: pool.view_of("peer", *a))
    assert s == slot
    same(p, got)
    assert isinstance(got.hidden, memoryview) and not got.hidden.readonly  # a view of the slot, no copy


def reject(frames: list[bytes], field: str, resolver=None, limits: LimitsConfig = LIMITS) -> WireError:
    with pytest.raises(WireError) as info:
        msg = wire.decode_frame(frames[0], limits)
        wire.payload_from_header(msg, frames, limits, resolver)  # type: ignore[arg-type]
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
        mutate(p, proposal__lengths=[BIG_VOCAB, 5], proposal__bucket_counts=[65536, 65536, BIG_VOCAB - 131072, 3, 1, 1],
               proposal__indices__shape=[BIG_VOCAB + 5], proposal__indices__nbytes=2 * (BIG_VOCAB + 5)),
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
    res = lambda *a: pool.view_of("me", *a)  # noqa: E731
    p = make(1)
    header, _ = wire.build_header(p, 0, 1 - mine)
    e = reject([wire.encode(header)], "hidden.slot", res)
    assert "is not granted to this peer" in str(e)
    header, _ = wire.build_header(make(1, "fp32", "dense"), 0, mine)
    e = reject([wire.encode(header)], "proposal.data.offset", res)
    assert "exceeds the 256-byte slot" in str(e)
    pool.hold(mine)
    header, _ = wire.build_header(p, 0, mine)
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


def _mutations(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    header = bytearray(frames[0])
    rest = list(frames[1:])
    op = rng.randrange(9)
    if op == 0:  # flip bytes
        for _ in range(rng.randint(1, 4)):
            header[rng.randrange(len(header))] = rng.randrange(256)
    elif op == 1:  # truncate header
        header = header[: rng.randrange(len(header))]
    elif op == 2:  # insert junk
        at = rng.randrange(len(header) + 1)
        header[at:at] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
    elif op == 3:  # random frame
        header = bytearray(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    elif op == 4 and rest:  # truncate or drop an inline frame
        i = rng.randrange(len(rest))
        rest[i] = rest[i][: rng.randrange(len(rest[i]) + 1)] if rng.random() < 0.5 else b""
    elif op == 5:  # extra frames
        rest.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 32))))
    else:  # structured: replace one value anywhere in the map with something plausible
        raw = msgspec.msgpack.decode(bytes(header))
        node, key = raw, None
        for depth in range(3):
            key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node)) if node else None
            child = node[key] if key is not None else None
            if depth < 2 and isinstance(child, (dict, list)) and child and rng.random() < 0.6:
                node = child
                continue
            break
        if key is not None:
            node[key] = rng.choice(
                [None, -1, 0, 1, 2**40, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 300, "fp32", "int32",
                 [], [1, 2], {"a": 1}, True, b"\x00\x01", [VOCAB], [0.5] * 100]
            )
        header = bytearray(msgspec.msgpack.encode(raw))
    return [bytes(header), *rest]


def test_fuzz_every_message_is_rejected_with_a_field_or_valid() -> None:
    rng = random.Random(FUZZ_SEED)
    pool = SlotPool(4, 4096)
    pool.grant("peer", 4)
    resolver = lambda *a: pool.view_of("peer", *a)  # noqa: E731
    corpus = []
    for steps in (1, 3):
        for hd in ("bf16", "fp32"):
            for prop in (None, "dense", "sparse", "sparse_u16_big"):
                p = make(steps, hd, prop)
                corpus.append(inline_frames(p, 3))
                header, _ = wire.build_header(p, 3, slot=1)
                corpus.append([wire.encode(header)])
    corpus.append([wire.encode(wire.Hello(name="p", want_slots=4))])
    corpus.append([wire.encode(wire.Heartbeat())])
    accepted = rejected = 0
    fields: set[str] = set()
    for case in range(FUZZ_CASES):
        frames = _mutations(rng, rng.choice(corpus))
        try:
            msg = wire.decode_frame(frames[0], LIMITS)
            if isinstance(msg, wire.PayloadHeader):
                payload, _ = wire.payload_from_header(msg, frames, LIMITS, resolver)
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
