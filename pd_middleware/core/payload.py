"""The payload: a typed, immutable record of what a prefill node sends per request.

Fields are kept light on purpose (tuples of Python scalars, read-only buffers): the
decode receive path handles tens of thousands of payloads per second, and tensors are
built once per *batch*, not per payload (see ``docs/transport.md``).

Shapes and dtypes, with S = number of draft steps (1 for single-layer EAGLE,
``num_steps`` for a multi-layer chain) and H = hidden size:

- ``draft_tokens``: S token ids (int64 semantics), each in ``[0, vocab_size)``;
- ``draft_probs``: S draft probabilities q(X_s) (fp32 semantics), finite, in ``[0, 1]``;
- ``hidden``: H values of ``hidden_dtype`` (``bf16``, ``fp16`` or ``fp32``) as raw bytes;
- ``proposal``: optional encoded proposal distribution (:class:`DenseEncoding` or
  :class:`SparseEncoding`), per step;
- ``provenance``: how X was drawn, at which temperature and from which encoding.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import msgspec

from ._errors import ValidationError

HiddenDType = Literal["bf16", "fp16", "fp32"]
DraftRule = Literal["greedy", "sampled"]

#: Bytes per element of each wire dtype.
ITEMSIZE: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "int32": 4, "int64": 8, "uint16": 2}

#: Largest allowed |sum - 1| of a received proposal step, by value dtype: a vector far
#: from normalised is a sign of corruption, not of rounding. 16-bit formats carry 8-11
#: mantissa bits, so their rounded values may drift by ~2^-9.
SUM_TOLERANCE: dict[str, float] = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 1e-2}

IndexFormat = Literal["int32", "u16"]
#: Tokens per bucket of the ``u16`` index format: an id is ``U16_BUCKET * block + low``.
U16_BUCKET = 1 << 16


def u16_buckets(vocab_size: int) -> int:
    """Buckets per step of the ``u16`` index format: ceil(V / 65536)."""
    return -(-vocab_size // U16_BUCKET)


def _as_tuple(value: Any, kind: type, field_name: str, request_id: str | None) -> tuple[Any, ...]:
    """Normalise a tensor, ndarray or sequence into a tuple of Python scalars."""
    if isinstance(value, tuple):
        return value
    tolist = getattr(value, "tolist", None)
    if tolist is not None:  # torch.Tensor / numpy.ndarray
        ndim = getattr(value, "ndim", 1)
        if ndim != 1:
            raise ValidationError(
                f"expected a 1-D sequence, got shape {tuple(value.shape)}",
                field=field_name,
                request_id=request_id,
            )
        dtype = str(getattr(value, "dtype", ""))
        if kind is int and "int" not in dtype:
            raise ValidationError(f"expected an integer dtype, got {dtype}", field=field_name, request_id=request_id)
        if kind is float and "float" not in dtype and "bfloat" not in dtype:
            raise ValidationError(f"expected a floating dtype, got {dtype}", field=field_name, request_id=request_id)
        return tuple(tolist())
    if isinstance(value, list):
        return tuple(value)
    raise ValidationError(f"expected a sequence, got {type(value).__name__}", field=field_name, request_id=request_id)


class Provenance(msgspec.Struct, frozen=True):
    """How the prefill drew its draft tokens.

    ``rule`` is ``"greedy"`` (argmax) or ``"sampled"``. ``sampled_from`` names the
    encoding whose decoded distribution X was drawn from (``DenseEncoding.encoding_id``
    or ``SparseEncoding.encoding_id``), or ``None`` when X was drawn from the draft
    model's own softmax, which was not sent. Only when ``sampled_from`` equals the
    attached proposal's ``encoding_id`` may a synthesizer hand that proposal to the
    verifier; otherwise only the one-hot proposal is exact.
    """

    rule: DraftRule = "sampled"
    temperature: float = 1.0
    sampled_from: str | None = None

    def __post_init__(self) -> None:
        if self.rule not in ("greedy", "sampled"):
            raise ValidationError(f"must be 'greedy' or 'sampled', got {self.rule!r}", field="provenance.rule")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValidationError(f"must be a finite number >= 0, got {t!r}", field="provenance.temperature")
        if self.rule == "greedy" and self.sampled_from is not None:
            raise ValidationError(
                "a greedy draft was not sampled from any encoding",
                field="provenance.sampled_from",
            )


class DenseEncoding(msgspec.Struct, frozen=True):
    """A full proposal distribution per step: S x V values of ``dtype``, row-major.

    The distribution it stands for (what a prefill must sample X from) is
    :func:`pd_middleware.sampling.encodings.dense_law`: the values widened to fp32 and
    renormalised per step.
    """

    dtype: Literal["fp32", "bf16", "fp16"]
    data: bytes | memoryview
    kind: ClassVar[str] = "dense"

    def __repr__(self) -> str:
        return f"DenseEncoding(dtype={self.dtype!r}, data=<{self.nbytes} bytes>)"

    @property
    def encoding_id(self) -> str:
        return f"dense-{self.dtype}"

    @property
    def nbytes(self) -> int:
        return len(self.data) if isinstance(self.data, bytes) else self.data.nbytes


class SparseEncoding(msgspec.Struct, frozen=True):
    """A truncated proposal per step, with an optional uniform floor.

    ``lengths[s]`` entries belong to step s; ``indices`` and ``values``
    (``value_dtype``) hold them concatenated over steps. ``tail_mass[s]`` is the
    probability spread uniformly over the tokens step s does not list (0.0 for a plain
    top-k/top-p). The distribution it stands for is
    :func:`pd_middleware.sampling.encodings.sparse_law`.

    ``index_format`` says how ``indices`` holds the token ids:

    - ``"int32"``: one int32 id per entry, in any order (4 B); ``bucket_counts`` empty;
    - ``"u16"``: within each step the entries are sorted by id, strictly ascending;
      ``indices`` holds the low 16 bits of each id as uint16 (2 B) and
      ``bucket_counts`` holds, per step, ``ceil(V / 65536)`` counts (flattened over
      steps): how many of the step's entries fall in each 65536-token block. The id of
      an entry is ``65536 * block + low``.

    The law, and therefore ``encoding_id`` (which the provenance guard compares), does
    not depend on the index format.
    """

    lengths: tuple[int, ...]
    indices: bytes | memoryview
    values: bytes | memoryview
    value_dtype: Literal["fp32", "fp16"] = "fp16"
    tail_mass: tuple[float, ...] = ()
    index_format: IndexFormat = "int32"
    bucket_counts: tuple[int, ...] = ()
    kind: ClassVar[str] = "sparse"

    def __repr__(self) -> str:
        return (
            f"SparseEncoding(lengths={self.lengths!r}, indices=<{_nbytes(self.indices)} bytes {self.index_format}>, "
            f"values=<{_nbytes(self.values)} bytes {self.value_dtype}>, tail_mass={self.tail_mass!r})"
        )

    @property
    def encoding_id(self) -> str:
        return f"sparse-{self.value_dtype}"

    @property
    def index_dtype(self) -> str:
        """Wire dtype of ``indices``: ``int32`` or ``uint16``."""
        return "uint16" if self.index_format == "u16" else "int32"

    @property
    def nbytes(self) -> int:
        """Bytes of the bulk tensors: indices (4 B per entry as int32, 2 B as u16) plus
        values. ``lengths``, ``tail_mass`` and ``bucket_counts`` travel in the control
        header (a few bytes per step), which the wire codec measures."""
        return _nbytes(self.indices) + _nbytes(self.values)


def _nbytes(buf: bytes | memoryview) -> int:
    return len(buf) if isinstance(buf, bytes) else buf.nbytes


EncodedProposal = DenseEncoding | SparseEncoding


class Payload(msgspec.Struct, frozen=True):
    """What a prefill node hands the decode node for one request.

    Construction validates every field; a violation raises
    :class:`~pd_middleware.ValidationError` naming the field and the request id.
    Tensors and ndarrays are accepted for ``draft_tokens``/``draft_probs`` and stored
    as tuples; ``hidden`` is kept as the raw buffer it arrived in (no copy).
    """

    request_id: str
    draft_tokens: tuple[int, ...]
    draft_probs: tuple[float, ...]
    vocab_size: int
    hidden: bytes | memoryview = b""
    hidden_dtype: HiddenDType = "bf16"
    provenance: Provenance = Provenance()
    proposal: EncodedProposal | None = None
    #: Which life of the request this payload is for, or None (one life only). An engine
    #: that serves one request id more than once (SGLang's rebootstrap after a retraction
    #: sends the same room again, with a longer prompt) tells the lives apart by it; the
    #: SGLang drop-in sends the draw's position (the tokens the prefill ran).
    life: int | None = None

    def __post_init__(self) -> None:
        # Written for the receive path (tens of thousands of payloads per second):
        # exact type checks, no helper calls for the common already-a-tuple case.
        rid = self.request_id
        if type(rid) is not str or not rid:
            raise ValidationError(f"must be a non-empty str, got {rid!r}", field="request_id", request_id=None)
        v = self.vocab_size
        if type(v) is not int or v <= 0:
            raise ValidationError(f"must be a positive int, got {v!r}", field="vocab_size", request_id=rid)
        toks = self.draft_tokens
        if type(toks) is not tuple:
            toks = _as_tuple(toks, int, "draft_tokens", rid)
            msgspec.structs.force_setattr(self, "draft_tokens", toks)
        probs = self.draft_probs
        if type(probs) is not tuple:
            probs = _as_tuple(probs, float, "draft_probs", rid)
            msgspec.structs.force_setattr(self, "draft_probs", probs)
        if not toks:
            raise ValidationError("must hold at least one token", field="draft_tokens", request_id=rid)
        if len(probs) != len(toks):
            raise ValidationError(
                f"has {len(probs)} entries for {len(toks)} draft tokens",
                field="draft_probs",
                request_id=rid,
            )
        for t in toks:
            if type(t) is not int or not 0 <= t < v:
                raise ValidationError(f"token id {t!r} is not an int in [0, {v})", field="draft_tokens", request_id=rid)
        for q in probs:
            tq = type(q)
            if tq is not float and tq is not int:
                raise ValidationError(f"{q!r} is not a number", field="draft_probs", request_id=rid)
            if not 0.0 <= q <= 1.0:  # also false for NaN
                raise ValidationError(
                    f"{q!r} is not a finite probability in [0, 1]", field="draft_probs", request_id=rid
                )
        hd = self.hidden_dtype
        size = ITEMSIZE.get(hd) if hd in ("bf16", "fp16", "fp32") else None
        if size is None:
            raise ValidationError(
                f"must be one of bf16, fp16, fp32, got {hd!r}",
                field="hidden_dtype",
                request_id=rid,
            )
        hidden = self.hidden
        th = type(hidden)
        if th is bytes:
            n = len(hidden)
        elif th is memoryview or isinstance(hidden, (bytes, memoryview)):
            n = hidden.nbytes if isinstance(hidden, memoryview) else len(hidden)
        else:
            raise ValidationError(
                f"must be bytes or memoryview, got {type(hidden).__name__}",
                field="hidden",
                request_id=rid,
            )
        if n % size:
            raise ValidationError(
                f"{n} bytes is not a whole number of {hd} values",
                field="hidden",
                request_id=rid,
            )
        if type(self.provenance) is not Provenance:
            raise ValidationError("must be a Provenance", field="provenance", request_id=rid)
        life = self.life
        if life is not None and (type(life) is not int or life < 0):
            raise ValidationError(f"must be None or an int >= 0, got {life!r}", field="life", request_id=rid)
        prop = self.proposal
        if prop is not None and type(prop) is not DenseEncoding and type(prop) is not SparseEncoding:
            raise ValidationError(
                f"must be a DenseEncoding or SparseEncoding, got {type(prop).__name__}",
                field="proposal",
                request_id=rid,
            )

    def __repr__(self) -> str:
        # Bulk buffers are summarised: a payload's repr lands in logs and error messages.
        return (
            f"Payload(request_id={self.request_id!r}, draft_tokens={self.draft_tokens!r}, "
            f"draft_probs={self.draft_probs!r}, vocab_size={self.vocab_size}, "
            f"hidden=<{_nbytes(self.hidden)} bytes {self.hidden_dtype}>, provenance={self.provenance!r}, "
            f"proposal={self.proposal!r}" + ("" if self.life is None else f", life={self.life}") + ")"
        )

    def check_fits(self, vocab_size: int, num_steps: int) -> None:
        """Raise :class:`~pd_middleware.ValidationError` unless this payload was made for
        a deployment with target vocab ``vocab_size`` and ``num_steps`` draft steps.

        The check every synthesizer runs first (field ``vocab_size`` or ``draft_tokens``).
        """
        if self.vocab_size != vocab_size:
            raise ValidationError(
                f"payload vocab {self.vocab_size} != target vocab {vocab_size}",
                field="vocab_size",
                request_id=self.request_id,
            )
        if len(self.draft_tokens) != num_steps:
            raise ValidationError(
                f"{len(self.draft_tokens)} draft tokens, deployment drafts {num_steps} steps",
                field="draft_tokens",
                request_id=self.request_id,
            )

    @property
    def num_steps(self) -> int:
        """S: 1 for single-layer EAGLE, ``num_steps`` for a multi-layer chain."""
        return len(self.draft_tokens)

    @property
    def hidden_size(self) -> int:
        """H, the number of hidden-state values."""
        return _nbytes(self.hidden) // ITEMSIZE[self.hidden_dtype]

    def hidden_tensor(self) -> Any:
        """The hidden state as a (H,) torch tensor of ``hidden_dtype`` (a copy)."""
        from ._buffers import tensor_from_buffer

        return tensor_from_buffer(self.hidden, self.hidden_dtype)
