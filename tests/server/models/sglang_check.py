"""Build SGLang's own model classes from the tiny models and load their weights (CPU).

Run in a child process by ``tests/server/test_models.py`` (it sets up SGLang's distributed
state, a one-rank gloo group on loopback, which must not outlive the check)::

    PYTHONPATH=tests python -m server.models.sglang_check PORT NAME=DIR ...

For each model it builds the SGLang class its config names (``LlamaForCausalLM``,
``LlamaForCausalLMEagle3``, ``LlamaForCausalLMEagle``, ``MiMoV2MTP``) from the config as
transformers reads it, fills every parameter with NaN, runs the class's own
``load_weights`` over the checkpoint, and reports
which parameters the checkpoint did not fill (SGLang skips unknown names silently, so a
misnamed tensor shows up only here) and whether the fused projections hold the file's
tensors. A multi-layer MTP draft is built once per chain step, with ``draft_model_idx``,
and its checkpoint goes through SGLang's own per-step filter first
(``DefaultModelLoader._filter_mtp_weights``), as the multi-layer worker loads it. A
DeepSeek-V3 directory is built as ``DeepseekV3ForCausalLM`` (when it holds the target) and
as ``DeepseekV3ForCausalLMNextN`` (the class SGLang gives a DeepSeek draft), and every
filled parameter is compared with the file (``check_deepseek``). Prints one JSON object.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch
from _sglang_import import install_torchvision_stand_in

ARCHITECTURES = {
    "LlamaForCausalLM": "sglang.srt.models.llama",
    "LlamaForCausalLMEagle3": "sglang.srt.models.llama_eagle3",
    "LlamaForCausalLMEagle": "sglang.srt.models.llama_eagle",
    "MiMoV2MTP": "sglang.srt.models.mimo_v2_nextn",
    "DeepseekV3ForCausalLM": "sglang.srt.models.deepseek_v2",
    "DeepseekV3ForCausalLMNextN": "sglang.srt.models.deepseek_nextn",
}


def use_cpu_engine_or_rope_stand_in() -> str:
    """Pick how SGLang's layers are imported here; returns which.

    A CPU server runs with ``SGLANG_USE_CPU_ENGINE=1``, whose layers import sgl-kernel's CPU
    ops by name; that needs the server tier's stand-in ops (an importable ``sgl_kernel``).
    Without them, the layers take the generic path, whose only foreign import on the way
    to building a Llama is vLLM's ``rotary_embedding`` (``rotary_embedding/base.py``, used
    in forward only). It is answered by a function that raises if called: building a model
    and loading its weights calls no kernel.
    """
    if importlib.util.find_spec("sgl_kernel") is not None:
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        return "cpu engine"
    if importlib.util.find_spec("vllm") is not None:
        return "generic"

    def rotary_embedding(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("vllm._custom_ops.rotary_embedding is an import-only stand-in in the model build check")

    vllm = types.ModuleType("vllm")
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]  # the one name imported
    vllm._custom_ops = ops  # type: ignore[attr-defined]
    sys.modules["vllm"], sys.modules["vllm._custom_ops"] = vllm, ops
    return "generic, rope stand-in"


def _setup(port: int, target_dir: Path) -> None:
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=str(target_dir), device="cpu"), role="scheduler", ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(
        backend="gloo", world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}"
    )
    initialize_model_parallel()


def _load(model: torch.nn.Module, weights: Any) -> tuple[dict[str, torch.nn.Parameter], list[str]]:
    """Fill every parameter with NaN, run the class's ``load_weights``; (parameters, unfilled names)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    model.load_weights(weights)
    return params, sorted(n for n, p in params.items() if torch.isnan(p.float()).any().item())


def _fused_equal(
    params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor], source: Any
) -> dict[str, bool]:
    """Whether each fused projection holds the file's tensors; ``source(stem)`` names a part in the file."""
    out = {}
    for name, p in params.items():
        if name.endswith("qkv_proj.weight"):
            parts, key = ("q_proj", "k_proj", "v_proj"), "qkv_proj"
        elif name.endswith("gate_up_proj.weight"):
            parts, key = ("gate_proj", "up_proj"), "gate_up_proj"
        else:
            continue
        stem = name.removeprefix("model.")
        want = torch.cat([tensors[source(stem.replace(key, part))] for part in parts], 0)
        out[name] = bool(torch.equal(p.data.to(want.dtype), want))
    return out


def _source(arch: str) -> Any:
    if arch == "LlamaForCausalLMEagle3":
        return lambda stem: stem.replace("layers.0.", "midlayer.")
    if arch == "LlamaForCausalLM":
        return lambda stem: "model." + stem
    return lambda stem: stem


def check_mtp(path: Path, config: Any, cls: type) -> dict[str, Any]:
    """One ``MiMoV2MTP`` per chain step, each from SGLang's filtered view of the checkpoint."""
    from safetensors.torch import load_file
    from sglang.srt.model_loader.loader import DefaultModelLoader

    tensors = load_file(str(path / "model.safetensors"))
    steps = []
    for idx in range(config.num_nextn_predict_layers):
        model = cls(config, draft_model_idx=idx)
        weights = DefaultModelLoader._filter_mtp_weights(iter(tensors.items()), "", idx)
        params, unfilled = _load(model, weights)
        # What the per-step filter renamed: model.mtp.layers.0.* is layer idx in the file.
        layer = f"model.mtp.layers.{idx}."

        def source(stem: str, layer: str = layer) -> str:
            return stem.replace("mtp_block.", layer)

        eh_proj = model.model.eh_proj.weight.data
        steps.append(
            {
                "unfilled": unfilled,
                "fused_equal": _fused_equal(params, tensors, source),
                "eh_proj_is_layer": bool(torch.equal(eh_proj.to(torch.bfloat16), tensors[layer + "eh_proj.weight"])),
            }
        )
    return {
        "architecture": "MiMoV2MTP",
        "class": f"{cls.__module__}.{cls.__name__}",
        "parameters": {n: list(p.shape) for n, p in params.items()},
        "steps": steps,
        "unfilled": sorted({n for st in steps for n in st["unfilled"]}),
        "fused_equal": {f"{i}:{n}": ok for i, st in enumerate(steps) for n, ok in st["fused_equal"].items()},
    }


def _deepseek_expected(name: str, tensors: dict[str, torch.Tensor], source: Any, experts: int) -> torch.Tensor | None:
    """The file's tensor(s) a DeepSeek parameter should hold (fused ones concatenated, the
    routed experts stacked); None for a parameter the file does not carry."""

    def get(stem: str) -> torch.Tensor:
        return tensors[source(stem)]

    if name.endswith("fused_qkv_a_proj_with_mqa.weight"):
        base = name.removesuffix("fused_qkv_a_proj_with_mqa.weight")
        return torch.cat([get(base + "q_a_proj.weight"), get(base + "kv_a_proj_with_mqa.weight")], 0)
    if name.endswith("gate_up_proj.weight"):
        base = name.removesuffix("gate_up_proj.weight")
        return torch.cat([get(base + "gate_proj.weight"), get(base + "up_proj.weight")], 0)
    if name.endswith("experts.w13_weight"):
        base = name.removesuffix("w13_weight")
        return torch.stack(
            [
                torch.cat([get(f"{base}{e}.gate_proj.weight"), get(f"{base}{e}.up_proj.weight")], 0)
                for e in range(experts)
            ]
        )
    if name.endswith("experts.w2_weight"):
        base = name.removesuffix("w2_weight")
        return torch.stack([get(f"{base}{e}.down_proj.weight") for e in range(experts)])
    return tensors.get(source(name))


def check_deepseek(path: Path, config: Any, arch: str) -> dict[str, Any]:
    """``DeepseekV3ForCausalLM`` (when the file holds the target) and ``DeepseekV3ForCausalLMNextN``
    (the architecture SGLang gives a DeepSeek draft, ``model_config.py``), each loaded from
    the whole file by its own ``load_weights``: which parameters stay unfilled, whether every
    filled one holds the file's tensors (fused and stacked ones included), and whether the
    absorbed-MLA matrices ``w_kc``/``w_vc`` are ``kv_b_proj``'s split."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    layer = f"model.layers.{config.num_hidden_layers}."
    out: dict[str, Any] = {"architecture": arch}
    kinds = (["DeepseekV3ForCausalLM"] if "model.norm.weight" in tensors else []) + ["DeepseekV3ForCausalLMNextN"]
    for kind in kinds:
        config.architectures = [kind]
        cls = getattr(importlib.import_module(ARCHITECTURES[kind]), kind)
        model = cls(config)
        params, unfilled = _load(model, iter(tensors.items()))
        if kind == "DeepseekV3ForCausalLM":
            source: Any = lambda stem: stem  # noqa: E731  # the target's names are the file's
            attns = [m.self_attn for m in model.model.layers]
        else:

            def source(stem: str) -> str:
                return layer + stem.removeprefix("model.decoder.").removeprefix("model.")

            attns = [model.model.decoder.self_attn]
        equal = {}
        for name, p in params.items():
            if name in unfilled:
                continue  # reported apart: the loader gave it nothing
            want = _deepseek_expected(name, tensors, source, config.n_routed_experts)
            if want is not None:
                equal[name] = bool(torch.equal(p.data.to(want.dtype), want))
        heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
        split = []
        for a in attns:
            kv_b = a.kv_b_proj.weight.data.view(heads, nope + v, config.kv_lora_rank)
            split.append(
                bool(torch.equal(a.w_kc, kv_b[:, :nope]) and torch.equal(a.w_vc, kv_b[:, nope:].transpose(1, 2)))
            )
        out[kind] = {
            "class": f"{cls.__module__}.{cls.__name__}",
            "parameters": {n: list(p.shape) for n, p in params.items()},
            "unfilled": unfilled,
            "equal": equal,
            "kv_b_split": split,
            "bias_dtype": str(next(p.dtype for n, p in params.items() if n.endswith("e_score_correction_bias"))),
        }
    return out


def check(path: Path, aux_ids: list[int] | None = None) -> dict[str, Any]:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    arch = config.architectures[0]
    cls = getattr(importlib.import_module(ARCHITECTURES[arch]), arch)
    if arch == "MiMoV2MTP":
        return check_mtp(path, config, cls)
    if arch == "DeepseekV3ForCausalLM":
        return check_deepseek(path, config, arch)
    model = cls(config)
    tensors = load_file(str(path / "model.safetensors"))
    params, unfilled = _load(model, iter(tensors.items()))
    out: dict[str, Any] = {
        "architecture": arch,
        "class": f"{cls.__module__}.{cls.__name__}",
        "parameters": {n: list(p.shape) for n, p in params.items()},
        "unfilled": unfilled,
        "fused_equal": _fused_equal(params, tensors, _source(arch)),
    }
    if arch == "LlamaForCausalLMEagle3":
        m = model.model
        out["num_aux_hidden_states"] = m.num_aux_hidden_states
        out["fc_in_features"] = m.fc.in_features
        out["hot_token_id_is_identity"] = bool(
            torch.equal(model.hot_token_id, torch.arange(config.vocab_size, dtype=model.hot_token_id.dtype))
        )
        out["lm_head_rows"] = model.lm_head.weight.shape[0]
        out["load_lm_head_from_target"] = model.load_lm_head_from_target
    if arch == "LlamaForCausalLM" and aux_ids is not None:
        # What the model runner does with the draft's ids (spec_aux_hidden_state.py).
        model.set_eagle3_layers_to_capture(aux_ids)
        out["layers_to_capture"] = list(model.model.layers_to_capture)
        out["num_hidden_layers"] = config.num_hidden_layers
    return out


def draft_aux_ids(path: Path) -> list[int]:
    """The ids SGLang reads from an EAGLE3 draft's config (``_resolve_eagle_aux_hidden_state``)."""
    from transformers import AutoConfig

    return list(AutoConfig.from_pretrained(str(path)).eagle_config["eagle_aux_hidden_state_layer_ids"])


def _arch(path: Path) -> str:
    return str(json.loads((path / "config.json").read_text())["architectures"][0])


def main(argv: list[str]) -> int:
    port = int(argv[0])
    models = dict(a.split("=", 1) for a in argv[1:])
    layers = use_cpu_engine_or_rope_stand_in()
    install_torchvision_stand_in()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _setup(port, Path(next(iter(models.values()))))
        eagle3 = [Path(p) for p in models.values() if _arch(Path(p)) == "LlamaForCausalLMEagle3"]
        aux_ids = draft_aux_ids(eagle3[0]) if eagle3 else None
        result = {name: check(Path(p), aux_ids) for name, p in models.items()}
    print(json.dumps({"layers": layers, "models": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
