"""Loaded by every Python process of a test server (this folder is first on ``PYTHONPATH``).

SGLang's launcher spawns its scheduler and detokenizer processes with ``multiprocessing``
(spawn): each is a fresh interpreter that imports ``sitecustomize`` at start, before any
SGLang module, which is what the CPU gap overrides need (the torchvision one in
particular runs before ``sglang`` is imported at all). See :mod:`cpu_gaps`.
"""

from __future__ import annotations

import cpu_gaps

cpu_gaps.install_from_env()
