"""A plain-torch EAGLE3 draft that computes what SGLang's ``LlamaForCausalLMEagle3`` computes.

Used to distil the trained draft (``train.py``) and to predict its acceptance offline
(``evaluate.py``). Parameter names are the checkpoint's (``spec.eagle3_tensors``), so
``state_dict()`` is the file, less the shared embedding and the id maps.

SGLang's forward, read in ``sglang/srt/models/llama_eagle3.py`` (0.5.23):

- the target's aux states (``spec.AUX_LAYER_IDS``, low to high, concatenated) go through
  ``fc`` to width H; a hidden state already H wide (a draft step's own output) skips it;
- the layer: ``residual = h``; ``x = cat(input_layernorm(embed(token)), hidden_norm(h))``
  (2H); attention with RoPE (rotate-half), ``o_proj``; ``residual += attn``;
  ``h = post_attention_layernorm(residual)``; ``residual += mlp(h)``;
- logits ``lm_head(norm(residual))``; the hidden state handed to the next step is the
  un-normed ``residual`` (``norm_output`` unset).

Positions: after a prefill of ``x_0 .. x_{n-1}``, the draft extend reads token ``x_{t+1}``
with the target's features ``g_t`` at position ``t``, so its output at ``t`` proposes
``x_{t+2}``, to be verified against the target's distribution at position ``t + 1``. Draft
step ``k`` at that anchor reads its own previous output at position ``t + k`` and attends to
the extend's keys at positions ``<= t`` and to the steps' keys of the same anchor.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from .spec import AUX_LAYER_IDS, Shape


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _linear(inp: int, out: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(inp, out, bias=bias)


class _Attention(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.q_proj = _linear(2 * s.hidden, s.hidden)
        self.k_proj = _linear(2 * s.hidden, s.hidden)
        self.v_proj = _linear(2 * s.hidden, s.hidden)
        self.o_proj = _linear(s.hidden, s.hidden)


class _MLP(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.gate_proj = _linear(s.hidden, s.intermediate)
        self.up_proj = _linear(s.hidden, s.intermediate)
        self.down_proj = _linear(s.intermediate, s.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.hidden_norm = RMSNorm(s.hidden, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.self_attn = _Attention(s)
        self.mlp = _MLP(s)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE. x [B, heads, L, head_dim], positions int64 [L]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Eagle3Draft(nn.Module):
    """The draft's own parameters; ``embed`` is the target's embedding, frozen and not owned."""

    def __init__(self, s: Shape, embed: nn.Embedding):
        super().__init__()
        self.shape = s
        self.fc = _linear(len(AUX_LAYER_IDS) * s.hidden, s.hidden)
        self.midlayer = _MidLayer(s)
        self.norm = RMSNorm(s.hidden, s.rms_eps)
        self.lm_head = _linear(s.hidden, s.vocab)
        self._embed = [embed]  # a list, so the shared module is neither a child nor saved

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.shape.heads, self.shape.head_dim).transpose(1, 2)

    def qkv(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens int64 [B, L], hidden [B, L, H] -> q, k, v [B, heads, L, head_dim]."""
        m = self.midlayer
        x = torch.cat([m.input_layernorm(self._embed[0](tokens)), m.hidden_norm(hidden)], -1)
        a = m.self_attn
        theta = self.shape.rope_theta
        return (
            rope(self._split(a.q_proj(x)), positions, theta),
            rope(self._split(a.k_proj(x)), positions, theta),
            self._split(a.v_proj(x)),
        )

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [B, heads, L, head_dim] -> (logits [B, L, V] fp32, residual out [B, L, H])."""
        B, _, L, _ = attn.shape
        m = self.midlayer
        residual = residual + m.self_attn.o_proj(attn.transpose(1, 2).reshape(B, L, self.shape.hidden))
        residual = residual + m.mlp(m.post_attention_layernorm(residual))
        return self.lm_head(self.norm(residual)).float(), residual

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Teacher-forced draft extend plus ``steps - 1`` draft steps at every anchor.

        tokens int64 [B, T] (``x_0 .. x_{T-1}``), aux [B, T, 3H] (the target's features
        ``g_t``). Returns one logits tensor per step, step ``k`` of shape [B, T - 1 - k, V]:
        entry ``t`` is the draft's proposal for ``x_{t+2+k}``, to compare with the target's
        logits at position ``t + 1 + k``.
        """
        L = tokens.shape[1] - 1
        pos = torch.arange(L)
        scale = 1.0 / math.sqrt(self.shape.head_dim)
        hidden = self.fc(aux[:, :L])
        q0, k0, v0 = self.qkv(tokens[:, 1:], hidden, pos)
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        own_k: list[torch.Tensor] = []  # keys and values of steps 1..k at each anchor
        own_v: list[torch.Tensor] = []
        out: list[torch.Tensor] = []
        q = q0
        for k in range(steps):
            n = L - k  # anchors whose step-k target position exists
            if k > 0:
                q, kk, vv = self.qkv(tokens[:, 1 + k : 1 + k + n], hidden[:, :n], pos[:n] + k)
                own_k = [t[:, :, :n] for t in own_k] + [kk]
                own_v = [t[:, :, :n] for t in own_v] + [vv]
            s0 = (q @ k0[:, :, :n].transpose(-1, -2)) * scale
            s0 = s0.masked_fill(~causal[:n, :n], float("-inf"))
            s_own = [(q * kk).sum(-1, keepdim=True) * scale for kk in own_k]
            p = torch.cat([s0, *s_own], -1).softmax(-1)
            attn = p[..., :n] @ v0[:, :, :n]
            for i, vv in enumerate(own_v):
                attn = attn + p[..., n + i : n + i + 1] * vv
            logits, hidden = self.finish(attn, hidden[:, :n])
            out.append(logits)
        return out


def target_features(target: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An HF Llama target on int64 [B, T] -> (logits fp32 [B, T, V], aux fp32 [B, T, 3H]).

    HF's ``hidden_states[i]`` is the residual stream entering layer ``i``, which is what
    SGLang captures for aux id ``i - 1``.
    """
    o = target(input_ids=tokens, output_hidden_states=True)
    aux = torch.cat([o.hidden_states[i + 1].float() for i in AUX_LAYER_IDS], -1)
    return o.logits.float(), aux


def export_tensors(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The checkpoint: the draft's parameters, the shared embedding, identity id maps; bf16."""
    out = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}
    V = draft.shape.vocab
    out["embed_tokens.weight"] = draft._embed[0].weight.detach().to(torch.bfloat16).contiguous()
    out["d2t"] = torch.zeros(V, dtype=torch.int64)  # draft id i is target id i + d2t[i]
    out["t2d"] = torch.ones(V, dtype=torch.bool)
    return out


def load_draft(path: Path, s: Shape, embed: nn.Embedding) -> Eagle3Draft:
    """A draft (fp32) from an EAGLE3 directory; ``embed`` is the target's, as SGLang shares it."""
    tensors = load_file(str(path / "model.safetensors"))
    draft = Eagle3Draft(s, embed)
    own = {k: v.float() for k, v in tensors.items() if k not in ("embed_tokens.weight", "d2t", "t2d")}
    draft.load_state_dict(own, strict=True)
    return draft.eval()
