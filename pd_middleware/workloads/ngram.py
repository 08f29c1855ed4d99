"""The ``ngram`` workload: real-text target and draft models built at run time.

Corpus: by default the Python standard library's own ``.py`` sources
(``sysconfig.get_paths()["stdlib"]``), which every machine has. Files are visited by a
top-down walk with directory and file names sorted, skipping ``site-packages``,
``dist-packages``, ``__pycache__`` and test directories, until ``max_bytes`` of text
(or ``max_files`` files) have been read. Every ``heldout_every``-th file is held out.
The corpus therefore differs between Python versions; :meth:`NgramWorkload.describe`
reports the Python version, file count and a SHA-256 of the text read.

Tokens: regex ``[A-Za-z_]\\w*|\\d+|[^\\w\\s]`` (identifiers, numbers, single punctuation
characters). Vocabulary: the ``top_n`` most frequent training tokens (ties by token
text) plus ``<unk>`` at id 0, so V = top_n + 1. Training files are concatenated.

Models (Witten-Bell interpolation, so both are full-support):

- unigram ``P1(c) = (C(c) + 1) / (N + V)``;
- draft ``q(c | b) = (C(b c) + T(b) P1(c)) / (C(b) + T(b))``, T = distinct followers;
- target ``p(c | a b) = (C(a b c) + T(a b) P2(c | b)) / (C(a b) + T(a b))`` over the
  same bigram ``P2 = q``; an unseen context backs off to the lower order entirely;
- temperature T: rows are raised to 1/T and renormalised.

Contexts are held-out positions t (uniform, seeded per request) with context
``(a, b) = (w[t-2], w[t-1])``. Chains: position k conditions on the last two tokens of
``(a, b, x_0 .. x_{k-1})`` (target) and the last one (draft). The batch's reference
prefix x is drawn from the draft's own q, one float64 uniform per request and step from
``numpy.random.default_rng([seed, request_index])``; :meth:`WorkloadBatch.draft_given`
and :meth:`~WorkloadBatch.target_given` condition on any other drafted tokens instead.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterator
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import msgspec

from ..core._errors import OptionValueError
from . import WorkloadBatch

if TYPE_CHECKING:
    import torch

TOKEN_RE = re.compile(r"[A-Za-z_]\w*|\d+|[^\w\s]")
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


class NgramOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``ngram`` workload."""

    # Draft steps S per request (1 = single-layer EAGLE).
    num_steps: int = 1
    # Vocabulary: this many most frequent tokens, plus <unk> (V = top_n + 1).
    top_n: int = 8191
    # Corpus directory; None = the running Python's standard library.
    corpus: str | None = None
    # Stop reading after this many bytes of text / this many files.
    max_bytes: int = 2_000_000
    max_files: int = 2_000
    # Every heldout_every-th file (0-based index % heldout_every == heldout_every - 1) is held out.
    heldout_every: int = 10
    # Sampling temperature applied to both target and draft rows.
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.num_steps <= 16:
            raise OptionValueError("num_steps", f"must be in [1, 16], got {self.num_steps}")
        if not 1 <= self.top_n <= 1 << 20:
            raise OptionValueError("top_n", f"must be in [1, 1048576], got {self.top_n}")
        if not 1_000 <= self.max_bytes <= 1 << 30:
            raise OptionValueError("max_bytes", f"must be in [1000, 2^30], got {self.max_bytes}")
        if not 2 <= self.max_files <= 1_000_000:
            raise OptionValueError("max_files", f"must be in [2, 1000000], got {self.max_files}")
        if not 2 <= self.heldout_every <= 1000:
            raise OptionValueError("heldout_every", f"must be in [2, 1000], got {self.heldout_every}")
        if not 0.0 < self.temperature <= 100.0:
            raise OptionValueError("temperature", f"must be in (0, 100], got {self.temperature}")


def read_corpus(root: str, max_bytes: int, max_files: int) -> list[tuple[str, str]]:
    """``(relative path, text)`` of the corpus files in deterministic order (see module doc)."""
    out: list[tuple[str, str]] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read(max_bytes - total)
            except OSError:  # unreadable file: skip, the hash in describe() records what was read
                continue
            out.append((os.path.relpath(path, root).replace(os.sep, "/"), text))
            total += len(text)
            if total >= max_bytes or len(out) >= max_files:
                return out
    return out


class NgramModel:
    """Count tables of the trigram target and bigram draft; rows built on demand."""

    def __init__(self, options: NgramOptions) -> None:
        import torch

        root = options.corpus or sysconfig.get_paths()["stdlib"]
        files = read_corpus(root, options.max_bytes, options.max_files)
        if len(files) < 2:
            raise OptionValueError("corpus", f"found {len(files)} .py files under the corpus directory, need >= 2")
        digest = hashlib.sha256()
        train_tokens: list[str] = []
        held_tokens: list[str] = []
        for i, (rel, text) in enumerate(files):
            digest.update(rel.encode() + b"\0" + text.encode("utf-8", "replace"))
            toks = TOKEN_RE.findall(text)
            (held_tokens if i % options.heldout_every == options.heldout_every - 1 else train_tokens).extend(toks)
        counts = Counter(train_tokens)
        vocab = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: options.top_n]]
        self.tokens = ["<unk>", *vocab]
        index = {t: i + 1 for i, t in enumerate(vocab)}
        self.vocab_size = v = len(self.tokens)
        train = torch.tensor([index.get(t, 0) for t in train_tokens], dtype=torch.int64)
        self.heldout = torch.tensor([index.get(t, 0) for t in held_tokens], dtype=torch.int64)
        if self.heldout.numel() < 3 or train.numel() < 3:
            raise OptionValueError("corpus", "too little text for a trigram model and held-out contexts")
        self.facts = {
            "python": sys.version.split()[0],
            "files": len(files),
            "bytes": sum(len(t) for _, t in files),
            "train_tokens": int(train.numel()),
            "heldout_tokens": int(self.heldout.numel()),
            "vocab_size": v,
            "corpus_sha256": digest.hexdigest(),
        }
        uni = torch.bincount(train, minlength=v).double()
        self.p1 = (uni + 1.0) / (uni.sum() + v)
        self._bi = self._table(train[:-1], train[1:], v)
        self._tri = self._table(train[:-2] * v + train[1:-1], train[2:], v)

    @staticmethod
    def _table(ctx: torch.Tensor, nxt: torch.Tensor, v: int) -> dict[str, torch.Tensor]:
        """Sorted unique (context, next) pairs with counts, grouped by context."""
        import torch

        codes, cnt = torch.unique(ctx * v + nxt, return_counts=True)
        keys, types = torch.unique_consecutive(codes // v, return_counts=True)
        ends = types.cumsum(0)
        totals = torch.zeros(keys.numel(), dtype=torch.float64).index_add_(
            0, torch.repeat_interleave(torch.arange(keys.numel()), types), cnt.double()
        )
        return {
            "keys": keys,
            "start": ends - types,
            "types": types,
            "total": totals,
            "next": codes % v,
            "count": cnt.double(),
        }

    def _witten_bell(self, table: dict[str, torch.Tensor], ctx: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
        """(n, V) float64 rows (C(ctx c) + T(ctx) lower(c)) / (C(ctx) + T(ctx)); unseen ctx -> lower."""
        import torch

        keys = table["keys"]
        ctx = ctx.contiguous()
        pos = torch.searchsorted(keys, ctx).clamp_max(keys.numel() - 1)
        found = keys[pos] == ctx
        types = torch.where(found, table["types"][pos], 0)
        total = torch.where(found, table["total"][pos], 0.0)
        t = types.double().unsqueeze(1)
        rows = lower * t
        # Scatter every (ctx, next) count of the batch at once: ranges [start, start+types).
        n_ent = int(types.sum())
        if n_ent:
            row_of = torch.repeat_interleave(torch.arange(ctx.numel()), types)
            first = torch.repeat_interleave(types.cumsum(0) - types, types)
            ent = torch.repeat_interleave(table["start"][pos], types) + torch.arange(n_ent) - first
            rows.index_put_((row_of, table["next"][ent]), table["count"][ent], accumulate=True)
        denom = (total + types.double()).unsqueeze(1)
        return torch.where(denom > 0, rows / denom.clamp_min(1.0), lower)

    def draft_rows(self, prev1: torch.Tensor) -> torch.Tensor:
        """float64 (n, V) bigram draft q(. | prev1)."""
        lower = self.p1.unsqueeze(0).expand(prev1.numel(), -1)
        return self._witten_bell(self._bi, prev1, lower)

    def target_rows(self, prev2: torch.Tensor, prev1: torch.Tensor) -> torch.Tensor:
        """float64 (n, V) trigram target p(. | prev2 prev1)."""
        return self._witten_bell(self._tri, prev2 * self.vocab_size + prev1, self.draft_rows(prev1))


@lru_cache(maxsize=4)
def _model(options: NgramOptions) -> NgramModel:
    # Keyed by the frozen options minus fields that do not change the tables.
    return NgramModel(options)


def _tempered(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature != 1.0:
        rows = rows.pow(1.0 / temperature)
    return (rows / rows.sum(dim=1, keepdim=True)).float()


class _NgramConditional:
    """Rows of one batch conditioned on really-drafted tokens."""

    def __init__(self, workload: NgramWorkload, context: torch.Tensor) -> None:
        self.w = workload
        self.context = context  # int64 (B, 2)

    def draft(self, step: int, drafted: torch.Tensor) -> torch.Tensor:
        import torch

        hist = torch.cat([self.context, drafted[:, :step].to(torch.int64)], dim=1)
        return _tempered(self.w.model.draft_rows(hist[:, -1]), self.w.options.temperature)

    def target(self, drafted: torch.Tensor) -> torch.Tensor:
        import torch

        hist = torch.cat([self.context, drafted.to(torch.int64)], dim=1)
        rows = [self.w.model.target_rows(hist[:, k], hist[:, k + 1]) for k in range(drafted.shape[1] + 1)]
        return _tempered(torch.stack(rows, dim=1).flatten(0, 1), self.w.options.temperature).view(
            hist.shape[0], len(rows), -1
        )


class NgramWorkload:
    """Trigram target, bigram draft, held-out contexts; see the module docstring."""

    name = "ngram"

    def __init__(self, options: NgramOptions | None = None) -> None:
        self.options = options if options is not None else NgramOptions()
        self.model = _model(msgspec.structs.replace(self.options, num_steps=1, temperature=1.0))
        self.vocab_size = self.model.vocab_size
        self.num_steps = self.options.num_steps

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "options": msgspec.structs.asdict(self.options), "corpus": dict(self.model.facts)}

    def batches(self, n_requests: int, batch_size: int, seed: int) -> Iterator[WorkloadBatch]:
        import numpy as np
        import torch

        from ..evaluation.verify import sample_categorical

        if n_requests < 0 or batch_size < 1:
            raise ValueError(f"need n_requests >= 0 and batch_size >= 1, got {n_requests}, {batch_size}")
        steps = self.num_steps
        held = self.model.heldout
        for start in range(0, n_requests, batch_size):
            idx = range(start, min(start + batch_size, n_requests))
            pos = np.empty(len(idx), dtype=np.int64)
            u = np.empty((len(idx), steps), dtype=np.float64)
            for row, i in enumerate(idx):
                rng = np.random.default_rng([seed, i])
                pos[row] = rng.integers(2, held.numel())
                u[row] = rng.random(steps)
            t = torch.from_numpy(pos)
            cond = _NgramConditional(self, torch.stack([held[t - 2], held[t - 1]], dim=1))
            ut = torch.from_numpy(u)
            prefix = torch.empty(len(idx), steps, dtype=torch.int64)
            draft = torch.empty(len(idx), steps, self.vocab_size, dtype=torch.float32)
            for k in range(steps):
                draft[:, k] = cond.draft(k, prefix[:, :k])
                prefix[:, k] = sample_categorical(draft[:, k].double(), ut[:, k])
            yield WorkloadBatch(
                request_ids=tuple(f"ngram-{seed}-{i}" for i in idx),
                target_probs=cond.target(prefix),
                draft_probs=draft,
                prefix=prefix,
                conditional=cond,
                draft_state=cond.context[:, -1].clone(),
            )

    def draft_head(self, seed: int, hidden_size: int) -> Any:
        """The bigram draft as a head: its state is the previous token (:mod:`.heads`)."""
        from .heads import WorkloadDraftHead

        def rows(state: Any) -> Any:
            return _tempered(self.model.draft_rows(state), self.options.temperature)

        return WorkloadDraftHead(rows, self.vocab_size, hidden_size)
