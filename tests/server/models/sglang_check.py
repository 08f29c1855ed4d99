"""Build SGLang's own model classes from the tiny models and load their weights (CPU).

Run in a child process by ``tests/server/test_models.py`` (it sets up SGLang's distributed
state, a one-rank gloo group on loopback, which must not outlive the check)::

    PYTHONPATH=tests python -m server.models.sglang_check PORT NAME=DIR ...

For each model it builds the SGLang class its config names (``LlamaForCausalLM``,
``LlamaForCausalLMEagle3``, ``LlamaForCausalLMEagle``) from the config as transformers
reads it, fills every parameter with NaN, runs the class's own ``load_weights`` over the
checkpoint, and reports
which parameters the checkpoint did not fill (SGLang skips unknown names silently, so a
misnamed tensor shows up only here) and whether the fused projections hold the file's
tensors. Prints one JSON object.
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


def check(path: Path, aux_ids: list[int] | None = None) -> dict[str, Any]:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path))
    arch = config.architectures[0]
    cls = getattr(importlib.import_module(ARCHITECTURES[arch]), arch)
    model = cls(config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    tensors = load_file(str(path / "model.safetensors"))
    model.load_weights(iter(tensors.items()))
    unfilled = sorted(n for n, p in params.items() if torch.isnan(p.float()).any().item())
    fused_ok = {}
    for name, p in params.items():
        if name.endswith("qkv_proj.weight"):
            parts = ("q_proj", "k_proj", "v_proj")
            key = "qkv_proj"
        elif name.endswith("gate_up_proj.weight"):
            parts = ("gate_proj", "up_proj")
            key = "gate_up_proj"
        else:
            continue
        stem = name.removeprefix("model.")
        candidates = [stem.replace(key, part) for part in parts]
        if arch == "LlamaForCausalLMEagle3":
            candidates = [c.replace("layers.0.", "midlayer.") for c in candidates]
        if arch == "LlamaForCausalLM":
            candidates = ["model." + c for c in candidates]
        want = torch.cat([tensors[c] for c in candidates], 0)
        fused_ok[name] = bool(torch.equal(p.data.to(want.dtype), want))
    out: dict[str, Any] = {
        "architecture": arch,
        "class": f"{cls.__module__}.{cls.__name__}",
        "parameters": {n: list(p.shape) for n, p in params.items()},
        "unfilled": unfilled,
        "fused_equal": fused_ok,
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
