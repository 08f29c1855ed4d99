"""Keep the A/B job's RSS equal to what it holds: big blocks go back to the OS when freed.

The job allocates and frees tens of ``(32, V)`` fp32 tensors (19.5 MB at V = 152064)
per batch on three threads. glibc's malloc raises its mmap threshold each time such a
block is freed (up to 32 MiB), so later blocks come from per-thread heap arenas, which
keep freed memory mapped: measured, the decode's RSS was ~650 MB above what it held
(docs/performance.md). A fixed threshold gives every block of 1 MiB or more its own
mapping, unmapped on free; small objects are unaffected.
"""

from __future__ import annotations

import ctypes
import sys

# glibc's <malloc.h>: mallopt(M_MMAP_THRESHOLD, bytes); setting it also disables the
# dynamic adjustment described above.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20


def return_big_blocks() -> bool:
    """Set glibc's mmap threshold to :data:`MMAP_THRESHOLD` for this process.

    Process-wide and lasting: the ``pd-middleware ab`` command and its prefill process
    call it, :func:`~pd_middleware.ab.runner.run_ab` does not (a host program keeps its
    own malloc settings). Returns False where there is no glibc (nothing changed).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
