"""Plugin contracts: the three kinds of plugin and when each runs.

Every plugin is published as a :class:`PluginSpec`, through the entry-point group
``pd_middleware.plugins`` or a ``module:attr`` path in a config. The spec's
``factory(options, context)`` builds the plugin object once, when a config is resolved;
its methods are then called on the hot path.

``hook`` (:class:`ReceiveHook`), **decode side**
    ``on_receive(payload, context)`` runs once per incoming payload, in config order,
    on the receiver's thread, after the wire message is validated and before the
    synthesizer. It may return a replacement :class:`~pd_middleware.Payload`, set
    ``context.arm`` (A/B routing; such a hook declares ``routes_arms = True``), record,
    or raise to fail *that payload only* (the failure is counted and reported with the
    hook's name). It must not block for long: every payload behind it waits.

``synthesizer`` (:class:`Synthesizer`), **decode side**
    ``synthesize(payload)`` runs once per payload, right after the hooks, on the same
    thread. It returns the proposal descriptor the assembler will write, or ``None``
    when rejection sampling is off. It must be exact for the payload's provenance or
    fall back to one-hot (see :class:`~pd_middleware.decode.guard.ProvenanceGuard`). Never
    blocks; never builds a V-wide row for a one-hot or sparse proposal.

``encoder`` (:class:`ProposalEncoder`), **prefill side**
    ``encode(probs, uniforms=...)`` runs once per batch of finished prefill requests.
    It builds the distribution it will send, draws X from exactly that distribution
    and returns X, q(X), the encoded proposal and the provenance. It runs where
    ``probs`` lives (the accelerator on a server) and copies to the host only what it
    sends; it does no I/O. Draw (b, s) inverts the CDF at ``uniforms[b, s]`` when
    given (the engine's per-request randomness, :mod:`pd_middleware.sampling.draws`), else uses
    ``generator``.

**Engine capabilities.** A plugin that needs something only the engine has (the decode's
own draft head, :class:`~pd_middleware.core.draft_head.DraftHead`, for the ``recompute``
synthesizer) names it in :attr:`PluginSpec.needs`; the engine offers what it has in
:attr:`PluginContext.capabilities`. A plugin whose need the engine does not offer is
refused when it is built, at startup (:meth:`~pd_middleware.registry.PluginRegistry.build`),
with a :class:`~pd_middleware.ConfigError` naming the config key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    import torch

    from .payload import EncodedProposal, Payload, Provenance
    from .proposal import Proposal

PluginKind = Literal["hook", "synthesizer", "encoder"]
PLUGIN_KINDS: tuple[str, ...] = ("hook", "synthesizer", "encoder")

#: The method each kind must implement and its parameters after ``self``.
KIND_METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "hook": ("on_receive", ("payload", "context")),
    "synthesizer": ("synthesize", ("payload",)),
    "encoder": ("encode", ("probs",)),
}


@dataclass(frozen=True, slots=True)
class PluginContext:
    """Deployment facts a plugin factory receives next to its own options."""

    vocab_size: int
    """Target vocabulary size V: the width of every proposal row."""
    num_steps: int
    """Draft steps S per request: 1 single-layer EAGLE, >1 a multi-layer chain."""
    rejection_sampling: bool
    """Whether the verifier uses rejection sampling (and so needs ``draft_probs``)."""
    device: str = "cpu"
    """Torch device of the assembler buffer (``cpu``, ``cuda``, ``cuda:1``...)."""
    side: Literal["prefill", "decode"] = "decode"
    """Which process builds the plugin."""
    arms: tuple[tuple[str, int], ...] = ()
    """A/B arms as ``(name, weight)`` in config order; empty without ``[[arms]]``."""
    capabilities: Mapping[str, Any] = field(default_factory=dict)
    """What the engine offers plugins, by name (:data:`CAPABILITIES`): ``draft_head``, the
    decode's :class:`~pd_middleware.core.draft_head.DraftHead`. Empty when it offers nothing."""


#: Capability names an engine may offer in :attr:`PluginContext.capabilities`.
CAPABILITIES: tuple[str, ...] = ("draft_head",)


class ReceiveContext(msgspec.Struct):
    """Per-payload facts the receive path carries alongside the payload.

    Hooks may set ``arm``; the pipeline reads it to pick the synthesizer.
    """

    peer: str | None = None
    """Identity of the prefill that sent the payload, when the transport knows it."""
    arm: str = "default"
    """A/B arm the payload is routed to (``default`` without A/B)."""
    received_at: float = 0.0
    """``time.perf_counter()`` when the control message arrived."""


@runtime_checkable
class ReceiveHook(Protocol):
    """Decode side, per payload, before synthesis. See the module docstring."""

    def on_receive(self, payload: Payload, context: ReceiveContext) -> Payload | None: ...


@runtime_checkable
class Synthesizer(Protocol):
    """Decode side, per payload, after the hooks. See the module docstring."""

    def synthesize(self, payload: Payload) -> Proposal | None: ...


@dataclass(frozen=True, slots=True)
class EncodedBatch:
    """What an encoder returns for a batch of B requests with S steps each.

    ``tokens``: int64 (B, S) drafted ids; ``token_probs``: float32 (B, S) their
    probability under the law X was drawn from; ``proposals``: B encodings (``None``
    when the encoder ships no distribution); ``provenance``: shared by the batch.
    """

    tokens: torch.Tensor
    token_probs: torch.Tensor
    proposals: list[EncodedProposal | None]
    provenance: Provenance


@runtime_checkable
class ProposalEncoder(Protocol):
    """Prefill side, per batch. See the module docstring.

    ``probs``: float (B, S, V) draft probabilities *after* temperature (rows sum to 1),
    or (B, V) for single-layer, on any device; the encoder reports ``temperature`` in
    the provenance. ``uniforms``: float64 (B, S) in [0, 1), one per draw; an encoder
    without this parameter is still served (one call per request, on a host copy).
    """

    def encode(
        self,
        probs: torch.Tensor,
        *,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        uniforms: torch.Tensor | None = None,
    ) -> EncodedBatch: ...


class NoOptions:
    """Options type for plugins that take none (an empty table is accepted)."""


@dataclass(frozen=True)
class PluginSpec:
    """How a plugin is published.

    ``factory(options, context)`` returns the plugin object; ``options`` is the typed
    options class (a ``msgspec.Struct`` with ``forbid_unknown_fields=True``, or
    :class:`NoOptions`). ``name`` is unique within its ``kind``.
    """

    name: str
    kind: PluginKind
    factory: Callable[[Any, PluginContext], Any]
    options: type = NoOptions
    summary: str = ""
    tags: tuple[str, ...] = field(default=())
    needs: tuple[str, ...] = field(default=())
    """Engine capabilities the plugin needs (names from :data:`CAPABILITIES`); a plugin is
    refused at startup when the engine does not offer one of them."""
