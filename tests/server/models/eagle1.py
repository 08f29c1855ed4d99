"""A plain-torch EAGLE-1/2 draft that computes what SGLang's ``LlamaForCausalLMEagle`` computes.

Used to distil the trained EAGLE-1 draft (``distil.py``) and to predict its acceptance
offline (``evaluate.py``). Parameter names are the checkpoint's (``spec.eagle1_tensors``),
less the shared embedding.

SGLang's forward, read in ``sglang/srt/models/llama_eagle.py`` (0.5.23):

- ``x = fc(cat(embed(token), h))`` (2H -> H, with bias), where ``h`` is the target's
  hidden state for the draft extend (its final, normed output: SGLang's ``LlamaForCausalLM``
  hands the logits processor the state after ``model.norm``) and the draft's own previous
  output for a draft step;
- one decoder layer whose ``input_layernorm`` is deleted: attention reads ``x`` itself
  (rotate-half RoPE), ``residual = x + attn``, then ``residual += mlp(post_attention_layernorm(residual))``;
- no final norm: the logits are ``lm_head(residual)``, and ``residual`` is the hidden state
  handed to the next step. The head and the embedding are the target's
  (``set_embed_and_head``); with ``--speculative-token-map`` SGLang takes the head's rows in
  the map's order (``eagle_worker_v2.py`` around 375), which this class does not model: a
  full-size permutation changes the order of the draft's logits, not its law over target ids.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from .layers import MLP, Attention, RMSNorm, linear, merge_heads, project_qkv, unroll_chain
from .spec import Shape


class _Layer(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.self_attn = Attention(s, qkv_in=s.hidden)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.mlp = MLP(s)


class Eagle1Draft(nn.Module):
    """The draft's own parameters; ``embed`` and ``head`` are the target's, frozen and not owned."""

    def __init__(self, s: Shape, embed: nn.Embedding, head: nn.Linear):
        super().__init__()
        self.shape = s
        self.fc = linear(2 * s.hidden, s.hidden, bias=True)
        self.layers = nn.ModuleList([_Layer(s)])
        self._shared = [embed, head]  # a list, so the shared modules are neither children nor saved

    def start_from_target_hidden(self) -> None:
        """Initialise ``fc`` to pass the hidden half through (``x = h``): the head then starts
        from inputs of the scale it was trained on, instead of from a near-zero state."""
        H = self.shape.hidden
        with torch.no_grad():
            self.fc.weight[:, H:].copy_(torch.eye(H))
            self.fc.bias.zero_()

    def step_inputs(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens int64 [B, L], hidden [B, L, H] -> q, k, v [B, heads, L, head_dim] and the residual ``fc`` output."""
        x = self.fc(torch.cat([self._shared[0](tokens), hidden], -1))
        return (*project_qkv(self.layers[0].self_attn, x, positions, self.shape), x)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [B, heads, L, head_dim] -> (logits [B, L, V] fp32, the layer's output [B, L, H])."""
        layer = self.layers[0]
        residual = residual + layer.self_attn.o_proj(merge_heads(attn))
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return self._shared[1](residual).float(), residual

    def unroll(self, tokens: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens int64 [B, T]; hidden [B, T, H], the target's final normed states. Returns the
        logits of each step, step ``k`` [B, T - 1 - k, V] (``layers.unroll_chain``)."""
        return unroll_chain(self, tokens, hidden[:, : tokens.shape[1] - 1], steps)


def export_tensors(draft: Eagle1Draft) -> dict[str, torch.Tensor]:
    """The checkpoint: the draft's parameters and the shared embedding (no head: SGLang
    gives the draft the target's); bf16."""
    out = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()}
    out["embed_tokens.weight"] = draft._shared[0].weight.detach().to(torch.bfloat16).contiguous()
    return out


def load_draft(path: Path, s: Shape, embed: nn.Embedding, head: nn.Linear) -> Eagle1Draft:
    """A draft (fp32) from an EAGLE-1 directory; ``embed`` and ``head`` are the target's."""
    tensors = load_file(str(path / "model.safetensors"))
    draft = Eagle1Draft(s, embed, head)
    own = {k: v.float() for k, v in tensors.items() if k != "embed_tokens.weight"}
    draft.load_state_dict(own, strict=True)
    return draft.eval()
