"""A raw ZMTP 3.0 client over a plain TCP socket, for attacks libzmq would not make.

pyzmq always sends whole messages; an attacker need not. This client speaks just enough
of ZMTP 3.0 (RFC 23): the 64-byte greeting with the NULL mechanism, the READY command
(``Socket-Type: DEALER``) and then frames with any flags, e.g. one message whose every
frame has MORE set and which never ends. Used by reliability/attacks.py and the tests.
"""

from __future__ import annotations

import socket
import struct

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


def _frame(body: bytes, flags: int) -> bytes:
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def _prop(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


class RawZmtp:
    """One TCP connection to ``host:port`` that completed (or tried) a NULL handshake."""

    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def handshake(self) -> bool:
        """Send the NULL greeting and READY; True when the peer answered with its own
        greeting and READY (False: it closed the connection, e.g. a CURVE server)."""
        greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)
        try:
            self.sock.sendall(greeting)
            self.sock.sendall(_frame(b"\x05READY" + _prop(b"Socket-Type", b"DEALER"), _COMMAND))
            got = b""
            while len(got) < 64 + 2:
                chunk = self.sock.recv(4096)
                if not chunk:
                    return False
                got += chunk
            return got[:1] == b"\xff" and got[12:16] == b"NULL"
        except OSError:
            return False

    def send_frame(self, body: bytes, more: bool) -> None:
        """One message frame (MORE set when ``more``)."""
        self.sock.sendall(_frame(body, _MORE if more else 0))

    def stream_more(self, total_bytes: int, frame_bytes: int = 0) -> int:
        """Send never-ending-message frames (MORE on every one) until ``total_bytes`` went
        out or the peer closed; return the bytes sent."""
        one = _frame(bytes(frame_bytes), _MORE)
        chunk = one * max(1, 65536 // len(one))
        sent = 0
        try:
            while sent < total_bytes:
                self.sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass
        return sent

    def close(self) -> None:
        self.sock.close()
