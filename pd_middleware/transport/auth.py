"""Control-plane authentication: CURVE with a ZAP allowlist (recommended), or HMAC.

**CURVE** (libzmq's CurveZMQ: Curve25519 key exchange, encrypted and authenticated
frames, per-message nonces that make every replay fail). The decode runs a ZAP handler
(:class:`CurveGate`) that admits only the public keys on its allowlist; an unlisted or
unauthenticated client is refused during the ZMTP handshake, before libzmq buffers a
single message from it, so none of its bytes reaches Python. The authenticated key, read
from each message's ``User-Id`` property, is the peer's identity; the allowlist names it.

**HMAC** (kept for deployments without libsodium; no confidentiality). With a shared key
the sender appends two frames: a 24-byte *tail* (the connection's 16-byte random nonce
and an 8-byte sequence number) and a 32-byte HMAC-SHA256 over the direction, the tail
and every other frame, each prefixed by its 8-byte length. The receiver checks it with a
constant-time compare *before* decoding anything, then requires the nonce to be this
connection's and the sequence to grow (the window is strict: one ZMQ connection keeps
order), so a captured message replayed on the same or another connection is refused as
``wire:replay``. A hello opens a connection: it must carry sequence 0, a nonce not seen
before, and a timestamp within :data:`HELLO_FRESH_S` of the decode's clock. Any key
holder can still claim any hello name: HMAC authenticates the deployment, not the peer.

Key generation for CURVE (no CLI needed)::

    from pd_middleware.transport.auth import write_keypair
    public_file, secret_file = write_keypair("keys", "prefill-a")   # keys/prefill-a.key(_secret)
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import pathlib
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq
import zmq.auth

from ..core._errors import ConfigError

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

Buffer = bytes | memoryview

#: Length of the signature frame.
SIGNATURE_BYTES = 32
#: Length of the tail frame: nonce (16 bytes) then sequence number (8 bytes, big endian).
TAIL_BYTES = 24
NONCE_BYTES = 16
#: The nonce recorded for a message that carried none (unsigned: no HMAC configured).
NO_NONCE = bytes(NONCE_BYTES)
#: A signed hello is accepted this long (seconds) either side of the decode's wall clock.
HELLO_FRESH_S = 60.0
#: Direction tags inside the MAC: a message cannot be reflected back to its sender.
TO_DECODE = b"P"
TO_PREFILL = b"D"


def _nbytes(f: Buffer) -> int:
    return len(f) if isinstance(f, bytes) else memoryview(f).nbytes


class Signer:
    """Signs and verifies multipart messages with one shared key (HMAC mode)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("HMAC key must be at least 16 bytes")
        self._base = hmac.new(key, digestmod=hashlib.sha256)

    def _mac(self, direction: bytes, tail: bytes, frames: Sequence[Buffer]) -> bytes:
        h = self._base.copy()
        h.update(direction)
        h.update(tail)
        for f in frames:
            h.update(_nbytes(f).to_bytes(8, "little"))
            h.update(f)
        return h.digest()

    def sign(self, frames: Sequence[Buffer], nonce: bytes, seq: int, direction: bytes) -> list[bytes]:
        """The two frames to append to ``frames``: the tail and the signature."""
        tail = nonce + seq.to_bytes(8, "big")
        return [tail, self._mac(direction, tail, frames)]

    def open(self, frames: Sequence[Buffer], direction: bytes) -> tuple[bytes, int] | None:
        """``(nonce, seq)`` when the last two frames are a valid tail and signature over
        the others (which are then the message), else None. Replay is the caller's check."""
        if len(frames) < 3:
            return None
        tail, mac = frames[-2], frames[-1]
        if _nbytes(tail) != TAIL_BYTES or _nbytes(mac) != SIGNATURE_BYTES:
            return None
        tail = bytes(tail)
        if not hmac.compare_digest(self._mac(direction, tail, frames[:-2]), bytes(mac)):
            return None
        return tail[:NONCE_BYTES], int.from_bytes(tail[NONCE_BYTES:], "big")


class HelloGuard:
    """The decode's memory of HMAC hellos: each opens a connection once, while fresh."""

    #: Most nonces remembered; each is kept while its hello looks fresh (at most ~2 HELLO_FRESH_S).
    CAP = 1 << 16

    def __init__(self) -> None:
        self._nonces: dict[bytes, float] = {}

    def check(self, ts: float, nonce: bytes, seq: int) -> str:
        """Why a verified hello is a replay or stale ('' when it is fresh); remembers its nonce."""
        import time

        wall = time.time()
        nonces = self._nonces
        if len(nonces) >= self.CAP or (nonces and next(iter(nonces.values())) < wall):
            for n, until in list(nonces.items()):
                if until < wall:
                    del nonces[n]
        if seq != 0:
            return f"a hello must open its connection with sequence 0, not {seq}"
        if not math.isfinite(ts):  # NaN compares False to every bound: it would look fresh forever
            return f"hello timestamp {ts!r} is not a finite time"
        if ts - wall > HELLO_FRESH_S:
            return (
                f"hello timestamp is {ts - wall:.0f} s in the future, off this clock by more than {HELLO_FRESH_S:g} s"
            )
        if wall - ts > HELLO_FRESH_S:
            return f"hello timestamp is {wall - ts:.0f} s in the past, off this clock by more than {HELLO_FRESH_S:g} s"
        if nonce in nonces:
            return "this hello's nonce was already used (a replayed hello)"
        if len(nonces) >= self.CAP:
            return "too many fresh hellos; try again shortly"
        # Remembered for as long as the hello looks fresh (until ts + HELLO_FRESH_S), and then
        # some: a hello dated in the future must not outlive the memory of its nonce.
        nonces[nonce] = max(wall, ts) + HELLO_FRESH_S + 1.0
        return ""


def new_nonce() -> bytes:
    """A fresh random connection nonce."""
    return os.urandom(NONCE_BYTES)


# -- CURVE ------------------------------------------------------------------------------


def write_keypair(directory: str | os.PathLike[str], name: str) -> tuple[str, str]:
    """Create ``NAME.key`` (public) and ``NAME.key_secret`` in ``directory``; return their paths.

    The public file goes into the decode's ``curve.clients_dir`` (or its Z85 text into
    ``curve.clients``); the secret file is this node's ``curve.secret_key_file``.
    """
    pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
    pub, sec = zmq.auth.create_certificates(str(directory), name)
    return str(pub), str(sec)


def load_secret_key(curve: object) -> tuple[bytes, bytes]:
    """This node's ``(public, secret)`` Z85 keys from ``curve.secret_key_env`` or ``secret_key_file``.

    Raises :class:`ConfigError` (path ``transport.curve....``) when the key is missing or malformed.
    """
    env = getattr(curve, "secret_key_env", None)
    path = getattr(curve, "secret_key_file", None)
    secret: bytes | None = None
    where = "transport.curve.secret_key_env"
    if env is not None:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"environment variable {env} is unset", path=where)
        secret = value.strip().encode()
    elif path is not None:
        where = "transport.curve.secret_key_file"
        try:
            _, sec = zmq.auth.load_certificate(path)
            secret = sec
        except (OSError, ValueError) as exc:
            try:
                secret = pathlib.Path(path).read_text().strip().encode()
            except OSError:
                raise ConfigError(f"cannot read {path}: {exc}", path=where) from None
    if secret is None or len(secret) != 40:
        raise ConfigError("missing or not a 40-character Z85 secret key", path=where)
    try:
        return zmq.curve_public(secret), secret
    except (zmq.ZMQError, ValueError) as exc:
        raise ConfigError(f"not a valid Z85 secret key: {exc}", path=where) from None


def load_allowlist(curve: object) -> dict[str, str]:
    """Allowed client keys as Z85 public key -> peer name (``clients`` plus ``clients_dir``).

    A name is an identity: two keys under one name (``clients`` and a same-name file in
    ``clients_dir``), or one key under two names, raise :class:`ConfigError`.
    """
    allowed: dict[str, str] = {}
    where: dict[str, str] = {}  # name -> where it was defined

    def add(key: str, name: str, origin: str, path: str) -> None:
        if name in where:
            raise ConfigError(f"peer name {name!r} is given twice: {where[name]} and {origin}", path=path)
        if key in allowed:
            raise ConfigError(f"{origin}: the key of {name!r} is already allowed as {allowed[key]!r}", path=path)
        allowed[key] = name
        where[name] = origin

    for name, key in getattr(curve, "clients", {}).items():
        add(key, name, f"clients.{name}", "transport.curve.clients")
    directory = getattr(curve, "clients_dir", None)
    if directory is not None:
        root = pathlib.Path(directory)
        if not root.is_dir():
            raise ConfigError(f"{directory} is not a directory", path="transport.curve.clients_dir")
        for f in sorted(root.glob("*.key")):
            try:
                pub, _ = zmq.auth.load_certificate(str(f))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{f.name}: {exc}", path="transport.curve.clients_dir") from None
            add(pub.decode(), f.stem, f"clients_dir/{f.name}", "transport.curve.clients_dir")
    return allowed


class _Allowlist:
    """ZAP credentials provider: admits exactly the keys of one receiver's allowlist."""

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key.decode("ascii", "replace") in self.keys


# One ZAP handler per zmq.Context (libzmq allows one): receivers sharing a context each
# get their own ZAP domain and allowlist on it.
_GATES: weakref.WeakKeyDictionary[zmq.Context[Any], tuple[ThreadAuthenticator, set[str]]] = weakref.WeakKeyDictionary()
_GATES_LOCK = threading.Lock()


def _start(auth: ThreadAuthenticator, wait_s: float = 2.0) -> None:
    """Start a ZAP handler; the inproc endpoint of one stopped just before in this
    context may take a moment to be released (libzmq unbinds asynchronously)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            auth.start()
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class CurveGate:
    """The decode's ZAP allowlist for one server socket (see the module docstring)."""

    def __init__(self, ctx: zmq.Context[Any], domain: str, allowed: dict[str, str]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self._ctx = ctx
        self.domain = domain
        self.allowed = allowed
        with _GATES_LOCK:
            entry = _GATES.get(ctx)
            if entry is None:
                auth = ThreadAuthenticator(ctx)
                _start(auth)
                entry = (auth, set())
                _GATES[ctx] = entry
            auth, domains = entry
            auth.configure_curve_callback(domain=domain, credentials_provider=_Allowlist(allowed))
            domains.add(domain)

    def close(self) -> None:
        """Remove this socket's allowlist; the last one out stops the ZAP thread."""
        with _GATES_LOCK:
            entry = _GATES.get(self._ctx)
            if entry is None:
                return
            auth, domains = entry
            domains.discard(self.domain)
            getattr(auth, "credentials_providers", {}).pop(self.domain, None)
            if not domains:
                auth.stop()
                del _GATES[self._ctx]


def curve_server(sock: zmq.Socket[Any], curve: object, domain: str) -> CurveGate:
    """Make ``sock`` a CURVE server behind an allowlist gate (call before bind)."""
    pub, sec = load_secret_key(curve)
    allowed = load_allowlist(curve)
    if not allowed:
        raise ConfigError("CURVE is on but no client key is allowed", path="transport.curve.clients")
    gate = CurveGate(sock.context, domain, allowed)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, sec)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pub)
    return gate


def curve_client(sock: zmq.Socket[Any], curve: object) -> None:
    """Make ``sock`` a CURVE client of ``curve.server_key`` (call before connect)."""
    server = getattr(curve, "server_key", None)
    if server is None:
        raise ConfigError("CURVE is on but the decode's public key is not set", path="transport.curve.server_key")
    pub, sec = load_secret_key(curve)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, pub)
    sock.setsockopt(zmq.CURVE_SECRETKEY, sec)
