"""``import common_ops``: what sgl-kernel's loader falls back to when its CUDA libraries do not load.

Registers the plain-torch stand-ins of :mod:`sgl_cpu_ops` as ``torch.ops.sgl_kernel.*``
(once per process), so ``import sgl_kernel`` succeeds on a CPU-only machine.
"""

from __future__ import annotations

import sgl_cpu_ops

LIBRARY = sgl_cpu_ops.register("sgl_kernel")
