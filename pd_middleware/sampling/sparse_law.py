"""The canonical law of a :class:`~pd_middleware.core.payload.SparseEncoding`, and draws from it.

:func:`sparse_law` runs on the decode's scheduler thread for every received sparse
proposal (about 2,700 entries per request at the ``sparse_floor`` operating point), so
it is written in numpy over whole buffers: every check is one vectorised pass, there is
no Python loop over entries, and the bytes are read in place (``np.frombuffer``) and
widened once. Torch tensors are made only at the end, sharing the numpy memory.

The law it returns is, bit for bit, what the assembler writes: listed values are fp32
(widened, then scaled in fp32), and each step's floor is rounded to fp32 here, so the
support check of :mod:`pd_middleware.decode.guard` reads the very numbers the verifier gets
(a floor that underflows to 0 in fp32 is 0 in the law, not 1e-46).
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch

from ..core._buffers import tensor_from_buffer
from ..core._errors import ValidationError
from ..core.payload import ITEMSIZE, SUM_TOLERANCE, U16_BUCKET, SparseEncoding, u16_buckets
from ..core.proposal import SparseProposal

_NP_VALUES = {"fp32": np.dtype("<f4"), "fp16": np.dtype("<f2")}

# Per-thread scratch for the int32 repeat check: one int32 per (step, token), reused
# across calls (only positions written in the same call are read back, so it is never
# cleared). Per thread because an encoder and a decode may validate concurrently.
_scratch = threading.local()


def _scratch_for(size: int) -> np.ndarray:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < size:
        buf = np.empty(size, dtype=np.int32)
        _scratch.buf = buf
    return buf


@functools.lru_cache(maxsize=64)
def _bucket_bases(n: int) -> np.ndarray:
    """int64 (n,): 65536 * b for flat bucket b (read-only, shared)."""
    bases = np.arange(n, dtype=np.int64) << 16
    bases.flags.writeable = False
    return bases


def _err(msg: str, field: str, rid: str | None) -> ValidationError:
    return ValidationError(msg, field=field, request_id=rid)


def sparse_law(
    enc: SparseEncoding, num_steps: int, vocab_size: int, *, request_id: str | None = None
) -> SparseProposal:
    """Validate a sparse encoding and return its law as a :class:`SparseProposal`.

    Checks: one length per step, each in ``[1, vocab_size]``; index and value buffers of
    matching size; indices in ``[0, vocab_size)`` and unique within a step; values finite
    and non-negative with a positive sum; ``tail_mass`` empty or one value per step in
    ``[0, 1)``, zero when a step lists the whole vocab; listed sum plus tail mass equal to
    1 within :data:`SUM_TOLERANCE`. For ``index_format == "u16"`` also:
    ``bucket_counts`` holds ``ceil(V / 65536)`` non-negative counts per step summing to
    that step's length, and the decoded ids are strictly ascending within each step
    (which proves them unique). The result's ``indices`` are int64 ids in the encoding's
    entry order, ``values`` float32 scaled to ``1 - tail_mass``, ``floor`` the fp32
    value of every unlisted token, ``scale`` the factor applied to the listed values.
    """
    rid = request_id
    lengths, tail, u16 = _check_layout(enc, num_steps, vocab_size, rid)
    idx = _u16_ids(enc, lengths, vocab_size, rid) if u16 else _int32_ids(enc, lengths, vocab_size, rid)
    vals_t = _widened_values(enc)
    vals = vals_t.numpy()
    scales, floors = _normalisation(vals, lengths, tail, vocab_size, SUM_TOLERANCE[enc.value_dtype], rid)
    # The values are scaled in fp32 (one rounding), as the law is defined.
    if num_steps == 1:
        sc = np.float32(scales[0])
        vals *= sc
        scale = (float(sc),)
    else:
        scale32 = np.asarray(scales, dtype=np.float32)
        vals *= np.repeat(scale32, lengths)
        scale = tuple(scale32.tolist())
    return SparseProposal(
        lengths=tuple(lengths), indices=torch.from_numpy(idx), values=vals_t, floor=tuple(floors), scale=scale
    )


def _check_layout(
    enc: SparseEncoding, num_steps: int, vocab_size: int, rid: str | None
) -> tuple[tuple[int, ...], tuple[float, ...], bool]:
    """The encoding's shape before any buffer is read: lengths, dtypes, index format,
    buffer sizes, tail masses. Returns ``(lengths, tail_mass per step, u16)``."""
    lengths = enc.lengths
    if len(lengths) != num_steps:
        raise _err(f"has {len(lengths)} steps, expected {num_steps}", "proposal.lengths", rid)
    for n in lengths:
        if type(n) is not int or not 1 <= n <= vocab_size:
            raise _err(f"entry count {n!r} is not an int in [1, {vocab_size}]", "proposal.lengths", rid)
    vdt = enc.value_dtype
    if vdt not in _NP_VALUES:
        raise _err(f"unsupported value dtype {vdt!r}", "proposal.value_dtype", rid)
    fmt = enc.index_format
    if fmt not in ("int32", "u16"):
        raise _err(f"unsupported index format {fmt!r}", "proposal.index_format", rid)
    u16 = fmt == "u16"
    if not u16 and enc.bucket_counts:
        raise _err(f"has {len(enc.bucket_counts)} counts, but int32 indices take none", "proposal.bucket_counts", rid)
    total = sum(lengths)
    n_idx = len(enc.indices) if isinstance(enc.indices, bytes) else enc.indices.nbytes
    if n_idx != total * (2 if u16 else 4):
        raise _err(
            f"holds {n_idx} bytes, expected {total} {'u16' if u16 else 'int32'} indices", "proposal.indices", rid
        )
    n_val = len(enc.values) if isinstance(enc.values, bytes) else enc.values.nbytes
    if n_val != total * ITEMSIZE[vdt]:
        raise _err(f"holds {n_val} bytes, expected {total} {vdt} values", "proposal.values", rid)
    tail = enc.tail_mass or (0.0,) * num_steps
    if len(tail) != num_steps:
        raise _err(f"has {len(tail)} entries, expected {num_steps}", "proposal.tail_mass", rid)
    for s, t in enumerate(tail):
        tt = type(t)  # bool is an int, not a probability; float subclasses (np.float64) are fine
        if (tt is not float and tt is not int and not isinstance(t, float)) or not 0.0 <= t < 1.0:
            raise _err(f"step {s}: {t!r} is not a probability in [0, 1)", "proposal.tail_mass", rid)
        if t > 0.0 and lengths[s] == vocab_size:
            raise _err(f"step {s} lists the whole vocab but spreads {t} over no token", "proposal.tail_mass", rid)
    return lengths, tail, u16


def _widened_values(enc: SparseEncoding) -> torch.Tensor:
    """The listed values as a new float32 tensor: the law's own, scaled in place after.

    One widening copy: torch widens fp16 with the CPU's vector conversions, several times
    faster than numpy's astype. The widening makes a new tensor, so a writable fp16
    buffer is read in place; fp32 values are copied (the scaling must never write into
    the encoding).
    """
    if enc.value_dtype == "fp16":
        return tensor_from_buffer(enc.values, "fp16", copy=False).float()
    return tensor_from_buffer(enc.values, enc.value_dtype)


def _normalisation(
    vals: np.ndarray,
    lengths: tuple[int, ...],
    tail: tuple[float, ...],
    vocab_size: int,
    tol: float,
    rid: str | None,
) -> tuple[list[float], list[float]]:
    """Check the values' mass per step and return ``(scales, floors)``: the factor that
    brings step s's listed mass to ``1 - tail[s]``, and the fp32 value of each of its
    unlisted tokens."""
    if len(lengths) == 1:
        sums = [float(vals.sum(dtype=np.float64))]
    else:
        starts = np.cumsum((0, *lengths[:-1]))
        sums = np.add.reduceat(vals, starts, dtype=np.float64).tolist()
    # A NaN or inf anywhere makes its step's float64 sum non-finite (fp32/fp16 values
    # cannot overflow a float64 sum), so one pass over the sums finds them all.
    if not math.isfinite(sum(sums)):
        raise _err("contains NaN or inf", "proposal.values", rid)
    if float(vals.min()) < 0.0:
        raise _err("contains negative values", "proposal.values", rid)
    scales: list[float] = []
    floors: list[float] = []
    for s, (m, t) in enumerate(zip(sums, tail)):
        if not m > 0.0:
            raise _err(f"step {s} has no probability mass", "proposal.values", rid)
        if abs(m + t - 1.0) > tol:
            raise _err(f"step {s}: listed mass {m:.6g} + tail {t:.6g} is not 1 within {tol:g}", "proposal.values", rid)
        scales.append((1.0 - t) / m)
        # fp32, as the assembler writes it: the law and the buffer hold the same number.
        floors.append(float(np.float32(t / (vocab_size - lengths[s]))) if t > 0.0 else 0.0)
    return scales, floors


def _int32_ids(enc: SparseEncoding, lengths: tuple[int, ...], vocab_size: int, rid: str | None) -> np.ndarray:
    """Decode and check int32 indices: in range, unique within each step. int64 (total,)."""
    raw = np.frombuffer(enc.indices, dtype="<i4")
    if int(raw.min()) < 0 or int(raw.max()) >= vocab_size:
        bad = int(raw[(raw < 0) | (raw >= vocab_size)][0])
        raise _err(f"index {bad} is outside [0, {vocab_size})", "proposal.indices", rid)
    idx = raw.astype(np.int64)
    s = len(lengths)
    key = idx if s == 1 else idx + np.repeat(np.arange(s, dtype=np.int64) * vocab_size, lengths)
    # Repeat check in O(n): write each entry's position at its key, read it back. Two
    # entries with one key cannot both read their own position, whichever write won.
    pos = np.arange(key.size, dtype=np.int32)
    scratch = _scratch_for(s * vocab_size)
    scratch[key] = pos
    if bool((scratch[key] != pos).any()):
        raise _err("repeats an index within a step", "proposal.indices", rid)
    return idx


def _u16_ids(enc: SparseEncoding, lengths: tuple[int, ...], vocab_size: int, rid: str | None) -> np.ndarray:
    """Decode and check u16 indices: int64 ids (total,), strictly ascending per step.

    Entry j lies in flat bucket b (``np.repeat`` of the bucket numbers by their
    counts); its step is b // nb and its id 65536 * (b % nb) + low. Because each step's
    counts sum to its length, the flat buckets are non-decreasing over the entries, so
    one comparison of consecutive (bucket, low) keys checks that ids ascend strictly
    within every step.
    """
    nb = u16_buckets(vocab_size)
    counts = enc.bucket_counts
    steps_n = len(lengths)
    if len(counts) != steps_n * nb:
        raise _err(
            f"has {len(counts)} counts, expected {steps_n} steps x {nb} buckets of {U16_BUCKET} tokens "
            f"= {steps_n * nb}",
            "proposal.bucket_counts",
            rid,
        )
    for c in counts:
        if type(c) is not int or c < 0:
            raise _err(f"count {c!r} is not an int >= 0", "proposal.bucket_counts", rid)
    for s, n in enumerate(lengths):
        got = sum(counts[s * nb : (s + 1) * nb])
        if got != n:
            raise _err(f"step {s}: counts sum to {got}, but the step lists {n} entries", "proposal.bucket_counts", rid)
    low = np.frombuffer(enc.indices, dtype="<u2")
    # key = 65536 * flat bucket + low, built as int64 (the ids' final dtype).
    key: np.ndarray = np.repeat(_bucket_bases(steps_n * nb), counts) | low
    if key.size > 1:
        # At a step boundary the flat bucket jumps into the next step's range, so the
        # key still rises there: a drop can only occur inside one step.
        down = key[1:] <= key[:-1]
        if bool(down.any()):
            j = int(down.argmax()) + 1
            s = int(key[j] >> 16) // nb
            base = s * nb * U16_BUCKET
            raise _err(
                f"step {s}: ids are not strictly ascending (entry {j}: id {int(key[j]) - base} after "
                f"{int(key[j - 1]) - base})",
                "proposal.indices",
                rid,
            )
    idx = key
    if steps_n > 1:
        idx -= np.repeat(np.arange(steps_n, dtype=np.int64) * (nb * U16_BUCKET), lengths)
    # Ids ascend within a step, so only each step's last entry can be out of range.
    if (int(idx[-1]) >= vocab_size) if steps_n == 1 else bool((idx[np.cumsum(lengths) - 1] >= vocab_size).any()):
        j = int((idx >= vocab_size).argmax())
        raise _err(f"index {int(idx[j])} is outside [0, {vocab_size})", "proposal.indices", rid)
    return idx


def sparse_law_tensor(enc: SparseEncoding, num_steps: int, vocab_size: int) -> torch.Tensor:
    """(S, V) float32: the exact vector a prefill samples X from for ``enc``.

    Bit for bit what the assembler writes for :func:`sparse_law`'s proposal: every
    unlisted token holds the fp32 floor, every listed one its fp32 value.
    """
    return sparse_law(enc, num_steps, vocab_size).to_dense(vocab_size)
