"""Where the decode's recompute head issues its collective under SGLang's overlap scheduler.

Under the overlap scheduler SGLang launches a batch's forward on the scheduler's
**forward stream** (``Scheduler.forward_stream``, from ``TpModelWorker.get_worker_info``;
every launch does ``forward_stream.wait_stream(schedule_stream)`` first) and goes on to
build the next batch on its **schedule stream** while that forward runs. The decode's
prebuilt batch, and so the drop-in's recompute, is built there, on the scheduler thread.

A vocab-parallel draft head (TP > 1, or attention TP > 1 with ``--enable-dp-lm-head``)
all-gathers its logits over the communicator the forward's own collectives use. Issued on
the schedule stream, that gather could run on the device *concurrently* with the forward
in flight on another stream of the same communicator, which NCCL does not allow (a hang,
or collectives matched across ranks in different orders).

:class:`ForwardOrder` issues the head on the forward stream instead, in the scheduler's
own program order:

- the forward stream first waits for the schedule stream (the head's inputs, copied there
  by the builder);
- the head, its gather included, is enqueued on the forward stream: after the
  collectives of every forward the scheduler launched before this batch was built, and
  before those of every forward it launches after. Every TP rank of a node runs the same
  event loop and builds the same prebuilt batch at the same point of it (SGLang
  all-reduces the transfer polls over the TP group), so every rank enqueues the same
  collectives in the same order **on one stream**: the order NCCL needs, by construction;
- the schedule stream then waits for the forward stream (the builder reads q' and X'
  there), and the head's output is recorded as used on the schedule stream, so the
  caching allocator never hands its memory to the forward stream while the schedule
  stream still reads it.

The cost: the head waits for the forward in flight before it runs. SGLang 0.5.19 and
later already make the schedule stream wait for the forward stream before a prebuilt
batch is built (``_get_new_prebuilt_batch``: "Drain it before a prebuilt request seeds a
potentially reused row"), and the recompute reads X' back to the host before the vote,
so on those releases nothing waits longer than it did; on 0.5.18 the builder of a
prebuilt batch waits for the forward in flight, once per prebuilt batch.

On a CPU build every stream is the caller's (``torch.cpu.Stream`` is bookkeeping only):
the order is observable (``torch.cpu.current_stream()`` is the forward stream inside the
head), the hazard is not. ``tests/test_sglang_groups.py`` pins the order per rank with
real groups; ``docs/sglang.md`` ("The overlap scheduler") has the argument.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class Ordered:
    """What :meth:`ForwardOrder.__call__` yields: :meth:`keep` marks a tensor made inside
    as read afterwards on the caller's stream (a no-op on the CPU or without an order)."""

    __slots__ = ("_here",)

    def __init__(self, here: Any = None) -> None:
        self._here = here

    def keep(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._here is not None and tensor.device.type != "cpu":
            tensor.record_stream(self._here)
        return tensor


class ForwardOrder:
    """Run a block on SGLang's forward stream, ordered after the caller's stream and before
    what the caller enqueues next (see the module docstring).

    ``stream``: the scheduler's ``forward_stream``; ``device_module``:
    ``torch.get_device_module(device)`` (anything with ``current_stream()`` and
    ``stream(s)``; streams with ``wait_stream``). ``None`` for either: no order (a head
    without a collective, or no overlapped forward), the block runs where it is called.
    """

    def __init__(self, stream: Any = None, device_module: Any = None) -> None:
        self.stream = stream
        self.device_module = device_module

    @property
    def active(self) -> bool:
        return self.stream is not None and self.device_module is not None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Ordered]:
        if not self.active:
            yield Ordered()
            return
        dm, forward = self.device_module, self.stream
        here = dm.current_stream()
        forward.wait_stream(here)  # the inputs the builder made on the schedule stream
        try:
            with dm.stream(forward):
                yield Ordered(here)
        finally:
            here.wait_stream(forward)  # the builder reads the head's output on its own stream

    def __repr__(self) -> str:
        return f"ForwardOrder({'forward stream' if self.active else 'none'})"


#: No order: the head runs on the caller's stream (no collective, or no overlap).
UNORDERED = ForwardOrder()


def forward_order(scheduler: Any, *, gathers: bool) -> ForwardOrder:
    """The order for a head on ``scheduler``: on its forward stream when the head gathers
    (``gathers``) and the overlap scheduler is on; :data:`UNORDERED` otherwise. Raises
    nothing: a scheduler under overlap without a forward stream is refused by
    :func:`~.startup.check_placement` before this is asked."""
    if not gathers or not bool(getattr(scheduler, "enable_overlap", False)):
        return UNORDERED
    stream = getattr(scheduler, "forward_stream", None)
    if stream is None:
        return UNORDERED
    device = getattr(scheduler, "device", None) or "cpu"
    return ForwardOrder(stream, torch.get_device_module(device))
