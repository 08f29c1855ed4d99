"""The ``arm_tally`` receive hook: how many payloads each A/B arm received.

Runs on the decode side, on the receiving thread, once per payload, before the
synthesizer; it must not block. It reads ``context.arm`` (set by the routing hook, or
by the ``ab`` job's router, which runs before every configured hook).
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import msgspec

from pd_middleware import (
    OptionValueError,
    Payload,
    PluginContext,
    PluginSpec,
    ReceiveContext,
)


class ArmTallyOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of ``arm_tally`` (``hooks = [{ name = "arm_tally", options = {...} }]``)."""

    # Fail every n-th payload on purpose (0 = never): a way to watch failures reach
    # the report. Never set it in production.
    fail_every: int = 0

    def __post_init__(self) -> None:
        # OptionValueError names the field; the config loader adds the key path
        # (hooks[0].options.fail_every).
        if not 0 <= self.fail_every <= 1_000_000:
            raise OptionValueError("fail_every", f"must be in [0, 1000000], got {self.fail_every}")


class ArmTally:
    """Counts payloads per arm in :attr:`counts`."""

    #: The most recently built instance, so a test or a demo can read the counts.
    latest: ClassVar[ArmTally | None] = None

    def __init__(self, options: ArmTallyOptions, context: PluginContext) -> None:
        self.fail_every = options.fail_every
        self.arms = tuple(name for name, _ in context.arms)
        self.counts: Counter[str] = Counter()
        self.seen = 0
        ArmTally.latest = self

    def on_receive(self, payload: Payload, context: ReceiveContext) -> None:
        self.seen += 1
        self.counts[context.arm] += 1
        if self.fail_every and self.seen % self.fail_every == 0:
            # Raising fails this one payload (stage "hook:arm_tally"), never the receiver.
            raise RuntimeError(f"arm_tally: failing payload #{self.seen} on purpose (fail_every={self.fail_every})")
        return None  # None keeps the payload; returning a Payload would replace it


HOOK = PluginSpec(
    name="arm_tally",
    kind="hook",
    factory=ArmTally,
    options=ArmTallyOptions,
    summary="example: count payloads per A/B arm (optionally fail every n-th on purpose)",
)
