"""Trace files: payloads recorded by the ``record`` hook, and the ``trace`` workload.

Format ``pd-middleware-trace`` version 1 (``docs/workloads.md``): a sequence of frames,
each a little-endian uint32 byte count followed by that many bytes of one msgpack map.
Never pickle. Every map has a ``kind``:

- ``header``: ``format``, ``version``, ``created_unix``, ``meta`` (str -> str); opens a
  segment. Appending to an existing file starts a new segment with its own header;
- ``payload``: ``seq`` and every :class:`~pd_middleware.core.payload.Payload` field, tensors
  as raw bytes (``hidden``, the encoded ``proposal``; a sparse proposal's
  ``index_format`` and ``bucket_counts`` are written only when not the int32
  defaults), plus the receive context (``arm``,
  ``peer``, ``received_at``) and an optional ``target`` tensor (dtype, shape, bytes);
- ``end``: ``records`` written in the segment; closes it.

The writer only appends and never seeks back; it flushes on :meth:`TraceWriter.close`
(and :meth:`~TraceWriter.flush`). The reader checks format and version of every
segment, the framing, and each payload (by constructing it).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, Literal

import msgspec

from ..core._errors import OptionValueError, PDMiddlewareError, WireError
from ..core.payload import DenseEncoding, Payload, Provenance, SparseEncoding
from . import WorkloadBatch

if TYPE_CHECKING:
    import torch

FORMAT = "pd-middleware-trace"
VERSION = 1
#: Largest frame accepted: a (S+1, V) fp32 target at V = 152064 is 2.4 MB.
MAX_FRAME = 256 << 20
_LEN = struct.Struct("<I")


class TraceError(WireError):
    """A trace file is malformed; ``.path`` is the file, ``.offset`` the frame's byte offset."""

    def __init__(self, message: str, *, path: str, offset: int | None = None, field: str = "trace") -> None:
        self.field = field
        self.request_id = None
        self.path = path
        self.offset = offset
        self.detail = message
        at = f" at byte {offset}" if offset is not None else ""
        # Skips ValidationError's "request ...: field ..." prefix: a file has no request.
        PDMiddlewareError.__init__(self, f"trace {path}{at}: {message}")


class _Struct(msgspec.Struct, forbid_unknown_fields=True, tag_field="kind"):
    pass


class TraceHeader(_Struct, tag="header"):
    format: str
    version: int
    created_unix: float
    meta: dict[str, str] = {}


class ProvenanceRecord(msgspec.Struct, forbid_unknown_fields=True):
    rule: str
    temperature: float
    sampled_from: str | None


class DenseRecord(_Struct, tag="dense"):
    dtype: str
    data: bytes


class SparseRecord(_Struct, tag="sparse", omit_defaults=True):
    lengths: tuple[int, ...]
    indices: bytes
    values: bytes
    value_dtype: str
    tail_mass: tuple[float, ...]
    # Added within version 1 (omitted when default, so int32 records are unchanged and
    # older readers still read them; a u16 record makes an older reader fail loudly on
    # the unknown field instead of misreading its indices).
    index_format: str = "int32"
    bucket_counts: tuple[int, ...] = ()


class TensorRecord(msgspec.Struct, forbid_unknown_fields=True):
    dtype: Literal["fp32"]
    shape: tuple[int, ...]
    data: bytes


class PayloadRecord(_Struct, tag="payload"):
    seq: int
    request_id: str
    draft_tokens: tuple[int, ...]
    draft_probs: tuple[float, ...]
    vocab_size: int
    hidden: bytes
    hidden_dtype: str
    provenance: ProvenanceRecord
    proposal: DenseRecord | SparseRecord | None = None
    arm: str | None = None
    peer: str | None = None
    received_at: float | None = None
    target: TensorRecord | None = None


class TraceEnd(_Struct, tag="end"):
    records: int


_Record = TraceHeader | PayloadRecord | TraceEnd
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Record)


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One recorded payload: the payload, its receive context, and the target if recorded.

    ``target``: float32 (S+1, V) or None.
    """

    seq: int
    payload: Payload
    arm: str | None = None
    peer: str | None = None
    received_at: float | None = None
    target: torch.Tensor | None = None


def _proposal_record(p: Any) -> DenseRecord | SparseRecord | None:
    if p is None:
        return None
    if isinstance(p, DenseEncoding):
        return DenseRecord(dtype=p.dtype, data=bytes(p.data))
    return SparseRecord(
        lengths=tuple(p.lengths),
        indices=bytes(p.indices),
        values=bytes(p.values),
        value_dtype=p.value_dtype,
        tail_mass=tuple(p.tail_mass),
        index_format=p.index_format,
        bucket_counts=tuple(p.bucket_counts),
    )


class TraceWriter:
    """Appends payload records to a trace file (see the module docstring).

    ``mode``: ``"append"`` adds a segment to an existing file (refusing one whose last
    frame is cut short) or creates it; ``"create"`` fails if the file exists. Safe to
    call from several threads; :meth:`close` is idempotent.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        meta: dict[str, str] | None = None,
        mode: Literal["append", "create"] = "append",
    ) -> None:
        self.path = os.fspath(path)
        if mode == "append" and os.path.exists(self.path):
            _check_tail(self.path)
        try:
            self._fh: BinaryIO | None = open(self.path, "ab" if mode == "append" else "xb")  # noqa: SIM115  # owned by the writer; close() closes it
        except FileExistsError:
            raise TraceError("already exists and mode is 'create'", path=self.path) from None
        except OSError as exc:
            raise TraceError(f"cannot open for writing: {exc.strerror}", path=self.path) from None
        self._lock = threading.Lock()
        self.records = 0
        self._write(TraceHeader(format=FORMAT, version=VERSION, created_unix=time.time(), meta=dict(meta or {})))

    def _write(self, rec: _Record) -> None:
        data = _ENCODER.encode(rec)
        if self._fh is None:
            raise TraceError("writer is closed", path=self.path)
        self._fh.write(_LEN.pack(len(data)))
        self._fh.write(data)

    def write(
        self,
        payload: Payload,
        *,
        target: torch.Tensor | None = None,
        arm: str | None = None,
        peer: str | None = None,
        received_at: float | None = None,
    ) -> None:
        """Append one payload (and optionally its float (S+1, V) target distribution)."""
        tgt = None
        if target is not None:
            t = target.detach().to("cpu").float().contiguous()
            tgt = TensorRecord(dtype="fp32", shape=tuple(t.shape), data=t.numpy().tobytes())
        pv = payload.provenance
        with self._lock:
            rec = PayloadRecord(
                seq=self.records,
                request_id=payload.request_id,
                draft_tokens=payload.draft_tokens,
                draft_probs=tuple(float(v) for v in payload.draft_probs),
                vocab_size=payload.vocab_size,
                hidden=bytes(payload.hidden),
                hidden_dtype=payload.hidden_dtype,
                provenance=ProvenanceRecord(
                    rule=pv.rule, temperature=float(pv.temperature), sampled_from=pv.sampled_from
                ),
                proposal=_proposal_record(payload.proposal),
                arm=arm,
                peer=peer,
                received_at=received_at,
                target=tgt,
            )
            self._write(rec)
            self.records += 1

    def flush(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.flush()

    def close(self) -> None:
        """Write the segment's ``end`` record, flush and close."""
        with self._lock:
            if self._fh is None:
                return
            self._write(TraceEnd(records=self.records))
            fh, self._fh = self._fh, None
            fh.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _frames(fh: BinaryIO, path: str) -> Iterator[tuple[int, bytes | None]]:
    """(offset, frame bytes); bytes is None for a frame cut short at the end of the file."""
    offset = 0
    while True:
        head = fh.read(4)
        if not head:
            return
        if len(head) < 4:
            yield offset, None
            return
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise TraceError(f"frame of {n} bytes exceeds the {MAX_FRAME}-byte limit", path=path, offset=offset)
        data = fh.read(n)
        if len(data) < n:
            yield offset, None
            return
        yield offset, data
        offset += 4 + n


def _check_tail(path: str) -> None:
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        offset = 0
        while offset < size:
            fh.seek(offset)
            head = fh.read(4)
            n = _LEN.unpack(head)[0] if len(head) == 4 else size
            if offset + 4 + n > size:
                raise TraceError("ends with a partial frame; refusing to append after it", path=path, offset=offset)
            offset += 4 + n


def _payload(rec: PayloadRecord) -> Payload:
    prop: DenseEncoding | SparseEncoding | None = None
    if isinstance(rec.proposal, DenseRecord):
        # Trace records keep dtypes and rules as str (the trace format is older than the
        # Literal types); the payload structs check each value and name the field.
        prop = DenseEncoding(dtype=rec.proposal.dtype, data=rec.proposal.data)  # type: ignore[arg-type]  # checked by DenseEncoding
    elif isinstance(rec.proposal, SparseRecord):
        r = rec.proposal
        prop = SparseEncoding(
            lengths=r.lengths,
            indices=r.indices,
            values=r.values,
            value_dtype=r.value_dtype,  # type: ignore[arg-type]  # str, checked by SparseEncoding
            tail_mass=r.tail_mass,
            index_format=r.index_format,  # type: ignore[arg-type]  # str, checked by SparseEncoding
            bucket_counts=r.bucket_counts,
        )
    pv = rec.provenance
    return Payload(
        request_id=rec.request_id,
        draft_tokens=rec.draft_tokens,
        draft_probs=rec.draft_probs,
        vocab_size=rec.vocab_size,
        hidden=rec.hidden,
        hidden_dtype=rec.hidden_dtype,  # type: ignore[arg-type]  # str, checked by Payload
        provenance=Provenance(
            rule=pv.rule,  # type: ignore[arg-type]  # str, checked by Provenance
            temperature=pv.temperature,
            sampled_from=pv.sampled_from,
        ),
        proposal=prop,
    )


def read_trace(path: str | os.PathLike[str], *, allow_truncated: bool = False) -> Generator[TraceEntry, None, None]:
    """Yield every recorded payload of every segment, in file order.

    A frame cut short at the end, or a segment without its ``end`` record (a writer that
    crashed), is a :class:`TraceError` unless ``allow_truncated``.
    """
    import torch

    p = os.fspath(path)
    header: TraceHeader | None = None
    count = 0
    with open(p, "rb") as fh:
        for offset, data in _frames(fh, p):
            if data is None:
                if allow_truncated:
                    return
                raise TraceError("ends with a partial frame (writer interrupted?)", path=p, offset=offset)
            try:
                rec = _DECODER.decode(data)
            except msgspec.DecodeError as exc:
                raise TraceError(f"bad record: {exc}", path=p, offset=offset) from None
            if isinstance(rec, TraceHeader):
                if header is not None and not allow_truncated:
                    raise TraceError("segment has no end record (writer crashed?)", path=p, offset=offset)
                if rec.format != FORMAT:
                    raise TraceError(f"format {rec.format!r} is not {FORMAT!r}", path=p, offset=offset, field="format")
                if rec.version != VERSION:
                    raise TraceError(
                        f"version {rec.version} is not supported (reader speaks {VERSION})",
                        path=p,
                        offset=offset,
                        field="version",
                    )
                header, count = rec, 0
                continue
            if header is None:
                raise TraceError(f"{type(rec).__name__} record before any header", path=p, offset=offset)
            if isinstance(rec, TraceEnd):
                if rec.records != count:
                    raise TraceError(
                        f"end record counts {rec.records} payloads, segment holds {count}",
                        path=p,
                        offset=offset,
                        field="records",
                    )
                header = None
                continue
            count += 1
            target = None
            if rec.target is not None:
                t = rec.target
                target = torch.frombuffer(bytearray(t.data), dtype=torch.float32).view(t.shape)
            yield TraceEntry(rec.seq, _payload(rec), rec.arm, rec.peer, rec.received_at, target)
    if header is not None and not allow_truncated:
        raise TraceError("last segment has no end record (writer not closed?)", path=p)


class TraceOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``trace`` workload."""

    # Trace file written by the ``record`` hook (or TraceWriter).
    path: str
    # Accept a trace whose writer did not close it cleanly.
    allow_truncated: bool = False

    def __post_init__(self) -> None:
        if not self.path:
            raise OptionValueError("path", "must name a trace file")


class TraceWorkload:
    """Replays a trace in file order. ``seed`` is ignored: a trace is already fixed.

    :meth:`payloads` yields every recorded payload. :meth:`batches` needs records that
    carry a ``target`` and an encoded ``proposal`` (the draft distribution, through
    :mod:`pd_middleware.sampling.encodings`); rows condition on the recorded draft tokens.
    """

    name = "trace"

    def __init__(self, options: TraceOptions) -> None:
        self.options = options
        entries = self.payloads()
        first = next(entries, None)
        entries.close()
        if first is None:
            raise TraceError("holds no payload records", path=options.path)
        self.vocab_size = first.payload.vocab_size
        self.num_steps = first.payload.num_steps

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "options": msgspec.structs.asdict(self.options)}

    def payloads(self) -> Generator[TraceEntry, None, None]:
        return read_trace(self.options.path, allow_truncated=self.options.allow_truncated)

    def batches(self, n_requests: int, batch_size: int, seed: int) -> Iterator[WorkloadBatch]:
        """Batches of the first ``n_requests`` records (fewer if the trace is shorter)."""
        import torch

        from ..sampling.encodings import dense_law_tensor, sparse_law

        def flush(entries: list[TraceEntry]) -> WorkloadBatch:
            return WorkloadBatch(
                request_ids=tuple(e.payload.request_id for e in entries),
                target_probs=torch.stack([e.target for e in entries]),  # type: ignore[misc]  # targets checked present before flush
                draft_probs=torch.stack([_law(e) for e in entries]),
                prefix=torch.tensor([e.payload.draft_tokens for e in entries], dtype=torch.int64),
            )

        def _law(e: TraceEntry) -> torch.Tensor:
            pl, s, v = e.payload, e.payload.num_steps, e.payload.vocab_size
            if isinstance(pl.proposal, DenseEncoding):
                return dense_law_tensor(pl.proposal, s, v)
            return sparse_law(pl.proposal, s, v, request_id=pl.request_id).to_dense(v)  # type: ignore[arg-type]  # proposal checked present; not dense, so sparse

        buf: list[TraceEntry] = []
        for i, e in enumerate(self.payloads()):
            if i >= n_requests:
                break
            pl = e.payload
            missing = "target" if e.target is None else "proposal" if pl.proposal is None else None
            if missing:
                raise TraceError(
                    f"record {e.seq} ({pl.request_id}) has no {missing}; only payloads() can replay it",
                    path=self.options.path,
                    field=missing,
                )
            if (pl.vocab_size, pl.num_steps) != (self.vocab_size, self.num_steps):
                raise TraceError(
                    f"record {e.seq} has V={pl.vocab_size}, S={pl.num_steps}; the trace started "
                    f"with V={self.vocab_size}, S={self.num_steps}",
                    path=self.options.path,
                )
            want = (self.num_steps + 1, self.vocab_size)
            got = tuple(e.target.shape)  # type: ignore[union-attr]  # missing target raised above
            if got != want:
                raise TraceError(
                    f"record {e.seq} has a target of shape {got}, expected {want}",
                    path=self.options.path,
                    field="target",
                )
            buf.append(e)
            if len(buf) == batch_size:
                yield flush(buf)
                buf = []
        if buf:
            yield flush(buf)
