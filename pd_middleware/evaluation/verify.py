"""The reference chain verifier, with the chain kernels' literal semantics, and its exact mode.

Rule (``docs/strategies.md``, design notes section 2), per request and per draft step
s = 0..S-1 while every earlier step was accepted, q' being the vector handed to the
verifier. ``kernel`` picks whose reading of q' is reproduced, value for value
(the table in ``docs/strategies.md`` lists every case):

- ``"flashinfer"`` (default): FlashInfer's ``ChainSpeculativeSampling``
  (``include/flashinfer/sampling.cuh``). Accept X_s iff ``u * q'(X_s) < p(X_s)``,
  literally: q'(X) <= 0 is accepted whenever p(X) > 0 (a negative or -inf q'(X) even
  when p(X) = 0), q'(X) > 1 with probability p/q', NaN and +inf never. On rejection,
  draw from ``relu(p - q')`` over the whole row with ``fmaxf`` semantics: an entry
  whose difference is NaN counts 0, an entry with q' = -inf is +inf, and then (the
  sum being inf) the kernel's search never succeeds and it emits the last token with a
  positive residual.
- ``"sglang"``: SGLang 0.5.23's Triton ``speculative_sampling_classic_kernel``
  (``sglang/kernels/ops/speculative/reject_sampling.py``, what ``eagle_sample`` runs
  under rejection sampling). Accept X_s iff ``0 < q'(X_s) <= 1`` and ``u * q'(X_s) <
  p(X_s)``; the residual reads every q' entry outside [0, 1] (NaN included) as 0.

Both then stop; after all S steps are accepted, commit a bonus draw from p at
position S. A residual with no mass (p <= q' on the whole row, e.g. p == q') is where
the kernels disagree and neither is meaningful (FlashInfer reads an uninitialised
index, SGLang emits V - 1): here it falls back to p, and the table says so.

Uniforms are drawn up front, independently per request and per step, in float64 on
[0, 1) (FlashInfer's ``curand_uniform`` is on (0, 1]: the two differ on a null set);
categorical draws use an inverse CDF over a float64 cumulative sum with
``searchsorted(..., right=True)``, so a zero-mass token can never be drawn, not even at
u = 0.

The exact mode (:func:`exact_verify_law`, :func:`exact_chain_law`, in
:mod:`pd_middleware.evaluation.verify_exact`, re-exported here) applies the same rule with
:class:`fractions.Fraction` and returns laws, for enumeration tests.
Statistics helpers live in :mod:`pd_middleware.evaluation.stats` and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core._errors import ValidationError
from ..sampling.draws import sample_categorical
from .stats import (
    ExactnessAccumulator,
    ExactnessCheck,
    chi_square,
    chi_square_critical,
    chi_square_sf,
    tv_bound,
    tv_distance,
    wilson_interval,
)
from .verify_exact import (
    KERNELS,
    ChainLaw,
    Kernel,
    check_kernel,
    complete_law,
    exact_accept_probability,
    exact_chain_law,
    exact_residual,
    exact_verify_law,
    target_sequence_law,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "KERNELS",
    "ChainLaw",
    "ExactnessAccumulator",
    "ExactnessCheck",
    "VerifyResult",
    "acceptance_probability",
    "chi_square",
    "chi_square_critical",
    "chi_square_sf",
    "complete_law",
    "exact_accept_probability",
    "exact_chain_law",
    "exact_residual",
    "exact_verify_law",
    "expected_accepted_length",
    "residual_weights",
    "sample_categorical",
    "sanitize_q",
    "sum_min",
    "target_sequence_law",
    "tv_bound",
    "tv_distance",
    "verify_chain",
    "verify_coins",
    "wilson_interval",
]


# --------------------------------------------------------------------------- torch


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What one verify of a batch of B chains of S draft steps commits.

    ``committed``: int64 (B, S+1), the committed tokens of each request, left-aligned,
    padded with -1 after the last one; ``accepted_lengths``: int64 (B,), how many draft
    tokens were accepted (0..S).
    """

    committed: torch.Tensor
    accepted_lengths: torch.Tensor

    @property
    def num_committed(self) -> torch.Tensor:
        """int64 (B,): committed tokens per request, ``accepted_lengths + 1``."""
        return self.accepted_lengths + 1

    @property
    def first_accepted(self) -> torch.Tensor:
        """bool (B,): whether the first draft token was accepted."""
        return self.accepted_lengths >= 1


def sanitize_q(q: torch.Tensor) -> torch.Tensor:
    """q with every NaN, inf, negative or >1 entry replaced by 0 (a new tensor, same dtype)."""
    import torch

    valid = torch.isfinite(q) & (q >= 0) & (q <= 1)
    return torch.where(valid, q, torch.zeros((), dtype=q.dtype, device=q.device))


def _accepts(u: torch.Tensor, qx: torch.Tensor, px: torch.Tensor, kernel: Kernel) -> torch.Tensor:
    """bool: the kernel's acceptance test, literally (float64 operands)."""
    ok = u * qx < px  # NaN anywhere makes this False, as in the kernels
    if kernel == "sglang":
        ok &= (qx > 0) & (qx <= 1)
    return ok


def residual_weights(p: torch.Tensor, q: torch.Tensor, kernel: Kernel = "flashinfer") -> torch.Tensor:
    """float64 (n, V): the kernel's unnormalised residual relu(p - q') per entry.

    ``"flashinfer"``: ``fmaxf(p - q', 0)``, so a NaN difference is 0 and q' = -inf gives
    +inf; ``"sglang"``: q' outside [0, 1] (NaN included) read as 0 first.
    """
    import torch

    check_kernel(kernel)
    p, q = p.double(), q.double()
    if kernel == "sglang":
        q = torch.where((q >= 0) & (q <= 1), q, torch.zeros((), dtype=q.dtype, device=q.device))
    diff = p - q
    return torch.where(diff > 0, diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def _draw_residual(p: torch.Tensor, q: torch.Tensor, u: torch.Tensor, kernel: Kernel) -> torch.Tensor:
    """int64 (n,): one residual draw per row, with the kernels' corner cases (module docstring)."""
    import torch

    r = residual_weights(p, q, kernel)
    total = r.sum(dim=1)
    out = torch.empty(r.shape[0], dtype=torch.int64, device=r.device)
    inf = ~torch.isfinite(total)
    if bool(inf.any()):
        # FlashInfer with q' = -inf somewhere: u * sum is inf, no prefix exceeds it, and
        # the kernel falls back to its last valid index: the last entry with r > 0.
        positive = (r[inf] > 0).flip(1).to(torch.int8)
        out[inf] = r.shape[1] - 1 - positive.argmax(dim=1)
    fin = ~inf
    if bool(fin.any()):
        rf = r[fin]
        empty = rf.sum(dim=1) <= 0
        if bool(empty.any()):  # p <= q' on the whole row: the kernels are undefined here; draw from p
            rf[empty] = p[fin][empty].double()
        out[fin] = sample_categorical(rf, u[fin])
    return out


def _check_shapes(target: torch.Tensor, draft: torch.Tensor, tokens: torch.Tensor) -> None:
    if target.dim() != 3:
        raise ValidationError(f"expected (B, S+1, V), got shape {tuple(target.shape)}", field="target_probs")
    b, s1, v = target.shape
    if tuple(draft.shape) != (b, s1 - 1, v):
        raise ValidationError(
            f"expected {(b, s1 - 1, v)} to match target_probs {tuple(target.shape)}, got {tuple(draft.shape)}",
            field="draft_probs",
        )
    if tuple(tokens.shape) != (b, s1 - 1) or tokens.dtype.is_floating_point:
        raise ValidationError(
            f"expected integer {(b, s1 - 1)}, got {tokens.dtype} {tuple(tokens.shape)}", field="draft_tokens"
        )
    if s1 < 2:
        raise ValidationError("needs at least one draft step (S+1 >= 2 positions)", field="target_probs")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= v):
        raise ValidationError(f"token ids must lie in [0, {v})", field="draft_tokens")


def verify_coins(
    batch: int, num_steps: int, generator: torch.Generator | None, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 uniforms for one verify: (B, S) acceptance coins and (B, S+1) draw coins.

    Drawn on the generator's device (or ``device`` without one), then moved to ``device``.
    """
    import torch

    gdev = generator.device if generator is not None else device
    u = torch.rand(batch, 2 * num_steps + 1, dtype=torch.float64, generator=generator, device=gdev).to(device)
    return u[:, :num_steps], u[:, num_steps:]


def verify_chain(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    uniforms: tuple[torch.Tensor, torch.Tensor] | None = None,
    kernel: Kernel = "flashinfer",
) -> VerifyResult:
    """Verify a batch of draft chains; see the module docstring for the rule.

    ``target_probs``: float (B, S+1, V); position s < S is p given the accepted prefix
    X_<s, position S the bonus distribution given all S drafts. ``draft_probs``: float
    (B, S, V), the q' handed to the verifier (the assembler's buffer); (B, V) is
    accepted when S = 1. ``draft_tokens``: int64 (B, S) ((B,) when S = 1).
    ``generator`` seeds the uniforms (:func:`verify_coins`); ``uniforms`` overrides
    them with explicit float64 ((B, S), (B, S+1)) tensors. ``kernel``: whose reading
    of invalid q' values to reproduce (``"flashinfer"`` or ``"sglang"``). Rows are
    independent: the loop runs over steps only, every step is a tensor operation over
    the batch.
    """
    import torch

    check_kernel(kernel)

    if draft_probs.dim() == 2 and target_probs.dim() == 3 and target_probs.shape[1] == 2:
        draft_probs = draft_probs.unsqueeze(1)
    if draft_tokens.dim() == 1:
        draft_tokens = draft_tokens.unsqueeze(1)
    _check_shapes(target_probs, draft_probs, draft_tokens)
    b, s1, _ = target_probs.shape
    steps = s1 - 1
    device = target_probs.device
    draft_tokens = draft_tokens.to(device=device, dtype=torch.int64)
    u_acc, u_draw = uniforms if uniforms is not None else verify_coins(b, steps, generator, device)

    committed = torch.full((b, s1), -1, dtype=torch.int64, device=device)
    accepted = torch.zeros(b, dtype=torch.int64, device=device)
    active = torch.ones(b, dtype=torch.bool, device=device)
    rows = torch.arange(b, device=device)
    for s in range(steps):
        x = draft_tokens[:, s]
        px = target_probs[rows, s, x].double()
        qx = draft_probs[rows, s, x].double()
        ok = active & _accepts(u_acc[:, s], qx, px, kernel)
        rejected = active & ~ok
        committed[:, s] = torch.where(ok, x, committed[:, s])
        accepted += ok.to(torch.int64)
        if bool(rejected.any()):
            idx = rejected.nonzero().squeeze(1)
            committed[idx, s] = _draw_residual(target_probs[idx, s], draft_probs[idx, s], u_draw[idx, s], kernel)
        active = ok
    if bool(active.any()):
        idx = active.nonzero().squeeze(1)
        committed[idx, steps] = sample_categorical(target_probs[idx, steps].double(), u_draw[idx, steps])
    return VerifyResult(committed=committed, accepted_lengths=accepted)


def acceptance_probability(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    kernel: Kernel = "flashinfer",
) -> torch.Tensor:
    """float64 (B, S): P(accept X_s | steps before s accepted) = P(u * q'(X_s) < p(X_s)).

    Shapes as :func:`verify_chain`. min(1, p/q') for q' in (0, inf); under
    ``"flashinfer"`` q' = 0 accepts iff p > 0, q' < 0 (-inf included) always, NaN and
    +inf never; under ``"sglang"`` q' outside (0, 1] never. Averaging this instead of
    the 0/1 outcome gives a lower-variance acceptance estimate.
    """
    import torch

    check_kernel(kernel)

    if draft_tokens.dim() == 1:
        draft_tokens = draft_tokens.unsqueeze(1)
    if draft_probs.dim() == 2:
        draft_probs = draft_probs.unsqueeze(1)
    idx = draft_tokens.to(device=target_probs.device, dtype=torch.int64).unsqueeze(2)
    steps = idx.shape[1]
    px = target_probs[:, :steps].gather(2, idx).squeeze(2).double()
    qx = draft_probs.gather(2, idx.to(draft_probs.device)).squeeze(2).double().to(px.device)
    pos = (qx > 0) & torch.isfinite(qx)
    ratio = (px / torch.where(pos, qx, 1.0)).clamp_max(1.0)
    zero = (px > 0).double()
    one, none = torch.ones_like(px), torch.zeros_like(px)
    if kernel == "sglang":
        return torch.where(pos & (qx <= 1), ratio, none)
    # NaN and +inf fall through every branch to 0.
    return torch.where(pos, ratio, torch.where(qx == 0, zero, torch.where(qx < 0, one, none)))


def expected_accepted_length(acceptance: torch.Tensor) -> torch.Tensor:
    """float64 (B,): E[accepted drafts] = sum_k prod_{j<=k} a_j, from (B, S) step acceptances."""
    return acceptance.double().cumprod(dim=1).sum(dim=1)


def sum_min(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float64 (...,): sum over the last dim of min(p, q'), q' sanitised.

    The acceptance of X ~ q' verified against q' (the full-distribution bound).
    """
    import torch

    return torch.minimum(p.double(), sanitize_q(q).double()).sum(dim=-1)
