"""A receive hook for tests, named in configs as ``_ab_hooks:SEE_ARM`` (tests/ is on sys.path)."""

from __future__ import annotations

from typing import ClassVar

from pd_middleware import PluginSpec


class SeeArm:
    """Records the arm each payload had when this hook ran."""

    latest: ClassVar[SeeArm | None] = None

    def __init__(self, options: object, context: object) -> None:
        self.seen: list[str] = []
        SeeArm.latest = self

    def on_receive(self, payload: object, context: object) -> None:
        self.seen.append(context.arm)  # type: ignore[attr-defined]  # a ReceiveContext


SEE_ARM = PluginSpec(name="see_arm", kind="hook", factory=SeeArm, summary="test: record the arm hooks see")


class BatchSeen:
    """Records, per payload received, its batch index and how many batches were verified by then.

    ``VERIFIED`` is bumped by the test's wrapper around the verifier (tests/test_ab_runner.py).
    """

    latest: ClassVar[BatchSeen | None] = None
    batch_size: ClassVar[int] = 16
    verified: ClassVar[list[int]] = [0]

    def __init__(self, options: object, context: object) -> None:
        self.seen: list[tuple[int, int]] = []
        BatchSeen.latest = self

    def on_receive(self, payload: object, context: object) -> None:
        index = int(payload.request_id.partition("/")[2])  # type: ignore[attr-defined]  # a Payload
        self.seen.append((index // self.batch_size, self.verified[0]))


BATCH_SEEN = PluginSpec(name="batch_seen", kind="hook", factory=BatchSeen, summary="test: batch index vs verified")
