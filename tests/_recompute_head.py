"""A stand-in draft head for the two-process PD tier (no draft model runs in a harness rank;
SGLang's real EAGLE3 head is tested in tests/test_sglang_recompute.py). Shared by the rank
processes (tests/_sglang_pd_dropin.py) and the test that checks what they built."""

from __future__ import annotations

import torch

HEAD_SEED = 20261201
HEAD_HIDDEN = 16


class MatrixHead:
    """logits = h @ W.T, with W seeded float32 (V, H), on CPU."""

    def __init__(self, vocab: int, hidden: int = HEAD_HIDDEN, seed: int = HEAD_SEED) -> None:
        self.weight = 2.0 * torch.randn((vocab, hidden), generator=torch.Generator().manual_seed(seed))
        self.vocab_size, self.hidden_size = vocab, hidden
        self.device = torch.device("cpu")
        self.draft_id_of = None
        self.arch = "MatrixHead"

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float() @ self.weight.T
