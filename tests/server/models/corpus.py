"""Local real text: the Python standard library's top-level sources, split by file.

Every machine with Python has them, so training and evaluation need no download. Every
10th file (sorted by name) is held out for evaluation; the tokenizer and the target are
trained on the rest. The files differ between Python versions, so figures quote the
version they were measured on (``trained/figures.json``).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

HELD_OUT_EVERY = 10


def stdlib_files() -> list[Path]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if len(files) < 2 * HELD_OUT_EVERY:
        raise FileNotFoundError(f"too few stdlib sources ({len(files)}) under {sysconfig.get_paths()['stdlib']}")
    return files


def split() -> tuple[list[Path], list[Path]]:
    """(train, held_out) file lists."""
    files = stdlib_files()
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != 0]
    return train, held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def windows(ids: torch.Tensor, count: int, length: int, generator: torch.Generator, bos: int) -> torch.Tensor:
    """``count`` random windows of ``length`` tokens: ``bos`` then ``length - 1`` tokens of
    ``ids`` (int64 [N]), as a served prompt starts. Returns int64 [count, length]."""
    if len(ids) <= length:
        raise ValueError(f"corpus of {len(ids)} tokens is shorter than a window of {length}")
    starts = torch.randint(0, len(ids) - length, (count,), generator=generator)
    body = torch.stack([ids[s : s + length - 1] for s in starts.tolist()])
    return torch.cat([torch.full((count, 1), bos, dtype=torch.long), body], dim=1)
