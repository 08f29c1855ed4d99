"""Distil the tier's other drafts from the shipped trained target: a multi-layer MTP draft and an EAGLE-1 draft.

Run from the repository root, after ``train.py`` (it reads ``trained/target`` and
``trained/tokenizer``, and never changes them)::

    python -m tests.server.models.distil

1. Load the shipped target (bf16, as served) in fp32, frozen; encode the training split
   of the stdlib sources with the shipped tokenizer.
2. Distil ``trained/multi_layer/`` (``mtp.MtpDraft``, ``spec.MTP_DEPTH`` layers, SGLang's
   ``MiMoV2MTP``): forward KL(p_target || q_k) at every anchor for every layer ``k``,
   teacher-forced (layer ``k`` reads ``x_{t+1+k}`` and the target's ``h_t``).
3. Distil ``trained/eagle1/`` (``eagle1.Eagle1Draft``, SGLang's ``LlamaForCausalLMEagle``):
   the same KL over ``train.DRAFT_TTT_STEPS`` chained draft steps, weighted as ``train.py``
   weights the EAGLE3 draft's.
4. Measure both on the held-out files (``evaluate.measure``) and write
   ``trained/drafts_figures.json``.

The embedding and head are the target's in both (SGLang shares them), so the files hold
only each draft's own parameters; ``build.py`` adds the shared copies. The step counts are
fixed and every generator is seeded (a rerun on the same machine and versions gives the
same weights).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from . import corpus, evaluate
from .build import TRAINED, write_model
from .eagle1 import Eagle1Draft
from .eagle1 import export_tensors as eagle1_tensors
from .layers import final_states
from .mtp import MtpDraft
from .mtp import export_tensors as mtp_tensors
from .spec import BOS, MTP_DEPTH, eagle1_config, mtp_config
from .spec import TRAINED as SHAPE
from .tokenizer import encode_files, load_tokenizer
from .train import DRAFT_STEP_WEIGHTS, DRAFT_TTT_STEPS, WINDOW, fit, step_loss, write_report

MTP_STEPS, EAGLE1_STEPS, BATCH, LR = 400, 400, 16, 2e-3


def distil_mtp(target: LlamaForCausalLM, ids: torch.Tensor, steps: int) -> tuple[MtpDraft, list[float]]:
    torch.manual_seed(3)
    draft = MtpDraft(SHAPE, MTP_DEPTH, target.model.embed_tokens, target.lm_head).train()
    g = torch.Generator().manual_seed(3)
    weights = [1.0] * MTP_DEPTH  # independent layers: each its own loss

    def loss_at(step: int) -> torch.Tensor:
        x = corpus.windows(ids, BATCH, WINDOW, g, BOS)
        with torch.no_grad():
            logits, hidden = final_states(target, x)
        return step_loss(logits, draft.unroll(x, hidden), weights)

    log = fit(list(draft.parameters()), steps, LR, loss_at, "mtp")
    return draft.eval(), log


def distil_eagle1(target: LlamaForCausalLM, ids: torch.Tensor, steps: int) -> tuple[Eagle1Draft, list[float]]:
    torch.manual_seed(4)
    draft = Eagle1Draft(SHAPE, target.model.embed_tokens, target.lm_head).train()
    draft.start_from_target_hidden()
    g = torch.Generator().manual_seed(4)

    def loss_at(step: int) -> torch.Tensor:
        x = corpus.windows(ids, BATCH, WINDOW, g, BOS)
        with torch.no_grad():
            logits, hidden = final_states(target, x)
        return step_loss(logits, draft.unroll(x, hidden, DRAFT_TTT_STEPS), DRAFT_STEP_WEIGHTS)

    log = fit(list(draft.parameters()), steps, LR, loss_at, "eagle1")
    return draft.eval(), log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.server.models.distil", description=__doc__.split("\n")[0])
    ap.add_argument("--trained", type=Path, default=TRAINED, help="folder of the shipped target (default: trained/)")
    ap.add_argument("--out", type=Path, default=TRAINED, help="output folder (default: the shipped trained/)")
    ap.add_argument("--mtp-steps", type=int, default=MTP_STEPS)
    ap.add_argument("--eagle1-steps", type=int, default=EAGLE1_STEPS)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: Path = args.out
    t0 = time.monotonic()

    tok = load_tokenizer(args.trained / "tokenizer")
    target = LlamaForCausalLM.from_pretrained(str(args.trained / "target"), dtype=torch.float32).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    train_files, _ = corpus.split()
    ids = encode_files(tok, train_files)
    print(f"{len(ids)} training tokens from {len(train_files)} files", flush=True)

    t1 = time.monotonic()
    mtp, mtp_log = distil_mtp(target, ids, args.mtp_steps)
    write_model(out / "multi_layer", mtp_config(SHAPE), mtp_tensors(mtp), tokenizer=False)
    t2 = time.monotonic()
    e1, e1_log = distil_eagle1(target, ids, args.eagle1_steps)
    own = {k: v for k, v in eagle1_tensors(e1).items() if k != "embed_tokens.weight"}
    write_model(out / "eagle1", eagle1_config(SHAPE), own, tokenizer=False)
    t3 = time.monotonic()

    # The offline models read only each draft's own tensors (the embedding and head are
    # the target's), so the shipped directories are measured as they are.
    figures = {
        name: evaluate.measure(args.trained / "target", out / name, tokenizer_dir=args.trained / "tokenizer")
        for name in ("multi_layer", "eagle1")
    }
    record = {
        "multi_layer": {"steps": args.mtp_steps, "batch": BATCH, "layers": MTP_DEPTH, "loss_every_50": mtp_log},
        "eagle1": {"steps": args.eagle1_steps, "batch": BATCH, "ttt_steps": DRAFT_TTT_STEPS, "loss_every_50": e1_log},
        "seconds": {
            "multi_layer": round(t2 - t1, 1),
            "eagle1": round(t3 - t2, 1),
            "total": round(time.monotonic() - t0, 1),
        },
        "heldout": figures,
    }
    write_report(out / "drafts_figures.json", args.threads, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
