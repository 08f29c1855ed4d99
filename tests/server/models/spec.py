"""Shapes, configs and weight tables of the tiny models, as SGLang 0.5.23 reads them.

One table per architecture names every tensor of the checkpoint with its shape. The random
builder fills it, ``train.py`` exports into it, and the tests check files against it.

What SGLang reads (``sglang/srt/models/llama_eagle3.py``, ``llama_eagle.py``,
``model_executor/model_runner_components/spec_aux_hidden_state.py``), and why each field
is set:

- EAGLE3 (``LlamaForCausalLMEagle3``):
  - ``eagle_config.eagle_aux_hidden_state_layer_ids`` picks the target layers whose outputs
    feed the draft; the target captures id ``i`` at the input of layer ``i + 1``
    (``LlamaForCausalLM.set_eagle3_layers_to_capture``), so every id must be below
    ``layers - 1`` or it is never captured, and the draft's ``fc`` (sized by the number of
    ids) would not fit. Without the field SGLang falls back to ``[2, L // 2, L - 3]`` and
    3 states, which a small target cannot give.
  - ``draft_vocab_size`` equal to ``vocab_size``: rejection sampling refuses a draft vocab
    that differs from the target's (``eagle_worker_v2.py``, ``init_lm_head`` and after).
  - ``target_hidden_size``: the width of each captured state.
  - ``d2t``/``t2d`` (identity maps here): the draft-to-target id offsets SGLang adds to
    ``arange``; the embedding is replaced by the target's at start (``set_embed``).
  - weights named ``midlayer.*`` (the published EAGLE3 layout, mapped to ``layers.0``).
- EAGLE-1 (``LlamaForCausalLMEagle``): one decoder layer without ``input_layernorm``,
  ``fc: [H, 2H]`` with bias over ``cat(embed, target hidden)``; SGLang shares the target's
  embedding and head (``set_embed_and_head``). Its ``--speculative-token-map`` is a file
  beside the weights (``TOKEN_MAP_FILE``): ``torch.load`` of a list of ``hot_vocab`` target
  ids (``speculative/spec_utils.py``, ``load_token_map``), a full permutation here.
- Multi-layer MTP (``MiMoV2MTP``, ``models/mimo_v2_nextn.py``, served with
  ``--enable-multi-layer-eagle``): ``MTP_DEPTH`` layers named ``model.mtp.layers.<k>.*``
  (MiMo-V2's layout; the loader gives draft step ``k`` layer ``k``), each ``enorm``,
  ``hnorm``, ``eh_proj: [H, 2H]`` (no bias), a pre-norm decoder layer and
  ``final_layernorm``. The config carries MiMo-V2's attention fields (``swa_*``,
  ``layernorm_epsilon``); ``sliding_window_size = -1`` is full attention (the CPU
  stand-ins refuse windows). The class is listed as hybrid-SWA by architecture
  (``model_config.py``, ``is_hybrid_swa_model``), and a draft with no full-attention layer
  sizes no full pool, so the server needs ``--disable-hybrid-swa-memory``.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import LlamaConfig

BOS, EOS, PAD = 0, 1, 2
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
VOCAB = 1024
# Target layers whose outputs an EAGLE3 draft reads (SGLang's convention, see above):
# the outputs of layers 0, 1 and 2 of a 4-layer target, low to high.
AUX_LAYER_IDS = (0, 1, 2)
#: MTP layers of the multi-layer draft: one per chain step (``--speculative-num-steps 3``).
MTP_DEPTH = 3
#: The token map's file name inside the EAGLE-1 draft's directory (SGLang loads the
#: directory's safetensors only, so the file is not mistaken for weights).
TOKEN_MAP_FILE = "token_map.pt"


@dataclass(frozen=True)
class Shape:
    """The size of a target and of its drafts (the drafts share hidden and head sizes)."""

    hidden: int  # H, also each draft's hidden size and each aux state's width
    intermediate: int  # MLP width
    layers: int  # target decoder layers (each draft has one)
    heads: int  # attention heads, key/value heads too (no GQA)
    vocab: int = VOCAB
    max_positions: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if max(AUX_LAYER_IDS) >= self.layers - 1:
            raise ValueError(f"aux layer ids {AUX_LAYER_IDS} need a target with more than {self.layers} layers")


RANDOM = Shape(hidden=64, intermediate=128, layers=4, heads=4)
TRAINED = Shape(hidden=128, intermediate=256, layers=4, heads=4)


def _common(s: Shape) -> dict[str, object]:
    return dict(
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads,
        head_dim=s.head_dim,
        hidden_act="silu",
        max_position_embeddings=s.max_positions,
        rms_norm_eps=s.rms_eps,
        rope_theta=s.rope_theta,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def target_config(s: Shape) -> LlamaConfig:
    return LlamaConfig(architectures=["LlamaForCausalLM"], num_hidden_layers=s.layers, **_common(s))


def eagle3_config(s: Shape) -> LlamaConfig:
    return LlamaConfig(
        architectures=["LlamaForCausalLMEagle3"],
        num_hidden_layers=1,
        draft_vocab_size=s.vocab,
        target_hidden_size=s.hidden,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS), "use_aux_hidden_state": True},
        **_common(s),
    )


def eagle1_config(s: Shape) -> LlamaConfig:
    return LlamaConfig(architectures=["LlamaForCausalLMEagle"], num_hidden_layers=1, **_common(s))


def mtp_config(s: Shape) -> LlamaConfig:
    """MiMo-V2's MTP fields on a Llama config (``model_type`` llama: transformers reads it
    without remote code; SGLang picks the class from ``architectures``)."""
    return LlamaConfig(
        architectures=["MiMoV2MTP"],
        num_hidden_layers=1,
        num_nextn_predict_layers=MTP_DEPTH,
        swa_num_attention_heads=s.heads,
        swa_num_key_value_heads=s.heads,
        swa_head_dim=s.head_dim,
        swa_v_head_dim=s.head_dim,
        v_head_dim=s.head_dim,
        swa_rope_theta=s.rope_theta,
        sliding_window_size=-1,
        layernorm_epsilon=s.rms_eps,
        partial_rotary_factor=1.0,
        add_swa_attention_sink_bias=False,
        add_full_attention_sink_bias=False,
        **_common(s),
    )


def _layer(s: Shape, prefix: str, *, qkv_in: int, input_norm: bool) -> dict[str, tuple[int, ...]]:
    H, inter = s.hidden, s.intermediate
    t = {
        f"{prefix}self_attn.q_proj.weight": (H, qkv_in),
        f"{prefix}self_attn.k_proj.weight": (H, qkv_in),
        f"{prefix}self_attn.v_proj.weight": (H, qkv_in),
        f"{prefix}self_attn.o_proj.weight": (H, H),
        f"{prefix}post_attention_layernorm.weight": (H,),
        f"{prefix}mlp.gate_proj.weight": (inter, H),
        f"{prefix}mlp.up_proj.weight": (inter, H),
        f"{prefix}mlp.down_proj.weight": (H, inter),
    }
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = (H,)
    return t


def target_tensors(s: Shape) -> dict[str, tuple[int, ...]]:
    """HF Llama checkpoint names -> shapes."""
    t = {"model.embed_tokens.weight": (s.vocab, s.hidden)}
    for i in range(s.layers):
        t |= _layer(s, f"model.layers.{i}.", qkv_in=s.hidden, input_norm=True)
    return t | {"model.norm.weight": (s.hidden,), "lm_head.weight": (s.vocab, s.hidden)}


def eagle3_tensors(s: Shape) -> dict[str, tuple[int, ...]]:
    """EAGLE3 checkpoint names -> shapes (d2t and t2d are int64 and bool; the rest floats)."""
    H = s.hidden
    t = _layer(s, "midlayer.", qkv_in=2 * H, input_norm=True)
    t["midlayer.hidden_norm.weight"] = (H,)
    return t | {
        "fc.weight": (H, len(AUX_LAYER_IDS) * H),
        "norm.weight": (H,),
        "lm_head.weight": (s.vocab, H),
        "embed_tokens.weight": (s.vocab, H),
        "d2t": (s.vocab,),
        "t2d": (s.vocab,),
    }


def eagle1_tensors(s: Shape) -> dict[str, tuple[int, ...]]:
    """EAGLE-1 checkpoint names -> shapes (SGLang prefixes ``model.``; no input_layernorm, and
    no head: SGLang's loader skips one and gives the draft the target's)."""
    H = s.hidden
    t = _layer(s, "layers.0.", qkv_in=H, input_norm=False)
    return t | {
        "embed_tokens.weight": (s.vocab, H),
        "fc.weight": (H, 2 * H),
        "fc.bias": (H,),
    }


def mtp_tensors(s: Shape, depth: int = MTP_DEPTH) -> dict[str, tuple[int, ...]]:
    """Multi-layer MTP checkpoint names -> shapes: ``depth`` layers, and copies of the
    target's embedding and head (SGLang replaces both with the target's at start)."""
    H = s.hidden
    t: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, H), "lm_head.weight": (s.vocab, H)}
    for k in range(depth):
        p = f"model.mtp.layers.{k}."
        t |= _layer(s, p, qkv_in=H, input_norm=True)
        t |= {
            f"{p}enorm.weight": (H,),
            f"{p}hnorm.weight": (H,),
            f"{p}eh_proj.weight": (H, 2 * H),
            f"{p}final_layernorm.weight": (H,),
        }
    return t


# --- DeepSeek-V3 (MLA, MoE) and its NextN draft ------------------------------------------
#
# What SGLang 0.5.23 reads (``models/deepseek_v2.py``, ``models/deepseek_nextn.py``,
# ``models/deepseek_common/deepseek_weight_loader.py``, ``layers/moe/topk.py``,
# ``layers/rotary_embedding/factory.py``, ``configs/update_config.py``), and why each field
# is set:
#
# - ``topk_method: noaux_tc`` gives the gate its ``e_score_correction_bias`` (fp32) and the
#   biased grouped top-k (sigmoid scores, bias added for the choice only, groups ranked by
#   the sum of their top 2); ``moe_layer_freq`` and ``first_k_dense_replace`` pick the MoE
#   layers. transformers' ``DeepseekV3Config`` has neither of the first two: they are kept
#   as extra fields of config.json.
# - ``rope_scaling`` is yarn with factor 1.0 (plain RoPE, attention scale unchanged): the
#   CPU rope factory accepts only ``deepseek_yarn`` (``get_rope_cpu``), and MLA renames any
#   scaling to it. ``max_position_embeddings`` equals the yarn
#   ``original_max_position_embeddings`` so transformers sees no implied factor.
#   ``rope_interleave`` (default true) makes the rope GPT-J style: pairs (2i, 2i + 1).
# - Sizes divide by TP 2: heads even, intermediate sizes multiples of 64 (the CPU pads
#   heads to a multiple of TP and intermediates to a multiple of TP x 32).
# - ``num_nextn_predict_layers: 1`` (the loader asserts 1). The NextN layer is
#   ``model.layers.{num_hidden_layers}.*`` in the checkpoint: ``enorm``, ``hnorm``,
#   ``eh_proj`` [H, 2H], ``shared_head.norm`` and a decoder layer whose MLP is always MoE
#   (``_is_layer_sparse`` with ``is_nextn``); its embedding and head are the target's.
#   The target's loader skips layers >= ``num_hidden_layers``, so one directory serves as
#   both (``--speculative-draft-model-path`` the target's own path), and a directory with
#   the same config and only the NextN layer serves as the draft alone.


@dataclass(frozen=True)
class DeepseekShape:
    """A tiny DeepSeek-V3: MLA attention, the first ``first_dense`` layers dense, the rest MoE."""

    hidden: int = 128
    layers: int = 3  # target decoder layers; the NextN layer is layer ``layers``
    first_dense: int = 1  # first_k_dense_replace
    heads: int = 4
    q_lora: int = 64
    kv_lora: int = 64
    qk_nope: int = 32
    qk_rope: int = 16
    v_head: int = 32
    intermediate: int = 256  # the dense layers' MLP width
    moe_intermediate: int = 64  # each expert's width (and the shared expert's, per shared expert)
    routed_experts: int = 8
    shared_experts: int = 1
    experts_per_token: int = 2
    groups: int = 4  # n_group: 2 experts each (the group score sums a group's top 2)
    topk_groups: int = 2
    routed_scaling: float = 2.5
    vocab: int = VOCAB
    max_positions: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        """The query/key width per head (nope + rope); the attention scale is its -1/2 power."""
        return self.qk_nope + self.qk_rope

    def __post_init__(self) -> None:
        if self.routed_experts % self.groups or self.routed_experts // self.groups < 2:
            raise ValueError(f"{self.routed_experts} experts do not split into {self.groups} groups of 2 or more")
        if self.topk_groups * (self.routed_experts // self.groups) < self.experts_per_token:
            raise ValueError("the chosen groups hold fewer experts than a token picks")


DEEPSEEK = DeepseekShape()


def deepseek_config(s: DeepseekShape) -> dict[str, object]:
    """config.json of the target (and of the NextN draft: SGLang renames the architecture
    to ``DeepseekV3ForCausalLMNextN`` when it loads a draft)."""
    return dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        moe_intermediate_size=s.moe_intermediate,
        num_hidden_layers=s.layers,
        num_nextn_predict_layers=1,
        first_k_dense_replace=s.first_dense,
        moe_layer_freq=1,
        num_attention_heads=s.heads,
        num_key_value_heads=s.heads,
        q_lora_rank=s.q_lora,
        kv_lora_rank=s.kv_lora,
        qk_nope_head_dim=s.qk_nope,
        qk_rope_head_dim=s.qk_rope,
        v_head_dim=s.v_head,
        n_routed_experts=s.routed_experts,
        n_shared_experts=s.shared_experts,
        num_experts_per_tok=s.experts_per_token,
        n_group=s.groups,
        topk_group=s.topk_groups,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=s.routed_scaling,
        hidden_act="silu",
        max_position_embeddings=s.max_positions,
        rope_theta=s.rope_theta,
        rope_scaling={
            "type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": s.max_positions,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rope_interleave=True,
        rms_norm_eps=s.rms_eps,
        attention_bias=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def _swiglu(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}gate_proj.weight": (inter, hidden),
        f"{prefix}up_proj.weight": (inter, hidden),
        f"{prefix}down_proj.weight": (hidden, inter),
    }


def _deepseek_layer(s: DeepseekShape, prefix: str, *, sparse: bool) -> dict[str, tuple[int, ...]]:
    H, a = s.hidden, f"{prefix}self_attn."
    t = {
        f"{prefix}input_layernorm.weight": (H,),
        f"{prefix}post_attention_layernorm.weight": (H,),
        f"{a}q_a_proj.weight": (s.q_lora, H),
        f"{a}q_a_layernorm.weight": (s.q_lora,),
        f"{a}q_b_proj.weight": (s.heads * s.head_dim, s.q_lora),
        f"{a}kv_a_proj_with_mqa.weight": (s.kv_lora + s.qk_rope, H),
        f"{a}kv_a_layernorm.weight": (s.kv_lora,),
        f"{a}kv_b_proj.weight": (s.heads * (s.qk_nope + s.v_head), s.kv_lora),
        f"{a}o_proj.weight": (H, s.heads * s.v_head),
    }
    if not sparse:
        return t | _swiglu(f"{prefix}mlp.", H, s.intermediate)
    t |= {
        f"{prefix}mlp.gate.weight": (s.routed_experts, H),
        f"{prefix}mlp.gate.e_score_correction_bias": (s.routed_experts,),
    }
    for e in range(s.routed_experts):
        t |= _swiglu(f"{prefix}mlp.experts.{e}.", H, s.moe_intermediate)
    return t | _swiglu(f"{prefix}mlp.shared_experts.", H, s.moe_intermediate * s.shared_experts)


#: The NextN layer's copies of the target's embedding and head, in DeepSeek's published
#: layout; SGLang's loader skips both (it gives the draft the target's at start).
NEXTN_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def deepseek_nextn_tensors(s: DeepseekShape) -> dict[str, tuple[int, ...]]:
    """The NextN layer's names -> shapes (``model.layers.{layers}.*``), with ``NEXTN_SHARED``."""
    p, H = f"model.layers.{s.layers}.", s.hidden
    return (
        _deepseek_layer(s, p, sparse=True)
        | {
            f"{p}enorm.weight": (H,),
            f"{p}hnorm.weight": (H,),
            f"{p}eh_proj.weight": (H, 2 * H),
            f"{p}shared_head.norm.weight": (H,),
        }
        | {p + name: (s.vocab, H) for name in NEXTN_SHARED}
    )


def deepseek_tensors(s: DeepseekShape) -> dict[str, tuple[int, ...]]:
    """The target's checkpoint names -> shapes, with its NextN layer (as DeepSeek publishes
    them: one file). ``e_score_correction_bias`` is fp32, the rest bf16."""
    t: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, s.hidden)}
    for i in range(s.layers):
        t |= _deepseek_layer(s, f"model.layers.{i}.", sparse=i >= s.first_dense)
    t |= {"model.norm.weight": (s.hidden,), "lm_head.weight": (s.vocab, s.hidden)}
    return t | deepseek_nextn_tensors(s)
