"""Raw wire buffers as tensors: the one place that maps wire dtype names to torch.

Kept apart from :mod:`pd_middleware.sampling.encodings` so that :mod:`pd_middleware.core.payload`
(which encodings imports) can turn its hidden state into a tensor without importing
encodings back: no import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


_TORCH_DTYPES: dict[str, torch.dtype] = {}


def torch_dtype(name: str) -> torch.dtype:
    """Map a wire dtype name (``fp32``, ``bf16``, ``fp16``, ``int32``, ``int64``, ``uint16``) to torch."""
    if not _TORCH_DTYPES:  # built once, on first use: importing this module needs no torch
        import torch

        _TORCH_DTYPES.update(
            fp32=torch.float32,
            bf16=torch.bfloat16,
            fp16=torch.float16,
            int32=torch.int32,
            int64=torch.int64,
            uint16=torch.uint16,
        )
    return _TORCH_DTYPES[name]


def tensor_from_buffer(buf: bytes | memoryview, dtype: str, *, copy: bool = True) -> torch.Tensor:
    """A 1-D tensor over ``buf`` of wire dtype ``dtype``.

    With ``copy=False`` and a writable buffer the tensor shares its memory (a view of a
    receive slot); otherwise the bytes are copied once.
    """
    import torch

    n = len(buf) if isinstance(buf, bytes) else buf.nbytes
    if n == 0:
        return torch.empty(0, dtype=torch_dtype(dtype))
    src: bytes | bytearray | memoryview = buf
    if copy or isinstance(buf, bytes) or buf.readonly:
        src = bytearray(buf)  # torch.frombuffer needs a writable buffer
    return torch.frombuffer(src, dtype=torch_dtype(dtype))
