"""The one rank-agreement collective: every rank votes per row, and no rank skips the vote.

Under TP (and attention TP within a DP group) several ranks run the same batch, and each
must hand SGLang the same X for a request: the sharded target forward embeds each rank's
own X, so ranks that differ verify garbage, and a rank that leaves a collective alone
leaves the others blocked in it. So every per-batch decision of the drop-in that can
differ between ranks goes through :func:`agree`:

- each rank builds its votes (per row: ok, and the X it would hand SGLang) in
  ``votes()``; **an exception there is this rank's "not ok" vote** for every row, never a
  skipped call;
- every rank then takes part in ONE all-reduce (MIN) of ``[ok, X, -X]`` over ``group``,
  the CPU group of the ranks that run the batch (SGLang's attention-TP ``cpu_group``):
  the minimum of ``ok`` is "every rank could", the minimum and maximum of X say whether
  they drew the same;
- a failure of the collective itself (the group is broken) is a :class:`Verdict` with
  ``failed`` set and no row agreed.

A rank with nothing to say about a row's X votes :data:`NEUTRAL` (the MIN's identity).
``group`` None (one rank, or agreement turned off for a negative-control test) returns
this rank's own votes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Identity of the MIN (a rank without an X for a row).
NEUTRAL = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class Verdict:
    """What the ranks agreed on, per row (r rows, s tokens a row).

    ``ok``: bool (r,), every rank voted ok; ``lo``/``hi``: int64 (r, s), the smallest and
    largest X any rank voted (NEUTRAL where none had one); ``error``: this rank's own
    exception from ``votes()`` (None when it voted normally); ``failed``: the collective
    itself failed (then ``ok`` is all False).
    """

    ok: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    error: BaseException | None = None
    failed: BaseException | None = None

    @property
    def same(self) -> torch.Tensor:
        """bool (r,): every rank voted the same X (and at least one voted one)."""
        return ((self.lo == self.hi) & (self.lo != NEUTRAL)).all(dim=1)

    @property
    def agreed(self) -> torch.Tensor:
        """bool (r,): every rank voted ok with the same X."""
        return self.ok & self.same


def agree(
    rows: int,
    steps: int,
    votes: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    group: Any,
    *,
    all_reduce: Callable[..., Any] | None = None,
) -> Verdict:
    """Run this rank's ``votes()`` and the one MIN all-reduce over ``group``; never raises.

    ``votes()`` returns (ok: bool (rows,), X: int64 (rows, steps)); anything else it does
    (raise, or return another shape) is this rank's "not ok" for every row, with no X.
    ``all_reduce``: the collective (default ``torch.distributed.all_reduce``; injected by
    tests that record which group each call uses).
    """
    error: BaseException | None = None
    try:
        ok, x = votes()
        ok = torch.as_tensor(ok, dtype=torch.bool).reshape(rows).cpu()
        x = torch.as_tensor(x, dtype=torch.int64).reshape(rows, steps).cpu()
    except Exception as exc:  # this rank's failure is its vote: every rank still enters the collective
        error = exc
        ok = torch.zeros(rows, dtype=torch.bool)
        x = torch.full((rows, steps), NEUTRAL, dtype=torch.int64)
    if group is None:
        return Verdict(ok, x.clone(), x.clone(), error)
    neg = torch.where(x == NEUTRAL, torch.full_like(x, NEUTRAL), -x)
    flat = torch.cat([ok.to(torch.int64), x.reshape(-1), neg.reshape(-1)])
    try:
        if all_reduce is None:
            import torch.distributed as dist

            dist.all_reduce(flat, op=dist.ReduceOp.MIN, group=group)
        else:
            all_reduce(flat, group)
    except Exception as exc:  # the group itself is broken: nothing is agreed
        none = torch.zeros(rows, dtype=torch.bool)
        return Verdict(none, x.clone(), x.clone(), error, failed=exc)
    n = rows * steps
    lo = flat[rows : rows + n].reshape(rows, steps)
    hi_neg = flat[rows + n :].reshape(rows, steps)
    hi = torch.where(hi_neg == NEUTRAL, torch.full_like(hi_neg, NEUTRAL), -hi_neg)
    return Verdict(flat[:rows] > 0, lo, hi, error)


def group_of(group: Any, enabled: bool) -> Any:
    """``group`` (a CPU process group) when agreement is on and it has more than one rank, else None."""
    if not enabled or group is None:
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return None
    return group
