"""Build the tier's model directories (HF format, as SGLang 0.5.23 loads them on CPU).

``build_models(out_dir)`` returns, by name:

- ``target``: a random Llama (``spec.RANDOM``: H 64, 4 layers, vocab 1024) with the
  project's tokenizer;
- ``eagle3``: a random EAGLE3 draft for it, full vocabulary, 3 aux states;
- ``eagle1``: a random EAGLE-1 draft for it;
- ``trained_target``, ``trained_eagle3``: the shipped trained pair (``trained/``, made by
  ``train.py``), whose first-step acceptance is neither 0 nor 1;
- ``trained_multi_layer``: a multi-layer MTP draft for ``trained_target`` (``MiMoV2MTP``,
  ``spec.MTP_DEPTH`` layers, served with ``--enable-multi-layer-eagle``), distilled by
  ``distil.py``;
- ``trained_eagle1_token_map``: an EAGLE-1 draft for ``trained_target``, distilled by
  ``distil.py``, with a non-identity full-size ``--speculative-token-map`` beside its weights
  (``token_map_path``): a fixed-seed permutation of the 1024 ids.
- ``trained_deepseek``: the shipped DeepSeek-V3-style target (``spec.DEEPSEEK``: MLA, the
  first layer dense and the rest MoE, ``noaux_tc`` routing), made by ``train_deepseek.py``,
  with its NextN layer in the same checkpoint (``model.layers.{layers}.*``, as DeepSeek
  publishes it; SGLang's target loader skips it, so the directory is also its own draft);
- ``trained_deepseek_nextn``: the NextN draft alone (the same config, only the NextN
  layer's tensors), for ``--speculative-draft-model-path``.

The random weights come from fixed seeds (one ``torch.Generator`` per model, tensors filled
in name order), so every build is the same bytes: torch's CPU generator is deterministic
for a given version (tested here within one machine). The random heads are scaled so that
logits spread over a few units: greedy choices then differ by more than bf16 kernels do,
and a random draft's law differs from its target's.

Outputs are cached under ``out_dir/<key>/``, where the key hashes this package's sources
and the shipped files; a build is written to a temporary directory and renamed into place,
so a half-written build is never used.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from . import spec
from .spec import RANDOM, Shape

HERE = Path(__file__).resolve().parent
TRAINED = HERE / "trained"
TOKENIZER = TRAINED / "tokenizer"
MODEL_NAMES = (
    "target",
    "eagle3",
    "eagle1",
    "trained_target",
    "trained_eagle3",
    "trained_multi_layer",
    "trained_eagle1_token_map",
    "trained_deepseek",
    "trained_deepseek_nextn",
)
SEEDS = {"target": 0, "eagle3": 1, "eagle1": 2, "token_map": 3}
INIT_STD = 0.02
HEAD_LOGIT_STD = 3.0  # std of a random head's logits over a unit-RMS hidden state
# The sources whose change changes what is built, and the shipped inputs.
_SOURCES = ("build.py", "spec.py", "tokenizer.py")


def default_build_dir() -> Path:
    """``build/server-models`` at the repository root (gitignored)."""
    return HERE.parents[2] / "build" / "server-models"


def token_map_path(paths: dict[str, Path]) -> Path:
    """The ``--speculative-token-map`` file of ``trained_eagle1_token_map`` in a ``build_models`` answer."""
    return paths["trained_eagle1_token_map"] / spec.TOKEN_MAP_FILE


def token_map(vocab: int = spec.VOCAB) -> list[int]:
    """The map's content: ``hot[i]`` is the target id of draft id ``i``, a permutation of
    ``range(vocab)`` from a fixed seed (not the identity)."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(SEEDS["token_map"])).tolist()


def build_models(out_dir: Path) -> dict[str, Path]:
    """Build (or reuse) every model under ``out_dir``; returns ``{name: directory}`` for
    ``MODEL_NAMES``. Raises FileNotFoundError when the shipped trained files are missing."""
    out_dir = Path(out_dir)
    final = out_dir / cache_key()
    if not (final / "manifest.json").is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=out_dir))
        try:
            _build_into(tmp, final.name)
            try:
                os.replace(tmp, final)
            except OSError:
                # Another process renamed its identical build into place first.
                if not (final / "manifest.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return {name: final / name for name in MODEL_NAMES}


def cache_key() -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    for f in _shipped_files():
        h.update(str(f.relative_to(TRAINED)).encode() + b"\0" + f.read_bytes())
    h.update(f"torch={torch.__version__}".encode())
    return h.hexdigest()[:16]


def _shipped_files() -> list[Path]:
    need = {
        TOKENIZER / "tokenizer.json": "train",
        TRAINED / "target" / "model.safetensors": "train",
        TRAINED / "eagle3" / "model.safetensors": "train",
        TRAINED / "multi_layer" / "model.safetensors": "distil",
        TRAINED / "eagle1" / "model.safetensors": "distil",
        TRAINED / "deepseek" / "model.safetensors": "train_deepseek",
    }
    missing = {str(p.relative_to(HERE)): how for p, how in need.items() if not p.is_file()}
    if missing:
        how = " then ".join(
            f"`python -m tests.server.models.{m}`"
            for m in ("train", "distil", "train_deepseek")
            if m in missing.values()
        )
        raise FileNotFoundError(f"shipped model files missing: {', '.join(missing)}; remake them with {how}")
    return sorted(p for p in TRAINED.rglob("*") if p.is_file())


def _build_into(root: Path, key: str) -> None:
    s = RANDOM
    target = random_tensors(spec.target_tensors(s), SEEDS["target"], s)
    eagle3 = random_tensors(spec.eagle3_tensors(s), SEEDS["eagle3"], s)
    eagle1 = random_tensors(spec.eagle1_tensors(s), SEEDS["eagle1"], s)
    # SGLang replaces the drafts' embedding by the target's at start (and gives EAGLE-1 the
    # target's head); the files carry the same tensor, so each directory is whole on its own.
    eagle3["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    eagle1["embed_tokens.weight"] = target["model.embed_tokens.weight"].clone()
    eagle1["fc.bias"].zero_()
    write_model(root / "target", spec.target_config(s), target)
    write_model(root / "eagle3", spec.eagle3_config(s), eagle3)
    write_model(root / "eagle1", spec.eagle1_config(s), eagle1)
    for name, sub in (("trained_target", "target"), ("trained_eagle3", "eagle3")):
        shutil.copytree(TRAINED / sub, root / name)
        _copy_tokenizer(root / name)
    # The distilled drafts ship their own tensors only; each directory gets copies of the
    # target's embedding (and the MTP draft its head), as the EAGLE3 draft carries its
    # embedding: SGLang replaces both with the target's at start (set_embed_and_head).
    shared = load_file(str(TRAINED / "target" / "model.safetensors"))
    _shipped_with(
        root / "trained_multi_layer",
        TRAINED / "multi_layer",
        {"model.embed_tokens.weight": shared["model.embed_tokens.weight"], "lm_head.weight": shared["lm_head.weight"]},
    )
    _shipped_with(
        root / "trained_eagle1_token_map",
        TRAINED / "eagle1",
        {"embed_tokens.weight": shared["model.embed_tokens.weight"]},
    )
    # SGLang's load_token_map: torch.load(path, weights_only=True), then an int64 tensor.
    torch.save(token_map(), str(root / "trained_eagle1_token_map" / spec.TOKEN_MAP_FILE))
    _build_deepseek(root)
    manifest = {
        "key": key,
        "models": {
            name: {f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in sorted((root / name).iterdir())}
            for name in MODEL_NAMES
        },
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _build_deepseek(root: Path) -> None:
    """The DeepSeek target (with its NextN layer) and the NextN draft alone. Both NextN
    layers get copies of the target's embedding and head under ``spec.NEXTN_SHARED``
    (DeepSeek's published layout; SGLang's loader skips them)."""
    src = TRAINED / "deepseek"
    tensors = load_file(str(src / "model.safetensors"))
    prefix = f"model.layers.{spec.DEEPSEEK.layers}."
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    shared = dict(zip((prefix + n for n in spec.NEXTN_SHARED), (embed, head), strict=True))
    _shipped_with(root / "trained_deepseek", src, shared)
    nextn = {k: v for k, v in tensors.items() if k.startswith(prefix)}
    dst = root / "trained_deepseek_nextn"
    dst.mkdir()
    shutil.copy2(src / "config.json", dst / "config.json")
    save_file(
        {k: (nextn | shared)[k].contiguous() for k in sorted(nextn | shared)},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    _copy_tokenizer(dst)


def _shipped_with(dst: Path, src: Path, extra: dict[str, torch.Tensor]) -> None:
    """``src``'s config and tensors plus ``extra``, and the tokenizer, in ``dst``."""
    dst.mkdir(parents=True)
    shutil.copy2(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors")) | extra
    save_file(
        {k: tensors[k].contiguous() for k in sorted(tensors)}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )
    _copy_tokenizer(dst)


def random_tensors(table: dict[str, tuple[int, ...]], seed: int, s: Shape) -> dict[str, torch.Tensor]:
    """Fill a checkpoint table from one seeded generator, in name order (bf16; id maps exact)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(table):
        shape = table[name]
        if name == "d2t":
            out[name] = torch.zeros(shape, dtype=torch.int64)  # identity: draft id i is target id i
        elif name == "t2d":
            out[name] = torch.ones(shape, dtype=torch.bool)
        elif name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            std = HEAD_LOGIT_STD / math.sqrt(s.hidden) if name.endswith("lm_head.weight") else INIT_STD
            out[name] = (torch.randn(shape, generator=g) * std).to(torch.bfloat16)
    return out


def write_model(path: Path, config: LlamaConfig, tensors: dict[str, torch.Tensor], *, tokenizer: bool = True) -> None:
    """config.json and model.safetensors in ``path``, and the tokenizer unless told not to."""
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    if tokenizer:
        _copy_tokenizer(path)


def _copy_tokenizer(path: Path) -> None:
    for f in sorted(TOKENIZER.iterdir()):
        shutil.copy2(f, path / f.name)
