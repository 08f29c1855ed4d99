"""Plain-torch pieces the tier's draft models share: RMSNorm, rotate-half RoPE, the SiLU MLP,
causal attention, and the teacher-forced EAGLE chain (``unroll_chain``).

The drafts (``eagle3.py``, ``eagle1.py``, ``mtp.py``) compute what SGLang 0.5.23's classes
compute on the same weights; their parameter names are the checkpoint's.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .spec import Shape


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def linear(inp: int, out: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(inp, out, bias=bias)


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, Llama's MLP."""

    def __init__(self, s: Shape):
        super().__init__()
        self.gate_proj = linear(s.hidden, s.intermediate)
        self.up_proj = linear(s.hidden, s.intermediate)
        self.down_proj = linear(s.intermediate, s.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """The projections of one attention block (no GQA, no bias); ``qkv_in`` is q/k/v's input width."""

    def __init__(self, s: Shape, qkv_in: int):
        super().__init__()
        self.q_proj = linear(qkv_in, s.hidden)
        self.k_proj = linear(qkv_in, s.hidden)
        self.v_proj = linear(qkv_in, s.hidden)
        self.o_proj = linear(s.hidden, s.hidden)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. x [B, heads, L, head_dim], positions int64 [L]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def split_heads(x: torch.Tensor, s: Shape) -> torch.Tensor:
    """[B, L, H] -> [B, heads, L, head_dim]."""
    B, L, _ = x.shape
    return x.view(B, L, s.heads, s.head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, L, head_dim] -> [B, L, H]."""
    B, heads, L, hd = x.shape
    return x.transpose(1, 2).reshape(B, L, heads * hd)


def project_qkv(
    a: Attention, x: torch.Tensor, positions: torch.Tensor, s: Shape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, heads, L, head_dim] of ``x`` [B, L, qkv_in], RoPE on q and k."""
    return (
        rope(split_heads(a.q_proj(x), s), positions, s.rope_theta),
        rope(split_heads(a.k_proj(x), s), positions, s.rope_theta),
        split_heads(a.v_proj(x), s),
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q over k, v [B, heads, L, head_dim], each position over itself and before."""
    L = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def final_states(target: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An HF Llama target on int64 [B, T] -> (logits fp32 [B, T, V], final normed states fp32 [B, T, H]).

    The normed states are what SGLang's ``LlamaForCausalLM`` hands an EAGLE-1 or MTP draft
    (its logits processor gets the output of ``model.norm``); HF's ``last_hidden_state``
    is that same output.
    """
    hidden = target.model(input_ids=tokens).last_hidden_state
    return target.lm_head(hidden).float(), hidden.float()


class ChainDraft(Protocol):
    """A draft whose step ``k`` reads its own step ``k - 1`` output (EAGLE-1/2 and EAGLE3)."""

    shape: Shape

    def step_inputs(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens int64 [B, L], hidden [B, L, H] -> q, k, v [B, heads, L, head_dim] and the residual [B, L, H]."""
        ...

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [B, heads, L, head_dim] -> (logits [B, L, V] fp32, hidden handed to the next step [B, L, H])."""
        ...


def unroll_chain(draft: ChainDraft, tokens: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Teacher-forced draft extend plus ``steps - 1`` draft steps at every anchor.

    tokens int64 [B, T] (``x_0 .. x_{T-1}``); hidden [B, T - 1, H]: what the draft extend
    reads at position ``t`` with token ``x_{t+1}`` (from the target's features ``g_t``).
    Returns one logits tensor per step, step ``k`` of shape [B, T - 1 - k, V]: entry ``t``
    is the draft's proposal for ``x_{t+2+k}``, to compare with the target's logits at
    position ``t + 1 + k``. Step ``k`` at anchor ``t`` reads its own previous output at
    position ``t + k``; it attends to the extend's keys at positions ``<= t`` and to the
    steps' keys of the same anchor (SGLang's KV cache during a draft).
    """
    L = tokens.shape[1] - 1
    pos = torch.arange(L)
    scale = 1.0 / math.sqrt(draft.shape.head_dim)
    q, k0, v0, residual = draft.step_inputs(tokens[:, 1:], hidden[:, :L], pos)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    own_k: list[torch.Tensor] = []  # keys and values of steps 1..k at each anchor
    own_v: list[torch.Tensor] = []
    out: list[torch.Tensor] = []
    for k in range(steps):
        n = L - k  # anchors whose step-k target position exists
        if k > 0:
            q, kk, vv, residual = draft.step_inputs(tokens[:, 1 + k : 1 + k + n], hidden[:, :n], pos[:n] + k)
            own_k = [t[:, :, :n] for t in own_k] + [kk]
            own_v = [t[:, :, :n] for t in own_v] + [vv]
        s0 = (q @ k0[:, :, :n].transpose(-1, -2)) * scale
        s0 = s0.masked_fill(~causal[:n, :n], float("-inf"))
        s_own = [(q * kk).sum(-1, keepdim=True) * scale for kk in own_k]
        p = torch.cat([s0, *s_own], -1).softmax(-1)
        attn = p[..., :n] @ v0[:, :, :n]
        for i, vv in enumerate(own_v):
            attn = attn + p[..., n + i : n + i + 1] * vv
        logits, hidden = draft.finish(attn, residual)
        out.append(logits)
    return out
