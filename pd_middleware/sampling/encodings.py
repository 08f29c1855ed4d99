"""The canonical law of every wire encoding, shared by prefill and decode.

Exactness of a shipped proposal rests on one fact: the prefill draws X from *exactly*
the vector the verifier later receives. Both sides therefore compute that vector with
the functions here and nowhere else:

- :func:`dense_law` for :class:`~pd_middleware.core.payload.DenseEncoding`: widen to fp32,
  renormalise each step;
- :func:`sparse_law` for :class:`~pd_middleware.core.payload.SparseEncoding`: decode the
  token ids (int32, or u16 low bits plus per-step bucket counts), widen the listed
  values to fp32, scale them to ``1 - tail_mass``, and give every unlisted token
  ``tail_mass / (V - listed)``.

Both validate what they read (a decode receives it from the network) and raise
:class:`~pd_middleware.ValidationError` naming the field. The normalisation tolerance
is :data:`SUM_TOLERANCE`: the received values must already sum to 1 within it, because
a vector far from normalised is a sign of corruption, not of rounding. The sparse law
lives in :mod:`pd_middleware.sampling.sparse_law` (numpy, for the decode's hot path) and is
re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core._buffers import tensor_from_buffer, torch_dtype
from ..core._errors import ValidationError
from ..core.payload import ITEMSIZE, SUM_TOLERANCE, DenseEncoding
from ..core.proposal import DenseProposal, SparseProposal
from .draws import law_uniforms, sample_categorical
from .sparse_law import sparse_law, sparse_law_tensor

__all__ = [
    "SUM_TOLERANCE",
    "dense_law",
    "dense_law_tensor",
    "encoder_input",
    "sample_law",
    "sample_sparse_law",
    "sparse_law",
    "sparse_law_tensor",
    "tensor_from_buffer",
    "torch_dtype",
]

if TYPE_CHECKING:
    import torch


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


def dense_law_tensor(enc: DenseEncoding, num_steps: int, vocab_size: int) -> torch.Tensor:
    """(S, V) float32: the exact vector a prefill samples X from for ``enc``."""
    d = dense_law(enc, num_steps, vocab_size, copy=True)
    return d.probs.float() * d.scale.view(-1, 1)


def sample_law(
    law: torch.Tensor, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None
) -> torch.Tensor:
    """Draw one token per row of ``law`` (float (N, V), non-negative, rows with mass).

    Row i yields token j with probability ``law[i, j] / law[i].sum()``, computed in
    float64 by inverse CDF (:func:`pd_middleware.sampling.draws.sample_categorical`), so a
    zero-mass token is never drawn. Row i's uniform is ``uniforms`` (N values, any
    shape, row-major) or else a draw from ``generator``. Runs on ``law.device``, with
    no host copy; returns int64 (N,) there.
    """
    u = law_uniforms(law.shape[0], law.device, generator, uniforms)
    return sample_categorical(law, u)


def encoder_input(probs: torch.Tensor, *, tolerance: float = 1e-3) -> torch.Tensor:
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
    # One pass for both bounds: a NaN makes the min and max NaN, and NaN fails both
    # comparisons; inf fails the second.
    lo, hi = torch.aminmax(probs)
    if not bool((lo >= 0) & (hi <= 1)):
        raise ValidationError("contains NaN, inf or values outside [0, 1]", field="probs")
    sums = probs.sum(dim=-1, dtype=torch.float32).double()
    bad = (sums - 1.0).abs() > tolerance
    if bool(bad.any()):
        b, s = (int(i) for i in bad.nonzero()[0])
        raise ValidationError(
            f"row ({b}, {s}) sums to {float(sums[b, s]):.6g}, not 1 within {tolerance:g}", field="probs"
        )
    return probs


def sample_sparse_law(
    laws: list[SparseProposal],
    vocab_size: int,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per step of each sparse law, without building V-wide rows.

    The row a step stands for is what the assembler writes: ``values`` at ``indices``
    and the fp32 ``floor`` on every other token. One float64 uniform per step picks,
    by inverse CDF over [listed entries, unlisted tokens in ascending order], either a
    listed entry (zero values are never picked) or the j-th unlisted token. The
    uniforms are ``uniforms`` (N values, in step order) or else draws from ``generator``.
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
    x = law_uniforms(n, "cpu", generator, uniforms) * total
    pick_listed = (x < listed_mass) | (floor <= 0)
    # Listed: first entry whose cumulative mass exceeds x (clamped for x == total).
    j = torch.searchsorted(
        cum, x.clamp_max(torch.nextafter(listed_mass, torch.zeros_like(listed_mass))).unsqueeze(1), right=True
    )
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
