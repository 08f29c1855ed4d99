"""The pd-middleware drop-in inside a harness rank (see ``tests/_sglang_pd.py``).

Imported only in rank processes. :func:`install` activates the drop-in in the rank the
way a scheduler start does (``install`` with the engine's :class:`EngineFacts`), so
``MetadataBuffers``, ``set_buf``, ``clear_slot``, ``_commit_transfer_to_req`` and the
Mooncake registration run patched from the next topology on. What stands in for the
scheduler:

- prefill: the model's draft distribution q is a seeded softmax over V (the same on
  every prefill TP rank, as identical replicas compute); the drop-in's real
  ``publish_batch`` encodes it and rewrites the draft input's X and q(X), and the two
  lines of SGLang's ``process_batch_result_disagg_prefill`` that copy them into the
  request are done here (that method needs a running scheduler);
- decode: SGLang's real ``build_eagle_disagg_draft_input`` runs on the committed
  requests, with a namespace batch (the fields it reads) under SGLang's speculative
  settings (EAGLE, top-k 1, one step, rejection sampling).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from _recompute_head import HEAD_HIDDEN, MatrixHead
from _sglang_pd import draft_q
from sglang.srt.disaggregation import decode as sglang_decode
from sglang.srt.disaggregation import prefill as sglang_prefill
from sglang.srt.disaggregation import utils as sglang_utils
from sglang.srt.disaggregation.mooncake import conn as sglang_mooncake
from sglang.srt.runtime_context import get_context
from sglang.srt.speculative import eagle_disaggregation as ed

from pd_middleware.config import parse_config
from pd_middleware.integrations import sglang as S
from pd_middleware.integrations.sglang.agreement import group_of
from pd_middleware.integrations.sglang.prefill import publish_batch
from pd_middleware.integrations.sglang.startup import EngineFacts

#: Every module the drop-in patches except the scheduler's (no scheduler runs here, and
#: its module needs packages this tier leaves out); activation comes from the facts.
MODULES = S.SGLangModules(
    builder=ed,
    prefill=sglang_prefill,
    utils=sglang_utils,
    transfer=sglang_decode,
    mooncake=sglang_mooncake,
    only_given=True,
)


def install(rank: Any, config: dict | None, vocab: int) -> dict:
    """(Re)install the drop-in in ``rank`` for ``config`` (None: none); takes effect at the
    next ``configure``, which allocates fresh buffers on a fresh Mooncake engine."""
    S.uninstall()
    rank.fresh_engine = True
    rank.prepare_req = None
    rank.vocab = vocab
    if config is None:
        return {"installed": False}
    facts = EngineFacts(
        role=rank.role, vocab_size=vocab, num_steps=1, algorithm="EAGLE", topk=1, rejection_sampling=True
    )
    inst = S.install(parse_config(config), S.InstallOptions(facts=facts, modules=MODULES))
    if inst.recompute is not None:  # decode-only recompute: what the scheduler-start hook binds
        if rank.role == "decode":
            inst.recompute.bind_head(
                MatrixHead(vocab, HEAD_HIDDEN),
                vocab_size=vocab,
                num_steps=1,
                rejection_sampling=True,
            )
        return {"installed": True, "channel": inst.channel_name}
    if rank.role == "prefill":
        rank.prepare_req = lambda req, first: _encode(rank, inst, req, first, vocab)
    rank.flip_proposal_byte = lambda **kw: _flip(rank, **kw)
    rank.set_x = lambda **kw: _set_x(rank, **kw)
    return {"installed": True, "layout": inst.channel.describe(), "channel": inst.channel_name}


def _encode(rank: Any, inst: Any, req: Any, first: dict, vocab: int) -> None:
    q = draft_q(first["q_seed"], vocab)
    # SGLang's own draw before the drop-in replaces it: the same on every rank that
    # computes the same q (``own_x`` in ``first`` stands for SGLang's TP-consistent sampling).
    x = int(first.get("own_x", q.argmax()))
    draft_input = SimpleNamespace(
        topk_index=torch.tensor([[x]]), topk_p=torch.tensor([[float(q[0, x])]]), draft_probs=q
    )
    # The prefill's attention-TP CPU group, as the wrapper takes it from the Scheduler.
    group = group_of(rank.groups.get(rank.tp_size), inst.rank_agreement)
    publish_batch(
        inst.publisher,
        SimpleNamespace(reqs=[req], sampling_info=None),
        SimpleNamespace(next_draft_input=draft_input),
        group=group,
        events=inst.events,
    )
    # What SGLang's process_batch_result_disagg_prefill does next for a finished request.
    req.output_topk_p = draft_input.topk_p[0]
    req.output_topk_index = draft_input.topk_index[0]


def _flip(rank: Any, *, idx: int, offset: int, **_: Any) -> None:
    """Decode, before commit: flip one byte of the request's proposal row (a corrupt transfer)."""
    rows = S.current().channel.rows(rank.meta)
    rows[idx, offset] ^= 0xFF


def _set_x(rank: Any, *, idx: int, x: int, **_: Any) -> None:
    """Decode, before commit: make SGLang's own row carry X = ``x`` (another rank's draw)."""
    rank.meta.output_topk_index[idx, 0] = x


def build(rank: Any, rooms: list[int]) -> dict:
    """Decode: SGLang's ``build_eagle_disagg_draft_input`` over the committed requests of ``rooms``."""
    reqs = [rank.committed.pop(r) for r in rooms]
    inst = S.current()
    if inst is not None and inst.recompute is not None:
        # The decode ranks' attention-TP CPU group of this topology (SGLang's scheduler hands
        # attn_tp_cpu_group at start; here the topology is configured after the install).
        inst.recompute.group = group_of(rank.groups.get(rank.tp_size), inst.rank_agreement)
    batch = SimpleNamespace(
        reqs=reqs,
        device=torch.device("cpu"),
        model_config=SimpleNamespace(vocab_size=rank.vocab, hf_config=SimpleNamespace()),
        enable_overlap=False,
        req_pool_indices=torch.arange(1, len(reqs) + 1),
        seq_lens=torch.full((len(reqs),), 10),
        # Read by the recompute path only (SGLang's builder does not): T = 1, no seed, sampled.
        sampling_info=SimpleNamespace(
            temperatures=torch.ones((len(reqs), 1)), sampling_seed=None, top_ks=torch.full((len(reqs),), 50)
        ),
    )
    with get_context().override_server_args(
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        speculative_num_steps=1,
        enable_multi_layer_eagle=False,
        speculative_use_rejection_sampling=True,
    ):
        out = ed.build_eagle_disagg_draft_input(batch, torch.arange(len(reqs), dtype=torch.int64), None)
    attached = [getattr(r, "pd_middleware", None) for r in reqs]
    return {
        "draft_probs": out.draft_probs.clone(),
        "topk_index": out.topk_index.clone(),
        "topk_p": out.topk_p.clone(),
        "hidden": out.hidden_states.clone(),
        "reasons": [getattr(a, "reason", None) for a in attached],
        "counters": counters(),
    }


def fault(rank: Any, kind: str) -> None:
    """``encoder_fails``: this rank's encoder raises; ``agreement_off``: no cross-rank
    agreement or canary here (a negative control); ``reset``: undo both."""
    inst = S.current()
    assert inst is not None, "fault needs an installed drop-in"
    if kind == "encoder_fails":

        def broken(*a: Any, **k: Any) -> Any:
            raise RuntimeError(f"injected: {rank.name}'s encoder fails")

        inst.publisher.encoder.encode = broken  # type: ignore[union-attr]
    elif kind == "agreement_off":
        inst.rank_agreement = False
    elif kind == "reset":
        inst.rank_agreement = True
        if inst.publisher is not None:
            inst.publisher.encoder.__dict__.pop("encode", None)
    else:
        raise ValueError(f"unknown fault {kind!r}")


def counters() -> dict:
    inst = S.current()
    return (
        {}
        if inst is None
        else {k: dict(v) if isinstance(v, dict) else v for k, v in inst.counters().items() if k != "metrics"}
    )
