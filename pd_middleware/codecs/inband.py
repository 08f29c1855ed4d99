"""The in-band proposal row: one request's encoded proposal in a fixed-capacity byte row.

Engine-agnostic. An engine that already moves fixed-size per-request metadata rows from
prefill to decode (SGLang's ``MetadataBuffers``) carries one more row per request, of
``RowLayout.capacity_bytes`` bytes, holding what :func:`write_row` wrote. The decode
turns it back into a :class:`~pd_middleware.Payload` with :func:`read_row`, then runs
it through the same receive pipeline (hooks, synthesizer, validation) as any payload.

Row format, version :data:`ROW_VERSION`, all little-endian:

======  ====  ===============================================================
offset  size  field
======  ====  ===============================================================
0       4     magic ``b"PDMR"`` (a zero row was never written)
4       2     format version
6       2     flags: 1 has proposal, 2 overflow (proposal left out), 4 greedy draft
8       8     layout signature (:attr:`RowLayout.signature`)
16      8     bootstrap room (uint64)
24      4     body length L (bytes after the 48-byte header)
28      4     digest: CRC-32 of bytes [0, 28) and [32, 48 + L)
32      4     vocab V
36      1     steps S
37      1     proposal kind: 0 none, 1 dense, 2 sparse
38      1     dense dtype / sparse value dtype code
39      1     sparse index format code (0 int32, 1 u16)
40      8     temperature (float64)
48      ...   body: S x int64 draft tokens X, S x float32 q(X), sampled_from
              (u8 length + ASCII), then the proposal:
              dense: S*V values; sparse: S x uint32 lengths, S x float64
              tail mass, S*ceil(V/65536) x uint32 bucket counts (u16 only),
              padding to 8 bytes, indices, values
======  ====  ===============================================================

The digest is CRC-32 (``zlib.crc32``, standard library, GB/s on any CPU): it catches
torn and corrupted rows (every burst up to 32 bits, and any other error with
probability 1 - 2^-32), which is what an engine's own transfer can produce. It is not
an authenticator; the metadata path is the engine's trusted channel (xxhash would be
faster but is not a dependency, and the row is at most a few KiB in the operating
points that matter).

The row carries X itself, so a decode can check it against the X the engine delivers
through its own metadata and never pair a proposal with a different draw.
"""

from __future__ import annotations

import functools
import hashlib
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..core._errors import ValidationError
from ..core.payload import ITEMSIZE, DenseEncoding, Payload, Provenance, SparseEncoding, u16_buckets

__all__ = [
    "HEADER_BYTES",
    "ROW_MAGIC",
    "ROW_VERSION",
    "RowFault",
    "RowLayout",
    "RowOverflowError",
    "clear_row",
    "mark_overflow",
    "read_row",
    "row_bytes",
    "row_extent",
    "write_row",
]

ROW_MAGIC = 0x524D4450  # b"PDMR" little-endian
ROW_VERSION = 1
HEADER_BYTES = 48
FLAG_PROPOSAL = 1
FLAG_OVERFLOW = 2
FLAG_GREEDY = 4
#: Smallest and largest row capacity a layout accepts (bytes; multiples of 64).
MIN_CAPACITY = 256
MAX_CAPACITY = 8 << 20
MAX_STEPS = 16

_HEAD = struct.Struct("<IHHQQII")  # magic, version, flags, signature, room, length, digest
_SHAPE = struct.Struct("<IBBBBd")  # vocab, steps, kind, dtype, index format, temperature
_DIGEST_AT = 28
_LENGTH_AT = 24  # the body length in _HEAD: after magic, version, flags, signature, room
_KIND_NONE, _KIND_DENSE, _KIND_SPARSE = 0, 1, 2
_DTYPES: tuple[Literal["fp32", "bf16", "fp16"], ...] = ("fp32", "bf16", "fp16")
_INDEX_FORMATS = ("int32", "u16")
_U64 = (1 << 64) - 1


class RowOverflowError(ValidationError):
    """The encoded proposal does not fit the row's capacity (``.needed`` > ``.capacity``)."""

    def __init__(self, needed: int, capacity: int, request_id: str | None) -> None:
        super().__init__(f"needs {needed} bytes, the row holds {capacity}", field="proposal", request_id=request_id)
        self.needed = needed
        self.capacity = capacity


@dataclass(frozen=True, slots=True)
class RowFault:
    """Why a row gave no payload. ``reason``: ``not_sent``, ``overflow``, ``magic``,
    ``version``, ``layout``, ``length``, ``digest``, ``vocab`` or ``decode:<field>``;
    ``detail``: a sentence for the log."""

    reason: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RowLayout:
    """What both nodes must agree on: row capacity, target vocab V and draft steps S.

    ``capacity_bytes``: bytes per row, a multiple of 64 in [256, 8 MiB];
    ``vocab_size``: V >= 1; ``num_steps``: S in [1, 16].
    """

    capacity_bytes: int
    vocab_size: int
    num_steps: int
    _signature: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        c = self.capacity_bytes
        if not (MIN_CAPACITY <= c <= MAX_CAPACITY) or c % 64:
            raise ValueError(f"capacity_bytes must be a multiple of 64 in [{MIN_CAPACITY}, {MAX_CAPACITY}], got {c}")
        if not 1 <= self.vocab_size <= 1 << 24:
            raise ValueError(f"vocab_size must be in [1, 16777216], got {self.vocab_size}")
        if not 1 <= self.num_steps <= MAX_STEPS:
            raise ValueError(f"num_steps must be in [1, {MAX_STEPS}], got {self.num_steps}")
        if c < HEADER_BYTES + 12 * self.num_steps + 1:
            raise ValueError(f"capacity_bytes {c} cannot hold the header of {self.num_steps} steps")
        raw = struct.pack("<HIII", ROW_VERSION, c, self.vocab_size, self.num_steps)
        sig = int.from_bytes(hashlib.blake2b(raw, digest_size=8, person=b"pd-mw-row").digest(), "little")
        object.__setattr__(self, "_signature", sig)  # computed once: read per row

    @property
    def signature(self) -> int:
        """A 64-bit digest of (format version, capacity, V, S); equal on both nodes or a mismatch."""
        return self._signature

    def describe(self) -> str:
        """``rowv1 capacity=... vocab=... steps=... sig=...``: for error messages naming both sides."""
        return (
            f"rowv{ROW_VERSION} capacity={self.capacity_bytes} vocab={self.vocab_size} "
            f"steps={self.num_steps} sig={self.signature:016x}"
        )


def row_bytes(payload: Payload) -> int:
    """Bytes :func:`write_row` needs for ``payload`` (header included)."""
    s = len(payload.draft_tokens)
    n = HEADER_BYTES + 12 * s + 1 + len(_sampled_from(payload))
    p = payload.proposal
    if type(p) is DenseEncoding:
        n += p.nbytes
    elif type(p) is SparseEncoding:
        n += 12 * s + 4 * len(p.bucket_counts)
        n = -(-n // 8) * 8 + p.nbytes
    return n


def _sampled_from(payload: Payload) -> bytes:
    sf = payload.provenance.sampled_from
    return b"" if sf is None else sf.encode("ascii")


def _put(row: np.ndarray, off: int, buf: Any) -> int:
    src = np.frombuffer(buf, dtype=np.uint8)
    row[off : off + src.size] = src
    return off + src.size


def write_row(row: np.ndarray, room: int, payload: Payload, layout: RowLayout) -> int:
    """Encode ``payload`` into ``row`` (uint8, ``layout.capacity_bytes`` long) for ``room``.

    ``payload``: its S draft tokens, q(X), provenance and optional dense/sparse proposal
    (its hidden state is not carried: the engine ships that itself). Returns the bytes
    written. Raises :class:`RowOverflowError` (leaving ``row`` untouched) when it does not
    fit, and ValueError when the payload's shape is not the layout's; bytes past the
    written length are zeroed (the digest covers only the written ones).
    """
    if row.dtype != np.uint8 or row.ndim != 1 or row.size != layout.capacity_bytes:
        raise ValueError(f"row must be uint8 ({layout.capacity_bytes},), got {row.dtype} {row.shape}")
    s = len(payload.draft_tokens)
    if s != layout.num_steps or payload.vocab_size != layout.vocab_size:
        raise ValueError(
            f"payload has S={s}, V={payload.vocab_size}; the layout is S={layout.num_steps}, V={layout.vocab_size}"
        )
    need = row_bytes(payload)
    if need > layout.capacity_bytes:
        raise RowOverflowError(need, layout.capacity_bytes, payload.request_id)
    off = HEADER_BYTES
    off = _put(row, off, np.asarray(payload.draft_tokens, dtype="<i8"))
    off = _put(row, off, np.asarray(payload.draft_probs, dtype="<f4"))
    sf = _sampled_from(payload)
    row[off] = len(sf)
    off = _put(row, off + 1, sf) if sf else off + 1
    p = payload.proposal
    kind = dtype = fmt = 0
    if type(p) is DenseEncoding:
        kind, dtype = _KIND_DENSE, _DTYPES.index(p.dtype)
        off = _put(row, off, p.data)
    elif type(p) is SparseEncoding:
        kind, dtype, fmt = _KIND_SPARSE, _DTYPES.index(p.value_dtype), _INDEX_FORMATS.index(p.index_format)
        tail = p.tail_mass or (0.0,) * s
        off = _put(row, off, np.asarray(p.lengths, dtype="<u4"))
        off = _put(row, off, np.asarray(tail, dtype="<f8"))
        if p.bucket_counts:
            off = _put(row, off, np.asarray(p.bucket_counts, dtype="<u4"))
        pad = -off % 8
        row[off : off + pad] = 0
        off = _put(row, off + pad, p.indices)
        off = _put(row, off, p.values)
    # The engine transfers the whole row: zero what this request did not write, so no byte
    # of an earlier request's proposal travels with it (a memset of at most capacity bytes).
    row[off:] = 0
    flags = (FLAG_PROPOSAL if kind else 0) | (FLAG_GREEDY if payload.provenance.rule == "greedy" else 0)
    _finish(row, off, flags, room, layout, kind, dtype, fmt, payload.provenance.temperature)
    return off


def mark_overflow(row: np.ndarray, room: int, payload: Payload, layout: RowLayout) -> int:
    """Write ``payload``'s X and q(X) with the overflow flag and no proposal.

    For a proposal that :func:`write_row` refused: the decode then knows the prefill
    has the drop-in (a zero row would say it has not) and counts ``overflow``.
    """
    bare = Payload(
        request_id=payload.request_id,
        draft_tokens=payload.draft_tokens,
        draft_probs=payload.draft_probs,
        vocab_size=payload.vocab_size,
        provenance=payload.provenance,
    )
    n = write_row(row, room, bare, layout)
    flags = int.from_bytes(row[6:8].tobytes(), "little") | FLAG_OVERFLOW
    row[6:8] = np.frombuffer(struct.pack("<H", flags), np.uint8)
    _seal(row, n)
    return n


def _finish(
    row: np.ndarray, end: int, flags: int, room: int, layout: RowLayout, kind: int, dtype: int, fmt: int, temp: float
) -> None:
    head = _HEAD.pack(ROW_MAGIC, ROW_VERSION, flags, layout.signature, room & _U64, end - HEADER_BYTES, 0)
    row[: _HEAD.size] = np.frombuffer(head, np.uint8)
    row[_HEAD.size : HEADER_BYTES] = np.frombuffer(
        _SHAPE.pack(layout.vocab_size, layout.num_steps, kind, dtype, fmt, float(temp)), np.uint8
    )
    _seal(row, end)


def _seal(row: np.ndarray, end: int) -> None:
    view = memoryview(row)  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs omit __buffer__
    crc = zlib.crc32(view[_DIGEST_AT + 4 : end], zlib.crc32(view[:_DIGEST_AT]))
    row[_DIGEST_AT : _DIGEST_AT + 4] = np.frombuffer(struct.pack("<I", crc), np.uint8)


def row_digest(row: np.ndarray) -> int:
    """The digest field of ``row``'s header (a cleared row reads 0)."""
    return int.from_bytes(row[28:32].tobytes(), "little")


def row_extent(row: np.ndarray) -> int:
    """How many leading bytes of ``row`` a read needs: the header plus the body length
    its header declares, at most the row's size. Reads the live row without checking it
    (:func:`read_row` checks the copy); an unwritten row needs its header only."""
    size = int(row.size)
    if size < HEADER_BYTES:
        return size
    length = int.from_bytes(row[_LENGTH_AT : _LENGTH_AT + 4].tobytes(), "little")
    return min(size, HEADER_BYTES + length)


def clear_row(row: np.ndarray) -> None:
    """Mark ``row`` as never written (zero magic); the rest is left for the next writer."""
    row[:HEADER_BYTES] = 0


def read_row(
    row: np.ndarray, room: int, layout: RowLayout, request_id: str | None = None, *, copy: bool = True
) -> Payload | RowFault:
    """Turn ``row`` back into a :class:`Payload` for ``room``, or say why not.

    Checks, in order: magic and room (``not_sent``), ``version``, ``layout`` signature,
    body ``length``, ``digest``, ``vocab``/steps, ``overflow`` flag, then the body's
    own structure (``decode:<field>``); the Payload's constructor validates the rest.
    The payload's buffers are copies: the engine reuses the row once it returns.
    ``copy=False`` is for a caller whose ``row`` is already its own snapshot (the SGLang
    channel copies each row once): the proposal's buffers are then views of ``row``.
    Never raises for a bad row. ``request_id``: the payload's id (default: the room).
    """
    rid = request_id if request_id is not None else str(room)
    view = memoryview(row)  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy's stubs omit __buffer__
    if row.size < HEADER_BYTES:
        return RowFault("length", f"row of {row.size} bytes is shorter than the header")
    magic, version, flags, sig, wrote_room, length, digest = _HEAD.unpack_from(view, 0)
    if magic == 0:
        return RowFault("not_sent", "the prefill wrote no proposal row")
    if magic != ROW_MAGIC:
        return RowFault("magic", f"magic {magic:#010x}, expected {ROW_MAGIC:#010x}")
    if wrote_room != room & _U64:
        return RowFault("not_sent", f"row belongs to room {wrote_room}, not {room}")
    if version != ROW_VERSION:
        return RowFault("version", f"row format v{version}, this decode reads v{ROW_VERSION}")
    if sig != layout.signature:
        return RowFault("layout", f"row layout sig={sig:016x}, this decode is {layout.describe()}")
    end = HEADER_BYTES + length
    if end > row.size:
        return RowFault("length", f"body of {length} bytes overruns the {row.size}-byte row")
    crc = zlib.crc32(view[_DIGEST_AT + 4 : end], zlib.crc32(view[:_DIGEST_AT]))
    if crc != digest:
        return RowFault("digest", f"CRC-32 {crc:#010x} != {digest:#010x}")
    vocab, steps, kind, dtype, fmt, temp = _SHAPE.unpack_from(view, _HEAD.size)
    if vocab != layout.vocab_size or steps != layout.num_steps:
        return RowFault(
            "vocab", f"row says V={vocab}, S={steps}; the decode is V={layout.vocab_size}, S={layout.num_steps}"
        )
    if flags & FLAG_OVERFLOW:
        return RowFault("overflow", "the proposal did not fit the row; the prefill sent X only")
    try:
        return _body(view, end, flags, steps, vocab, kind, dtype, fmt, temp, rid, bytes if copy else _view)
    except ValidationError as exc:
        return RowFault(f"decode:{exc.field}", exc.detail)


@functools.lru_cache(maxsize=64)
def _fmt(code: str, n: int) -> struct.Struct:
    return struct.Struct(f"<{n}{code}")


def _view(view: memoryview) -> memoryview:
    return view


def _body(
    view: memoryview,
    end: int,
    flags: int,
    s: int,
    vocab: int,
    kind: int,
    dtype: int,
    fmt: int,
    temp: float,
    rid: str,
    take_bytes: Callable[[memoryview], bytes | memoryview],
) -> Payload:
    def take(off: int, n: int, field: str) -> int:
        if off + n > end:
            raise ValidationError(
                f"needs {off + n - HEADER_BYTES} body bytes, the row has {end - HEADER_BYTES}",
                field=field,
                request_id=rid,
            )
        return off + n

    off = HEADER_BYTES
    nxt = take(off, 12 * s + 1, "draft_tokens")
    tokens = _fmt("q", s).unpack_from(view, off)
    probs = _fmt("f", s).unpack_from(view, off + 8 * s)
    n_sf = view[nxt - 1]
    off = take(nxt, n_sf, "provenance.sampled_from")
    try:
        sf = bytes(view[nxt:off]).decode("ascii") if n_sf else None
        prov = Provenance(rule="greedy" if flags & FLAG_GREEDY else "sampled", temperature=temp, sampled_from=sf)
    except (UnicodeDecodeError, ValidationError) as exc:
        raise ValidationError(str(exc), field="provenance", request_id=rid) from None
    proposal: DenseEncoding | SparseEncoding | None = None
    if kind == _KIND_DENSE:
        if dtype >= len(_DTYPES):
            raise ValidationError(f"unknown dtype code {dtype}", field="proposal.dtype", request_id=rid)
        name = _DTYPES[dtype]
        n = s * vocab * ITEMSIZE[name]
        start, off = off, take(off, n, "proposal.data")
        proposal = DenseEncoding(dtype=name, data=take_bytes(view[start:off]))
    elif kind == _KIND_SPARSE:
        if dtype >= len(_DTYPES) or _DTYPES[dtype] == "bf16":
            raise ValidationError(f"unknown value dtype code {dtype}", field="proposal.value_dtype", request_id=rid)
        if fmt >= len(_INDEX_FORMATS):
            raise ValidationError(f"unknown index format code {fmt}", field="proposal.index_format", request_id=rid)
        vname, iname = _DTYPES[dtype], _INDEX_FORMATS[fmt]
        start, off = off, take(off, 12 * s, "proposal.lengths")
        lengths = _fmt("I", s).unpack_from(view, start)
        tail = _fmt("d", s).unpack_from(view, start + 4 * s)
        buckets: tuple[int, ...] = ()
        if iname == "u16":
            nb = s * u16_buckets(vocab)
            start, off = off, take(off, 4 * nb, "proposal.bucket_counts")
            buckets = _fmt("I", nb).unpack_from(view, start)
        off = take(off, -off % 8, "proposal.indices")
        total = sum(lengths)
        if total > s * vocab:
            raise ValidationError(
                f"{total} entries for {s} steps of V={vocab}", field="proposal.lengths", request_id=rid
            )
        start, off = off, take(off, total * (2 if iname == "u16" else 4), "proposal.indices")
        indices = take_bytes(view[start:off])
        start, off = off, take(off, total * ITEMSIZE[vname], "proposal.values")
        proposal = SparseEncoding(
            lengths=lengths,
            indices=indices,
            values=take_bytes(view[start:off]),
            value_dtype=vname,  # type: ignore[arg-type]  # checked against _DTYPES above
            tail_mass=tail if any(tail) else (),
            index_format=iname,  # type: ignore[arg-type]  # checked against _INDEX_FORMATS above
            bucket_counts=buckets,
        )
    elif kind != _KIND_NONE:
        raise ValidationError(f"unknown proposal kind {kind}", field="proposal", request_id=rid)
    if off != end:
        raise ValidationError(f"{end - off} trailing bytes after the proposal", field="proposal", request_id=rid)
    return Payload(
        request_id=rid, draft_tokens=tokens, draft_probs=probs, vocab_size=vocab, provenance=prov, proposal=proposal
    )
