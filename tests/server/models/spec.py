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
