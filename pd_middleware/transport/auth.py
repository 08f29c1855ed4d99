"""Optional shared-secret HMAC-SHA256 over every frame of a control message.

With a key configured, the sender appends one 32-byte signature frame computed over
all other frames, each prefixed by its 8-byte length (so bytes cannot be moved across
a frame boundary without breaking the signature). The receiver strips and checks it
with a constant-time compare *before* decoding anything; an unsigned or forged message
never reaches the decoder or the pipeline.

Not covered (see docs/transport.md): replay of a captured signed message, and
confidentiality (frames are not encrypted). Use a private network or a tunnel for that.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Sequence, Union

Buffer = Union[bytes, memoryview]

#: Length of the signature frame.
SIGNATURE_BYTES = 32


class Signer:
    """Signs and verifies multipart messages with one shared key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("HMAC key must be at least 16 bytes")
        self._base = hmac.new(key, digestmod=hashlib.sha256)

    def sign(self, frames: Sequence[Buffer]) -> bytes:
        """The signature frame for ``frames`` (append it as the last frame)."""
        h = self._base.copy()
        for f in frames:
            n = len(f) if isinstance(f, bytes) else memoryview(f).nbytes
            h.update(n.to_bytes(8, "little"))
            h.update(f)
        return h.digest()

    def verify(self, frames: Sequence[Buffer]) -> bool:
        """True when the last frame is a valid signature over the others."""
        if len(frames) < 2:
            return False
        mac = frames[-1]
        if (len(mac) if isinstance(mac, bytes) else memoryview(mac).nbytes) != SIGNATURE_BYTES:
            return False
        return hmac.compare_digest(self.sign(frames[:-1]), bytes(mac))
