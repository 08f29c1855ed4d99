"""The ``synthetic`` workload: Zipf-like targets over a realistic vocabulary. The default.

Defaults are fixed so that results are comparable across versions; options may change
the values, the defaults never change. Per context (one per request and position):

- ``s ~ U[s_min, s_max]`` (1.0, 2.0);
- a uniformly random permutation ``perm`` of the V = 152064 token ids;
- target logits ``z[perm[r]] = -s * log(r + 1)`` (the token of rank r+1);
- draft logits ``z + N(0, noise_std^2)`` (0.5), noise iid per token, from a
  ``torch.Generator`` seeded with a 63-bit integer drawn from the context's stream;
- ``p = softmax(z / T)``, ``q = softmax((z + noise) / T)``, T = 1.

The random stream of a context is ``numpy.random.default_rng([STREAM_VERSION, seed,
request_index, position])``, drawing s, then the permutation, then the noise seed, in
that order (torch's normal sampler is about 3x faster than numpy's here). So a
request's rows do not depend on the batch size. Each position of a chain is an
independent context: the rows do not depend on the drafted prefix (``prefix`` is -1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from ..core._errors import OptionValueError
from . import WorkloadBatch

#: Bump only if the generation procedure changes (it must not, for the defaults).
STREAM_VERSION = 1


class SyntheticOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``synthetic`` workload (defaults are fixed across versions)."""

    # Vocabulary size V.
    vocab_size: int = 152064
    # Draft steps S per request (1 = single-layer EAGLE).
    num_steps: int = 1
    # Zipf exponent range: s ~ U[s_min, s_max] per context.
    s_min: float = 1.0
    s_max: float = 2.0
    # Standard deviation of the Gaussian noise added to the target logits for the draft.
    noise_std: float = 0.5
    # Sampling temperature applied to both target and draft logits.
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not 2 <= self.vocab_size <= 1 << 24:
            raise OptionValueError("vocab_size", f"must be in [2, 16777216], got {self.vocab_size}")
        if not 1 <= self.num_steps <= 16:
            raise OptionValueError("num_steps", f"must be in [1, 16], got {self.num_steps}")
        if not 0.0 <= self.s_min <= self.s_max <= 100.0:
            raise OptionValueError("s_max", f"need 0 <= s_min <= s_max <= 100, got {self.s_min}, {self.s_max}")
        if not 0.0 <= self.noise_std <= 100.0:
            raise OptionValueError("noise_std", f"must be in [0, 100], got {self.noise_std}")
        if not 0.0 < self.temperature <= 100.0:
            raise OptionValueError("temperature", f"must be in (0, 100], got {self.temperature}")


class SyntheticWorkload:
    """Seeded Zipf-like target and noisy draft rows; see the module docstring."""

    name = "synthetic"

    def __init__(self, options: SyntheticOptions | None = None) -> None:
        import torch

        self.options = options if options is not None else SyntheticOptions()
        self.vocab_size = self.options.vocab_size
        self.num_steps = self.options.num_steps
        # log(rank) for ranks 1..V, shared by every context.
        self._log_rank = torch.log(torch.arange(1, self.vocab_size + 1, dtype=torch.float64)).float()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "stream_version": STREAM_VERSION, "options": msgspec.structs.asdict(self.options)}

    def contexts(self, seed: int, request_indices: list[int], position: int, with_draft: bool) -> tuple[Any, Any]:
        """float32 (n, V) target rows and (n, V) draft rows (or None) for one position."""
        import numpy as np
        import torch

        o = self.options
        v = self.vocab_size
        n = len(request_indices)
        s = np.empty(n, dtype=np.float32)
        perm = np.empty((n, v), dtype=np.int64)
        noise = torch.empty(n, v, dtype=torch.float32) if with_draft else None
        gen = torch.Generator()
        for row, i in enumerate(request_indices):  # a loop over requests, never over the vocab
            rng = np.random.default_rng([STREAM_VERSION, seed, i, position])
            s[row] = rng.uniform(o.s_min, o.s_max)
            perm[row] = rng.permutation(v)
            if noise is not None:
                gen.manual_seed(int(rng.integers(0, 2**63 - 1)))
                torch.randn(v, generator=gen, out=noise[row])
        st = torch.from_numpy(s).view(n, 1)
        z = torch.empty(n, v, dtype=torch.float32).scatter_(1, torch.from_numpy(perm), -st * self._log_rank)
        del perm
        inv_t = 1.0 / o.temperature
        p = torch.softmax(z * inv_t, dim=1)
        if noise is None:
            return p, None
        d = noise.mul_(o.noise_std).add_(z).mul_(inv_t)
        return p, torch.softmax(d, dim=1)

    def batches(self, n_requests: int, batch_size: int, seed: int) -> Iterator[WorkloadBatch]:
        import torch

        if n_requests < 0 or batch_size < 1:
            raise ValueError(f"need n_requests >= 0 and batch_size >= 1, got {n_requests}, {batch_size}")
        steps = self.num_steps
        for start in range(0, n_requests, batch_size):
            idx = list(range(start, min(start + batch_size, n_requests)))
            b = len(idx)
            target = torch.empty(b, steps + 1, self.vocab_size, dtype=torch.float32)
            draft = torch.empty(b, steps, self.vocab_size, dtype=torch.float32)
            for k in range(steps + 1):
                p, q = self.contexts(seed, idx, k, with_draft=k < steps)
                target[:, k] = p
                if q is not None:
                    draft[:, k] = q
            yield WorkloadBatch(
                request_ids=tuple(f"synthetic-{seed}-{i}" for i in idx),
                target_probs=target,
                draft_probs=draft,
                prefix=torch.full((b, steps), -1, dtype=torch.int64),
                draft_state=torch.tensor(idx, dtype=torch.int64),
            )

    def draft_head(self, seed: int, hidden_size: int) -> Any:
        """The draft head of runs with ``seed``: its state is the request index, and it
        regenerates that context's step-0 draft row (:mod:`.heads`)."""
        from .heads import WorkloadDraftHead

        def rows(state: Any) -> Any:
            return self.contexts(seed, [int(i) for i in state.tolist()], 0, with_draft=True)[1]

        return WorkloadDraftHead(rows, self.vocab_size, hidden_size)
