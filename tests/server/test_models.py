"""The real-server tier's tiny models (tests/server/models, README.md there).

- The builders give complete HF directories whose tensors, dtypes and configs are exactly
  what the tables in ``models/spec.py`` say, the random ones the same bytes on every build.
- The tokenizer round-trips text; its training is deterministic.
- The shipped trained pair accepts, offline at T = 1 on held-out stdlib text, with
  probability strictly between 0.1 and 0.9 (printed), and a reversed draft falls outside
  that band (the negative control); so does every chain step of the distilled multi-layer
  MTP and EAGLE-1 drafts.
- The EAGLE-1 draft's ``--speculative-token-map`` loads as SGLang loads it and is a
  non-identity permutation of the whole vocabulary; the drafts carry the target's
  embedding and head; the multi-layer draft's layer ``k`` reads the ids the worker's
  rotation gives it.
- The DeepSeek-V3 pair (``trained_deepseek``, ``trained_deepseek_nextn``): configs say
  what SGLang reads, the NextN draft's first-verify acceptance is in (0.2, 0.9) with a
  sign-flipped draft outside it, the draft directory is the target's NextN layer, the
  plain model's routing is the documented grouped top-k, and its batched draft equals a
  per-anchor extend with a KV cache.
- Tests marked ``sglang``: SGLang's own classes build from the configs and their
  ``load_weights`` fill every parameter (``models/sglang_check.py``, in a child process);
  for DeepSeek every parameter also holds the file's tensors (fused and stacked ones too).
- Marked ``server``: SGLang's own DeepSeek-V3 forward on CPU (a ``ModelRunner`` in a child
  process, ``models/sglang_forward.py``) gives the plain model's logits on a prompt.

Needs torch, transformers, safetensors and tokenizers (skipped without transformers).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the model builders need transformers (make setup-sglang)")
pytest.importorskip("safetensors", reason="the model builders need safetensors (make setup-sglang)")
pytest.importorskip("tokenizers", reason="the model builders need tokenizers (make setup-sglang)")

from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaForCausalLM

from server.models import MODEL_NAMES, build_models, corpus, deepseek, evaluate, spec, token_map_path
from server.models.build import token_map
from server.models.eagle1 import Eagle1Draft
from server.models.eagle3 import Eagle3Draft
from server.models.mtp import MtpDraft
from server.models.tokenizer import load_tokenizer, train_tokenizer

TESTS = Path(__file__).resolve().parents[1]
SHAPES = {
    "target": spec.RANDOM,
    "eagle3": spec.RANDOM,
    "eagle1": spec.RANDOM,
    "trained_target": spec.TRAINED,
    "trained_eagle3": spec.TRAINED,
    "trained_multi_layer": spec.TRAINED,
    "trained_eagle1_token_map": spec.TRAINED,
    "trained_deepseek": spec.DEEPSEEK,
    "trained_deepseek_nextn": spec.DEEPSEEK,
}
TABLES = {
    "target": spec.target_tensors,
    "eagle3": spec.eagle3_tensors,
    "eagle1": spec.eagle1_tensors,
    "trained_target": spec.target_tensors,
    "trained_eagle3": spec.eagle3_tensors,
    "trained_multi_layer": spec.mtp_tensors,
    "trained_eagle1_token_map": spec.eagle1_tensors,
    "trained_deepseek": spec.deepseek_tensors,
    "trained_deepseek_nextn": spec.deepseek_nextn_tensors,
}
ARCHITECTURES = {
    "target": "LlamaForCausalLM",
    "eagle3": "LlamaForCausalLMEagle3",
    "eagle1": "LlamaForCausalLMEagle",
    "trained_target": "LlamaForCausalLM",
    "trained_eagle3": "LlamaForCausalLMEagle3",
    "trained_multi_layer": "MiMoV2MTP",
    "trained_eagle1_token_map": "LlamaForCausalLMEagle",
    # SGLang renames a DeepSeek draft's architecture to DeepseekV3ForCausalLMNextN.
    "trained_deepseek": "DeepseekV3ForCausalLM",
    "trained_deepseek_nextn": "DeepseekV3ForCausalLM",
}
DRAFT_OF = {
    "eagle3": "target",
    "eagle1": "target",
    "trained_eagle3": "trained_target",
    "trained_multi_layer": "trained_target",
    "trained_eagle1_token_map": "trained_target",
}
#: The drafts distil.py made from the trained target.
DISTILLED = ("trained_multi_layer", "trained_eagle1_token_map")
DEEPSEEK_NAMES = ("trained_deepseek", "trained_deepseek_nextn")
#: How far (total variation per position) SGLang's bf16 DeepSeek forward may be from the
#: plain fp32 model's on the same weights.
TV_TOLERANCE = 0.03


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_models(tmp_path_factory.mktemp("server-models"))


def test_build_returns_every_model_as_a_complete_directory(models: dict[str, Path]) -> None:
    assert tuple(models) == MODEL_NAMES
    for name, path in models.items():
        files = {f.name for f in path.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files, name


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_checkpoint_holds_exactly_the_table(models: dict[str, Path], name: str) -> None:
    tensors = load_file(str(models[name] / "model.safetensors"))
    table = TABLES[name](SHAPES[name])
    assert {k: tuple(v.shape) for k, v in tensors.items()} == table
    for key, t in tensors.items():
        if key == "d2t":
            assert t.dtype == torch.int64 and not t.any(), "d2t must be the identity map (all offsets 0)"
        elif key == "t2d":
            assert t.dtype == torch.bool and t.all(), "t2d must map every target id"
        elif key.endswith("e_score_correction_bias"):
            assert t.dtype == torch.float32, key  # SGLang's parameter is fp32, as HF stores it
            assert t.abs().max() > 0, "the routing bias was never trained"
        else:
            assert t.dtype == torch.bfloat16, key
            assert torch.isfinite(t.float()).all(), key


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_config_says_what_sglang_reads(models: dict[str, Path], name: str) -> None:
    cfg = AutoConfig.from_pretrained(str(models[name]))
    s = SHAPES[name]
    assert cfg.architectures == [ARCHITECTURES[name]]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads) == (s.vocab, s.hidden, s.heads)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (spec.BOS, spec.EOS, spec.PAD)
    assert cfg.tie_word_embeddings is False
    if ARCHITECTURES[name] == "DeepseekV3ForCausalLM":
        return  # test_deepseek_config_says_what_sglang_reads
    if name in DRAFT_OF:
        target = AutoConfig.from_pretrained(str(models[DRAFT_OF[name]]))
        assert cfg.num_hidden_layers == 1
        assert cfg.vocab_size == target.vocab_size
    if ARCHITECTURES[name] == "LlamaForCausalLMEagle3":
        # Rejection sampling needs the full vocabulary; the aux ids must all be captured
        # by the target (id i is read at the input of layer i + 1) and fit fc.
        assert cfg.draft_vocab_size == target.vocab_size
        assert cfg.target_hidden_size == target.hidden_size
        ids = cfg.eagle_config["eagle_aux_hidden_state_layer_ids"]
        assert ids == list(spec.AUX_LAYER_IDS)
        assert all(0 <= i + 1 < target.num_hidden_layers for i in ids)
        fc = load_file(str(models[name] / "model.safetensors"))["fc.weight"]
        assert fc.shape == (cfg.hidden_size, len(ids) * target.hidden_size)
    if ARCHITECTURES[name] == "MiMoV2MTP":
        # One MTP layer per chain step; full attention (-1: no window); MiMo-V2's attention
        # fields, which the class reads instead of the Llama ones.
        assert cfg.num_nextn_predict_layers == spec.MTP_DEPTH
        assert cfg.sliding_window_size == -1
        assert (cfg.swa_num_attention_heads, cfg.swa_num_key_value_heads) == (s.heads, s.heads)
        assert (cfg.swa_head_dim, cfg.swa_v_head_dim) == (s.head_dim, s.head_dim)
        assert cfg.layernorm_epsilon == s.rms_eps
        assert not cfg.add_swa_attention_sink_bias


@pytest.mark.parametrize("name", ["target", "trained_target"])
def test_target_loads_and_runs_in_transformers(models: dict[str, Path], name: str) -> None:
    model = LlamaForCausalLM.from_pretrained(str(models[name]), dtype=torch.float32).eval()
    tok = load_tokenizer(models[name])
    x = torch.tensor([tok("def main():\n    return 0\n")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=x).logits
    assert logits.shape == (1, x.shape[1], spec.VOCAB)
    assert torch.isfinite(logits).all()
    if name == "target":
        # The random head spreads logits over units, not hundredths (build.HEAD_LOGIT_STD):
        # greedy picks are then not decided by bf16 noise.
        spread = logits.std(-1).median().item()
        assert 1.0 < spread < 10.0, spread


def test_random_builds_are_the_same_bytes_and_cached(models: dict[str, Path], tmp_path: Path) -> None:
    root = models["target"].parent
    again = build_models(tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    assert json.loads((again["target"].parent / "manifest.json").read_text()) == manifest
    stamp = (root / "manifest.json").stat().st_mtime_ns
    assert build_models(root.parent) == models  # the cache answers; nothing is rebuilt
    assert (root / "manifest.json").stat().st_mtime_ns == stamp


def test_tokenizer_round_trips_text(models: dict[str, Path]) -> None:
    tok = load_tokenizer(models["target"])
    assert len(tok) == spec.VOCAB
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (spec.BOS, spec.EOS, spec.PAD)
    _, held = corpus.split()
    texts = [corpus.read(held[0])[:4000], "héllo → 世界 🚀\n\tx = {'a': 1}\r\n", "   ", ""]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert all(0 <= i < spec.VOCAB for i in ids)
    assert tok("x = 1")["input_ids"][0] == spec.BOS  # a prompt starts with <s>, as SGLang encodes it
    shipped = (models["target"] / "tokenizer.json").read_bytes()
    assert all((models[n] / "tokenizer.json").read_bytes() == shipped for n in MODEL_NAMES)


def test_tokenizer_training_is_deterministic() -> None:
    files = corpus.split()[0][:4]
    a, b = train_tokenizer(files, vocab=320), train_tokenizer(files, vocab=320)
    assert len(a) == 320
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_overlap_figures_on_known_laws() -> None:
    p = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert evaluate.overlap(p, p).item() == pytest.approx(1.0)
    assert evaluate.overlap(p, torch.tensor([0.0, 0.0, 0.0, 1.0])).item() == 0.0
    assert evaluate.overlap(p, torch.tensor([0.25, 0.25, 0.25, 0.25])).item() == pytest.approx(0.75)
    # One-hot at X ~ q accepts with p(X): here q is one-hot at 0, so p(0).
    assert evaluate.one_hot_accept(p, torch.tensor([1.0, 0.0, 0.0, 0.0])).item() == pytest.approx(0.5)


def test_trained_pair_accepts_neither_never_nor_always(models: dict[str, Path], tmp_path: Path) -> None:
    figures = evaluate.measure(models["trained_target"], models["trained_eagle3"], windows=16)
    print("trained pair, held-out stdlib text:", json.dumps(figures))
    t1 = figures["T=1.0"]
    assert 0.1 < t1["sum_min_pq"] < 0.9, t1
    # SGLang's one-hot PD proposal accepts less often: the gap the middleware closes.
    assert t1["one_hot_accept"] < t1["sum_min_pq"], t1

    # Negative control: the same draft with its head reversed and sharpened proposes the
    # tokens it rates least likely, where the target puts almost no mass.
    reversed_draft = tmp_path / "reversed-draft"
    shutil.copytree(models["trained_eagle3"], reversed_draft)
    tensors = load_file(str(reversed_draft / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * -20
    save_file(tensors, str(reversed_draft / "model.safetensors"), metadata={"format": "pt"})
    control = evaluate.measure(models["trained_target"], reversed_draft, windows=16)["T=1.0"]
    print("reversed draft (control):", json.dumps(control))
    assert not 0.1 < control["sum_min_pq"] < 0.9, control


@pytest.mark.parametrize("name", DISTILLED)
def test_distilled_drafts_accept_neither_never_nor_always_at_every_step(models: dict[str, Path], name: str) -> None:
    figures = evaluate.measure(models["trained_target"], models[name], windows=16)
    print(f"{name}, held-out stdlib text:", json.dumps(figures))
    per_step = figures["sum_min_pq_per_step_T=1"]
    assert len(per_step) == 3
    assert all(0.1 < a < 0.9 for a in per_step), per_step
    assert figures["T=1.0"]["sum_min_pq"] == per_step[0]


def test_token_map_is_a_non_identity_permutation_as_sglang_loads_it(models: dict[str, Path]) -> None:
    path = token_map_path(models)
    assert path.parent == models["trained_eagle1_token_map"] and path.name == spec.TOKEN_MAP_FILE
    # SGLang's load_token_map (speculative/spec_utils.py): torch.load, then an int64 tensor.
    hot = torch.tensor(torch.load(str(path), weights_only=True), dtype=torch.int64)
    assert hot.shape == (spec.VOCAB,)
    assert torch.equal(hot.sort().values, torch.arange(spec.VOCAB)), "not a permutation of the vocabulary"
    moved = (hot != torch.arange(spec.VOCAB)).sum().item()
    assert moved > spec.VOCAB // 2, f"only {moved} ids moved"
    assert hot.tolist() == token_map()  # the fixed seed's permutation, every build


def test_distilled_drafts_carry_the_targets_embedding_and_head(models: dict[str, Path]) -> None:
    target = load_file(str(models["trained_target"] / "model.safetensors"))
    mtp = load_file(str(models["trained_multi_layer"] / "model.safetensors"))
    eagle1 = load_file(str(models["trained_eagle1_token_map"] / "model.safetensors"))
    assert torch.equal(mtp["model.embed_tokens.weight"], target["model.embed_tokens.weight"])
    assert torch.equal(mtp["lm_head.weight"], target["lm_head.weight"])
    assert torch.equal(eagle1["embed_tokens.weight"], target["model.embed_tokens.weight"])
    # The layers are trained, and each its own: no two MTP layers share a projection.
    eh = [mtp[f"model.mtp.layers.{k}.eh_proj.weight"] for k in range(spec.MTP_DEPTH)]
    assert not any(torch.equal(eh[i], eh[j]) for i in range(len(eh)) for j in range(i))


def _one_anchor(
    draft: Eagle3Draft | Eagle1Draft | deepseek.NextnDraft,
    tokens: torch.Tensor,
    hidden: torch.Tensor,
    t: int,
    steps: int,
) -> list[torch.Tensor]:
    """What SGLang runs for one request whose prompt ends at ``x_{t+1}``: a draft extend over
    positions 0..t with a KV cache (``hidden`` [B, >t, H]: what the extend reads), then
    ``steps - 1`` single-token draft steps appending to it (teacher-forced tokens here).
    Returns the logits of each step at this anchor."""
    scale = 1.0 / math.sqrt(draft.shape.head_dim)
    q, k, v, residual = draft.step_inputs(tokens[:, 1 : t + 2], hidden[:, : t + 1], torch.arange(t + 1))
    mask = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()
    attn = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf")).softmax(-1) @ v
    logits, out = draft.finish(attn, residual)
    result, h = [logits[:, t]], out[:, t : t + 1]
    for step in range(1, steps):
        q1, k1, v1, residual = draft.step_inputs(tokens[:, t + 1 + step : t + 2 + step], h, torch.tensor([t + step]))
        k, v = torch.cat([k, k1], 2), torch.cat([v, v1], 2)
        a = ((q1 @ k.transpose(-1, -2)) * scale).softmax(-1) @ v
        logits, h = draft.finish(a, residual)
        result.append(logits[:, 0])
    return result


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "nextn"])
def test_unrolled_draft_equals_extend_then_steps_with_a_kv_cache(kind: str) -> None:
    # The batched training/evaluation forward against SGLang's order of work, per anchor.
    torch.manual_seed(0)
    s = spec.RANDOM
    embed = torch.nn.Embedding(s.vocab, s.hidden)
    T, steps = 10, 3
    tokens = torch.randint(0, s.vocab, (2, T))
    with torch.no_grad():
        if kind == "eagle3":
            draft: Eagle3Draft | Eagle1Draft | deepseek.NextnDraft = Eagle3Draft(s, embed).eval()
            aux = torch.randn(2, T, len(spec.AUX_LAYER_IDS) * s.hidden)
            outs, hidden = draft.unroll(tokens, aux, steps), draft.fc(aux)
        elif kind == "nextn":
            ds = spec.DEEPSEEK
            embed = torch.nn.Embedding(ds.vocab, ds.hidden)
            draft = deepseek.NextnDraft(ds, embed, torch.nn.Linear(ds.hidden, ds.vocab, bias=False)).eval()
            hidden = torch.randn(2, T, ds.hidden)
            outs = draft.unroll(tokens, hidden, steps)
        else:
            draft = Eagle1Draft(s, embed, torch.nn.Linear(s.hidden, s.vocab, bias=False)).eval()
            hidden = torch.randn(2, T, s.hidden)
            outs = draft.unroll(tokens, hidden, steps)
        for t in range(T - steps):
            for k, want in enumerate(_one_anchor(draft, tokens, hidden, t, steps)):
                torch.testing.assert_close(outs[k][:, t], want, rtol=1e-4, atol=1e-4)
        # Negative control: the anchor's step-1 logits differ from a neighbour's.
        assert not torch.allclose(outs[1][:, 0], outs[1][:, 1], atol=1e-3)


def _rotate(ids: torch.Tensor, new: int) -> torch.Tensor:
    """SGLang's ``rotate_input_ids`` on one request: shift left by one, ``new`` last."""
    return torch.cat([ids[1:], torch.tensor([new])])


def test_mtp_layer_k_reads_the_ids_rotated_k_plus_one_times() -> None:
    # The multi-layer worker's prefill (_draft_extend_for_prefill): the prompt's ids rotated
    # once with the target's next token for layer 0, then once more per layer with the
    # previous layer's token, every layer at positions 0..n-1 with the target's h_0..h_{n-1}.
    # Teacher-forced (the true next tokens), the last position of layer k is unroll's entry
    # n - 1 of step k.
    torch.manual_seed(0)
    s = spec.RANDOM
    embed, head = torch.nn.Embedding(s.vocab, s.hidden), torch.nn.Linear(s.hidden, s.vocab, bias=False)
    draft = MtpDraft(s, spec.MTP_DEPTH, embed, head).eval()
    T = 12
    tokens = torch.randint(0, s.vocab, (1, T))
    hidden = torch.randn(1, T, s.hidden)
    n = T - 1 - spec.MTP_DEPTH  # prompt length, so that every layer's true next token exists
    with torch.no_grad():
        outs = draft.unroll(tokens, hidden)
        ids = tokens[0, :n]
        for k, layer in enumerate(draft.model.mtp.layers):
            ids = _rotate(ids, int(tokens[0, n + k]))
            got = head(layer(embed(ids)[None], hidden[:, :n], s))[0, n - 1]
            torch.testing.assert_close(got.float(), outs[k][0, n - 1], rtol=1e-4, atol=1e-4)
        # Negative control: one rotation too few gives layer 1 other logits.
        stale = head(
            draft.model.mtp.layers[1](embed(_rotate(tokens[0, :n], int(tokens[0, n])))[None], hidden[:, :n], s)
        )
        assert not torch.allclose(stale[0, n - 1].float(), outs[1][0, n - 1], atol=1e-3)


def test_deepseek_config_says_what_sglang_reads(models: dict[str, Path]) -> None:
    s = spec.DEEPSEEK
    text = (models["trained_deepseek"] / "config.json").read_text()
    # The draft directory carries the target's config: SGLang renames the architecture of a
    # DeepSeek draft (model_config.py) and finds the NextN layer at num_hidden_layers.
    assert (models["trained_deepseek_nextn"] / "config.json").read_text() == text
    raw = json.loads(text)
    # transformers' DeepseekV3Config has neither field, and SGLang reads both: in the file.
    assert (raw["topk_method"], raw["moe_layer_freq"]) == ("noaux_tc", 1)
    cfg = AutoConfig.from_pretrained(str(models["trained_deepseek"]))
    assert cfg.architectures == ["DeepseekV3ForCausalLM"] and cfg.model_type == "deepseek_v3"
    assert (cfg.topk_method, cfg.moe_layer_freq, cfg.scoring_func) == ("noaux_tc", 1, "sigmoid")
    assert cfg.num_nextn_predict_layers == 1  # SGLang's loader asserts 1
    assert 0 < cfg.first_k_dense_replace < cfg.num_hidden_layers == s.layers  # dense, then MoE
    assert cfg.norm_topk_prob is True and cfg.routed_scaling_factor == s.routed_scaling
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (s.q_lora, s.kv_lora)
    # The CPU rope factory takes only (deepseek_)yarn; factor 1 is plain RoPE, GPT-J style.
    rope = cfg.rope_parameters
    assert (rope["rope_type"], rope["factor"]) == ("yarn", 1.0)
    assert rope["original_max_position_embeddings"] == cfg.max_position_embeddings
    assert cfg.rope_interleave is True
    # TP 2 on CPU: heads split evenly; intermediate sizes are multiples of TP x 32.
    assert cfg.num_attention_heads % 2 == 0
    assert cfg.intermediate_size % 64 == 0 and cfg.moe_intermediate_size % 64 == 0
    assert cfg.n_routed_experts % cfg.n_group == 0 and cfg.n_routed_experts // cfg.n_group >= 2
    assert (cfg.vocab_size, cfg.hidden_size) == (s.vocab, s.hidden)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (spec.BOS, spec.EOS, spec.PAD)
    assert cfg.tie_word_embeddings is False


def test_deepseek_nextn_directory_is_the_targets_nextn_layer(models: dict[str, Path]) -> None:
    target = load_file(str(models["trained_deepseek"] / "model.safetensors"))
    draft = load_file(str(models["trained_deepseek_nextn"] / "model.safetensors"))
    prefix = f"model.layers.{spec.DEEPSEEK.layers}."
    assert set(draft) == {k for k in target if k.startswith(prefix)}
    assert all(torch.equal(draft[k], target[k]) for k in draft)
    # DeepSeek's published layout: the NextN layer carries copies of the embedding and head.
    assert torch.equal(draft[prefix + "embed_tokens.weight"], target["model.embed_tokens.weight"])
    assert torch.equal(draft[prefix + "shared_head.head.weight"], target["lm_head.weight"])


def test_deepseek_nextn_accepts_neither_never_nor_always(models: dict[str, Path], tmp_path: Path) -> None:
    target, draft = models["trained_deepseek"], models["trained_deepseek_nextn"]
    figures = evaluate.measure(target, draft, windows=16)
    print("DeepSeek NextN, held-out stdlib text:", json.dumps(figures))
    t1 = figures["T=1.0"]
    assert 0.2 < t1["sum_min_pq"] < 0.9, t1
    assert t1["one_hot_accept"] < t1["sum_min_pq"], t1
    # The target's own directory is the same draft (its NextN layer is in the checkpoint).
    assert evaluate.measure(target, target, windows=16) == figures

    # Negative control: shared_head.norm's weight negated and scaled makes the logits
    # lm_head(-20 h): the draft proposes what it rates least likely.
    flipped = tmp_path / "flipped-nextn"
    shutil.copytree(draft, flipped)
    tensors = load_file(str(flipped / "model.safetensors"))
    key = f"model.layers.{spec.DEEPSEEK.layers}.shared_head.norm.weight"
    tensors[key] = tensors[key] * -20
    save_file(tensors, str(flipped / "model.safetensors"), metadata={"format": "pt"})
    control = evaluate.measure(target, flipped, windows=16)["T=1.0"]
    print("flipped NextN (control):", json.dumps(control))
    assert not 0.2 < control["sum_min_pq"] < 0.9, control


def _grouped_top_k_by_enumeration(scores: list[float], bias: list[float], s: spec.DeepseekShape) -> set[int]:
    """The experts one token picks, straight from the rule (``biased_grouped_topk_impl``)."""
    size = s.routed_experts // s.groups
    biased = [a + b for a, b in zip(scores, bias, strict=True)]
    group_score = [sum(sorted(biased[g * size : (g + 1) * size])[-2:]) for g in range(s.groups)]
    kept = sorted(range(s.groups), key=lambda g: group_score[g])[-s.topk_groups :]
    allowed = [e for g in kept for e in range(g * size, (g + 1) * size)]
    return set(sorted(allowed, key=lambda e: biased[e])[-s.experts_per_token :])


def test_deepseek_routing_is_the_biased_grouped_top_k() -> None:
    torch.manual_seed(0)
    s = spec.DEEPSEEK
    moe = deepseek.MoE(s).eval()
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.2)
        moe.gate.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, s.routed_experts))
    x = torch.randn(64, s.hidden)
    with torch.no_grad():
        w, ids = moe.route(x)
        scores = (x @ moe.gate.weight.T).sigmoid()
    bias = moe.gate.e_score_correction_bias.tolist()
    for n in range(x.shape[0]):
        assert set(ids[n].tolist()) == _grouped_top_k_by_enumeration(scores[n].tolist(), bias, s), n
    # The weights are the unbiased scores of the picked experts, renormalised to sum 1.
    picked = scores.gather(1, ids)
    torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True))
    # Negative control: the bias changes the choice for some tokens.
    unbiased = [0.0] * s.routed_experts
    assert any(
        set(ids[n].tolist()) != _grouped_top_k_by_enumeration(scores[n].tolist(), unbiased, s) for n in range(64)
    )


def test_deepseek_rope_turns_adjacent_pairs() -> None:
    # GPT-J style (SGLang's is_neox_style = not rope_interleave): pair (2i, 2i + 1) turns by
    # position * theta ** (-2i / d).
    d, theta, pos = 8, 10000.0, 5
    x = torch.randn(1, d)
    got = deepseek.rope_interleaved(x, torch.tensor([pos]), theta)[0]
    for i in range(d // 2):
        a = pos * theta ** (-2 * i / d)
        c, s_ = math.cos(a), math.sin(a)
        x0, x1 = x[0, 2 * i].item(), x[0, 2 * i + 1].item()
        assert got[2 * i].item() == pytest.approx(x0 * c - x1 * s_, abs=1e-5)
        assert got[2 * i + 1].item() == pytest.approx(x1 * c + x0 * s_, abs=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.sglang
def test_sglang_classes_build_and_load_every_model(models: dict[str, Path]) -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed; run `make setup-sglang`")
    # The child imports transformers, which imports torchvision: its CPU gap (the servers'
    # sitecustomize, limited to that override) must load first there too.
    site = TESTS / "server" / "site"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "PDM_CPU_GAPS": "torchvision_meta",
    }
    args = [f"{n}={p}" for n, p in models.items()]
    cmd = [sys.executable, "-m", "server.models.sglang_check", str(_free_port()), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print("sglang layers:", report["layers"])
    for name, r in report["models"].items():
        s = SHAPES[name]
        assert r["architecture"] == ARCHITECTURES[name]
        if name in DEEPSEEK_NAMES:
            _check_deepseek_report(name, r)
            continue
        # SGLang skips unknown names silently, so a misnamed tensor shows up only here. EAGLE-1
        # loads no head: SGLang gives it the target's at start (set_embed_and_head).
        expect = ["lm_head.weight"] if r["architecture"] == "LlamaForCausalLMEagle" else []
        assert r["unfilled"] == expect, (name, r["unfilled"])
        assert r["fused_equal"] and all(r["fused_equal"].values()), (name, r["fused_equal"])
        if r["architecture"] == "LlamaForCausalLMEagle3":
            assert r["num_aux_hidden_states"] == len(spec.AUX_LAYER_IDS)
            assert r["fc_in_features"] == len(spec.AUX_LAYER_IDS) * s.hidden
            assert r["hot_token_id_is_identity"] and r["lm_head_rows"] == s.vocab
            assert r["load_lm_head_from_target"] is False  # its own head, the full vocabulary
        if r["architecture"] == "MiMoV2MTP":
            # One model per chain step (draft_model_idx), each holding its own layer.
            assert len(r["steps"]) == spec.MTP_DEPTH
            assert all(st["eh_proj_is_layer"] for st in r["steps"]), r["steps"]
        if r["architecture"] == "LlamaForCausalLM":
            assert r["layers_to_capture"] == [i + 1 for i in spec.AUX_LAYER_IDS]
            assert max(r["layers_to_capture"]) < r["num_hidden_layers"]


def _check_deepseek_report(name: str, r: dict[str, object]) -> None:
    # The target's class only where the file holds the target; the NextN class always.
    kinds = (
        ["DeepseekV3ForCausalLMNextN"]
        if name == "trained_deepseek_nextn"
        else [
            "DeepseekV3ForCausalLM",
            "DeepseekV3ForCausalLMNextN",
        ]
    )
    assert [k for k in r if k != "architecture"] == kinds
    for kind in kinds:
        k = r[kind]
        assert isinstance(k, dict)
        # The NextN draft loads no embedding or head: SGLang gives it the target's at start.
        expect = ["lm_head.weight", "model.embed_tokens.weight"] if kind.endswith("NextN") else []
        assert k["unfilled"] == expect, (name, kind, k["unfilled"])
        # Every other parameter holds the file's tensor (fused q_a/kv_a and gate/up, the
        # routed experts stacked), and the absorbed-MLA matrices are kv_b_proj's split.
        assert sorted(k["equal"]) == sorted(set(k["parameters"]) - set(expect)), (name, kind)
        assert all(k["equal"].values()), (name, kind, k["equal"])
        assert k["kv_b_split"] and all(k["kv_b_split"]), (name, kind)
        assert k["bias_dtype"] == "torch.float32"


@pytest.mark.server
def test_sglang_deepseek_forward_gives_the_plain_models_logits(models: dict[str, Path]) -> None:
    # SGLang's ModelRunner at TP 1 on CPU (the tier's stand-ins), in a child process: a
    # prefill, then greedy decode steps (models/sglang_forward.py; every attention call on
    # the absorbed MLA path, as every decode runs). The plain model (models/deepseek.py) on
    # the same sequence must give the same laws: bf16 against fp32 arithmetic, so close,
    # not equal.
    from server.harness import server_env

    path = models["trained_deepseek"]
    ids = load_tokenizer(path)("def main(argv):\n    for name in argv:\n")["input_ids"]
    steps = 4
    env = server_env(None)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(TESTS)])
    cmd = [sys.executable, "-m", "server.models.sglang_forward", str(path), json.dumps(ids), str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["seq"][: len(ids)] == ids and len(r["seq"]) == len(ids) + steps
    got = torch.tensor([r["prefill_last"], *r["decode"]])

    def plain(model: deepseek.DeepseekTarget) -> torch.Tensor:
        with torch.no_grad():
            logits, _ = model(torch.tensor([r["seq"]]))
        return logits[0, len(ids) - 1 :]

    def total_variation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return 0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1)

    target = deepseek.load_target(path, spec.DEEPSEEK)
    want = plain(target)
    tv = total_variation(got, want)
    print("SGLang vs plain model: total variation per position", [round(v, 5) for v in tv.tolist()])
    print("max |logit difference|", (got - want).abs().max().item(), "logit std", want.std().item())
    assert tv.max() < TV_TOLERANCE, tv
    # SGLang's greedy tokens are the plain model's.
    assert got.argmax(-1)[:-1].tolist() == r["seq"][len(ids) :]
    assert want.argmax(-1)[:-1].tolist() == r["seq"][len(ids) :]

    # The NextN draft extend after the prefill, in SGLang, reading SGLang's captured hidden
    # states (the target's final normed ones: the plain target's, up to bf16).
    n, H = len(ids), spec.DEEPSEEK.hidden
    hidden = torch.tensor(r["hidden"])
    with torch.no_grad():
        _, plain_hidden = target(torch.tensor([ids]))
    print("captured hidden: max |difference|", (hidden - plain_hidden[0]).abs().max().item())
    assert hidden.shape == (n, H)
    torch.testing.assert_close(hidden, plain_hidden[0], atol=0.1, rtol=0.05)
    draft = deepseek.load_nextn(
        models["trained_deepseek_nextn"], spec.DEEPSEEK, target.model.embed_tokens, target.lm_head
    )
    tokens = torch.tensor([r["seq"][: n + 1]])  # the draft reads x_{t+1} at position t
    nextn_got = torch.tensor(r["nextn_logits"])

    def plain_nextn() -> torch.Tensor:
        with torch.no_grad():
            return draft.unroll(tokens, torch.cat([hidden, hidden[-1:]])[None], 1)[0][0]

    nextn_tv = total_variation(nextn_got, plain_nextn())
    print("NextN: total variation per position", [round(v, 5) for v in nextn_tv.tolist()])
    assert nextn_tv.max() < TV_TOLERANCE, nextn_tv

    # Negative controls, each farther from SGLang than the tolerance: the plain target
    # without its routing bias (other experts picked), and the plain NextN layer reading
    # cat(h, embedding) instead of cat(embedding, h) (eh_proj's halves swapped).
    for layer in target.model.layers:
        if isinstance(layer.mlp, deepseek.MoE):
            layer.mlp.gate.e_score_correction_bias.zero_()
    control = total_variation(got, plain(target))
    print("control (routing bias zeroed): total variation", [round(v, 5) for v in control.tolist()])
    assert control.max() > TV_TOLERANCE, control
    with torch.no_grad():
        w = draft.eh_proj.weight
        w.copy_(torch.cat([w[:, H:], w[:, :H]], 1))
    nextn_control = total_variation(nextn_got, plain_nextn())
    print("control (eh_proj halves swapped): total variation", round(nextn_control.max().item(), 5))
    assert nextn_control.max() > TV_TOLERANCE, nextn_control
