"""Shared pieces of the reliability scripts: environment, payloads, pipelines, output.

Every script is bounded (a count and a wall-clock budget), talks to 127.0.0.1 only and
prints one JSON object as its last stdout line. This module holds what they share:

- :func:`setup_env`: the repo and its plugins on ``sys.path`` (so the scripts run from
  a checkout without installation) and the Mooncake variables set before any engine;
- :func:`make_payload`: deterministic payloads (none / dense / sparse proposals) whose
  provenance matches the attached encoding, so the real synthesizers validate it;
- :func:`build_pipeline`: the real ``one_hot``, ``sparse`` and ``full_distribution``
  synthesizers, picked per payload by proposal kind;
- :func:`check_delivery`: an oracle run on every delivery (nothing invalid accepted);
- :func:`emit`, :func:`percentile`, :func:`machine`.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
import struct
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


def setup_env() -> None:
    """Put the checkout on ``sys.path`` and set the Mooncake variables (setdefault)."""
    for p in (str(ROOT / "plugins"), str(ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")


def child_env() -> dict[str, str]:
    """Environment for a child Python process that imports the checkout."""
    env = dict(os.environ)
    extra = [str(ROOT), str(ROOT / "plugins")]
    env["PYTHONPATH"] = os.pathsep.join([*extra, env.get("PYTHONPATH", "")])
    env.setdefault("MC_FORCE_TCP", "1")
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    return env


def emit(result: dict[str, Any]) -> None:
    """Print the script's figures as the last stdout line: one JSON object."""
    print(json.dumps(result, sort_keys=False), flush=True)


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 100] of ``xs`` (0.0 for an empty list)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


def machine() -> dict[str, Any]:
    """What the figures were measured on: cores and the 1-minute load average at the end."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux
        load = -1.0
    return {"cpus": os.cpu_count(), "loadavg_1m": round(load, 2), "python": sys.version.split()[0]}


class Budget:
    """A wall-clock budget: ``left()`` seconds remain, ``over()`` once it is spent."""

    def __init__(self, seconds: float) -> None:
        self.t0 = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def over(self) -> bool:
        return self.left() <= 0


VOCAB = 64
HIDDEN = 32


def make_payload(rid: str, kind: str = "none", steps: int = 1, seed: Any = None, vocab: int = VOCAB) -> Any:
    """A valid payload with proposal ``kind`` in {none, dense, dense16, sparse, sparse_floor}.

    Deterministic in ``(rid, kind, steps, seed)``. Dense/sparse payloads say they were
    sampled from the attached encoding, so the real synthesizers validate (not skip) it.
    """
    from pd_middleware import DenseEncoding, Payload, Provenance, SparseEncoding

    rng = random.Random(f"{rid}/{kind}/{steps}/{seed}")
    hidden = struct.pack(f"<{HIDDEN}e", *(rng.uniform(-2, 2) for _ in range(HIDDEN)))
    tokens = tuple(rng.randrange(vocab) for _ in range(steps))
    enc = None
    if kind in ("dense", "dense16"):
        dtype = "fp32" if kind == "dense" else "fp16"
        rows = []
        for _ in range(steps):
            w = [rng.random() + 1e-3 for _ in range(vocab)]
            t = sum(w)
            rows += [x / t for x in w]
        enc = DenseEncoding(dtype, struct.pack(f"<{steps * vocab}{'f' if dtype == 'fp32' else 'e'}", *rows))
    elif kind in ("sparse", "sparse_floor"):
        k = 4
        idx: list[int] = []
        vals: list[float] = []
        tail = 0.25 if kind == "sparse_floor" else 0.0
        for _ in range(steps):
            idx += rng.sample(range(vocab), k)
            vals += [(1.0 - tail) / k] * k
        enc = SparseEncoding(
            lengths=(k,) * steps,
            indices=struct.pack(f"<{k * steps}i", *idx),
            values=struct.pack(f"<{k * steps}f", *vals),
            value_dtype="fp32",
            tail_mass=(tail,) * steps,
        )
    prov = Provenance("sampled", 1.0, enc.encoding_id if enc is not None else None)
    probs = tuple(rng.uniform(0.01, 1.0) for _ in range(steps))
    return Payload(rid, tokens, probs, vocab, hidden=hidden, hidden_dtype="fp16", provenance=prov, proposal=enc)


class ByKind:
    """Synthesizer that hands each payload to the real plugin for its proposal kind and steps.

    The transport sees one arm; a deployment has one synthesizer, but the campaign wants
    dense and sparse proposals validated through one live receiver.
    """

    def __init__(self, vocab: int = VOCAB, max_steps: int = 4) -> None:
        from pd_middleware import PluginContext
        from pd_middleware.core.contracts import NoOptions
        from pd_middleware_full.full import FullDistributionSynthesizer
        from pd_middleware_plugins.one_hot import OneHotSynthesizer
        from pd_middleware_plugins.sparse import SparseSynthesizer

        self._by: dict[tuple[str, int], Any] = {}
        for s in range(1, max_steps + 1):
            ctx = PluginContext(vocab_size=vocab, num_steps=s, rejection_sampling=True)
            self._by[("none", s)] = OneHotSynthesizer(NoOptions(), ctx)
            self._by[("dense", s)] = FullDistributionSynthesizer(NoOptions(), ctx)
            self._by[("sparse", s)] = SparseSynthesizer(NoOptions(), ctx)
        self._vocab = vocab

    def synthesize(self, payload: Any) -> Any:
        p = payload.proposal
        kind = "none" if p is None else p.kind
        synth = self._by.get((kind, len(payload.draft_tokens)))
        if synth is None:  # more steps than configured: let one_hot raise its own error
            synth = self._by[(kind, 1)]
        return synth.synthesize(payload)


def build_pipeline(vocab: int = VOCAB, max_steps: int = 4) -> Any:
    """A ReceivePipeline with the real synthesizers behind :class:`ByKind`."""
    from pd_middleware.decode.pipeline import ReceivePipeline

    return ReceivePipeline([], {"default": ("by_kind", ByKind(vocab, max_steps))})


def check_delivery(d: Any, vocab: int = VOCAB) -> str | None:
    """Oracle for an accepted payload: None if it is sound, else what is wrong with it.

    Token ids in [0, V), draft probs finite in [0, 1], proposal rows finite,
    non-negative and normalised (after the synthesizer's scale), sparse indices in range.
    """
    import torch

    from pd_middleware.core.proposal import DenseProposal, OneHotProposal, SparseProposal

    p = d.payload
    if any(type(t) is not int or not 0 <= t < p.vocab_size for t in p.draft_tokens):
        return "draft_tokens out of range"
    if any(not (0.0 <= q <= 1.0) for q in p.draft_probs):
        return "draft_probs outside [0, 1]"
    prop = d.proposal
    if prop is None or isinstance(prop, OneHotProposal):
        if prop is not None and tuple(prop.tokens) != tuple(p.draft_tokens):
            return "one-hot tokens differ from the draft tokens"
        return None
    dense = prop.to_dense(p.vocab_size).float()
    if not bool(torch.isfinite(dense).all()) or bool((dense < 0).any()):
        return "proposal has NaN/inf/negative entries"
    sums = dense.reshape(-1, p.vocab_size).sum(dim=1)
    if bool(((sums - 1.0).abs() > 1e-2).any()):
        return f"proposal rows sum to {sums.tolist()}"
    if isinstance(prop, SparseProposal):
        idx = prop.indices
        if bool(((idx < 0) | (idx >= p.vocab_size)).any()):
            return "sparse index out of range"
    elif not isinstance(prop, DenseProposal):
        return f"unknown proposal type {type(prop).__name__}"
    return None
