"""Transport configuration: the ``[transport]`` table of a pd-middleware config.

Typed, frozen and strict like the rest of the config: unknown keys are errors, and a
bad value raises :class:`~pd_middleware.core._errors.OptionValueError` from ``__post_init__``,
which the config loader turns into a :class:`~pd_middleware.ConfigError` whose path is
the full key (``transport.slots.count``). Secrets can stay out of files: set
``hmac_key_env`` to the name of an environment variable instead of ``hmac_key``, and
``curve.secret_key_env`` (or ``curve.secret_key_file``) for CURVE.

Defaults suit one machine (loopback, TCP); see ``docs/transport.md`` for RDMA across
machines.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Literal

import msgspec

from ..core._errors import ConfigError, OptionValueError

_STRUCT = dict(forbid_unknown_fields=True, frozen=True, kw_only=True)
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A Z85-encoded Curve25519 key: 40 characters of the Z85 alphabet.
_Z85_RE = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")

#: Inline/bulk crossover measured by ``benchmarks/bulk.py --crossover`` on 2-core
#: loopback TCP (see docs/transport.md): below this many bulk bytes per payload, raw
#: ZMQ frames beat a Mooncake write plus the header round.
DEFAULT_INLINE_THRESHOLD = 128 * 1024


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP, ``[::1]``, ``localhost``) is loopback: 127.0.0.0/8 or ::1.

    Anything else, a name or ``*`` included, is not: it may reach beyond this machine.
    """
    h = host.strip()
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def host_of(address: str) -> str:
    """The host of a ``tcp://host:port`` address (brackets kept off an IPv6 host)."""
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):
        return rest[1 : rest.find("]")] if "]" in rest else rest
    return rest.rsplit(":", 1)[0]


def insecure_reason(cfg: TransportConfig, host: str, what: str) -> str | None:
    """Why ``cfg`` must not ``what`` (bind / connect to) ``host`` as configured, or None.

    Beyond loopback only CURVE keeps a stranger's bytes out of the process (libzmq
    buffers a whole multipart message before anyone can count its frames), so CURVE is
    required there unless ``security = "insecure"`` says otherwise, explicitly.
    """
    if cfg.curve.enabled or cfg.security == "insecure" or is_loopback(host):
        return None
    mode = "HMAC" if cfg.hmac_key is not None or cfg.hmac_key_env is not None or cfg.hmac_peers else "no authentication"
    return (
        f"would {what} {host!r}, beyond loopback, with {mode}: CURVE is required there "
        "(curve.enabled = true; keys: `pd-middleware keys new NAME`), "
        'or set security = "insecure" to accept strangers\' bytes'
    )


def _is_ip(h: str) -> bool:
    try:
        ipaddress.ip_address(h)
    except ValueError:
        return False
    return True


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise OptionValueError(field, message)


#: ZMQ high-water mark, in messages, where ``hwm`` is not set (see TransportConfig.recv_hwm).
DEFAULT_HWM = 100_000


class LimitsConfig(msgspec.Struct, **_STRUCT):
    """Size caps the decode enforces on every inbound message before allocating."""

    # Largest msgpack control frame (header, hello...) accepted, in bytes.
    max_message_bytes: int = 64 * 1024
    # Largest single tensor (inline frame or slot range), in bytes; also caps zmq frames.
    max_tensor_bytes: int = 64 * 1024 * 1024
    # Most ZMQ frames one message may have (header + inline tensors + signature).
    max_frames: int = 8
    # Most draft steps S one payload may carry.
    max_steps: int = 64
    # Largest vocabulary size V a payload may declare.
    max_vocab: int = 1 << 24
    # Longest request id, in characters.
    max_request_id: int = 256
    # Most outcomes waiting for the scheduler; past it the receiver stops reading (backpressure).
    max_queued_outcomes: int = 65536
    # Most inline tensor bytes waiting for the scheduler; past it the receiver stops reading.
    max_queued_inline_bytes: int = 256 * 1024 * 1024
    # Most deliveries the scheduler may hold unreleased; past it the receiver stops reading.
    # It bounds the table of live request ids (each owned by its peer until released).
    max_live_requests: int = 65536
    # Hidden-state width H every payload must carry (elements); 0 = not checked.
    hidden_size: int = 0
    # Hidden-state dtype every payload must carry; None = not checked.
    hidden_dtype: Literal["bf16", "fp16", "fp32"] | None = None

    def __post_init__(self) -> None:
        _check(1024 <= self.max_message_bytes <= 1 << 26, "max_message_bytes", "must be in [1024, 2**26]")
        _check(1 <= self.max_tensor_bytes <= 1 << 34, "max_tensor_bytes", "must be in [1, 2**34]")
        _check(2 <= self.max_frames <= 64, "max_frames", "must be in [2, 64]")
        _check(1 <= self.max_steps <= 4096, "max_steps", "must be in [1, 4096]")
        _check(1 <= self.max_vocab <= 1 << 30, "max_vocab", "must be in [1, 2**30]")
        _check(1 <= self.max_request_id <= 65536, "max_request_id", "must be in [1, 65536]")
        _check(1 <= self.max_queued_outcomes <= 1 << 24, "max_queued_outcomes", "must be in [1, 2**24]")
        _check(
            1 << 16 <= self.max_queued_inline_bytes <= 1 << 40, "max_queued_inline_bytes", "must be in [2**16, 2**40]"
        )
        _check(1 <= self.max_live_requests <= 1 << 24, "max_live_requests", "must be in [1, 2**24]")
        _check(0 <= self.hidden_size <= 1 << 20, "hidden_size", "must be in [0, 2**20]")


class SlotsConfig(msgspec.Struct, **_STRUCT):
    """Decode-side receive slots: Mooncake-registered memory the prefills write into."""

    # Total slots the decode allocates (count x size_bytes bytes are registered once).
    count: int = 256
    # Bytes per slot: must hold one payload's bulk tensors (hidden + proposal).
    size_bytes: int = 1 << 20
    # Slots granted to each prefill peer at hello (at most what is left in the pool).
    per_peer: int = 64
    # How long a prefill waits for a free slot before NoSlotError, in seconds.
    wait_s: float = 5.0

    def __post_init__(self) -> None:
        _check(0 <= self.count <= 1 << 20, "count", "must be in [0, 2**20]")
        _check(64 <= self.size_bytes <= 1 << 32, "size_bytes", "must be in [64, 2**32]")
        _check(0 <= self.per_peer <= 1 << 20, "per_peer", "must be in [0, 2**20]")
        _check(0.0 <= self.wait_s <= 3600.0, "wait_s", "must be in [0, 3600]")


class MooncakeConfig(msgspec.Struct, **_STRUCT):
    """The Mooncake transfer engine (data plane). Ignored when no engine is opened."""

    # Open an engine in open_receiver/open_sender; false = inline ZMQ frames only.
    enabled: bool = True
    # Address the engine advertises to peers: 127.0.0.1 on one machine, the NIC's IP across machines.
    host: str = "127.0.0.1"
    # "tcp" on loopback/Ethernet, "rdma" for InfiniBand/RoCE (with device_names).
    protocol: Literal["tcp", "rdma"] = "tcp"
    # RDMA NICs, comma-separated (e.g. "mlx5_0,mlx5_1"); empty for TCP.
    device_names: str = ""
    # Set MC_FORCE_TCP=1 before the engine starts (auto-discovery would pick RDMA if present).
    force_tcp: bool = True
    # MC_LOG_LEVEL used when the environment does not set it.
    log_level: Literal["INFO", "WARNING", "ERROR"] = "WARNING"
    # A write not complete after this many seconds fails with TransferError (op transfer_check_status).
    write_timeout_s: float = 30.0
    # Bulk writes a prefill sender keeps running at once (pipelined: send() returns once its
    # write is submitted); 1 = send() waits for its own write and raises its failure.
    max_inflight_writes: int = 8
    # Digest that ties each bulk region to its header (transport/integrity.py): "auto" = BLAKE3
    # when the control plane is authenticated, else xxh3-128; the decode refuses weaker ones.
    digest: Literal["auto", "xxh3_128", "blake3"] = "auto"

    def __post_init__(self) -> None:
        _check(bool(self.host), "host", "must not be empty")
        _check(0.0 < self.write_timeout_s <= 3600.0, "write_timeout_s", "must be in (0, 3600]")
        _check(1 <= self.max_inflight_writes <= 64, "max_inflight_writes", "must be in [1, 64]")
        if self.protocol == "rdma":
            _check(not self.force_tcp, "force_tcp", "must be false when protocol is 'rdma'")
            _check(bool(self.device_names), "device_names", "must name the RDMA NICs when protocol is 'rdma'")


class CurveConfig(msgspec.Struct, **_STRUCT):
    """CURVE (libzmq's Curve25519 encryption and authentication) on the control socket.

    The recommended mode: a ZAP allowlist keeps every unlisted key out at the handshake,
    before libzmq buffers a single message, and the authenticated key, not the hello
    name, is the peer's identity. See docs/transport.md for key generation.
    """

    # Turn CURVE on (both sides must agree).
    enabled: bool = False
    # Environment variable holding this node's Z85 secret key (40 characters).
    secret_key_env: str | None = None
    # File holding this node's secret key: a zmq.auth .key_secret certificate or one Z85 line.
    secret_key_file: str | None = None
    # Prefill side: the decode's Z85 public key.
    server_key: str | None = None
    # Decode side: allowed prefills as name -> Z85 public key; the name is the peer's identity.
    clients: dict[str, str] = {}
    # Decode side: a directory of zmq.auth public certificates (NAME.key); NAME is the identity.
    clients_dir: str | None = None

    def __post_init__(self) -> None:
        _check(
            self.secret_key_env is None or bool(_ENV_RE.match(self.secret_key_env)),
            "secret_key_env",
            "must be an environment variable name",
        )
        _check(
            self.secret_key_env is None or self.secret_key_file is None,
            "secret_key_file",
            "set secret_key_env or secret_key_file, not both",
        )
        _check(
            self.server_key is None or bool(_Z85_RE.match(self.server_key)),
            "server_key",
            "must be a 40-character Z85 key",
        )
        for name, key in self.clients.items():
            _check(
                bool(name) and bool(_Z85_RE.match(key)), f"clients.{name}", "must map a name to a 40-character Z85 key"
            )
        if self.enabled:
            _check(
                self.secret_key_env is not None or self.secret_key_file is not None,
                "secret_key_env",
                "CURVE needs this node's secret key (secret_key_env or secret_key_file)",
            )


class TransportConfig(msgspec.Struct, **_STRUCT):
    """Control plane (ZMQ), data plane (Mooncake) and their safety limits."""

    # Interface the decode receiver binds; loopback unless you mean to expose it.
    bind_host: str = "127.0.0.1"
    # TCP port of the decode receiver; 0 picks a random free port.
    port: int = 0
    # Payloads whose bulk tensors total at most this many bytes travel inline as ZMQ frames.
    inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD
    # How often each side sends a heartbeat when otherwise idle, in seconds.
    heartbeat_s: float = 0.5
    # A peer silent for this long is lost: its expected requests fail, its slots return.
    peer_timeout_s: float = 5.0
    # How long connect()/reconnect() waits for the decode's slot grant, in seconds.
    connect_timeout_s: float = 5.0
    # Shared secret for HMAC-SHA256 over every frame; None = off.
    hmac_key: str | None = None
    # Name of an environment variable holding the secret (keeps it out of config files).
    hmac_key_env: str | None = None
    # Decode side: one HMAC key per prefill, as name -> environment variable holding that
    # prefill's key (each prefill signs with its own hmac_key/hmac_key_env). A hello's name
    # must then be the one whose key signed it: a key holder cannot be another prefill.
    # Empty (default): one shared key (hmac_key/hmac_key_env), which any holder can use as any name.
    hmac_peers: dict[str, str] = {}
    # ZMQ send/receive high-water mark per socket, in messages. None (default): 100,000,
    # except the decode's receive side, which gets max_queued_inline_bytes // max_tensor_bytes
    # (at least 1), so what libzmq holds for a connection the loop stopped reading stays
    # within about the inline cap (see recv_hwm).
    hwm: int | None = None
    # Most inbound messages the receiver handles before flushing acks.
    recv_batch: int = 256
    # "auto": CURVE is required to bind or connect beyond loopback (127.0.0.0/8, ::1);
    # plain and HMAC stay the loopback default. "insecure": allow plain or HMAC anywhere
    # (a stranger can then reach Python: docs/transport.md, "Modes and threats").
    security: Literal["auto", "insecure"] = "auto"
    # What a "delivered" ack means: "queued" = on the scheduler's queue; "consumed" = the
    # scheduler released the Delivery (it was used), so a decode crash before that loses nothing silently.
    ack: Literal["queued", "consumed"] = "queued"
    curve: CurveConfig = CurveConfig()
    slots: SlotsConfig = SlotsConfig()
    limits: LimitsConfig = LimitsConfig()
    mooncake: MooncakeConfig = MooncakeConfig()

    def __post_init__(self) -> None:
        _check(bool(self.bind_host), "bind_host", "must not be empty")
        _check(0 <= self.port <= 65535, "port", "must be in [0, 65535]")
        _check(0 <= self.inline_threshold_bytes <= 1 << 34, "inline_threshold_bytes", "must be in [0, 2**34]")
        _check(0.01 <= self.heartbeat_s <= 60.0, "heartbeat_s", "must be in [0.01, 60]")
        _check(
            2 * self.heartbeat_s <= self.peer_timeout_s <= 3600.0,
            "peer_timeout_s",
            f"must be in [2 x heartbeat_s = {2 * self.heartbeat_s:g}, 3600]",
        )
        _check(0.0 < self.connect_timeout_s <= 600.0, "connect_timeout_s", "must be in (0, 600]")
        _check(self.hmac_key is None or len(self.hmac_key) >= 16, "hmac_key", "must be at least 16 characters")
        _check(
            self.hmac_key_env is None or bool(_ENV_RE.match(self.hmac_key_env)),
            "hmac_key_env",
            "must be an environment variable name",
        )
        _check(
            self.hmac_key is None or self.hmac_key_env is None,
            "hmac_key_env",
            "set hmac_key or hmac_key_env, not both",
        )
        for name, env in self.hmac_peers.items():
            _check(
                bool(name) and bool(_ENV_RE.match(env)),
                f"hmac_peers.{name}",
                "must map a prefill name to an environment variable name",
            )
        _check(
            not (self.hmac_peers and (self.hmac_key is not None or self.hmac_key_env is not None)),
            "hmac_peers",
            "set hmac_peers (a key per prefill) or a shared hmac_key/hmac_key_env on the decode, not both",
        )
        _check(self.hwm is None or 1 <= self.hwm <= 10_000_000, "hwm", "must be in [1, 10000000]")
        _check(1 <= self.recv_batch <= 1 << 16, "recv_batch", "must be in [1, 65536]")
        h = self.bind_host.strip("[]")
        if h == "*" or _is_ip(h):  # other names are checked by preflight, and when binding
            why = insecure_reason(self, self.bind_host, "bind")
            _check(why is None, "bind_host", why or "")
        _check(
            not (
                self.curve.enabled and (self.hmac_key is not None or self.hmac_key_env is not None or self.hmac_peers)
            ),
            "hmac_key",
            "CURVE already authenticates every message: set hmac_key or curve.enabled, not both",
        )

    def peer_secrets(self) -> dict[str, bytes]:
        """Decode side: each prefill's HMAC key by name, read from ``hmac_peers``' variables.

        Raises :class:`ConfigError` (path ``transport.hmac_peers.NAME``) for a variable
        unset or shorter than 16 characters.
        """
        out: dict[str, bytes] = {}
        for name, env in self.hmac_peers.items():
            value = os.environ.get(env)
            if value is None or len(value) < 16:
                raise ConfigError(
                    f"environment variable {env} is unset or shorter than 16 characters",
                    path=f"transport.hmac_peers.{name}",
                )
            out[name] = value.encode()
        return out

    def send_hwm(self) -> int:
        """ZMQ_SNDHWM of either side, and ZMQ_RCVHWM of the prefill's socket."""
        return self.hwm if self.hwm is not None else DEFAULT_HWM

    def recv_hwm(self) -> int:
        """ZMQ_RCVHWM of the decode's ROUTER: ``hwm`` when set, else derived from the inline
        cap, so a stalled scheduler's backlog in libzmq is bounded by about
        ``max_queued_inline_bytes`` (plus one message) instead of ``hwm`` full-size tensors."""
        if self.hwm is not None:
            return self.hwm
        return max(1, self.limits.max_queued_inline_bytes // self.limits.max_tensor_bytes)

    def secret(self) -> bytes | None:
        """The HMAC key as bytes, read from ``hmac_key`` or the ``hmac_key_env`` variable.

        Raises :class:`ConfigError` (path ``transport.hmac_key_env``) when the variable
        is unset or too short: a missing secret must not silently turn signing off.
        """
        if self.hmac_key is not None:
            return self.hmac_key.encode()
        if self.hmac_key_env is None:
            return None
        value = os.environ.get(self.hmac_key_env)
        if value is None or len(value) < 16:
            raise ConfigError(
                f"environment variable {self.hmac_key_env} is unset or shorter than 16 characters",
                path="transport.hmac_key_env",
            )
        return value.encode()
