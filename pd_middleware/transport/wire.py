"""The wire schema: versioned, typed control messages, and frame decoding.

Every control message is one msgpack frame holding a tagged ``msgspec.Struct``
(``kind`` names the message, ``v`` the schema version). Bulk tensors never travel as
msgpack lists: a :class:`TensorRef` says where their raw bytes are, either an extra
ZMQ frame of the same message (``frame >= 1``, *inline*) or a byte range of a receive
slot the decode registered with Mooncake (``frame == 0``, ``slot``/``offset``, *bulk*).

Messages, by direction:

- prefill -> decode: :class:`Hello` (once per connection), :class:`PayloadHeader`
  (per request), :class:`Heartbeat`, :class:`Bye`;
- decode -> prefill: :class:`Grant` (slot registration, answer to hello),
  :class:`Ack` (batched slot-free notices and per-request status),
  :class:`ErrorReply`, :class:`Heartbeat`, :class:`Bye`.

Decoding (:func:`decode_frame`, then :func:`.payload_codec.payload_from_header`) checks the frame size
against :class:`~pd_middleware.transport.config.LimitsConfig` *before* parsing (and,
before any untyped decoding on the error path, the nesting depth: field ``nesting``), then
types (msgspec), version, declared sizes against the limits and against the frames or
slot that hold them, dtypes, shapes and ranges, and finally builds a
:class:`~pd_middleware.core.payload.Payload`, whose constructor validates values. Any
violation raises :class:`~pd_middleware.WireError` with ``.field`` (``draft_probs``,
``hidden.nbytes``, ``proposal.kind``...) and ``.request_id`` when it could be read.

A slot range also carries the slot's generation and a digest of its bytes, stamped by
:func:`.payload_codec.build_header`; the decode checks them against the slot
(:meth:`~pd_middleware.transport.slots.SlotPool.admit`, :mod:`.integrity`) before it
delivers anything.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

from ..core._errors import WireError
from .config import LimitsConfig
from .nesting import MAX_DEPTH, nesting_depth

#: Schema version; a message with another ``v`` is rejected (field ``v``).
WIRE_VERSION = 1

#: Byte alignment of each tensor inside a slot, so fp32 views are aligned.
SLOT_ALIGN = 64

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
TensorDType = Literal["bf16", "fp16", "fp32", "int32", "uint16"]

Buffer = bytes | memoryview
#: ``resolve(slot, offset, nbytes, field, request_id) -> memoryview`` of a slot range,
#: or raises WireError.
SlotResolver = Callable[[int, int, int, str, str], memoryview]


class TensorRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Where one tensor's raw bytes are: an inline frame or a slot range.

    A slot range also carries what ties its bytes to this (authenticated) header: the
    slot's generation and a digest of the bytes (:mod:`.integrity`). ``omit_defaults``:
    an inline reference encodes without them.
    """

    dtype: TensorDType
    shape: tuple[Count, ...]
    nbytes: Count
    # Index of the inline frame holding the bytes (>= 1); 0 = in a slot.
    frame: NonNeg = 0
    # Decode-assigned slot id (when frame == 0).
    slot: Annotated[int, msgspec.Meta(ge=-1)] = -1
    # Byte offset inside the slot.
    offset: NonNeg = 0
    # Slot generation this write belongs to (slot ranges only); fresh for every use of a grant.
    gen: NonNeg = 0
    # Digest of the range's bytes (slot ranges only): 16 bytes xxh3-128 or 32 bytes BLAKE3.
    digest: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


class WireProvenance(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Mirror of :class:`~pd_middleware.core.payload.Provenance`."""

    rule: Literal["greedy", "sampled"]
    temperature: float
    sampled_from: str | None = None


class DenseMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="kind", tag="dense"):
    """A dense proposal: S x V values of ``dtype`` in ``data``."""

    dtype: Literal["fp32", "bf16", "fp16"]
    data: TensorRef


class SparseMeta(
    msgspec.Struct,
    frozen=True,
    forbid_unknown_fields=True,
    kw_only=True,
    omit_defaults=True,
    tag_field="kind",
    tag="sparse",
):
    """A sparse proposal: per-step ``lengths``, ``indices``, ``values``, ``tail_mass``.

    ``indices`` is int32 (``index_format`` "int32") or uint16 low bits with
    ``bucket_counts``, ceil(V / 65536) per step (``"u16"``; see
    :class:`~pd_middleware.core.payload.SparseEncoding`). ``omit_defaults``: an int32 header
    encodes byte for byte as before these two fields existed, so peers that predate
    them still read it; a u16 header carries them and a ``uint16`` index dtype, which
    such a peer rejects (field ``proposal.indices.dtype``) rather than misreading it.
    Hence no version bump.
    """

    lengths: tuple[Count, ...]
    value_dtype: Literal["fp32", "fp16"]
    tail_mass: tuple[float, ...]
    indices: TensorRef
    values: TensorRef
    index_format: Literal["int32", "u16"] = "int32"
    bucket_counts: tuple[Count, ...] = ()


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="kind"):
    """Base of every control message: ``kind`` tag plus schema version ``v``.

    Subclasses inherit ``frozen``; each restates it because type checkers read
    ``frozen`` per class (a dataclass transform) and would call them mutable.
    """

    v: int = WIRE_VERSION


class PayloadHeader(Message, tag="payload", frozen=True):
    """Prefill -> decode, per request: every payload field except bulk bytes."""

    # Sender-local sequence number, echoed in acks.
    seq: NonNeg
    request_id: str
    draft_tokens: tuple[int, ...]
    draft_probs: tuple[float, ...]
    vocab_size: int
    hidden_dtype: Literal["bf16", "fp16", "fp32"]
    hidden: TensorRef | None
    provenance: WireProvenance
    proposal: DenseMeta | SparseMeta | None = None
    # Which life of the request (Payload.life), or None.
    life: NonNeg | None = None


class Hello(Message, tag="hello", frozen=True):
    """Prefill -> decode, once per connection: who I am and how many slots I want."""

    name: str
    want_slots: NonNeg
    # The prefill's Mooncake peer name (informational), None without an engine.
    mooncake: str | None = None
    # Sender's wall clock (time.time()) when it said hello: with HMAC, a hello older or
    # newer than auth.HELLO_FRESH_S is refused (with its nonce, this stops hello replay).
    ts: float = 0.0


class Grant(Message, tag="grant", frozen=True):
    """Decode -> prefill: slot registration (the answer to :class:`Hello`)."""

    # Random id of this decode incarnation; a change means the decode restarted.
    session: str
    # The decode's Mooncake peer name, None when it has no engine (inline only).
    mooncake: str | None
    slot_size: NonNeg
    slots: tuple[NonNeg, ...]
    addrs: tuple[NonNeg, ...]
    heartbeat_s: float
    # Current generation of each granted slot (same order as ``slots``); a header names the next.
    gens: tuple[NonNeg, ...] = ()


class Ack(Message, tag="ack", frozen=True):
    """Decode -> prefill, batched: freed slots and per-request outcomes (by seq)."""

    freed: tuple[NonNeg, ...] = ()
    delivered: tuple[NonNeg, ...] = ()
    # (seq, failure key, reason) per failed request.
    failed: tuple[tuple[NonNeg, str, str], ...] = ()


class ErrorReply(Message, tag="error", frozen=True):
    """Decode -> prefill: a message was rejected and could not be tied to a seq."""

    code: str
    reason: str
    request_id: str | None = None


class Heartbeat(Message, tag="ping", frozen=True):
    """Either direction, when idle; carries the decode session (empty from a prefill)."""

    session: str = ""


class Bye(Message, tag="bye", frozen=True):
    """Either direction: orderly close."""

    reason: str = ""


INBOUND = PayloadHeader | Hello | Heartbeat | Bye
OUTBOUND = Grant | Ack | ErrorReply | Heartbeat | Bye

ENCODER = msgspec.msgpack.Encoder()
INBOUND_DECODER = msgspec.msgpack.Decoder(INBOUND)
OUTBOUND_DECODER = msgspec.msgpack.Decoder(OUTBOUND)
# The error path reads a rejected frame's top level only: values stay undecoded Raw.
_SHALLOW_DECODER = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_RID_DECODER = msgspec.msgpack.Decoder(str)
_V_DECODER = msgspec.msgpack.Decoder(int)

_PATH_RE = re.compile(r"`\$([^`]*)`\s*$")
_NAME_RE = re.compile(r"field `([^`]+)`")
_INDEX_RE = re.compile(r"\[\d+\]")


def encode(msg: Message) -> bytes:
    """Encode one control message to a msgpack frame."""
    return ENCODER.encode(msg)


def _field_of(message: str) -> str:
    """Translate a msgspec error message into a dotted field name (``proposal.lengths``)."""
    m = _PATH_RE.search(message)
    path = _INDEX_RE.sub("", m.group(1)).lstrip(".") if m else ""
    n = _NAME_RE.search(message)
    if n is not None:
        path = f"{path}.{n.group(1)}" if path else n.group(1)
    return path or "message"


def _sniff(frame: bytes | memoryview, limits: LimitsConfig) -> tuple[str | None, object]:
    """Best-effort (request_id, v) from a frame that failed typed decoding (error path only).

    Never raises: the caller has already refused frames nested past MAX_DEPTH, and only
    the top-level map is decoded (its values stay Raw until one is read as str or int).
    """
    try:
        raw = _SHALLOW_DECODER.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None, None
    rid: str | None = None
    v: object = None
    try:
        if "request_id" in raw:
            rid = _RID_DECODER.decode(raw["request_id"])
        if "v" in raw:
            v = _V_DECODER.decode(raw["v"])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        pass
    if rid is not None and not 0 < len(rid) <= limits.max_request_id:
        rid = None
    return rid, v


def _check_nesting(frame: bytes | memoryview) -> None:
    depth = nesting_depth(frame)
    if depth > MAX_DEPTH:
        raise WireError(f"containers nest deeper than {MAX_DEPTH} levels", field="nesting")


def decode_frame(
    frame: bytes | memoryview, limits: LimitsConfig, decoder: msgspec.msgpack.Decoder[Any] = INBOUND_DECODER
) -> Message:
    """Decode one control frame; size is checked before parsing.

    Raises :class:`WireError` naming the field (``message`` for the frame as a whole,
    ``v`` for a version mismatch, ``kind`` for an unknown or misdirected message).
    """
    n = len(frame) if isinstance(frame, bytes) else frame.nbytes
    if n > limits.max_message_bytes:
        raise WireError(
            f"control frame of {n} bytes exceeds max_message_bytes {limits.max_message_bytes}", field="message"
        )
    try:
        msg: Message = decoder.decode(frame)
    except msgspec.ValidationError as exc:
        _check_nesting(frame)
        rid, v = _sniff(frame, limits)
        if v is not None and v != WIRE_VERSION:
            raise WireError(
                f"wire version {v!r} is not supported (expected {WIRE_VERSION})", field="v", request_id=rid
            ) from None
        raise WireError(str(exc), field=_field_of(str(exc)), request_id=rid) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        _check_nesting(frame)
        raise WireError(f"malformed msgpack: {exc}", field="message") from None
    if msg.v != WIRE_VERSION:
        raise WireError(
            f"wire version {msg.v!r} is not supported (expected {WIRE_VERSION})",
            field="v",
            request_id=getattr(msg, "request_id", None),
        )
    return msg
