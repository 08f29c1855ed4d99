"""The canonical law of every wire encoding, shared by prefill and decode.

Exactness of a shipped proposal rests on one fact: the prefill draws X from *exactly*
the vector the verifier later receives. Both sides therefore compute that vector with
the functions here and nowhere else:

- :func:`dense_law` for :class:`~pd_middleware.payload.DenseEncoding`: widen to fp32,
  renormalise each step;
- :func:`sparse_law` for :class:`~pd_middleware.payload.SparseEncoding`: widen the
  listed values to fp32, scale them to ``1 - tail_mass``, and give every unlisted token
  ``tail_mass / (V - listed)``.

Both validate what they read (a decode receives it from the network) and raise
:class:`~pd_middleware.ValidationError` naming the field. The normalisation tolerance
is :data:`SUM_TOLERANCE`: the received values must already sum to 1 within it, because
a vector far from normalised is a sign of corruption, not of rounding.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._errors import ValidationError
from .payload import ITEMSIZE, DenseEncoding, SparseEncoding
from .proposal import DenseProposal, SparseProposal

if TYPE_CHECKING:
    import torch

#: Largest allowed |sum - 1| of a received proposal step, by value dtype. 16-bit
#: formats carry 8-11 mantissa bits, so their rounded values may drift by ~2^-9.
SUM_TOLERANCE: dict[str, float] = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 1e-2}


def torch_dtype(name: str) -> "torch.dtype":
    """Map a wire dtype name (``fp32``, ``bf16``, ``fp16``, ``int32``, ``int64``) to torch."""
    import torch

    return {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "int32": torch.int32,
        "int64": torch.int64,
    }[name]


def tensor_from_buffer(buf: bytes | memoryview, dtype: str, *, copy: bool = True) -> "torch.Tensor":
    """A 1-D tensor over ``buf`` of wire dtype ``dtype``.

    With ``copy=False`` and a writable buffer the tensor shares its memory (a view of a
    receive slot); otherwise the bytes are copied once.
    """
    import torch

    n = len(buf) if isinstance(buf, bytes) else buf.nbytes
    if n == 0:
        return torch.empty(0, dtype=torch_dtype(dtype))
    if copy or isinstance(buf, bytes) or buf.readonly:
        buf = bytearray(buf)
    return torch.frombuffer(buf, dtype=torch_dtype(dtype))


def dense_law(
    enc: DenseEncoding, num_steps: int, vocab_size: int, *, request_id: str | None = None, copy: bool = False
) -> DenseProposal:
    """Validate a dense encoding and return its law as a :class:`DenseProposal`.

    ``enc.data`` must hold ``num_steps * vocab_size`` values of ``enc.dtype``; values must
    be finite and non-negative and each step must sum to 1 within
    :data:`SUM_TOLERANCE`. ``probs`` of the result is a view of ``enc.data`` when it is
    writable and ``copy`` is false.
    """
    import torch

    if enc.dtype not in ("fp32", "bf16", "fp16"):
        raise ValidationError(f"unsupported dtype {enc.dtype!r}", field="proposal.dtype", request_id=request_id)
    want = num_steps * vocab_size * ITEMSIZE[enc.dtype]
    if enc.nbytes != want:
        got_w = enc.nbytes / (num_steps * ITEMSIZE[enc.dtype])
        raise ValidationError(
            f"holds {enc.nbytes} bytes, expected {want} ({num_steps} x {vocab_size} {enc.dtype}); "
            f"width {got_w:g} != vocab {vocab_size}",
            field="proposal.data",
            request_id=request_id,
        )
    probs = tensor_from_buffer(enc.data, enc.dtype, copy=copy).view(num_steps, vocab_size)
    wide = probs.float()
    if not bool(torch.isfinite(wide).all()):
        raise ValidationError("contains NaN or inf", field="proposal.data", request_id=request_id)
    if bool((wide < 0).any()):
        raise ValidationError("contains negative values", field="proposal.data", request_id=request_id)
    sums = wide.sum(dim=1)
    tol = SUM_TOLERANCE[enc.dtype]
    bad = (sums - 1.0).abs() > tol
    if bool(bad.any()):
        s = int(bad.nonzero()[0, 0])
        raise ValidationError(
            f"step {s} sums to {float(sums[s]):.6g}, not 1 within {tol:g}",
            field="proposal.data",
            request_id=request_id,
        )
    return DenseProposal(probs=probs, scale=1.0 / sums)


def dense_law_tensor(enc: DenseEncoding, num_steps: int, vocab_size: int) -> "torch.Tensor":
    """(S, V) float32: the exact vector a prefill samples X from for ``enc``."""
    d = dense_law(enc, num_steps, vocab_size, copy=True)
    return d.probs.float() * d.scale.view(-1, 1)


def sparse_law(
    enc: SparseEncoding, num_steps: int, vocab_size: int, *, request_id: str | None = None
) -> SparseProposal:
    """Validate a sparse encoding and return its law as a :class:`SparseProposal`.

    Checks: one length per step, each in ``[1, vocab_size]``; index and value buffers of
    matching size; indices in ``[0, vocab_size)`` and unique within a step; values finite
    and non-negative with a positive sum; ``tail_mass`` empty or one value per step in
    ``[0, 1)``, zero when a step lists the whole vocab; listed sum plus tail mass equal to
    1 within :data:`SUM_TOLERANCE`.
    """
    import torch

    rid = request_id
    lengths = enc.lengths
    if len(lengths) != num_steps:
        raise ValidationError(
            f"has {len(lengths)} steps, expected {num_steps}", field="proposal.lengths", request_id=rid
        )
    for n in lengths:
        if type(n) is not int or not 1 <= n <= vocab_size:
            raise ValidationError(
                f"entry count {n!r} is not an int in [1, {vocab_size}]", field="proposal.lengths", request_id=rid
            )
    if enc.value_dtype not in ("fp32", "fp16"):
        raise ValidationError(
            f"unsupported value dtype {enc.value_dtype!r}", field="proposal.value_dtype", request_id=rid
        )
    total = sum(lengths)
    n_idx = (len(enc.indices) if isinstance(enc.indices, bytes) else enc.indices.nbytes)
    if n_idx != total * 4:
        raise ValidationError(
            f"holds {n_idx} bytes, expected {total} int32 indices", field="proposal.indices", request_id=rid
        )
    n_val = (len(enc.values) if isinstance(enc.values, bytes) else enc.values.nbytes)
    if n_val != total * ITEMSIZE[enc.value_dtype]:
        raise ValidationError(
            f"holds {n_val} bytes, expected {total} {enc.value_dtype} values", field="proposal.values", request_id=rid
        )
    tail = enc.tail_mass or (0.0,) * num_steps
    if len(tail) != num_steps:
        raise ValidationError(
            f"has {len(tail)} entries, expected {num_steps}", field="proposal.tail_mass", request_id=rid
        )
    for s, t in enumerate(tail):
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t < 1.0:
            raise ValidationError(
                f"step {s}: {t!r} is not a probability in [0, 1)", field="proposal.tail_mass", request_id=rid
            )
        if t > 0.0 and lengths[s] == vocab_size:
            raise ValidationError(
                f"step {s} lists the whole vocab but spreads {t} over no token",
                field="proposal.tail_mass",
                request_id=rid,
            )
    idx = tensor_from_buffer(enc.indices, "int32").long()
    if bool(((idx < 0) | (idx >= vocab_size)).any()):
        bad = int(idx[(idx < 0) | (idx >= vocab_size)][0])
        raise ValidationError(
            f"index {bad} is outside [0, {vocab_size})", field="proposal.indices", request_id=rid
        )
    if num_steps == 1:
        key = idx
    else:
        steps = torch.repeat_interleave(torch.arange(num_steps), torch.tensor(lengths))
        key = steps * vocab_size + idx
    if torch.unique(key).numel() != total:
        raise ValidationError("repeats an index within a step", field="proposal.indices", request_id=rid)
    vals = tensor_from_buffer(enc.values, enc.value_dtype).float()
    if not bool(torch.isfinite(vals).all()):
        raise ValidationError("contains NaN or inf", field="proposal.values", request_id=rid)
    if bool((vals < 0).any()):
        raise ValidationError("contains negative values", field="proposal.values", request_id=rid)
    tol = SUM_TOLERANCE[enc.value_dtype]
    if num_steps == 1:
        sums = [float(vals.sum())]
    else:
        sums = torch.zeros(num_steps, dtype=torch.float32).index_add_(0, steps, vals).tolist()
    scales = []
    floors = []
    for s, (m, t) in enumerate(zip(sums, tail)):
        if not m > 0.0:
            raise ValidationError(f"step {s} has no probability mass", field="proposal.values", request_id=rid)
        if abs(m + t - 1.0) > tol:
            raise ValidationError(
                f"step {s}: listed mass {m:.6g} + tail {t:.6g} is not 1 within {tol:g}",
                field="proposal.values",
                request_id=rid,
            )
        scales.append((1.0 - t) / m)
        floors.append(t / (vocab_size - lengths[s]) if t > 0.0 else 0.0)
    if num_steps == 1:
        vals.mul_(scales[0])
    else:
        vals.mul_(torch.tensor(scales, dtype=torch.float32)[steps])
    if not all(math.isfinite(f) for f in floors):  # pragma: no cover - guarded above
        raise ValidationError("non-finite floor", field="proposal.tail_mass", request_id=rid)
    return SparseProposal(lengths=tuple(lengths), indices=idx, values=vals, floor=tuple(floors))
