"""Bulk integrity: a slot region is delivered only if it matches its authenticated header.

The Mooncake plane carries no authentication: any process that reaches an engine's ports
can read and write the memory it serves, and the engine listens on every interface
(docs/transport.md, "Trust and the bulk plane"). A write can also fail to arrive, arrive
late (a write given up on), or never have been made (a header naming a granted slot).
So the header, which travels on the authenticated control plane, pins the bytes:

- each slot region's :class:`~pd_middleware.transport.wire.TensorRef` carries a *digest*
  of its bytes, computed by the prefill as it stages the write;
- every region of one payload carries the slot's *generation*, which changes on every
  grant and every use (:class:`~pd_middleware.transport.slots.SlotPool`), so a header is
  good for one use of one grant: stale, replayed or foreign headers are refused.

The decode checks both once, on the slot's bytes in place (no copy), before anything is
delivered; a mismatch fails that request alone as ``transfer:digest``
(:class:`~pd_middleware.IntegrityError`).

Two strengths, chosen by measurement (docs/transport.md, 608 KB regions on this host):

- ``xxh3_128`` (always on, ~9 us per 608 KB, ~65 GB/s): catches unwritten, stale and
  torn regions; not a defence against a forger, who can build colliding bytes.
- ``blake3`` (~95 us, ~6 GB/s): a cryptographic digest; with the control plane
  authenticated it also catches deliberate tampering by anyone who reaches the Mooncake
  plane. ``blake2b`` (~650 us) and ``sha256`` (~340 us) were measured and are slower.

A digest is self-describing by its length (16 bytes xxh3-128, 32 bytes BLAKE3). What
the check cannot see: bytes changed *after* the decode checked them (while the
scheduler uses the delivery), which only keeping the plane private prevents.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import blake3
import xxhash

from .._errors import IntegrityError

if TYPE_CHECKING:
    from .config import TransportConfig

Buffer = bytes | bytearray | memoryview
Algorithm = Literal["xxh3_128", "blake3"]


def _blake3(buf: Buffer) -> bytes:
    return blake3.blake3(buf).digest()


#: Digest functions by name.
DIGESTS: dict[str, Callable[[Buffer], bytes]] = {"xxh3_128": xxhash.xxh3_128_digest, "blake3": _blake3}
#: Algorithm of a digest, by its length in bytes.
BY_LENGTH: dict[int, str] = {16: "xxh3_128", 32: "blake3"}
#: Generation bits that count uses within one grant; the bits above them number the grant.
USE_BITS = 32


def authenticated(config: TransportConfig) -> bool:
    """Whether the control plane carrying the headers is authenticated (CURVE or HMAC configured)."""
    return config.curve.enabled or config.hmac_key is not None or config.hmac_key_env is not None


def algorithm_for(config: TransportConfig) -> str:
    """The digest this side computes (prefill) or requires (decode) for ``config``.

    ``transport.mooncake.digest`` ``"auto"`` means BLAKE3 when the headers are
    authenticated (only then can a digest stop a forger) and xxh3-128 otherwise.
    """
    mode = config.mooncake.digest
    if mode != "auto":
        return mode
    return "blake3" if authenticated(config) else "xxh3_128"


def digest(algorithm: str, buf: Buffer) -> bytes:
    """``algorithm``'s digest of ``buf`` (any contiguous buffer, read in place)."""
    return DIGESTS[algorithm](buf)


def verify(view: memoryview, expected: bytes, required: str, field: str, request_id: str) -> None:
    """Check ``view`` (a slot region, read in place) against the header's ``expected`` digest.

    ``required`` is the decode's algorithm: with ``"blake3"`` a 16-byte (forgeable)
    digest is refused; with ``"xxh3_128"`` either strength is accepted. Raises
    :class:`IntegrityError` naming ``field`` on a missing, unknown or different digest.
    """
    algorithm = BY_LENGTH.get(len(expected))
    if algorithm is None:
        what = "no digest" if not expected else f"a {len(expected)}-byte digest (expected 16 or 32)"
        raise IntegrityError(f"the header carries {what} for this slot region", field=field, request_id=request_id)
    if required == "blake3" and algorithm != "blake3":
        raise IntegrityError(
            "a 16-byte xxh3-128 digest is refused: the decode requires BLAKE3 (authenticated mode)",
            field=field,
            request_id=request_id,
        )
    if DIGESTS[algorithm](view) != expected:
        raise IntegrityError(
            f"the {view.nbytes} bytes in the slot do not match the header's {algorithm} digest "
            "(unwritten, stale, torn or tampered)",
            field=field,
            request_id=request_id,
        )
