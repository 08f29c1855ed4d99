"""A plain-torch DeepSeek-V3 target and its NextN draft that compute what SGLang 0.5.23's
``DeepseekV3ForCausalLM`` and ``DeepseekV3ForCausalLMNextN`` compute.

Used to train the shipped DeepSeek pair (``train_deepseek.py``) and to predict its
acceptance offline (``evaluate.py``). Parameter names are the checkpoint's
(``spec.deepseek_tensors``); the NextN draft's carry the prefix ``model.layers.{layers}.``
in the file.

SGLang's forward, read in ``models/deepseek_v2.py``, ``models/deepseek_nextn.py`` and
``layers/moe/topk.py``:

- **MLA** (``DeepseekV2AttentionMLA``; the MHA prefill and the absorbed decode compute
  the same): ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` per head ``[nope | rope]``;
  ``kv_a_proj_with_mqa(x) = [latent | k_pe]``, ``latent`` through ``kv_a_layernorm``, then
  ``kv_b_proj(latent)`` per head ``[k_nope | v]``; ``k_pe`` is one rope key shared by every
  head. RoPE is GPT-J style (``rope_interleave``: pairs ``(2i, 2i + 1)``; SGLang's
  ``is_neox_style = not rope_interleave``) on ``q_pe`` and ``k_pe``. The scale is
  ``(nope + rope) ** -0.5`` (yarn factor 1 leaves it and the rotation unchanged).
- **MoE** (``DeepseekV2MoE``, ``biased_grouped_topk_impl``): ``scores = sigmoid(x W_gate^T)``;
  the choice adds ``e_score_correction_bias``; groups are ranked by the sum of their top 2
  biased scores and the best ``topk_group`` kept; the top ``num_experts_per_tok`` experts
  of those are picked; their weights are the unbiased scores renormalised to sum 1
  (``norm_topk_prob``); the output is ``shared_experts(x) + routed_scaling_factor *
  Σ w_e expert_e(x)``.
- Pre-norm layers, the first ``first_k_dense_replace`` with a dense SwiGLU MLP; the
  target's final ``model.norm`` output is what its logits processor reads and what it
  hands the draft.
- **NextN** (``DeepseekModelNextN``): ``x = eh_proj(cat(enorm(embed(token)), hnorm(h)))``,
  one decoder layer (MLA, always MoE), then ``shared_head.norm``; the logits are
  ``lm_head(shared_head.norm(·))`` with the target's head and embedding
  (``set_embed_and_head``). For the draft extend ``h`` is the target's final normed state
  at the previous position; a draft step reads the draft's own previous output (after
  ``shared_head.norm``: the state its logits processor captured).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from .layers import RMSNorm, causal_attention, merge_heads, unroll_chain
from .spec import NEXTN_SHARED, DeepseekShape

INIT_STD = 0.02
RENORM_EPS = 1e-20


def _linear(inp: int, out: int) -> nn.Linear:
    layer = nn.Linear(inp, out, bias=False)
    nn.init.normal_(layer.weight, std=INIT_STD)
    return layer


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """GPT-J RoPE: pair ``(2i, 2i + 1)`` turns by ``position * theta ** (-2i / d)``.
    x [..., L, d], positions int64 [L]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv[None]  # [L, d/2]
    cos, sin = ang.cos(), ang.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = _linear(hidden, inter)
        self.up_proj = _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLA(nn.Module):
    """The projections of multi-head latent attention, with q and kv LoRA ranks."""

    def __init__(self, s: DeepseekShape):
        super().__init__()
        self.shape = s
        self.q_a_proj = _linear(s.hidden, s.q_lora)
        self.q_a_layernorm = RMSNorm(s.q_lora, s.rms_eps)
        self.q_b_proj = _linear(s.q_lora, s.heads * s.head_dim)
        self.kv_a_proj_with_mqa = _linear(s.hidden, s.kv_lora + s.qk_rope)
        self.kv_a_layernorm = RMSNorm(s.kv_lora, s.rms_eps)
        self.kv_b_proj = _linear(s.kv_lora, s.heads * (s.qk_nope + s.v_head))
        self.o_proj = _linear(s.heads * s.v_head, s.hidden)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, H] -> q, k [B, heads, L, nope + rope] and v [B, heads, L, v_head], RoPE applied."""
        s = self.shape
        B, L, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, L, s.heads, s.head_dim).transpose(1, 2)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([s.kv_lora, s.qk_rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, L, s.heads, s.qk_nope + s.v_head).transpose(1, 2)
        k_nope, v = kv.split([s.qk_nope, s.v_head], -1)
        q_nope, q_pe = q.split([s.qk_nope, s.qk_rope], -1)
        q = torch.cat([q_nope, rope_interleaved(q_pe, positions, s.rope_theta)], -1)
        k_pe = rope_interleaved(k_pe[:, None], positions, s.rope_theta).expand(B, s.heads, L, s.qk_rope)
        return q, torch.cat([k_nope, k_pe], -1), v


class Gate(nn.Module):
    """The router: ``weight`` [experts, H] and the ``noaux_tc`` choice bias (fp32, not trained by
    gradient: ``update_bias`` moves it towards balanced loads, DeepSeek-V3's auxiliary-loss-free rule)."""

    def __init__(self, s: DeepseekShape):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(s.routed_experts, s.hidden) * INIT_STD)
        self.register_buffer("e_score_correction_bias", torch.zeros(s.routed_experts))
        self.load: torch.Tensor | None = None  # tokens per expert in the last forward (training)


class MoE(nn.Module):
    def __init__(self, s: DeepseekShape):
        super().__init__()
        self.shape = s
        self.gate = Gate(s)
        self.experts = nn.ModuleList([SwiGLU(s.hidden, s.moe_intermediate) for _ in range(s.routed_experts)])
        self.shared_experts = SwiGLU(s.hidden, s.moe_intermediate * s.shared_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights fp32 [N, k], expert ids int64 [N, k]): biased grouped top-k."""
        s = self.shape
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        choice = scores.detach() + self.gate.e_score_correction_bias
        N = x.shape[0]
        group_scores = choice.view(N, s.groups, -1).topk(2, -1).values.sum(-1)
        keep = torch.zeros(N, s.groups, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(s.topk_groups, -1).indices, True)
        keep = keep[:, :, None].expand(N, s.groups, s.routed_experts // s.groups).reshape(N, -1)
        ids = choice.masked_fill(~keep, float("-inf")).topk(s.experts_per_token, -1).indices
        w = scores.gather(1, ids)
        return w / (w.sum(-1, keepdim=True) + RENORM_EPS), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w, ids = self.route(x2)
        if self.training:
            self.gate.load = torch.bincount(ids.flatten(), minlength=self.shape.routed_experts)
        routed = torch.zeros_like(x2)
        for e, expert in enumerate(self.experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                routed = routed.index_add(0, tok, w[tok, slot, None].to(x2.dtype) * expert(x2[tok]))
        return (self.shared_experts(x2) + self.shape.routed_scaling * routed).view(shape)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower the over-loaded ones' by ``rate``."""
        if self.gate.load is not None:
            load = self.gate.load.float()
            self.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
            self.gate.load = None


class DecoderLayer(nn.Module):
    def __init__(self, s: DeepseekShape, sparse: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.self_attn = MLA(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.mlp: nn.Module = MoE(s) if sparse else SwiGLU(s.hidden, s.intermediate)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions)
        x = x + self.self_attn.o_proj(merge_heads(causal_attention(q, k, v)))
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekTarget(nn.Module):
    """The target; ``state_dict`` names are the checkpoint's."""

    def __init__(self, s: DeepseekShape):
        super().__init__()
        self.shape = s
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        nn.init.normal_(self.model.embed_tokens.weight, std=INIT_STD)
        self.model.layers = nn.ModuleList([DecoderLayer(s, sparse=i >= s.first_dense) for i in range(s.layers)])
        self.model.norm = RMSNorm(s.hidden, s.rms_eps)
        self.lm_head = _linear(s.hidden, s.vocab)

    def moes(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens int64 [B, T] -> (logits fp32 [B, T, V], final normed states [B, T, H])."""
        x = self.model.embed_tokens(tokens)
        positions = torch.arange(tokens.shape[1])
        for layer in self.model.layers:
            x = layer(x, positions)
        hidden = self.model.norm(x)
        return self.lm_head(hidden).float(), hidden


class NextnDraft(nn.Module):
    """The NextN layer; ``embed`` and ``head`` are the target's, frozen and not owned.
    ``state_dict`` names are the checkpoint's less the ``model.layers.{layers}.`` prefix."""

    def __init__(self, s: DeepseekShape, embed: nn.Embedding, head: nn.Linear):
        super().__init__()
        self.shape = s
        self.enorm = RMSNorm(s.hidden, s.rms_eps)
        self.hnorm = RMSNorm(s.hidden, s.rms_eps)
        self.eh_proj = _linear(2 * s.hidden, s.hidden)
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.self_attn = MLA(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.mlp = MoE(s)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(s.hidden, s.rms_eps)
        self._shared = [embed, head]  # a list, so the shared modules are neither children nor saved

    def start_from_target_hidden(self) -> None:
        """``eh_proj`` passes the hidden half through at first (``x = hnorm(h)``)."""
        H = self.shape.hidden
        with torch.no_grad():
            self.eh_proj.weight[:, H:].copy_(torch.eye(H))

    def step_inputs(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens int64 [B, L], hidden [B, L, H] -> q, k, v [B, heads, L, ·] and the residual [B, L, H]."""
        x = self.eh_proj(torch.cat([self.enorm(self._shared[0](tokens)), self.hnorm(hidden)], -1))
        return (*self.self_attn.qkv(self.input_layernorm(x), positions), x)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [B, heads, L, v_head] -> (logits fp32 [B, L, V], the normed output handed to the next step)."""
        x = residual + self.self_attn.o_proj(merge_heads(attn))
        x = x + self.mlp(self.post_attention_layernorm(x))
        h = self.shared_head.norm(x)
        return self._shared[1](h).float(), h

    def unroll(self, tokens: torch.Tensor, hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens int64 [B, T]; hidden [B, T, H], the target's final normed states. Returns the
        logits of each chained step, step ``k`` [B, T - 1 - k, V] (``layers.unroll_chain``)."""
        return unroll_chain(self, tokens, hidden[:, : tokens.shape[1] - 1], steps)


def nextn_prefix(s: DeepseekShape) -> str:
    return f"model.layers.{s.layers}."


def _export(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bf16, except the routing bias (fp32, as SGLang's parameter and HF's checkpoints hold it)."""
    return {
        k: v.detach().to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16).contiguous()
        for k, v in state.items()
    }


def export_tensors(target: DeepseekTarget, draft: NextnDraft | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint: the target's tensors and, when given, the NextN layer's under its prefix."""
    out = _export(target.state_dict())
    if draft is not None:
        out |= {nextn_prefix(draft.shape) + k: v for k, v in _export(draft.state_dict()).items()}
    return out


def load_target(path: Path, s: DeepseekShape) -> DeepseekTarget:
    """The target (fp32, eval) from a DeepSeek directory; the NextN layer's tensors are ignored."""
    tensors = load_file(str(path / "model.safetensors"))
    prefix = nextn_prefix(s)
    target = DeepseekTarget(s)
    target.load_state_dict({k: v.float() for k, v in tensors.items() if not k.startswith(prefix)}, strict=True)
    return target.eval()


def load_nextn(path: Path, s: DeepseekShape, embed: nn.Embedding, head: nn.Linear) -> NextnDraft:
    """The NextN draft (fp32, eval) from a directory holding ``model.layers.{layers}.*``."""
    tensors = load_file(str(path / "model.safetensors"))
    prefix = nextn_prefix(s)
    draft = NextnDraft(s, embed, head)
    own = {k.removeprefix(prefix): v.float() for k, v in tensors.items() if k.startswith(prefix)}
    for name in NEXTN_SHARED:  # copies of the target's, which the draft reads from ``embed`` and ``head``
        own.pop(name, None)
    draft.load_state_dict(own, strict=True)
    return draft.eval()
