"""The ``ab_split`` receive hook: live A/B routing by a stable hash of the request id.

Each request goes to one arm of the config's ``[[arms]]``, with probability
proportional to the arm's ``weight``, decided by ``blake2b(salt + request_id)``: the
same request id always lands on the same arm, on every decode node and across restarts,
so retries and replays stay in their arm. Each arm has its own synthesizer (and so its
own fallback counters); the pipeline counts deliveries and failures per arm.

The prefill sends its richest encoding to every arm. That is safe: the one-hot arm is
exact for any X, and a compressed arm's provenance guard falls back to one-hot for any
payload whose X was not drawn from the encoding that arm hands the verifier.
"""

from __future__ import annotations

import bisect
import hashlib

import msgspec

from pd_middleware import OptionValueError, Payload, PluginContext, PluginSpec, ReceiveContext


class ABSplitOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``ab_split`` hook."""

    # Mixed into the hash: change it to draw a fresh, independent split.
    salt: str = ""

    def __post_init__(self) -> None:
        if len(self.salt) > 256:
            raise OptionValueError("salt", "must be at most 256 characters")


def arm_for(request_id: str, arms: tuple[str, ...], cumulative: tuple[int, ...], salt: bytes = b"") -> str:
    """The arm of ``request_id``: stable, weight-proportional (``cumulative`` weights)."""
    h = int.from_bytes(hashlib.blake2b(salt + request_id.encode(), digest_size=8).digest(), "big")
    return arms[bisect.bisect_right(cumulative, h % cumulative[-1])]


class ABSplitHook:
    """Decode side: sets ``context.arm`` for every payload."""

    #: Tells the middleware this hook assigns arms (``[[arms]]`` needs one such hook).
    routes_arms = True

    def __init__(self, options: ABSplitOptions, context: PluginContext) -> None:
        arms = [(n, w) for n, w in context.arms if w > 0]
        if not arms:
            raise OptionValueError("arms", "ab_split needs [[arms]] with at least one positive weight")
        self.arms = tuple(n for n, _ in arms)
        total = 0
        cum = []
        for _, w in arms:
            total += w
            cum.append(total)
        self.cumulative = tuple(cum)
        self.salt = options.salt.encode()

    def on_receive(self, payload: Payload, context: ReceiveContext) -> None:
        context.arm = arm_for(payload.request_id, self.arms, self.cumulative, self.salt)


HOOK = PluginSpec(
    name="ab_split",
    kind="hook",
    factory=ABSplitHook,
    options=ABSplitOptions,
    summary="live A/B: route each request to an arm by a stable hash of its id, weight-proportional",
)
