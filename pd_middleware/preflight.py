"""Start-up checks beyond the schema: would this config actually start, and is it useful?

:func:`preflight` is what ``pd-middleware check-config`` runs after the config parsed and
every plugin resolved. It returns findings instead of raising, so one run shows all:

- ``error`` (the deployment would fail at start-up): an environment variable the config
  names (any ``*_env`` field, e.g. ``transport.hmac_key_env``) is unset; a host does not
  parse; the receive slots plus the proposal buffers do not fit in physical memory.
- ``warning`` (it starts, but not as intended): an encoder/synthesizer pair whose proposal
  can never reach the verifier (every payload falls back to one-hot, so the bytes are
  wasted and acceptance is one-hot's), found by running the pair on a few random rows;
  a memory total above what is available now; defaults standing in for model facts.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import msgspec

from .config import Config, ResolvedConfig, ResolvedPlugin

_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
# V used for the pair probe when the config leaves the vocabulary to the engine.
_PROBE_VOCAB = 4096
_PROBE_ROWS = 8


@dataclass(frozen=True, slots=True)
class Finding:
    """One preflight result: ``level``, the config key ``path`` it concerns, ``message``."""

    level: Literal["error", "warning", "note"]
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.path}: {self.message}" if self.path else f"{self.level}: {self.message}"


def _leaves(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, msgspec.Struct):
        for f in msgspec.structs.fields(obj):
            yield from _leaves(getattr(obj, f.name), f"{path}.{f.encode_name}" if path else f.encode_name)
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from _leaves(x, f"{path}[{i}]")
    else:
        yield path, obj


def check_env(config: Config) -> list[Finding]:
    """Every ``*_env`` field that names a variable must name one that is set."""
    out = []
    for path, value in _leaves(config):
        if path.endswith("_env") and isinstance(value, str) and value and value not in os.environ:
            out.append(Finding("error", path, f"environment variable {value} is not set"))
    return out


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def check_hosts(config: Config) -> list[Finding]:
    """``bind_host`` must be something ZMQ can bind; ``mooncake.host`` an IP or host name."""
    out = []
    t = config.transport
    bind = t.bind_host
    try:
        interfaces = {name for _, name in socket.if_nameindex()}
    except OSError:
        interfaces = set()
    if not (bind == "*" or _is_ip(bind) or bind == "localhost" or bind in interfaces):
        out.append(
            Finding(
                "error", "transport.bind_host", f"{bind!r} is not an IP address, '*', 'localhost' or a local interface"
            )
        )
    mc = getattr(t, "mooncake", None)
    host = getattr(mc, "host", None)
    if isinstance(host, str) and not (_is_ip(host) or _HOSTNAME_RE.match(host)):
        out.append(Finding("error", "transport.mooncake.host", f"{host!r} is not an IP address or a host name"))
    metrics = getattr(config, "metrics", None)
    mhost = getattr(metrics, "host", None)
    if (
        getattr(metrics, "port", None) is not None
        and isinstance(mhost, str)
        and not (mhost == "localhost" or _is_ip(mhost) or mhost in interfaces)
    ):
        out.append(
            Finding("error", "metrics.host", f"{mhost!r} is not an IP address, 'localhost' or a local interface")
        )
    return out


def _meminfo() -> tuple[int | None, int | None]:
    """(physical, available) bytes, or None where the platform does not say."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = None
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, avail


def check_memory(config: Config, physical: int | None = None, available: int | None = None) -> list[Finding]:
    """The receive slots (``count x size_bytes``, registered up front) plus the assembler's
    fp32 ``(max_batch, num_steps, V)`` buffers (``num_buffers`` of them, on CPU) must fit."""
    if physical is None and available is None:
        physical, available = _meminfo()
    slots = config.transport.slots
    need = slots.count * slots.size_bytes
    parts = [f"slots {slots.count} x {slots.size_bytes} B"]
    vocab = config.model.vocab_size
    steps = config.model.num_steps
    if config.decode.device == "cpu" and vocab and steps:
        buf = config.decode.max_batch * steps * vocab * 4 * config.decode.num_buffers
        need += buf
        parts.append(
            f"proposal buffers {config.decode.num_buffers} x {config.decode.max_batch} x {steps} x {vocab} x 4 B"
        )
    what = f"{_human(need)} ({' + '.join(parts)})"
    if physical is not None and need > physical:
        return [
            Finding("error", "transport.slots", f"needs {what}, more than this machine's {_human(physical)} of memory")
        ]
    if available is not None and need > available:
        return [Finding("warning", "transport.slots", f"needs {what}, more than the {_human(available)} available now")]
    return []


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def probe_pair(config: Config, registry: Any, encoder: ResolvedPlugin, synthesizer: ResolvedPlugin) -> str | None:
    """Run ``encoder`` then ``synthesizer`` on a few random rows (fixed seed).

    Returns why the pair can never hand a proposal to the verifier, or None when it does
    (or when neither side deals in proposals: a one-hot synthesizer needs none). The
    guard makes every such pair exact by falling back to one-hot; the warning is about
    bytes sent for nothing.
    """
    import torch

    from .core.metrics import Metrics
    from .core.payload import Payload
    from .core.proposal import OneHotProposal

    vocab = config.model.vocab_size or _PROBE_VOCAB
    steps = config.model.num_steps or 1
    ctx_pre = _context(config, vocab, steps, "prefill")
    ctx_dec = replace(ctx_pre, side="decode")
    enc = registry.build(encoder.spec, encoder.options, ctx_pre, encoder.key)
    syn = registry.build(synthesizer.spec, synthesizer.options, ctx_dec, synthesizer.key)
    metrics = Metrics()
    guard = getattr(syn, "guard", None)
    if guard is not None and hasattr(guard, "attach_metrics"):
        guard.attach_metrics(metrics)
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(_PROBE_ROWS, steps, vocab, generator=gen) * 2.0, dim=-1)
    batch = enc.encode(probs if steps > 1 else probs[:, 0], generator=gen)
    sent = sum(p is not None for p in batch.proposals)
    handed = 0
    for i in range(_PROBE_ROWS):
        payload = Payload(
            request_id=f"probe/{i}",
            draft_tokens=tuple(int(x) for x in batch.tokens[i].reshape(-1)),
            draft_probs=tuple(min(1.0, max(0.0, float(x))) for x in batch.token_probs[i].reshape(-1)),
            vocab_size=vocab,
            provenance=batch.provenance,
            proposal=batch.proposals[i],
        )
        prop = syn.synthesize(payload)
        handed += prop is not None and not isinstance(prop, OneHotProposal)
    if handed or (sent == 0 and guard is None):
        return None
    reasons = ", ".join(sorted(metrics.snapshot().get("fallbacks_by_reason", {}))) or "one-hot synthesizer"
    if sent:
        return (
            f"encoder {encoder.spec.name!r} sends a proposal that synthesizer {synthesizer.spec.name!r} never hands "
            f"to the verifier (every payload falls back to one-hot: {reasons}); the bytes are wasted"
        )
    return (
        f"encoder {encoder.spec.name!r} sends no usable proposal for synthesizer {synthesizer.spec.name!r}: "
        f"every payload falls back to one-hot ({reasons}), so this arm can never be better than one_hot"
    )


def _context(config: Config, vocab: int, steps: int, side: Literal["prefill", "decode"]) -> Any:
    from .core.contracts import PluginContext

    return PluginContext(
        vocab_size=vocab,
        num_steps=steps,
        rejection_sampling=config.decode.rejection_sampling,
        device="cpu",
        side=side,
        arms=tuple((a.name, a.weight) for a in config.arms),
    )


def check_pairs(config: Config, resolved: ResolvedConfig, registry: Any) -> list[Finding]:
    """:func:`probe_pair` for every arm that has both an encoder and a synthesizer."""
    out = []
    for i, (arm, syn) in enumerate(resolved.synthesizers.items()):
        enc = resolved.encoders.get(arm)
        if enc is None or syn is None:
            continue
        path = f"arms[{i}]" if config.arms else "synthesizer"
        if syn.spec.needs:
            # Built only where an engine offers its capabilities (the SGLang decode, the ab job).
            out.append(
                Finding(
                    "note",
                    path,
                    f"synthesizer {syn.spec.name!r} needs the engine capability {', '.join(syn.spec.needs)}: "
                    "checked when the engine starts, not probed here",
                )
            )
            continue
        guard_log = logging.getLogger("pd_middleware.decode.guard")
        was, guard_log.disabled = guard_log.disabled, True  # the probe's fallbacks are expected
        try:
            why = probe_pair(config, registry, enc, syn)
        except Exception as exc:
            out.append(
                Finding("warning", path, f"could not probe the encoder/synthesizer pair: {type(exc).__name__}: {exc}")
            )
            continue
        finally:
            guard_log.disabled = was
        if why:
            out.append(Finding("warning", path, why))
    return out


def preflight(config: Config, resolved: ResolvedConfig, registry: Any, *, probe: bool = True) -> list[Finding]:
    """Every start-up check; errors first. ``probe=False`` skips the pair probe (torch)."""
    out = check_env(config) + check_hosts(config) + check_memory(config)
    if probe and config.decode.rejection_sampling:
        out += check_pairs(config, resolved, registry)
    return sorted(out, key=lambda f: f.level != "error")
