"""The payload codec: a :class:`~pd_middleware.Payload` to a :class:`~.wire.PayloadHeader`
plus its tensor frames or slot ranges (:func:`build_header`), and back with every check
(:func:`payload_from_header`). The message schema it fills lives in :mod:`.wire`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..core._errors import ValidationError, WireError
from ..core.payload import ITEMSIZE, DenseEncoding, Payload, Provenance, SparseEncoding, u16_buckets
from .config import LimitsConfig
from .wire import (
    SLOT_ALIGN,
    Buffer,
    DenseMeta,
    PayloadHeader,
    SlotResolver,
    SparseMeta,
    TensorRef,
    WireProvenance,
)


def _resolve(
    ref: TensorRef,
    field: str,
    dtype: str,
    shape: tuple[int, ...] | None,
    frames: Sequence[Buffer],
    limits: LimitsConfig,
    resolver: SlotResolver | None,
    rid: str,
) -> tuple[Buffer, int]:
    """Check one descriptor against its expected dtype/shape and the limits; return (bytes, slot)."""
    if ref.dtype != dtype:
        raise WireError(f"dtype {ref.dtype} does not match {dtype}", field=f"{field}.dtype", request_id=rid)
    if shape is not None and ref.shape != shape:
        raise WireError(f"shape {ref.shape} does not match {shape}", field=f"{field}.shape", request_id=rid)
    if shape is None and len(ref.shape) != 1:
        raise WireError(f"shape {ref.shape} is not 1-D", field=f"{field}.shape", request_id=rid)
    want = math.prod(ref.shape) * ITEMSIZE[dtype]
    if ref.nbytes != want:
        raise WireError(
            f"declares {ref.nbytes} bytes for shape {ref.shape} {dtype}", field=f"{field}.nbytes", request_id=rid
        )
    if want > limits.max_tensor_bytes:
        raise WireError(
            f"{want} bytes exceeds max_tensor_bytes {limits.max_tensor_bytes}", field=f"{field}.nbytes", request_id=rid
        )
    if ref.frame:
        if ref.frame >= len(frames):
            raise WireError(
                f"names frame {ref.frame} of a {len(frames)}-frame message", field=f"{field}.frame", request_id=rid
            )
        buf = frames[ref.frame]
        got = len(buf) if isinstance(buf, bytes) else buf.nbytes
        if got != want:
            raise WireError(
                f"frame {ref.frame} holds {got} bytes, declared {want}", field=f"{field}.nbytes", request_id=rid
            )
        return buf, -1
    if resolver is None:
        raise WireError("names a slot but this peer has no slots", field=f"{field}.slot", request_id=rid)
    if ref.offset % SLOT_ALIGN:
        raise WireError(
            f"offset {ref.offset} is not {SLOT_ALIGN}-byte aligned", field=f"{field}.offset", request_id=rid
        )
    return resolver(ref.slot, ref.offset, want, field, rid), ref.slot


def payload_from_header(
    h: PayloadHeader,
    frames: Sequence[Buffer],
    limits: LimitsConfig,
    resolver: SlotResolver | None = None,
) -> tuple[Payload, int]:
    """Build the :class:`Payload` a header describes; return it and its slot id (-1: none).

    ``frames[0]`` is the header frame itself; inline tensors are ``frames[ref.frame]``.
    ``resolver(slot, offset, nbytes, field, request_id)`` returns a zero-copy view of a slot range
    (or raises :class:`WireError`). All bulk tensors of one payload must share one slot.
    """
    rid = h.request_id
    _check_scalars(h, limits)
    slot = -1
    hidden: Buffer = b""
    if h.hidden is not None:
        hidden, slot = _resolve(h.hidden, "hidden", h.hidden_dtype, None, frames, limits, resolver, rid)
    proposal: DenseEncoding | SparseEncoding | None = None
    p = h.proposal
    if isinstance(p, DenseMeta):
        steps, vocab = len(h.draft_tokens), h.vocab_size
        data, s = _resolve(p.data, "proposal.data", p.dtype, (steps, vocab), frames, limits, resolver, rid)
        slot = _same_slot(slot, s, "proposal.data", rid)
        proposal = DenseEncoding(dtype=p.dtype, data=data)
    elif p is not None:
        proposal, slot = _sparse_encoding(h, p, slot, frames, limits, resolver)
    if len(frames) > 1:
        _check_frames_named(h, len(frames), rid)
    try:
        prov = _provenance(h.provenance)
        return (
            Payload(
                request_id=rid,
                draft_tokens=h.draft_tokens,
                draft_probs=h.draft_probs,
                vocab_size=h.vocab_size,
                hidden=hidden,
                hidden_dtype=h.hidden_dtype,
                provenance=prov,
                proposal=proposal,
                life=h.life,
            ),
            slot,
        )
    except ValidationError as exc:
        raise WireError(exc.detail, field=exc.field, request_id=rid) from None


def _check_scalars(h: PayloadHeader, limits: LimitsConfig) -> None:
    """The header's own fields against the limits, before any tensor is resolved:
    request id length, step count, vocab size, the hidden state's dtype and width."""
    rid = h.request_id
    if not 0 < len(rid) <= limits.max_request_id:
        raise WireError(
            f"length {len(rid)} is not in [1, {limits.max_request_id}]", field="request_id", request_id=rid[:64] or None
        )
    steps = len(h.draft_tokens)
    if not 0 < steps <= limits.max_steps:
        raise WireError(f"{steps} steps is not in [1, {limits.max_steps}]", field="draft_tokens", request_id=rid)
    vocab = h.vocab_size
    if not 0 < vocab <= limits.max_vocab:
        raise WireError(f"{vocab} is not in [1, {limits.max_vocab}]", field="vocab_size", request_id=rid)
    # A payload without a hidden state (SGLang's side channel: the engine carries it)
    # passes; one that carries a hidden state carries exactly the configured one.
    if h.hidden is not None and limits.hidden_dtype is not None and h.hidden_dtype != limits.hidden_dtype:
        raise WireError(
            f"{h.hidden_dtype} does not match the configured {limits.hidden_dtype}",
            field="hidden_dtype",
            request_id=rid,
        )
    if limits.hidden_size and h.hidden is not None:
        width = h.hidden.shape[0] if len(h.hidden.shape) == 1 else 0
        if width != limits.hidden_size:
            raise WireError(
                f"{width} elements, the configured hidden_size is {limits.hidden_size}",
                field="hidden.shape",
                request_id=rid,
            )


def _sparse_encoding(
    h: PayloadHeader,
    p: SparseMeta,
    slot: int,
    frames: Sequence[Buffer],
    limits: LimitsConfig,
    resolver: SlotResolver | None,
) -> tuple[SparseEncoding, int]:
    """The header's sparse proposal with its index and value buffers resolved; returns it
    and the payload's slot (``slot``: the hidden state's, -1 for none)."""
    rid, steps, vocab = h.request_id, len(h.draft_tokens), h.vocab_size
    if len(p.lengths) != steps:
        raise WireError(f"has {len(p.lengths)} steps, expected {steps}", field="proposal.lengths", request_id=rid)
    for n in p.lengths:
        if not 1 <= n <= vocab:
            raise WireError(f"entry count {n} is not in [1, {vocab}]", field="proposal.lengths", request_id=rid)
    total = sum(p.lengths)
    _check_buckets(p, vocab, rid)
    _check_tail(p.tail_mass, len(p.lengths), rid)
    idx_dtype = "uint16" if p.index_format == "u16" else "int32"
    idx, s = _resolve(p.indices, "proposal.indices", idx_dtype, (total,), frames, limits, resolver, rid)
    slot = _same_slot(slot, s, "proposal.indices", rid)
    vals, s = _resolve(p.values, "proposal.values", p.value_dtype, (total,), frames, limits, resolver, rid)
    slot = _same_slot(slot, s, "proposal.values", rid)
    enc = SparseEncoding(
        lengths=p.lengths,
        indices=idx,
        values=vals,
        value_dtype=p.value_dtype,
        tail_mass=p.tail_mass,
        index_format=p.index_format,
        bucket_counts=p.bucket_counts,
    )
    return enc, slot


def _check_buckets(p: SparseMeta, vocab: int, rid: str) -> None:
    """Shape of ``bucket_counts``: none for int32; for u16, ceil(V / 65536) per step,
    each step's summing to its length. (Id order and range are the synthesizer's check.)"""
    counts = p.bucket_counts
    if p.index_format != "u16":
        if counts:
            raise WireError(
                f"has {len(counts)} counts, but int32 indices take none", field="proposal.bucket_counts", request_id=rid
            )
        return
    nb = u16_buckets(vocab)
    steps = len(p.lengths)
    if len(counts) != steps * nb:
        raise WireError(
            f"has {len(counts)} counts, expected {steps} steps x {nb} buckets = {steps * nb}",
            field="proposal.bucket_counts",
            request_id=rid,
        )
    for s, n in enumerate(p.lengths):
        got = sum(counts[s * nb : (s + 1) * nb])
        if got != n:
            raise WireError(
                f"step {s}: counts sum to {got}, but the step lists {n} entries",
                field="proposal.bucket_counts",
                request_id=rid,
            )


_PROVENANCE: dict[WireProvenance, Provenance] = {}


def _provenance(pv: WireProvenance) -> Provenance:
    """The (immutable, validated) Provenance for ``pv``, cached: senders reuse a handful."""
    prov = _PROVENANCE.get(pv)
    if prov is None:
        prov = Provenance(rule=pv.rule, temperature=pv.temperature, sampled_from=pv.sampled_from)
        if len(_PROVENANCE) >= 256:  # bounded: a hostile sender cannot grow it
            _PROVENANCE.clear()
        _PROVENANCE[pv] = prov
    return prov


def _check_frames_named(h: PayloadHeader, n_frames: int, rid: str) -> None:
    """Every inline frame after the header is named by exactly one TensorRef.

    An unnamed or doubly named frame means the sender and the header disagree; it is
    refused rather than silently ignored (or read twice).
    """
    p = h.proposal
    if p is None and n_frames == 2 and h.hidden is not None and h.hidden.frame == 1:
        return  # the common case: one inline hidden state, correctly named
    refs: list[TensorRef | None] = [h.hidden]
    if isinstance(p, DenseMeta):
        refs.append(p.data)
    elif p is not None:
        refs += [p.indices, p.values]
    named = sorted(r.frame for r in refs if r is not None and r.frame)
    if named != list(range(1, n_frames)):
        raise WireError(
            f"the message has {n_frames - 1} tensor frame(s) but its header names frames {named}",
            field="frames",
            request_id=rid,
        )


def slot_refs(h: PayloadHeader) -> list[tuple[str, TensorRef]]:
    """``(field, ref)`` of every slot range a (decoded) header names, in header order."""
    p = h.proposal
    refs: list[tuple[str, TensorRef | None]] = [("hidden", h.hidden)]
    if isinstance(p, DenseMeta):
        refs.append(("proposal.data", p.data))
    elif p is not None:
        refs += [("proposal.indices", p.indices), ("proposal.values", p.values)]
    return [(f, r) for f, r in refs if r is not None and r.frame == 0]


def named_slot(h: PayloadHeader) -> int:
    """The first slot a (possibly invalid) header names, or -1 (the one slot-naming rule)."""
    for _, r in slot_refs(h):
        if r.slot >= 0:
            return r.slot
    return -1


def _same_slot(a: int, b: int, field: str, rid: str) -> int:
    if a != -1 and b != -1 and a != b:
        raise WireError(
            f"names slot {b}, but this payload's other tensors are in slot {a}", field=f"{field}.slot", request_id=rid
        )
    return b if a == -1 else a


def _nbytes(buf: Buffer) -> int:
    return len(buf) if isinstance(buf, bytes) else buf.nbytes


def _aligned(n: int) -> int:
    return (n + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def bulk_bytes(payload: Payload) -> int:
    """Bytes a payload's bulk tensors occupy in a slot (with alignment padding)."""
    total = _aligned(_nbytes(payload.hidden))
    p = payload.proposal
    if p is not None:
        if isinstance(p, DenseEncoding):
            total += _aligned(_nbytes(p.data))
        else:
            total += _aligned(_nbytes(p.indices)) + _aligned(_nbytes(p.values))
    return total


def _check_tail(tail: tuple[float, ...], steps: int, rid: str) -> None:
    """``tail_mass``: empty, or one probability in [0, 1) per step (NaN and infinities are not).

    Checked here, on the wire, so that no synthesizer that ignores the proposal lets it
    through; what the tail means for the law (:mod:`pd_middleware.sampling.sparse_law`) is checked there.
    """
    if tail and len(tail) != steps:
        raise WireError(
            f"has {len(tail)} entries, expected {steps} (or none)", field="proposal.tail_mass", request_id=rid
        )
    for s, t in enumerate(tail):
        if not 0.0 <= t < 1.0:  # False for NaN: refused
            raise WireError(
                f"step {s}: {t!r} is not a probability in [0, 1)", field="proposal.tail_mass", request_id=rid
            )


def build_header(
    payload: Payload,
    seq: int,
    slot: int = -1,
    *,
    gen: int = 0,
    digest: Callable[[str, int, int, int, Buffer], bytes] | None = None,
) -> tuple[PayloadHeader, list[tuple[Buffer, int]]]:
    """Describe ``payload`` on the wire.

    With ``slot == -1`` the tensors go inline: returns the header and the extra frames
    as ``(buffer, -1)`` in frame order. Otherwise they go into ``slot``: returns
    ``(buffer, offset)`` pairs, offsets ``SLOT_ALIGN``-aligned and packed so that the
    padded ranges are contiguous (one Mooncake transfer); each range carries ``gen`` and
    ``digest(request_id, slot, gen, offset, buffer)`` (an :class:`~.integrity.Binder`: the
    decode refuses a slot range without a matching digest).
    """
    parts: list[tuple[Buffer, int]] = []
    cursor = 0

    def ref(buf: Buffer, dtype: str, shape: tuple[int, ...]) -> TensorRef:
        nonlocal cursor
        n = _nbytes(buf)
        if slot < 0:
            parts.append((buf, -1))
            return TensorRef(dtype=dtype, shape=shape, nbytes=n, frame=len(parts))  # type: ignore[arg-type]  # dtype: a wire dtype name, checked on decode
        off = cursor
        cursor += _aligned(n)
        parts.append((buf, off))
        d = digest(payload.request_id, slot, gen, off, buf) if digest is not None else b""
        return TensorRef(dtype=dtype, shape=shape, nbytes=n, slot=slot, offset=off, gen=gen, digest=d)  # type: ignore[arg-type]  # dtype: a wire dtype name, checked on decode

    steps = len(payload.draft_tokens)
    hidden = None
    if _nbytes(payload.hidden):
        hidden = ref(payload.hidden, payload.hidden_dtype, (_nbytes(payload.hidden) // ITEMSIZE[payload.hidden_dtype],))
    p = payload.proposal
    meta: DenseMeta | SparseMeta | None = None
    if isinstance(p, DenseEncoding):
        meta = DenseMeta(dtype=p.dtype, data=ref(p.data, p.dtype, (steps, payload.vocab_size)))
    elif isinstance(p, SparseEncoding):
        total = sum(p.lengths)
        meta = SparseMeta(
            lengths=p.lengths,
            value_dtype=p.value_dtype,
            tail_mass=tuple(p.tail_mass),
            indices=ref(p.indices, p.index_dtype, (total,)),
            values=ref(p.values, p.value_dtype, (total,)),
            index_format=p.index_format,
            bucket_counts=tuple(p.bucket_counts),
        )
    pv = payload.provenance
    header = PayloadHeader(
        seq=seq,
        request_id=payload.request_id,
        draft_tokens=payload.draft_tokens,
        draft_probs=payload.draft_probs,
        vocab_size=payload.vocab_size,
        hidden_dtype=payload.hidden_dtype,
        hidden=hidden,
        provenance=WireProvenance(rule=pv.rule, temperature=pv.temperature, sampled_from=pv.sampled_from),
        proposal=meta,
        life=payload.life,
    )
    return header, parts
