"""Helpers shared by several test modules (fixtures live in tests/conftest.py).

- :class:`OneHot`: the smallest synthesizer a receive pipeline accepts (a stand-in
  where the test is about transport, not about a synthesizer).
- Wire payload builders (:func:`make`, :func:`inline_frames`, :func:`same`) and the
  seeded frame mutator (:func:`mutations`) used by the wire, transport, security and
  regression tests.
"""

from __future__ import annotations

import random
import struct

import msgspec

from pd_middleware import DenseEncoding, OneHotProposal, Payload, Provenance, SparseEncoding
from pd_middleware.transport import LimitsConfig, payload_codec, wire


class OneHot:
    """A synthesizer that proposes the draft tokens one-hot (transport tests' stand-in)."""

    def synthesize(self, payload: Payload) -> OneHotProposal:
        return OneHotProposal(payload.draft_tokens)


# ---- wire payloads ----------------------------------------------------------------

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
        None: None,
        "dense": lambda: dense(steps),
        "dense16": lambda: dense(steps, "fp16"),
        "sparse": lambda: sparse(steps),
        "sparse_u16": lambda: sparse_u16(steps),
        "sparse_u16_big": lambda: sparse_u16(steps, BIG_VOCAB),
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
    header, parts = payload_codec.build_header(p, seq)
    return [wire.encode(header), *(bytes(b) for b, _ in parts)]


def same(a: Payload, b: Payload) -> None:
    assert (a.request_id, a.draft_tokens, a.draft_probs, a.vocab_size) == (
        b.request_id,
        b.draft_tokens,
        b.draft_probs,
        b.vocab_size,
    )
    assert bytes(a.hidden) == bytes(b.hidden) and a.hidden_dtype == b.hidden_dtype
    assert a.provenance == b.provenance
    if a.proposal is None:
        assert b.proposal is None
    elif isinstance(a.proposal, DenseEncoding):
        assert isinstance(b.proposal, DenseEncoding) and a.proposal.dtype == b.proposal.dtype
        assert bytes(a.proposal.data) == bytes(b.proposal.data)
    else:
        assert isinstance(b.proposal, SparseEncoding)
        assert (a.proposal.lengths, a.proposal.value_dtype, a.proposal.tail_mass) == (
            b.proposal.lengths,
            b.proposal.value_dtype,
            b.proposal.tail_mass,
        )
        assert (a.proposal.index_format, a.proposal.bucket_counts) == (
            b.proposal.index_format,
            b.proposal.bucket_counts,
        )
        assert bytes(a.proposal.indices) == bytes(b.proposal.indices) and bytes(a.proposal.values) == bytes(
            b.proposal.values
        )


# ---- fuzz -------------------------------------------------------------------------


def mutations(rng: random.Random, frames: list[bytes]) -> list[bytes]:
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
                [
                    None,
                    -1,
                    0,
                    1,
                    2**40,
                    -(2**63),
                    1.5,
                    float("nan"),
                    float("inf"),
                    "",
                    "x" * 300,
                    "fp32",
                    "int32",
                    [],
                    [1, 2],
                    {"a": 1},
                    True,
                    b"\x00\x01",
                    [VOCAB],
                    [0.5] * 100,
                ]
            )
        header = bytearray(msgspec.msgpack.encode(raw))
    return [bytes(header), *rest]
