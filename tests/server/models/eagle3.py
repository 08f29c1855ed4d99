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

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .layers import MLP, Attention, RMSNorm, linear, merge_heads, project_qkv, unroll_chain
from .spec import AUX_LAYER_IDS, Shape


class _MidLayer(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.hidden_norm = RMSNorm(s.hidden, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.self_attn = Attention(s, qkv_in=2 * s.hidden)
        self.mlp = MLP(s)


class Eagle3Draft(nn.Module):
    """The draft's own parameters; ``embed`` is the target's embedding, frozen and not owned."""

    def __init__(self, s: Shape, embed: nn.Embedding):
        super().__init__()
        self.shape = s
        self.fc = linear(len(AUX_LAYER_IDS) * s.hidden, s.hidden)
        self.midlayer = _MidLayer(s)
        self.norm = RMSNorm(s.hidden, s.rms_eps)
        self.lm_head = linear(s.hidden, s.vocab)
        self._embed = [embed]  # a list, so the shared module is neither a child nor saved

    def qkv(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens int64 [B, L], hidden [B, L, H] -> q, k, v [B, heads, L, head_dim]."""
        m = self.midlayer
        x = torch.cat([m.input_layernorm(self._embed[0](tokens)), m.hidden_norm(hidden)], -1)
        return project_qkv(m.self_attn, x, positions, self.shape)

    def step_inputs(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv`` and the residual, which is the hidden state itself (``layers.ChainDraft``)."""
        return (*self.qkv(tokens, hidden, positions), hidden)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [B, heads, L, head_dim] -> (logits [B, L, V] fp32, residual out [B, L, H])."""
        m = self.midlayer
        residual = residual + m.self_attn.o_proj(merge_heads(attn))
        residual = residual + m.mlp(m.post_attention_layernorm(residual))
        return self.lm_head(self.norm(residual)).float(), residual

    def unroll(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Teacher-forced draft extend plus ``steps - 1`` draft steps at every anchor.

        tokens int64 [B, T] (``x_0 .. x_{T-1}``), aux [B, T, 3H] (the target's features
        ``g_t``). Returns one logits tensor per step, step ``k`` of shape [B, T - 1 - k, V]:
        entry ``t`` is the draft's proposal for ``x_{t+2+k}`` (``layers.unroll_chain``).
        """
        return unroll_chain(self, tokens, self.fc(aux[:, : tokens.shape[1] - 1]), steps)


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
