"""Remake the shipped DeepSeek pair under ``trained/deepseek/``: a DeepSeek-V3-style target and its NextN draft.

Run from the repository root, after ``train.py`` (it reads ``trained/tokenizer`` and never
changes it)::

    OMP_NUM_THREADS=1 nice python -m tests.server.models.train_deepseek --threads 1

1. Encode the training split of the stdlib sources (``corpus.py``) with the shipped tokenizer.
2. Train the target (``spec.DEEPSEEK``, ``deepseek.DeepseekTarget``) for a fixed number of
   steps: next-token cross-entropy, AdamW, warm-up then cosine decay (``train.fit``). The
   routing bias follows DeepSeek-V3's auxiliary-loss-free rule: after every step each
   expert's bias moves by ``BIAS_RATE`` towards the batch's mean load.
3. Round the target to bf16, the dtype it is served in, and distil the NextN draft
   (``deepseek.NextnDraft``) from the rounded target: forward KL(p_target || q_draft) at
   every anchor over ``train.DRAFT_TTT_STEPS`` chained draft steps, weighted as ``train.py``
   weights the EAGLE3 draft's. The embedding and head are the target's, frozen.
4. Write ``trained/deepseek/model.safetensors`` (the target's tensors and the NextN layer as
   ``model.layers.{layers}.*``, one file as DeepSeek publishes it) and ``config.json``,
   measure the pair on the held-out files (``evaluate.measure``) and write
   ``trained/deepseek/figures.json``.

Step counts are fixed and every generator is seeded, so a rerun on the same machine and
versions gives the same weights; wall time varies with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from . import corpus, evaluate
from .build import TRAINED
from .deepseek import DeepseekTarget, NextnDraft, export_tensors
from .distil import step_loss
from .spec import BOS, DEEPSEEK, deepseek_config
from .tokenizer import encode_files, load_tokenizer
from .train import DRAFT_STEP_DECAY, DRAFT_TTT_STEPS, WINDOW, fit

TARGET_STEPS, TARGET_BATCH, TARGET_LR = 400, 32, 3e-3
DRAFT_STEPS, DRAFT_BATCH, DRAFT_LR = 300, 16, 2e-3
BIAS_RATE = 1e-3  # DeepSeek-V3's bias update speed


def train_target(ids: torch.Tensor, steps: int) -> tuple[DeepseekTarget, list[float]]:
    torch.manual_seed(5)
    model = DeepseekTarget(DEEPSEEK).train()
    g = torch.Generator().manual_seed(5)

    def loss_at(step: int) -> torch.Tensor:
        for moe in model.moes():  # the loads of the previous step's forward
            moe.update_bias(BIAS_RATE)
        x = corpus.windows(ids, TARGET_BATCH, WINDOW, g, BOS)
        logits, _ = model(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    log = fit(list(model.parameters()), steps, TARGET_LR, loss_at, "target")
    return model.eval(), log


def distil_nextn(target: DeepseekTarget, ids: torch.Tensor, steps: int) -> tuple[NextnDraft, list[float]]:
    torch.manual_seed(6)
    draft = NextnDraft(DEEPSEEK, target.model.embed_tokens, target.lm_head).train()
    draft.start_from_target_hidden()
    g = torch.Generator().manual_seed(6)
    weights = [DRAFT_STEP_DECAY**k for k in range(DRAFT_TTT_STEPS)]

    def loss_at(step: int) -> torch.Tensor:
        draft.mlp.update_bias(BIAS_RATE)
        x = corpus.windows(ids, DRAFT_BATCH, WINDOW, g, BOS)
        with torch.no_grad():
            logits, hidden = target(x)
        return step_loss(logits, draft.unroll(x, hidden, DRAFT_TTT_STEPS), weights)

    log = fit(list(draft.parameters()), steps, DRAFT_LR, loss_at, "nextn")
    return draft.eval(), log


def write_pair(path: Path, target: DeepseekTarget, draft: NextnDraft | None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(deepseek_config(DEEPSEEK), indent=2) + "\n")
    tensors = export_tensors(target, draft)
    save_file({k: tensors[k] for k in sorted(tensors)}, str(path / "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.server.models.train_deepseek", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--trained", type=Path, default=TRAINED, help="folder of the shipped tokenizer (default: trained/)")
    ap.add_argument("--out", type=Path, default=TRAINED / "deepseek", help="output folder (default: trained/deepseek)")
    ap.add_argument("--target-steps", type=int, default=TARGET_STEPS)
    ap.add_argument("--draft-steps", type=int, default=DRAFT_STEPS)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: Path = args.out
    t0 = time.monotonic()

    tok = load_tokenizer(args.trained / "tokenizer")
    train_files, _ = corpus.split()
    ids = encode_files(tok, train_files)
    print(f"{len(ids)} training tokens from {len(train_files)} files", flush=True)

    t1 = time.monotonic()
    target, target_log = train_target(ids, args.target_steps)
    # Serve and distil the same weights: round to bf16 first (the routing bias stays fp32).
    rounded = export_tensors(target)
    target.load_state_dict({k: v.float() for k, v in rounded.items()})
    for p in target.parameters():
        p.requires_grad_(False)
    t2 = time.monotonic()

    draft, draft_log = distil_nextn(target, ids, args.draft_steps)
    write_pair(out, target, draft)
    t3 = time.monotonic()

    figures = evaluate.measure(out, out, tokenizer_dir=args.trained / "tokenizer")
    report = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": args.threads,
        "target": {"steps": args.target_steps, "batch": TARGET_BATCH, "window": WINDOW, "loss_every_50": target_log},
        "nextn": {
            "steps": args.draft_steps,
            "batch": DRAFT_BATCH,
            "ttt_steps": DRAFT_TTT_STEPS,
            "loss_every_50": draft_log,
        },
        "routing_bias": {
            f"layer {i}": [round(b, 4) for b in layer.mlp.gate.e_score_correction_bias.tolist()]
            for i, layer in enumerate(target.model.layers)
            if i >= DEEPSEEK.first_dense
        }
        | {"nextn": [round(b, 4) for b in draft.mlp.gate.e_score_correction_bias.tolist()]},
        "seconds": {"target": round(t2 - t1, 1), "nextn": round(t3 - t2, 1), "total": round(time.monotonic() - t0, 1)},
        "heldout": figures,
    }
    (out / "figures.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
