"""Per-request randomness and the one categorical draw: counter-based uniforms, inverse CDF.

Every rank that runs a prefill batch must draw the same X for a request, whatever the
batch around it, so a draw's randomness is a function of the request alone: one
float64 uniform per (request, step), the top 53 bits of a keyed BLAKE2b digest of
(``seed``, room, salt, position). SGLang's request id is the salt (the same on every TP
rank and new for every request), so a client that reuses a bootstrap room does not get
the same draw twice. Step k of a multi-step chain mixes ``":k"`` into the salt.

The position is the number of tokens the prefill ran for the request (its ``seq_len`` at
the draw: the prompt, plus the output already generated when SGLang rebootstraps it),
the same on every rank. It is what differs between a request's lives: a retract-mode
pause (``pause_generation(mode="retract")``) sends the request back to the prefill with
the same rid and room, and a draw keyed on those alone would reuse the uniform whose
verify outcome the output already records, so the new X would not be drawn from its law
given the history (V = 2, q = p flat: the new token would copy the old one). A life
that follows a verify has a longer prefix (every verify commits a token), hence another
position and a fresh uniform; a life that follows none reuses the same uniform (not
necessarily the same X: q may change, e.g. a retract-mode pause paired with a weight
update), whose outcome nothing has recorded yet.

A whole batch is then one encoder call with a (B, S) tensor of uniforms
(``encode(..., uniforms=u)``, :func:`encode_requests`): no generator object per request,
and the draws of a request do not depend on its neighbours or its row.

The decode's redraw (:func:`~pd_middleware.decode.recompute.inverse_cdf`, where SGLang's seeded
sampler is unavailable) takes its uniforms from the same digest
(:func:`seeded_uniforms`: of a request's sampling seed and position), and every
categorical draw of the project, prefill encoders, decode redraw and the reference
verifier's residual alike, inverts a CDF with :func:`sample_categorical`.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from ..core._errors import ValidationError

#: 2**-53: a 53-bit integer times this is a float64 in [0, 1), exactly.
_UNIT = 2.0**-53


def room_seed(seed: int, room: Any, salt: str = "", position: int | None = None) -> int:
    """A 63-bit digest of (``seed``, room, ``salt``, ``position``), equal on every rank.

    ``position`` None (a caller that knows none) leaves it out of the key; an int is
    appended after ``@``, which no int's digits contain, so two keys with positions are
    equal only when their salts and their positions are.
    """
    key = f"{int(seed)}:{room}:{salt}" if position is None else f"{int(seed)}:{room}:{salt}@{int(position)}"
    raw = key.encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8, person=b"pd-mw-draw").digest(), "little") >> 1


def step_salt(salt: str, step: int, steps: int) -> str:
    """The salt of step ``step`` of ``steps``: ``salt`` itself for one step, ``salt:step`` in a chain."""
    return salt if steps == 1 else f"{salt}:{step}"


def request_uniforms(
    seed: int,
    rooms: Sequence[Any],
    salts: Sequence[str] | None = None,
    steps: int = 1,
    positions: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """float64 (B, ``steps``) uniforms in [0, 1): row i, column k from
    (``seed``, rooms[i], salt of step k, positions[i]).

    ``salts``: one string per request (SGLang's rid), or None for "". ``positions``: one
    per request (the prefill's ``seq_len`` at the draw; None: left out of the key), or
    None for none. Each value is a multiple of 2**-53, so it is exact in float64 on any
    device.
    """
    if salts is not None and len(salts) != len(rooms):
        raise ValueError(f"{len(salts)} salts for {len(rooms)} rooms")
    if positions is not None and len(positions) != len(rooms):
        raise ValueError(f"{len(positions)} positions for {len(rooms)} rooms")
    bits = [
        room_seed(
            seed,
            room,
            step_salt(salts[i] if salts is not None else "", k, steps),
            positions[i] if positions is not None else None,
        )
        >> 10
        for i, room in enumerate(rooms)
        for k in range(steps)
    ]
    return torch.tensor(bits, dtype=torch.float64).mul_(_UNIT).view(len(rooms), steps)


def takes_uniforms(encoder: Any) -> bool:
    """Whether ``encoder.encode`` names a ``uniforms`` parameter (the batched, per-request draw).

    An encoder without one is called once per request with a generator seeded from
    :func:`room_seed`, on a host copy of its row, as before the parameter existed.
    """
    try:
        return "uniforms" in inspect.signature(encoder.encode).parameters
    except (AttributeError, TypeError, ValueError):
        return False


def encode_requests(
    encoder: Any,
    seed: int,
    rooms: Sequence[Any],
    probs: torch.Tensor,
    temps: Sequence[float],
    salts: Sequence[str] | None,
    *,
    batched: bool = True,
    positions: Sequence[int | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[Any], list[Any]]:
    """``encoder``'s draws for B requests: (X int64 (B, S), q'(X) (B, S), B proposals, B provenances).

    ``probs``: (B, V) or (B, S, V), any device; ``temps``: B temperatures; ``salts``: B
    per-request strings (SGLang's rid) or None; ``positions``: B draw positions (the
    prefill's ``seq_len`` per request) or None, mixed into the key. ``batched``: one encoder call per
    distinct temperature, where ``probs`` lives, at :func:`request_uniforms`; X and q'(X)
    stay where the encoder left them. Else (an encoder without ``uniforms``) one call per
    request on a host copy, with a generator seeded from :func:`room_seed`.
    """
    b = probs.shape[0]
    if not batched:
        host = probs.to("cpu", torch.float32)
        encs = [
            encoder.encode(
                host[i : i + 1],
                temperature=temps[i],
                generator=torch.Generator().manual_seed(
                    room_seed(
                        seed,
                        rooms[i],
                        salts[i] if salts is not None else "",
                        positions[i] if positions is not None else None,
                    )
                ),
            )
            for i in range(b)
        ]
        return (
            torch.cat([e.tokens.to("cpu", torch.int64).reshape(1, -1) for e in encs]),
            torch.cat([e.token_probs.to("cpu", torch.float32).reshape(1, -1) for e in encs]),
            [e.proposals[0] for e in encs],
            [e.provenance for e in encs],
        )
    steps = probs.shape[1] if probs.dim() == 3 else 1
    u = request_uniforms(seed, rooms, salts, steps, positions).to(probs.device)
    groups: dict[float, list[int]] = {}
    for i, t in enumerate(temps):
        groups.setdefault(float(t), []).append(i)
    if len(groups) == 1:
        enc = encoder.encode(probs, temperature=float(temps[0]), uniforms=u)
        tokens, token_probs = enc.tokens.reshape(b, steps), enc.token_probs.reshape(b, steps)
        return tokens, token_probs, list(enc.proposals), [enc.provenance] * b
    proposals: list[Any] = [None] * b
    provenances: list[Any] = [None] * b
    tokens = torch.empty((b, steps), dtype=torch.int64, device=probs.device)
    token_probs = torch.empty((b, steps), dtype=torch.float32, device=probs.device)
    for t, rows in groups.items():
        sel = torch.tensor(rows, device=probs.device)
        enc = encoder.encode(probs.index_select(0, sel), temperature=t, uniforms=u[sel])
        tokens[sel] = enc.tokens.reshape(len(rows), steps).to(probs.device, torch.int64)
        token_probs[sel] = enc.token_probs.reshape(len(rows), steps).to(probs.device, torch.float32)
        for j, i in enumerate(rows):
            proposals[i] = enc.proposals[j]
            provenances[i] = enc.provenance
    return tokens, token_probs, proposals, provenances


#: Largest float64 running sum :func:`sample_categorical` builds at once on the CPU.
_CPU_CDF_BYTES = 1 << 21


def sample_categorical(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: row i picks token j with probability ``weights[i, j] / sum``.

    ``weights``: float (n, V), non-negative, every row with positive mass, summed in
    float64 (a float64 copy of a few rows, summed in place: ``cumsum(dtype=float64)``
    allocates the widened copy and the sum); ``u``: float64 (n,) in [0, 1). Returns int64
    (n,). ``right=True`` makes the pick the first token whose cumulative mass exceeds
    ``u * total``, which always has positive mass.
    """
    n, v = weights.shape
    # On the CPU, a few rows at a time: each float64 running sum stays in cache (one
    # (64, 152064) sum is 78 MB). Rows are independent, so the draws are the same.
    step = max(1, n) if weights.device.type != "cpu" else max(1, _CPU_CDF_BYTES // (8 * v))
    parts = []
    for a in range(0, n, step):
        cdf = weights[a : a + step].to(torch.float64, copy=True).cumsum_(dim=1)  # never the caller's rows
        parts.append(torch.searchsorted(cdf, u[a : a + step].unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1))
    idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=weights.device)
    over = idx >= weights.shape[1]
    if bool(over.any()):
        # u * total rounded up to total (u within 2^-53 of 1): take the last token with mass.
        rows = over.nonzero().squeeze(1)
        positive = (weights[rows] > 0).flip(1).to(torch.int8)
        idx[rows] = weights.shape[1] - 1 - positive.argmax(dim=1)
    return idx


def seeded_uniforms(seeds: torch.Tensor, positions: torch.Tensor, salt: str = "decode-redraw") -> torch.Tensor:
    """float64 (B,) uniforms in [0, 1): row i from the digest of (``seeds[i]``, ``positions[i]``, ``salt``).

    The decode's seeded redraw: the same on every rank that holds the same request (its
    seed and position), independent of the batch around it. ``seeds``/``positions``:
    int64 (B,) on any device; the result is on the host.
    """
    bits = [room_seed(int(s), int(p), salt) >> 10 for s, p in zip(seeds.tolist(), positions.tolist())]
    return torch.tensor(bits, dtype=torch.float64).mul_(_UNIT)


def law_uniforms(
    n: int, device: torch.device | str, generator: torch.Generator | None, uniforms: torch.Tensor | None
) -> torch.Tensor:
    """float64 (n,) on ``device``: ``uniforms`` flattened (row-major, n values in [0, 1)), or
    n fresh draws from ``generator`` (on its device) when ``uniforms`` is None."""
    if uniforms is not None:
        u = uniforms.reshape(-1)
        if u.numel() != n:
            raise ValidationError(f"holds {u.numel()} values for {n} draws", field="uniforms")
        return u.to(device=device, dtype=torch.float64)
    gdev = generator.device if generator is not None else device
    return torch.rand(n, dtype=torch.float64, generator=generator, device=gdev).to(device)
