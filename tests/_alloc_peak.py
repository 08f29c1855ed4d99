"""The peak of memory a call allocates on the CPU, from torch's own allocator records.

Python's ``tracemalloc`` does not see torch's CPU allocator. Under
``torch.profiler.profile(profile_memory=True)`` that allocator reports every allocation and
free with its pointer and size; replaying them in time order, counting only the blocks
allocated inside the profile, gives the highest number of bytes the call held at once
above what existed before it (a block allocated earlier and freed inside is not counted:
the figure is what the call added). Shared by ``tests/test_recompute.py`` and
``benchmarks/recompute.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def allocation_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak bytes ``fn()`` held at once on the CPU above what existed before it, its result).

    The result is kept until the profile ends, so what ``fn`` returns counts in the peak.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            f = e.extra_fields
            # Same instant: the allocation first (never an under-count).
            events.append((e.start_time_ns, f.alloc_size < 0, f.ptr, f.alloc_size))
    live: dict[int, int] = {}
    held = peak = 0
    for _, _, ptr, size in sorted(events):
        if size > 0:
            live[ptr] = size
            held += size
            peak = max(peak, held)
        else:
            held -= live.pop(ptr, 0)
    return peak, out
