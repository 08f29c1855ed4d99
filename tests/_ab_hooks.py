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
