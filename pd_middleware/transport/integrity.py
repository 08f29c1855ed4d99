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

A digest is *bound* to its use: it covers (request id, slot, generation, offset) and then
the bytes (:class:`Binder`), keyed with a key derived from the HMAC secret when one is
configured. So a digest copied from one header does not validate the same bytes for
another request, another use of the slot, or another grant.

A digest is self-describing by its length (16 bytes xxh3-128, 32 bytes BLAKE3). What
the check cannot see: bytes changed *after* the decode checked them (while the
scheduler uses the delivery), which only keeping the plane private prevents.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import blake3
import xxhash

from ..core._errors import IntegrityError

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
    return (
        config.curve.enabled
        or config.hmac_key is not None
        or config.hmac_key_env is not None
        or bool(config.hmac_peers)
    )


def algorithm_for(config: TransportConfig) -> str:
    """The digest this side computes (prefill) or requires (decode) for ``config``.

    ``transport.mooncake.digest`` ``"auto"`` means BLAKE3 when the headers are
    authenticated (only then can a digest stop a forger) and xxh3-128 otherwise.
    """
    mode = config.mooncake.digest
    if mode != "auto":
        return mode
    return "blake3" if authenticated(config) else "xxh3_128"


def key_for(config: TransportConfig) -> bytes | None:
    """The 32-byte key that binds bulk digests, derived from the HMAC secret (None without one)."""
    secret = config.secret()
    return key_from_secret(secret) if secret is not None else None


def key_from_secret(secret: bytes) -> bytes:
    """The bulk-digest key of an HMAC secret (a separate key: the HMAC key signs messages)."""
    return hashlib.blake2b(secret, digest_size=32, person=b"pd-bulk-digest").digest()


_BIND = struct.Struct(">IqQQ")


class Binder:
    """The digest of one slot region, bound to its use: (request id, slot, generation,
    offset), then the bytes. ``key`` (:func:`key_for`): BLAKE3 becomes a keyed MAC and
    xxh3-128 is seeded (still not a defence against a forger: that takes BLAKE3)."""

    def __init__(self, algorithm: str, key: bytes | None = None) -> None:
        if algorithm not in DIGESTS:
            raise ValueError(f"unknown digest algorithm {algorithm!r}")
        self.algorithm = algorithm
        self._key = key
        self._seed = int.from_bytes(key[:8], "big") if key is not None else 0

    def __call__(self, rid: str, slot: int, gen: int, offset: int, buf: Buffer) -> bytes:
        r = rid.encode()
        prefix = b"pd-slot-v1" + _BIND.pack(len(r), slot, gen, offset) + r
        if self.algorithm == "blake3":
            h = blake3.blake3(prefix, key=self._key) if self._key is not None else blake3.blake3(prefix)
            h.update(buf)
            return h.digest()
        x = xxhash.xxh3_128(prefix, seed=self._seed)
        x.update(buf)
        return x.digest()


def digest(algorithm: str, buf: Buffer) -> bytes:
    """``algorithm``'s digest of ``buf`` (any contiguous buffer, read in place)."""
    return DIGESTS[algorithm](buf)


def verify(
    view: memoryview,
    expected: bytes,
    required: str,
    field: str,
    request_id: str,
    use: tuple[int, int, int] = (0, 0, 0),
    key: bytes | None = None,
) -> None:
    """Check ``view`` (a slot region, read in place) against the header's ``expected`` digest.

    ``use``: the region's (slot, generation, offset), bound into the digest with
    ``request_id`` (:class:`Binder`, keyed with ``key``). ``required`` is the decode's
    algorithm: with ``"blake3"`` a 16-byte (forgeable) digest is refused; with
    ``"xxh3_128"`` either strength is accepted. Raises :class:`IntegrityError` naming
    ``field`` on a missing, unknown or different digest.
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
    if Binder(algorithm, key)(request_id, *use, view) != expected:
        raise IntegrityError(
            f"the {view.nbytes} bytes in the slot do not match the header's {algorithm} digest for this "
            "request, slot, generation and offset (unwritten, stale, torn, tampered or copied from another header)",
            field=field,
            request_id=request_id,
        )
