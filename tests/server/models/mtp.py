"""A plain-torch multi-layer MTP draft that computes what SGLang's ``MiMoV2MTP`` computes.

SGLang 0.5.23's multi-layer EAGLE worker (``--enable-multi-layer-eagle``,
``speculative/multi_layer_eagle_worker_v2.py``) builds one draft model per chain step,
each loading one MTP layer (``draft_model_idx``; the loader keeps the checkpoint's
``model.mtp.layers.<idx>.*`` and renames it ``model.mtp.layers.0.*``, ``loader.py``
``_filter_mtp_weights``). ``MiMoV2MTP`` (``models/mimo_v2_nextn.py``) is the dense one of
the classes that take ``draft_model_idx``, and it is not chain-style: every step reads the
target's hidden state, not the previous step's (``chain_mtp_hidden_states`` is set only for
Step3p5, Inkling and GigaChat 3.5).

Layer ``k`` at position ``t`` reads token ``x_{t+1+k}`` and the target's hidden state ``h_t``
(the final, normed one), keeps its own KV cache, and proposes ``x_{t+2+k}``: the worker
runs every layer over the same positions and shifts the input ids one place left between
layers, writing the previous layer's draft token last (``rotate_input_ids``). Per layer:

- ``x = eh_proj(cat(enorm(embed(token)), hnorm(h)))`` (2H -> H, no bias);
- ``residual = x + attn(input_layernorm(x))``; ``out = residual + mlp(post_attention_layernorm(residual))``;
- logits ``lm_head(final_layernorm(out))``.

The embedding and the head are the target's (``set_embed_and_head``). Parameter names are
the checkpoint's (``spec.mtp_tensors``), less the shared embedding and head.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .layers import MLP, Attention, RMSNorm, causal_attention, linear, merge_heads, project_qkv
from .spec import Shape


class MtpLayer(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.enorm = RMSNorm(s.hidden, s.rms_eps)
        self.hnorm = RMSNorm(s.hidden, s.rms_eps)
        self.eh_proj = linear(2 * s.hidden, s.hidden)
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.self_attn = Attention(s, qkv_in=s.hidden)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.mlp = MLP(s)
        self.final_layernorm = RMSNorm(s.hidden, s.rms_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, s: Shape) -> torch.Tensor:
        """embeds, hidden [B, L, H] at positions 0..L-1 -> the normed output [B, L, H] (causal)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))
        q, k, v = project_qkv(self.self_attn, self.input_layernorm(x), torch.arange(x.shape[1]), s)
        residual = x + self.self_attn.o_proj(merge_heads(causal_attention(q, k, v)))
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        return self.final_layernorm(out)


class MtpDraft(nn.Module):
    """``depth`` MTP layers; ``embed`` and ``head`` are the target's, frozen and not owned."""

    def __init__(self, s: Shape, depth: int, embed: nn.Embedding, head: nn.Linear):
        super().__init__()
        self.shape = s
        self.model = nn.Module()
        self.model.mtp = nn.Module()
        self.model.mtp.layers = nn.ModuleList([MtpLayer(s) for _ in range(depth)])
        self._shared = [embed, head]  # a list, so the shared modules are neither children nor saved

    @property
    def depth(self) -> int:
        return len(self.model.mtp.layers)

    def unroll(self, tokens: torch.Tensor, hidden: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced, every layer over every position.

        tokens int64 [B, T]; hidden [B, T, H], the target's final normed states. Returns the
        logits of layer ``k`` [B, T - 1 - k, V] (fp32): entry ``t`` proposes ``x_{t+2+k}``, to
        compare with the target's logits at position ``t + 1 + k``.
        """
        T = tokens.shape[1]
        embed, head = self._shared
        out = []
        for k, layer in enumerate(self.model.mtp.layers):
            n = T - 1 - k
            h = layer(embed(tokens[:, 1 + k : 1 + k + n]), hidden[:, :n], self.shape)
            out.append(head(h).float())
        return out


def export_tensors(draft: MtpDraft) -> dict[str, torch.Tensor]:
    """The draft's own parameters (bf16): ``model.mtp.layers.<k>.*``, MiMo-V2's layout."""
    return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}


def load_draft(path: Path, s: Shape, depth: int, embed: nn.Embedding, head: nn.Linear) -> MtpDraft:
    """A draft (fp32) from an MTP directory; ``embed`` and ``head`` are the target's."""
    tensors = load_file(str(path / "model.safetensors"))
    draft = MtpDraft(s, depth, embed, head)
    own = {k: v.float() for k, v in tensors.items() if k.startswith("model.mtp.")}
    draft.load_state_dict(own, strict=True)
    return draft.eval()
