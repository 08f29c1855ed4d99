"""The canonical law of every wire encoding, shared by prefill and decode.

Exactness of a shipped proposal rests on one fact: the prefill draws X from *exactly*
the vector the verifier later receives. Both sides therefore compute that vector with
the functions here and nowhere else:

- :func:`dense_law` for :class:`~pd_middleware.payload.DenseEncoding`: widen to fp32,
  renormalise each step;
- :func:`sparse_law` for :class:`~pd_middleware.payload.SparseEncoding`: decode the
  token ids (int32, or u16 low bits plus per-step bucket counts), widen the listed
  values to fp32, scale them to ``1 - tail_mass``, and give every unlisted token
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
from .payload import ITEMSIZE, U16_BUCKET, DenseEncoding, SparseEncoding, u16_buckets
from .proposal import DenseProposal, SparseProposal

if TYPE_CHECKING:
    import torch

#: Largest allowed |sum - 1| of a received proposal step, by value dtype. 16-bit
#: formats carry 8-11 mantissa bits, so their rounded values may drift by ~2^-9.
SUM_TOLERANCE: dict[str, float] = {"fp32": 1e-3, "fp16": 1e-2, "bf16": 1e-2}


def torch_dtype(name: str) -> "torch.dtype":
    """Map a wire dtype name (``fp32``, ``bf16``, ``fp16``, ``int32``, ``int64``, ``uint16``) to torch."""
    import torch

    return {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "int32": torch.int32,
        "int64": torch.int64,
        "uint16": torch.uint16,
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
    1 within :data:`SUM_TOLERANCE`. For ``index_format == "u16"`` also: ``bucket_counts``
    holds ``ceil(V / 65536)`` non-negative counts per step summing to that step's length,
    and the decoded ids are strictly ascending within each step (which proves them
    unique). The result's ``indices`` are int64 ids in the encoding's entry order.
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
    if enc.index_format not in ("int32", "u16"):
        raise ValidationError(
            f"unsupported index format {enc.index_format!r}", field="proposal.index_format", request_id=rid
        )
    u16 = enc.index_format == "u16"
    if not u16 and enc.bucket_counts:
        raise ValidationError(
            f"has {len(enc.bucket_counts)} counts, but int32 indices take none",
            field="proposal.bucket_counts",
            request_id=rid,
        )
    total = sum(lengths)
    n_idx = (len(enc.indices) if isinstance(enc.indices, bytes) else enc.indices.nbytes)
    if n_idx != total * (2 if u16 else 4):
        raise ValidationError(
            f"holds {n_idx} bytes, expected {total} {'u16' if u16 else 'int32'} indices",
            field="proposal.indices",
            request_id=rid,
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
    if u16:
        idx, steps = _u16_ids(enc, lengths, vocab_size, rid)
    else:
        idx = tensor_from_buffer(enc.indices, "int32").long()
        if bool(((idx < 0) | (idx >= vocab_size)).any()):
            bad = int(idx[(idx < 0) | (idx >= vocab_size)][0])
            raise ValidationError(
                f"index {bad} is outside [0, {vocab_size})", field="proposal.indices", request_id=rid
            )
        if num_steps == 1:
            key = idx
        else:
            # Step id of each entry. searchsorted, not repeat_interleave: the latter costs
            # milliseconds per call on CPU builds of torch 2.13, even for a few entries.
            steps = torch.searchsorted(torch.tensor(lengths).cumsum(0), torch.arange(total), right=True)
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


def _u16_ids(
    enc: SparseEncoding, lengths: tuple[int, ...], vocab_size: int, rid: str | None
) -> "tuple[torch.Tensor, torch.Tensor]":
    """Decode and check u16 indices: (ids int64 (total,), step of each entry int64 (total,)).

    Entry j lies in flat bucket b = the first b with cumsum(bucket_counts)[b] > j
    (``searchsorted``: no Python loop over entries, no ``repeat_interleave``); its step
    is b // nb and its id 65536 * (b % nb) + low. Because each step's counts sum to its
    length, the flat buckets are non-decreasing over the entries, so one comparison of
    consecutive (bucket, low) keys checks that ids ascend strictly within every step.
    """
    import torch

    nb = u16_buckets(vocab_size)
    counts = enc.bucket_counts
    steps_n = len(lengths)
    if len(counts) != steps_n * nb:
        raise ValidationError(
            f"has {len(counts)} counts, expected {steps_n} steps x {nb} buckets of {U16_BUCKET} tokens "
            f"= {steps_n * nb}",
            field="proposal.bucket_counts",
            request_id=rid,
        )
    for c in counts:
        if type(c) is not int or c < 0:
            raise ValidationError(f"count {c!r} is not an int >= 0", field="proposal.bucket_counts", request_id=rid)
    for s, n in enumerate(lengths):
        got = sum(counts[s * nb : (s + 1) * nb])
        if got != n:
            raise ValidationError(
                f"step {s}: counts sum to {got}, but the step lists {n} entries",
                field="proposal.bucket_counts",
                request_id=rid,
            )
    total = sum(lengths)
    low = tensor_from_buffer(enc.indices, "uint16").long()
    bucket = torch.searchsorted(torch.tensor(counts, dtype=torch.int64).cumsum(0), torch.arange(total), right=True)
    key = bucket * U16_BUCKET + low
    if total > 1:
        down = key[1:] <= key[:-1]
        # At a step boundary the flat bucket jumps into the next step's range, so the
        # key still rises there: a drop can only occur inside one step.
        if bool(down.any()):
            j = int(down.nonzero()[0, 0]) + 1
            s = int(bucket[j]) // nb
            raise ValidationError(
                f"step {s}: ids are not strictly ascending (entry {j}: id "
                f"{int(key[j]) - s * nb * U16_BUCKET} after {int(key[j - 1]) - s * nb * U16_BUCKET})",
                field="proposal.indices",
                request_id=rid,
            )
    steps = bucket // nb
    idx = key - steps * (nb * U16_BUCKET)
    over = idx >= vocab_size
    if bool(over.any()):
        j = int(over.nonzero()[0, 0])
        raise ValidationError(
            f"index {int(idx[j])} is outside [0, {vocab_size})", field="proposal.indices", request_id=rid
        )
    return idx, steps


def sparse_law_tensor(enc: SparseEncoding, num_steps: int, vocab_size: int) -> "torch.Tensor":
    """(S, V) float32: the exact vector a prefill samples X from for ``enc``.

    Bit for bit what the assembler writes for :func:`sparse_law`'s proposal: every
    unlisted token holds the fp32 floor, every listed one its fp32 value.
    """
    return sparse_law(enc, num_steps, vocab_size).to_dense(vocab_size)


def sample_law(law: "torch.Tensor", generator: "torch.Generator | None" = None) -> "torch.Tensor":
    """Draw one token per row of ``law`` (float (N, V), non-negative, rows with mass).

    Row i yields token j with probability ``law[i, j] / law[i].sum()``, computed in
    float64 by inverse CDF (:func:`pd_middleware.verify.sample_categorical`), so a
    zero-mass token is never drawn. Uniforms come from ``generator`` (on its device).
    Returns int64 (N,) on ``law.device``.
    """
    import torch

    from .verify import sample_categorical

    n = law.shape[0]
    gdev = generator.device if generator is not None else law.device
    u = torch.rand(n, dtype=torch.float64, generator=generator, device=gdev).to(law.device)
    return sample_categorical(law.double(), u)


def encoder_input(probs: "torch.Tensor", *, tolerance: float = 1e-3) -> "torch.Tensor":
    """Check an encoder's input and return it as float (B, S, V) (a view when possible).

    ``probs``: (B, V) or (B, S, V) floating draft probabilities after temperature:
    finite, non-negative, each row summing to 1 within ``tolerance``. Raises
    :class:`~pd_middleware.ValidationError` with field ``probs``.
    """
    import torch

    if not isinstance(probs, torch.Tensor) or not probs.dtype.is_floating_point:
        raise ValidationError(f"must be a floating torch.Tensor, got {type(probs).__name__}", field="probs")
    if probs.dim() == 2:
        probs = probs.unsqueeze(1)
    if probs.dim() != 3 or 0 in probs.shape:
        raise ValidationError(f"expected shape (B, V) or (B, S, V), got {tuple(probs.shape)}", field="probs")
    # NaN fails both comparisons; inf fails the second.
    if not bool(((probs >= 0) & (probs <= 1)).all()):
        raise ValidationError("contains NaN, inf or values outside [0, 1]", field="probs")
    sums = probs.float().sum(dim=-1).double()
    bad = (sums - 1.0).abs() > tolerance
    if bool(bad.any()):
        b, s = (int(i) for i in bad.nonzero()[0])
        raise ValidationError(
            f"row ({b}, {s}) sums to {float(sums[b, s]):.6g}, not 1 within {tolerance:g}", field="probs"
        )
    return probs


def sample_sparse_law(
    laws: "list[SparseProposal]", vocab_size: int, generator: "torch.Generator | None" = None
) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Draw one token per step of each sparse law, without building V-wide rows.

    The row a step stands for is what the assembler writes: ``values`` at ``indices``
    and the fp32 ``floor`` on every other token. One float64 uniform per step picks,
    by inverse CDF over [listed entries, unlisted tokens in ascending order], either a
    listed entry (zero values are never picked) or the j-th unlisted token.
    Returns (tokens int64 (N,), their fp32 values in the row float32 (N,)), N = total
    steps, in order. Cost grows with the listed entries, not with V.
    """
    import torch

    lengths = torch.tensor([n for p in laws for n in p.lengths], dtype=torch.int64)
    n = lengths.numel()
    kmax = int(lengths.max())
    floor32 = torch.tensor([f for p in laws for f in p.floor], dtype=torch.float32)
    rows = torch.searchsorted(lengths.cumsum(0), torch.arange(int(lengths.sum())), right=True)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(rows.numel()) - starts[rows]
    idx = torch.cat([p.indices for p in laws])
    val = torch.cat([p.values for p in laws])
    vals = torch.zeros(n, kmax, dtype=torch.float64)
    vals[rows, cols] = val.double()
    cum = vals.cumsum(dim=1)
    listed_mass = cum[:, -1]
    floor = floor32.double()
    unlisted = (vocab_size - lengths).double()
    total = listed_mass + unlisted * floor
    gdev = generator.device if generator is not None else torch.device("cpu")
    x = torch.rand(n, dtype=torch.float64, generator=generator, device=gdev).cpu() * total
    pick_listed = (x < listed_mass) | (floor <= 0)
    # Listed: first entry whose cumulative mass exceeds x (clamped for x == total).
    j = torch.searchsorted(cum, x.clamp_max(torch.nextafter(listed_mass, torch.zeros_like(listed_mass))).unsqueeze(1), right=True)
    j = j.squeeze(1).clamp_max(lengths - 1)
    idx2 = torch.zeros(n, kmax, dtype=torch.int64)
    idx2[rows, cols] = idx
    tok_listed = idx2.gather(1, j.view(-1, 1)).squeeze(1)
    p_listed = vals.gather(1, j.view(-1, 1)).squeeze(1).float()
    # Unlisted: the k-th token absent from the sorted listed indices a is k + #{i: a_i - i <= k}.
    k = ((x - listed_mass) / torch.where(floor > 0, floor, torch.ones_like(floor))).floor()
    k = k.clamp(min=0).minimum((unlisted - 1).clamp(min=0)).to(torch.int64)
    sentinel = vocab_size + kmax
    srt = torch.full((n, kmax), sentinel, dtype=torch.int64)
    srt[rows, cols] = idx
    srt = srt.sort(dim=1).values - torch.arange(kmax)
    tok_unlisted = k + torch.searchsorted(srt, k.view(-1, 1), right=True).squeeze(1)
    tokens = torch.where(pick_listed, tok_listed, tok_unlisted)
    probs = torch.where(pick_listed, p_listed, floor32)
    return tokens, probs
