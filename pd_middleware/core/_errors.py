"""The error hierarchy: one root, one family per concern.

Every error carries its context as attributes so that callers (and tests) can act on
it without parsing messages:

- :class:`ConfigError` ``.issues`` lists every problem found, each a
  :class:`ConfigIssue` with the full key path (``synthesizer.options.top_k``);
  ``.path`` is the first one's and ``.source`` the file it came from, if any.
- :class:`PluginError` ``.plugin`` names the plugin and ``.key`` the config key that
  selected it.
- :class:`ValidationError` (and its wire subclass) ``.field`` and ``.request_id``.
- :class:`TransferError` ``.op``, ``.code`` and ``.peer``.
- :class:`ExactnessError` ``.reason``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class PDMiddlewareError(Exception):
    """Root of every error pd-middleware raises on purpose."""


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    """One problem in a config: the full key path (``model.vocab_sise``) and what is wrong."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"at {self.path}: {self.message}" if self.path else self.message


class ConfigError(PDMiddlewareError):
    """A config file or mapping is malformed.

    ``.issues`` lists every problem found (a loader reports them all at once), each with
    its full key path; ``.path`` and ``.detail`` are the first one's, and ``.source`` is
    the file (or ``<inline JSON>``) it came from, if any.
    """

    def __init__(
        self, message: str, *, path: str = "", source: str | None = None, issues: Sequence[ConfigIssue] = ()
    ) -> None:
        self.issues: tuple[ConfigIssue, ...] = tuple(issues) or (ConfigIssue(path, message),)
        self.path = path
        self.source = source
        self.detail = message
        origin = f" ({source})" if source else ""
        if len(self.issues) == 1:
            where = f" at {path}" if path else ""
            text = f"config error{where}{origin}: {message}"
        else:
            lines = "".join(f"\n  {i}" for i in self.issues)
            text = f"config error{origin}: {len(self.issues)} problems:{lines}"
        super().__init__(text)

    @classmethod
    def from_issues(cls, issues: Sequence[ConfigIssue], source: str | None = None) -> ConfigError:
        """One error carrying every issue; ``.path``/``.detail`` are the first issue's."""
        first = issues[0]
        return cls(first.message, path=first.path, source=source, issues=issues)


class PluginError(PDMiddlewareError):
    """A plugin could not be found, loaded, registered or built.

    ``.plugin`` is the plugin's name (or entry-point/``module:attr`` string) and ``.key``
    the config key that selected it, when one did.
    """

    def __init__(self, message: str, *, plugin: Any = None, key: str | None = None) -> None:
        self.plugin = plugin
        self.key = key
        where = f" (config key {key})" if key else ""
        super().__init__(f"plugin error{where}: {message}")
        self.detail = message


class ValidationError(PDMiddlewareError):
    """A payload or proposal failed validation.

    ``.field`` names the offending field and ``.request_id`` the request it belongs to
    (``None`` when the request id itself could not be read).
    """

    def __init__(self, message: str, *, field: str, request_id: str | None = None) -> None:
        self.field = field
        self.request_id = request_id
        super().__init__(f"request {request_id!r}: field {field!r}: {message}")
        self.detail = message


class WireError(ValidationError):
    """A control message or tensor frame broke the wire schema."""


class TransferError(PDMiddlewareError):
    """A data-plane (Mooncake) or control-plane operation failed.

    ``.op`` is the operation (``transfer_check_status``, ``send_probe``...), ``.code`` the
    engine's integer return code (``None`` if there was none) and ``.peer`` the remote
    endpoint.
    """

    def __init__(self, message: str, *, op: str, code: int | None = None, peer: str | None = None) -> None:
        self.op = op
        self.code = code
        self.peer = peer
        super().__init__(f"{op} failed (code={code}, peer={peer}): {message}")
        self.detail = message


class NoSlotError(TransferError):
    """Every receive slot stayed busy for longer than the configured wait."""


class TransferAbandoned(TransferError):
    """A bulk write was given up on (past ``write_timeout_s``, or timed out in the engine).

    Unlike a failed write it may still land later, so its slot must be retired (never
    written again) until a reconnect brings a new grant. ``.code`` is the engine's code
    when the engine reported the timeout, None when this adapter gave up.
    """


class IntegrityError(TransferError):
    """A payload's bulk bytes do not match their authenticated header.

    Raised by the decode before anything is delivered: a slot generation that is stale or
    foreign, or a region whose digest differs (an unwritten, stale, torn or tampered
    slot). ``.field`` names the region (``hidden.digest``, ``proposal.data.gen``) and
    ``.request_id`` its request; the failure is counted as ``transfer:digest``.
    """

    def __init__(self, message: str, *, field: str, request_id: str | None = None, peer: str | None = None) -> None:
        super().__init__(message, op="verify", peer=peer)
        self.field = field
        self.request_id = request_id


class ExactnessError(PDMiddlewareError):
    """A proposal/drafting combination would bias the verifier's output law."""

    def __init__(self, message: str, *, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


class OptionValueError(ValueError, PDMiddlewareError):
    """Raised by a config struct's ``__post_init__`` to reject one field's value.

    The loader turns it into a :class:`ConfigError` whose path is the struct's own
    location plus ``field`` (``arms[1].weight``), so nested structs need not know
    where they sit. (A ``ValueError`` because that is what msgspec locates.)
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")
