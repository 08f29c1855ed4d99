"""Remake the shipped trained pair under ``trained/``: tokenizer, target, EAGLE3 draft, figures.

Run from the repository root (about 4 minutes on 2 CPU cores)::

    python -m tests.server.models.train

1. Train the BPE tokenizer on the stdlib sources' training split (``corpus.py``).
2. Train the target (``spec.TRAINED``) for a fixed number of steps on windows of that
   text: next-token cross-entropy, AdamW, linear warm-up then cosine decay.
3. Round the target to bf16, the dtype it is served in, and distil the EAGLE3 draft from
   the rounded target: forward KL(p_target || q_draft) at every anchor over
   ``DRAFT_TTT_STEPS`` teacher-forced draft steps (``eagle3.Eagle3Draft.unroll``), the
   later steps weighted down. The target's embedding is shared and frozen, as SGLang
   shares it.
4. Measure the pair offline on the held-out files (``evaluate.measure``) and write
   ``trained/figures.json``.

Step counts are fixed and every generator is seeded, so a rerun on the same machine and
versions gives the same weights; wall time varies with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaForCausalLM

from . import corpus, evaluate
from .build import TRAINED, write_model
from .eagle3 import Eagle3Draft, export_tensors, target_features
from .spec import BOS, eagle3_config, target_config
from .spec import TRAINED as SHAPE
from .tokenizer import encode_files, train_tokenizer

TARGET_STEPS, TARGET_BATCH, TARGET_LR = 500, 32, 3e-3
DRAFT_STEPS, DRAFT_BATCH, DRAFT_LR = 400, 16, 2e-3
WINDOW = 128
DRAFT_TTT_STEPS, DRAFT_STEP_DECAY = 3, 0.8
#: Each chained draft step's weight in the distillation loss: the later steps weighted down.
DRAFT_STEP_WEIGHTS = tuple(DRAFT_STEP_DECAY**k for k in range(DRAFT_TTT_STEPS))
WARMUP = 40


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over WARMUP steps, then cosine decay to a tenth of ``peak``."""
    warm = min(1.0, (step + 1) / WARMUP)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))


def fit(
    params: list[torch.nn.Parameter], steps: int, peak: float, loss_at: Callable[[int], torch.Tensor], label: str
) -> list[float]:
    """Run ``steps`` AdamW steps of ``loss_at(step)``; returns the loss every 50 steps."""
    opt = torch.optim.AdamW(params, lr=peak, betas=(0.9, 0.95), weight_decay=0.01)
    log, t0 = [], time.monotonic()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak)
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log.append(round(loss.item(), 4))
            print(f"{label} step {step} loss {loss.item():.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
    return log


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Mean forward KL(p || q) over the anchors; logits [..., V]."""
    log_p = p_logits.log_softmax(-1)
    return (log_p.exp() * (log_p - q_logits.log_softmax(-1))).sum(-1).mean()


def step_loss(logits: torch.Tensor, outs: list[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ_k weights[k] KL(target at t + 1 + k || step k at t): a draft's distillation loss,
    ``logits`` the target's [B, T, V], ``outs[k]`` draft step k's [B, T - 1 - k, V] or shorter."""
    loss = torch.zeros(())
    for k, q_logits in enumerate(outs):
        n = q_logits.shape[1]
        loss = loss + weights[k] * kl(logits[:, 1 + k : 1 + k + n], q_logits)
    return loss


def write_report(path: Path, threads: int, record: dict[str, Any]) -> None:
    """Write a run's ``record`` to ``path`` as JSON, after the Python and torch versions and
    the torch thread count, and print it."""
    report = {"python": platform.python_version(), "torch": torch.__version__, "threads": threads, **record}
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


def train_target(ids: torch.Tensor, steps: int) -> tuple[LlamaForCausalLM, list[float]]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(target_config(SHAPE)).float().train()
    g = torch.Generator().manual_seed(0)

    def loss_at(step: int) -> torch.Tensor:
        x = corpus.windows(ids, TARGET_BATCH, WINDOW, g, BOS)
        return model(input_ids=x, labels=x).loss

    log = fit(list(model.parameters()), steps, TARGET_LR, loss_at, "target")
    return model.eval(), log


def distil_draft(target: LlamaForCausalLM, ids: torch.Tensor, steps: int) -> tuple[Eagle3Draft, list[float]]:
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(1)
    draft = Eagle3Draft(SHAPE, target.model.embed_tokens).train()
    g = torch.Generator().manual_seed(1)

    def loss_at(step: int) -> torch.Tensor:
        x = corpus.windows(ids, DRAFT_BATCH, WINDOW, g, BOS)
        with torch.no_grad():
            logits, aux = target_features(target, x)
        return step_loss(logits, draft.unroll(x, aux, DRAFT_TTT_STEPS), DRAFT_STEP_WEIGHTS)

    log = fit(list(draft.parameters()), steps, DRAFT_LR, loss_at, "draft")
    return draft.eval(), log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.server.models.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=TRAINED, help="output folder (default: the shipped trained/)")
    ap.add_argument("--target-steps", type=int, default=TARGET_STEPS)
    ap.add_argument("--draft-steps", type=int, default=DRAFT_STEPS)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: Path = args.out
    t0 = time.monotonic()

    train_files, _ = corpus.split()
    tok = train_tokenizer(train_files)
    shutil.rmtree(out / "tokenizer", ignore_errors=True)
    tok.save_pretrained(str(out / "tokenizer"))
    ids = encode_files(tok, train_files)
    print(f"tokenizer: {len(tok)} ids; {len(ids)} training tokens from {len(train_files)} files", flush=True)

    t1 = time.monotonic()
    target, target_log = train_target(ids, args.target_steps)
    # Serve and distil the same weights: round to bf16 first.
    served = {k: v.to(torch.bfloat16) for k, v in target.state_dict().items()}
    write_model(out / "target", target_config(SHAPE), served, tokenizer=False)
    target.load_state_dict({k: v.float() for k, v in served.items()})
    t2 = time.monotonic()

    draft, draft_log = distil_draft(target, ids, args.draft_steps)
    write_model(out / "eagle3", eagle3_config(SHAPE), export_tensors(draft), tokenizer=False)
    t3 = time.monotonic()

    figures = evaluate.measure(out / "target", out / "eagle3", tokenizer_dir=out / "tokenizer")
    record = {
        "target": {"steps": args.target_steps, "batch": TARGET_BATCH, "window": WINDOW, "loss_every_50": target_log},
        "draft": {
            "steps": args.draft_steps,
            "batch": DRAFT_BATCH,
            "ttt_steps": DRAFT_TTT_STEPS,
            "loss_every_50": draft_log,
        },
        "seconds": {
            "tokenizer": round(t1 - t0, 1),
            "target": round(t2 - t1, 1),
            "draft": round(t3 - t2, 1),
            "total": round(time.monotonic() - t0, 1),
        },
        "heldout": figures,
    }
    write_report(out / "figures.json", args.threads, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
