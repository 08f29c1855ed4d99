"""Where a gathering recompute head is issued under SGLang's overlap scheduler (``ordering.py``).

A recording device module stands in for ``torch.cuda`` (no GPU here): it records every
``wait_stream`` and which stream is current at each step, so the order the module promises
(the forward stream waits for the caller's, the block runs on the forward stream, the
caller's waits for the forward stream after, even when the block raises) is asserted
step by step. The real CPU streams and the two-process order of collectives per rank are
in ``tests/test_sglang_groups.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pd_middleware.integrations.sglang.ordering import UNORDERED, ForwardOrder, forward_order


class _Stream:
    def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait", self.name, other.name))


class _DeviceModule:
    """``current_stream()`` and ``stream(s)`` as torch.cuda has them, recorded."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.schedule = _Stream("schedule", self.log)
        self.forward = _Stream("forward", self.log)
        self._current = self.schedule

    def current_stream(self) -> _Stream:
        return self._current

    @contextlib.contextmanager
    def stream(self, s: _Stream) -> Iterator[None]:
        prev, self._current = self._current, s
        self.log.append(("enter", s.name))
        try:
            yield
        finally:
            self._current = prev
            self.log.append(("leave", s.name))


def test_the_block_runs_on_the_forward_stream_between_the_two_waits() -> None:
    dm = _DeviceModule()
    order = ForwardOrder(dm.forward, dm)
    assert order.active
    with order():
        dm.log.append(("block on", dm.current_stream().name))
    assert dm.log == [
        ("wait", "forward", "schedule"),  # the head's inputs, made on the schedule stream
        ("enter", "forward"),
        ("block on", "forward"),
        ("leave", "forward"),
        ("wait", "schedule", "forward"),  # the builder reads the output on its own stream
    ]
    assert dm.current_stream() is dm.schedule


def test_a_block_that_raises_still_leaves_the_callers_stream_waiting_for_the_forward() -> None:
    dm = _DeviceModule()
    with pytest.raises(RuntimeError, match="head failed"), ForwardOrder(dm.forward, dm)():
        raise RuntimeError("head failed")
    assert dm.log[-1] == ("wait", "schedule", "forward") and dm.current_stream() is dm.schedule


def test_unordered_touches_no_stream() -> None:
    with UNORDERED() as ordered:
        t = torch.zeros(2)
        assert ordered.keep(t) is t  # nothing recorded on a CPU tensor, nor without an order
    assert not UNORDERED.active


@pytest.mark.parametrize(
    ("overlap", "gathers", "stream", "active"),
    [
        (True, True, "s", True),  # the one case that needs the forward stream
        (True, False, "s", False),  # TP 1: no collective to order
        (False, True, "s", False),  # no forward in flight while the builder runs
        (True, True, None, False),  # no forward stream: check_placement refuses this first
    ],
)
def test_forward_order_is_asked_only_for_a_gathering_head_under_overlap(
    overlap: bool, gathers: bool, stream: Any, active: bool
) -> None:
    s = torch.cpu.Stream() if stream else None
    sched = SimpleNamespace(enable_overlap=overlap, forward_stream=s, device="cpu")
    got = forward_order(sched, gathers=gathers)
    assert got.active is active
    if active:
        assert got.stream is s and got.device_module is torch.cpu
        with got():
            assert torch.cpu.current_stream() is s  # the real CPU bookkeeping follows the order
        assert torch.cpu.current_stream() is not s
