"""Offline acceptance of a draft (EAGLE3, EAGLE-1, multi-layer MTP, or DeepSeek NextN) against its target, on held-out stdlib text.

At a draft step with target law p and proposal law q (both at temperature T), rejection
sampling accepts the drafted token with probability ``Σ_x min(p(x), q(x))``. A verifier
told a one-hot proposal at ``X ~ q`` accepts with ``p(X)``, so with probability
``Σ_x q(x) p(x)`` (SGLang's PD decode without the proposal: DESIGN.md §1). The figures are
means over every anchor of the sampled windows, for the first draft step (the first
verify's first draft), and per step: top-1 agreement and, at T = 1, ``Σ min(p, q)`` of step
``k`` given that the tokens before it are the true ones (teacher-forced), which is the
acceptance of chain step ``k`` given that every step before it was accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from . import corpus, deepseek, eagle1, eagle3, mtp
from .layers import final_states
from .spec import BOS, DEEPSEEK, MTP_DEPTH, Shape
from .tokenizer import encode_files, load_tokenizer


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Σ_x min(p, q) over the last axis: P(accept) under rejection sampling. p, q [..., V]."""
    return torch.minimum(p, q).sum(-1)


def one_hot_accept(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Σ_x q(x) p(x): P(accept) when the verifier sees a one-hot proposal at X ~ q."""
    return (p * q).sum(-1)


def shape_of(model: LlamaForCausalLM) -> Shape:
    c = model.config
    return Shape(
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        layers=c.num_hidden_layers,
        heads=c.num_attention_heads,
        vocab=c.vocab_size,
        rms_eps=c.rms_norm_eps,
    )


def draft_logits(
    target: LlamaForCausalLM, draft_dir: Path, tokens: torch.Tensor, steps: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The target's logits fp32 [B, T, V] on ``tokens`` int64 [B, T], and the draft's per
    step (step ``k`` [B, T - 1 - k, V], entry ``t`` to compare with the target at ``t + 1 + k``),
    the draft's kind read from its config's architecture."""
    s = shape_of(target)
    arch = json.loads((draft_dir / "config.json").read_text())["architectures"][0]
    embed, head = target.model.embed_tokens, target.lm_head
    if arch == "LlamaForCausalLMEagle3":
        logits, aux = eagle3.target_features(target, tokens)
        return logits, eagle3.load_draft(draft_dir, s, embed).unroll(tokens, aux, steps)
    logits, hidden = final_states(target, tokens)
    if arch == "LlamaForCausalLMEagle":
        return logits, eagle1.load_draft(draft_dir, s, embed, head).unroll(tokens, hidden, steps)
    if arch == "MiMoV2MTP":
        return logits, mtp.load_draft(draft_dir, s, MTP_DEPTH, embed, head).unroll(tokens, hidden)[:steps]
    raise ValueError(f"{draft_dir}: no offline model of architecture {arch}")


def pair_logits(
    target_dir: Path, draft_dir: Path, tokens: torch.Tensor, steps: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``draft_logits`` for any target the tier ships: a Llama (HF's class) or a DeepSeek-V3
    (``deepseek.py``, shape ``spec.DEEPSEEK``; its draft is the NextN layer in ``draft_dir``,
    which may be the target's own directory)."""
    arch = json.loads((target_dir / "config.json").read_text())["architectures"][0]
    if arch == "DeepseekV3ForCausalLM":
        target = deepseek.load_target(target_dir, DEEPSEEK)
        draft = deepseek.load_nextn(draft_dir, DEEPSEEK, target.model.embed_tokens, target.lm_head)
        logits, hidden = target(tokens)
        return logits, draft.unroll(tokens, hidden, steps)
    llama = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    return draft_logits(llama, draft_dir, tokens, steps)


@torch.no_grad()
def measure(
    target_dir: Path,
    draft_dir: Path,
    *,
    tokenizer_dir: Path | None = None,
    windows: int = 32,
    length: int = 128,
    seed: int = 7,
    temperatures: tuple[float, ...] = (1.0, 0.7),
    steps: int = 3,
) -> dict[str, object]:
    """Offline figures of the pair on ``windows`` held-out windows of ``length`` tokens
    (the tokenizer is read from ``tokenizer_dir``, by default the target's directory)."""
    _, held = corpus.split()
    ids = encode_files(load_tokenizer(tokenizer_dir or target_dir), held)
    x = corpus.windows(ids, windows, length, torch.Generator().manual_seed(seed), BOS)
    logits, outs = pair_logits(target_dir, draft_dir, x, steps)
    res: dict[str, object] = {"heldout_tokens": len(ids), "anchors": windows * (length - 1)}
    top1, accept = [], []
    for k, q_logits in enumerate(outs):
        n = q_logits.shape[1]
        p_logits = logits[:, 1 + k : 1 + k + n]
        top1.append(round((q_logits.argmax(-1) == p_logits.argmax(-1)).float().mean().item(), 4))
        accept.append(round(overlap(p_logits.softmax(-1), q_logits.softmax(-1)).mean().item(), 4))
    res["top1_agreement_per_step"] = top1
    res["sum_min_pq_per_step_T=1"] = accept
    p_logits = logits[:, 1 : 1 + outs[0].shape[1]]
    for temp in temperatures:
        p, q = (p_logits / temp).softmax(-1), (outs[0] / temp).softmax(-1)
        res[f"T={temp}"] = {
            "sum_min_pq": round(overlap(p, q).mean().item(), 4),
            "one_hot_accept": round(one_hot_accept(p, q).mean().item(), 4),
            "target_top1_prob": round(p.max(-1).values.mean().item(), 4),
        }
    return res
