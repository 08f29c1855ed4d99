"""The exact mode of the reference verifier: the same rule with :class:`fractions.Fraction`.

Laws instead of draws, for enumeration tests over a tiny vocabulary: a strategy is exact
iff the committed law equals p. ``kernel`` picks whose reading of an invalid q' to
reproduce (``"flashinfer"`` or ``"sglang"``), as in :mod:`pd_middleware.evaluation.verify`, whose
docstring and ``docs/strategies.md`` give the table. Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from ..core._errors import ValidationError

#: Whose chain kernel the verifier reproduces (see :mod:`pd_middleware.evaluation.verify`).
Kernel = Literal["flashinfer", "sglang"]
KERNELS: tuple[str, ...] = ("flashinfer", "sglang")


def check_kernel(kernel: str) -> None:
    """Refuse a ``kernel`` outside :data:`KERNELS` (ValidationError at field ``kernel``);
    shared by this module and :mod:`pd_middleware.evaluation.verify`."""
    if kernel not in KERNELS:
        raise ValidationError(f"must be one of {', '.join(KERNELS)}, got {kernel!r}", field="kernel")


Number = Fraction | int | float
LawFn = Callable[[tuple[int, ...]], Sequence[Number]]
SentFn = Callable[[tuple[int, ...], int], Sequence[Number]]


def _frac(v: Number) -> Fraction:
    return v if isinstance(v, Fraction) else Fraction(v)


def _sanitize_fraction(v: Number) -> Fraction:
    """SGLang's reading of a q' entry (exact twin of :func:`pd_middleware.evaluation.verify.sanitize_q`):
    NaN, inf, < 0 or > 1 counts as 0."""
    if isinstance(v, float) and not math.isfinite(v):
        return Fraction(0)
    f = _frac(v)
    return f if 0 <= f <= 1 else Fraction(0)


def _law(values: Sequence[Number], name: str) -> list[Fraction]:
    out = [_frac(v) for v in values]
    if any(v < 0 for v in out) or sum(out) != 1:
        raise ValidationError(f"must be non-negative and sum to exactly 1, got sum {sum(out)}", field=name)
    return out


def exact_accept_probability(p_x: Number, q_x: Number, kernel: Kernel = "flashinfer") -> Fraction:
    """P(u * q'(x) < p(x)) for u ~ U[0, 1), under ``kernel``'s reading of q'.

    ``"flashinfer"``: min(1, p/q') for q' > 0 finite; 1 if q' = 0 and p > 0 (else 0);
    1 if q' < 0 or q' = -inf; 0 for NaN and +inf. ``"sglang"``: 0 unless 0 < q' <= 1.
    """
    check_kernel(kernel)
    p = _frac(p_x)
    if isinstance(q_x, float) and not math.isfinite(q_x):
        return Fraction(1) if (kernel == "flashinfer" and q_x == -math.inf) else Fraction(0)
    q = _frac(q_x)
    if kernel == "sglang" and not 0 < q <= 1:
        return Fraction(0)
    if q < 0:
        return Fraction(1)
    if q == 0:
        return Fraction(1) if p > 0 else Fraction(0)
    return min(Fraction(1), p / q)


def exact_residual(p: Sequence[Number], q: Sequence[Number], kernel: Kernel = "flashinfer") -> list[Fraction]:
    """The law of the kernel's residual draw: relu(p - q') normalised, p itself when it
    has no mass. ``"flashinfer"``: a NaN or +inf q' entry gives 0, and a -inf one makes
    the draw the last token with a positive residual; ``"sglang"``: q' outside [0, 1]
    counts 0."""
    check_kernel(kernel)
    pf = [_frac(v) for v in p]
    r: list[Fraction] = []
    last_inf = False
    for a, b in zip(pf, q, strict=True):
        if isinstance(b, float) and not math.isfinite(b):
            if kernel == "sglang":  # read as q' = 0
                r.append(a)
            elif b == -math.inf:  # p + inf: positive; only the position matters
                last_inf = True
                r.append(Fraction(1))
            else:  # fmaxf(NaN, 0) and fmaxf(-inf, 0) are 0
                r.append(Fraction(0))
            continue
        qb = _sanitize_fraction(b) if kernel == "sglang" else _frac(b)
        r.append(max(a - qb, Fraction(0)))
    if last_inf:
        y = max(i for i, v in enumerate(r) if v > 0)
        return [Fraction(int(i == y)) for i in range(len(r))]
    total = sum(r)
    return [v / total for v in r] if total > 0 else pf


def exact_verify_law(
    p: Sequence[Number],
    q: Sequence[Number] | Callable[[int], Sequence[Number]],
    s: Sequence[Number],
    kernel: Kernel = "flashinfer",
) -> list[Fraction]:
    """Law of the committed token at one position.

    ``p``: target law; ``s``: the law X was really drawn from; ``q``: the vector handed
    to the verifier (any numbers; invalid entries count as 0), or a function of the
    drawn token x returning it (``lambda x: one_hot(x)``). All length V. ``kernel``:
    whose reading of q' (:func:`exact_accept_probability`). The strategy is exact iff
    the result equals ``p``.
    """
    pf, sf = _law(p, "p"), _law(s, "s")
    q_of = q if callable(q) else (lambda _x: q)
    out = [Fraction(0)] * len(pf)
    for x, sx in enumerate(sf):  # enumeration over a tiny vocab: this is the exact mode
        if sx == 0:
            continue
        qx = q_of(x)
        if not len(pf) == len(qx) == len(sf):
            raise ValidationError(f"lengths differ: p {len(pf)}, q {len(qx)}, s {len(sf)}", field="q")
        a = exact_accept_probability(pf[x], qx[x], kernel)
        out[x] += sx * a
        if a < 1:
            for y, ry in enumerate(exact_residual(pf, qx, kernel)):
                out[y] += sx * (1 - a) * ry
    return out


@dataclass(frozen=True, slots=True)
class ChainLaw:
    """Exact outcome of verifying a chain of S draft steps.

    ``law``: committed sequence (1..S+1 tokens) -> probability; ``accepted``: accepted
    length (0..S) -> probability; ``expected_accepted``: its mean.
    """

    law: dict[tuple[int, ...], Fraction]
    accepted: dict[int, Fraction]
    expected_accepted: Fraction


def exact_chain_law(p_fn: LawFn, q_fn: SentFn, s_fn: LawFn, num_steps: int, kernel: Kernel = "flashinfer") -> ChainLaw:
    """Enumerate every draft chain and coin outcome of one verify.

    ``p_fn(prefix)``: target law of the next token given the committed prefix;
    ``s_fn(prefix)``: law the drafter draws the next draft token from, given the drafted
    prefix; ``q_fn(prefix, x)``: the vector handed to the verifier for that step when
    the step drafted x (ignore x for a shipped distribution; one-hot uses it). Prefixes
    are tuples of token ids (``()`` for the first position). Cost is V^S leaves.
    """
    law: dict[tuple[int, ...], Fraction] = {}
    accepted: dict[int, Fraction] = {}

    def add(seq: tuple[int, ...], w: Fraction) -> None:
        if w:
            law[seq] = law.get(seq, Fraction(0)) + w
            accepted[len(seq) - 1] = accepted.get(len(seq) - 1, Fraction(0)) + w

    def walk(prefix: tuple[int, ...], weight: Fraction) -> None:
        p = _law(p_fn(prefix), f"p{prefix}")
        if len(prefix) == num_steps:
            for y, py in enumerate(p):
                add((*prefix, y), weight * py)
            return
        s = _law(s_fn(prefix), f"s{prefix}")
        for x, sx in enumerate(s):
            if sx == 0:
                continue
            q = q_fn(prefix, x)
            if not len(p) == len(q) == len(s):
                raise ValidationError(
                    f"lengths differ at prefix {prefix}: p {len(p)}, q {len(q)}, s {len(s)}", field="q"
                )
            a = exact_accept_probability(p[x], q[x], kernel)
            if a > 0:
                walk((*prefix, x), weight * sx * a)
            if a < 1:
                for y, ry in enumerate(exact_residual(p, q, kernel)):
                    add((*prefix, y), weight * sx * (1 - a) * ry)

    walk((), Fraction(1))
    mean = sum((k * w for k, w in accepted.items()), Fraction(0))
    return ChainLaw(law=law, accepted=dict(sorted(accepted.items())), expected_accepted=mean)


def complete_law(law: dict[tuple[int, ...], Fraction], p_fn: LawFn, length: int) -> dict[tuple[int, ...], Fraction]:
    """Extend every committed sequence to ``length`` tokens by sampling the target.

    A verifier is exact iff the completed law equals :func:`target_sequence_law`: each
    committed token has law p given what came before it, whenever the chain got there.
    """
    out: dict[tuple[int, ...], Fraction] = {}
    for seq, w in law.items():
        frontier = {seq: w}
        for _ in range(length - len(seq)):
            nxt: dict[tuple[int, ...], Fraction] = {}
            for prefix, pw in frontier.items():
                for y, py in enumerate(_law(p_fn(prefix), f"p{prefix}")):
                    if py:
                        nxt[(*prefix, y)] = nxt.get((*prefix, y), Fraction(0)) + pw * py
            frontier = nxt
        for s, v in frontier.items():
            out[s] = out.get(s, Fraction(0)) + v
    return out


def target_sequence_law(p_fn: LawFn, length: int) -> dict[tuple[int, ...], Fraction]:
    """Joint law of ``length`` tokens sampled autoregressively from ``p_fn``."""
    return complete_law({(): Fraction(1)}, p_fn, length)
