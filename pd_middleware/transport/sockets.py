"""The two control sockets, set up in one place: the decode's ROUTER and a prefill's DEALER.

Both: linger 0 (a closing socket never blocks ``Context.term``), the configured
high-water marks, ``ZMQ_MAXMSGSIZE`` (libzmq drops, and disconnects, any frame above it
before Python sees it) and, with ``curve.enabled``, CURVE: the server behind its ZAP
allowlist (:class:`~.auth.CurveGate`), the client with the decode's public key.
"""

from __future__ import annotations

import math
import time
from typing import Any

import zmq

from ..core._errors import ConfigError, TransferError
from .auth import CurveGate, curve_client, curve_server
from .config import TransportConfig, host_of, insecure_reason


def poll_ms(seconds: float) -> int:
    """A ``poll`` timeout of ``seconds``, in whole milliseconds, rounded up.

    pyzmq's ``poll`` truncates a float timeout to whole milliseconds, so a wait under
    1 ms became a 0 ms poll: the caller spun until its deadline passed (the receive loop
    spun through up to 1 ms of every ack interval, on a 2-core machine a quarter of the
    CPU the bulk benchmark had for the engine's own threads).
    """
    return max(0, math.ceil(seconds * 1000.0))


def _base(ctx: zmq.Context[Any], kind: int, cfg: TransportConfig, max_frame: int, rcvhwm: int) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SNDHWM, cfg.send_hwm())
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    return sock


def bind_router(
    ctx: zmq.Context[Any], cfg: TransportConfig, domain: str
) -> tuple[zmq.Socket[Any], str, CurveGate | None]:
    """The decode's bound ROUTER, its ``tcp://host:port`` and its CURVE gate (None without CURVE).

    Raises :class:`TransferError` (op ``bind``) when the address cannot be bound, and
    :class:`ConfigError` (``transport.security``) beyond loopback without CURVE unless
    ``security = "insecure"``.
    """
    why = insecure_reason(cfg, cfg.bind_host, "bind")
    if why is not None:
        raise ConfigError(why, path="transport.security")
    sock = _base(ctx, zmq.ROUTER, cfg, max(cfg.limits.max_message_bytes, cfg.limits.max_tensor_bytes), cfg.recv_hwm())
    gate = None
    try:
        if cfg.curve.enabled:
            gate = curve_server(sock, cfg.curve, domain)
        # A fixed port may still be held for a moment by a receiver stopping in this
        # process (libzmq unbinds asynchronously): retry briefly, then fail clearly.
        deadline = time.monotonic() + 2.0
        while True:
            try:
                if cfg.port:
                    sock.bind(f"tcp://{cfg.bind_host}:{cfg.port}")
                    port = cfg.port
                else:
                    port = sock.bind_to_random_port(f"tcp://{cfg.bind_host}")
                return sock, f"tcp://{cfg.bind_host}:{port}", gate
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE and cfg.port and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise TransferError(str(exc), op="bind", peer=f"{cfg.bind_host}:{cfg.port}") from None
    except BaseException:
        sock.close(0)
        if gate is not None:
            gate.close()
        raise


def connect_dealer(ctx: zmq.Context[Any], cfg: TransportConfig, address: str) -> zmq.Socket[Any]:
    """A prefill's DEALER connected (asynchronously, as ZMQ does) to ``address``.

    Raises :class:`ConfigError` (``transport.security``) for an address beyond loopback
    without CURVE unless ``security = "insecure"``.
    """
    why = insecure_reason(cfg, host_of(address), "connect to")
    if why is not None:
        raise ConfigError(why, path="transport.security")
    sock = _base(ctx, zmq.DEALER, cfg, cfg.limits.max_message_bytes, cfg.send_hwm())
    try:
        if cfg.curve.enabled:
            curve_client(sock, cfg.curve)
        sock.connect(address)
    except BaseException:
        sock.close(0)
        raise
    return sock
