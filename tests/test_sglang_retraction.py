"""A retracted decode request that SGLang resumes comes back through the first-draft builder.

SGLang 0.5.23 (``disaggregation/decode.py``): under memory pressure the decode retracts
running requests (``Req.reset_for_retract``), parks them in the prealloc queue's
``retracted_queue``, and ``resume_retracted_reqs`` later puts them back in the waiting
queue; ``process_prebuilt`` then builds their first draft input again, from the fields
their transfer committed (X, q(X), the hidden state of the prompt's last position). The
drop-in recognises such a request at the builder (``sources.returning``: the row its first
build saw is still there) and serves it the one-hot at its X, counted once ``retracted``:
recompute does not redraw X from a hidden state of another position, and a shipped
proposal (consumed at the first build) is not looked for again.

Real: SGLang's ``Req`` (its constructor and ``reset_for_retract``), its
``DecodePreallocQueue.resume_retracted_reqs``, and the builder
``build_eagle_disagg_draft_input``. Stand-ins, said where used: the prealloc queue is a
namespace with the pools and budget methods ``resume_retracted_reqs`` reads (every budget
fits), its KV restore (``restore_kv_cache``) is recorded instead of copying KV, and the
prebuilt batch is a namespace with the fields the builder and the recompute step read.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from _recompute_head import HEAD_HIDDEN, MatrixHead
from _sglang_builder import build_draft_input, namespace_batch

from pd_middleware.config import parse_config
from pd_middleware.integrations import sglang as S

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sglang_context", "sglang_uninstall")]

V = 64


@pytest.fixture
def sg(sglang_importable):
    import importlib

    from _sglang_import import import_sglang

    return SimpleNamespace(
        sb=import_sglang("sglang.srt.managers.schedule_batch"),
        sp=importlib.import_module("sglang.srt.sampling.sampling_params"),
        decode=importlib.import_module("sglang.srt.disaggregation.decode"),
        ed=importlib.import_module("sglang.srt.speculative.eagle_disaggregation"),
        rc=importlib.import_module("sglang.srt.runtime_context"),
    )


def facts():
    return S.EngineFacts(role="decode", vocab_size=V, num_steps=1, algorithm="EAGLE", topk=1, rejection_sampling=True)


def shipped():
    """An in-band decode with the sparse strategy, and a publisher for its rows' payloads."""
    cfg = parse_config(
        {
            "synthesizer": {"name": "sparse"},
            "encoder": {"name": "sparse", "options": {"mode": "topk", "k": 5, "value_dtype": "fp32"}},
            "sglang": {"capacity_bytes": 4096, "seed": 5},
        }
    )
    inst = S.install(cfg, S.InstallOptions(channel="metadata", facts=facts()))
    pub = S.ProposalPublisher.from_config(cfg, stage=lambda *a: None, vocab_size=V, num_steps=1)
    return inst, pub


def recompute():
    """The decode-only recompute default, its head bound as the scheduler-start hook does."""
    import tomllib
    from pathlib import Path

    data = tomllib.loads((Path(__file__).resolve().parents[1] / "configs" / "sglang.toml").read_text())
    inst = S.install(parse_config(data), S.InstallOptions(facts=facts()))
    inst.recompute.bind_head(MatrixHead(V, HEAD_HIDDEN), vocab_size=V, num_steps=1, rejection_sampling=True)
    return inst


def committed(sg, room, x, hidden_seed=0):
    """A real SGLang Req as the decode's transfer commit leaves it (its first token, X in a
    16-wide row, q(X), the prompt's last hidden state)."""
    req = sg.sb.Req(f"req-{room}", "", [1, 2, 3], sg.sp.SamplingParams(max_new_tokens=8))
    req.bootstrap_room = room
    req.output_ids.append(11)
    row = torch.zeros(16, dtype=torch.int64)
    row[0] = x
    req.output_topk_index = row
    req.output_topk_p = torch.full((16,), 0.25)
    g = torch.Generator().manual_seed(hidden_seed or room)
    req.hidden_states_tensor = torch.randn(HEAD_HIDDEN, generator=g)
    req.output_dsa_topk_indices = None
    return req


def build(sg, reqs):
    """SGLang's builder over a prebuilt batch of ``reqs`` (the fields it and recompute read)."""
    b = len(reqs)
    batch = namespace_batch(
        reqs,
        V,
        seq_lens=torch.tensor([len(r.origin_input_ids) + len(r.output_ids) for r in reqs]),
        sampling_info=SimpleNamespace(temperatures=torch.ones((b, 1)), sampling_seed=None, top_ks=torch.full((b,), 50)),
    )
    return build_draft_input(sg.ed, batch)


def retract_and_resume(sg, reqs):
    """SGLang's retraction of running ``reqs`` and its real ``resume_retracted_reqs``; returns
    what it hands back to the waiting queue (then built again by process_prebuilt)."""
    for r in reqs:
        r.reset_for_retract()  # what the scheduler's retract_decode does to each request
    restored = []
    queue = SimpleNamespace(
        retracted_queue=list(reqs),
        req_to_token_pool=SimpleNamespace(available_size=lambda: 64),
        tree_cache=None,
        token_to_kv_pool_allocator=SimpleNamespace(prealloc_fits_assumes_reclaim=lambda: False),
        scheduler=SimpleNamespace(enable_overlap=False),
        _uses_swa_reservation=lambda: False,
        _allocatable_token_budgets=lambda **kw: 10**6,
        _prealloc_required_tokens=lambda req: (8, None),
        _prealloc_reservation_fits=lambda *a, **kw: True,
        _pre_alloc=lambda req: None,
    )
    with (
        patch.object(sg.decode, "restore_kv_cache", lambda req, *a: restored.append(req)),
        sg.rc.get_context().override_server_args(disaggregation_decode_retraction_backup="cpu_tensor"),
    ):
        out = sg.decode.DecodePreallocQueue.resume_retracted_reqs(queue)
    assert out == reqs and restored == reqs and queue.retracted_queue == []
    assert all(r.retraction_count == 1 and not r.is_retracted for r in reqs)
    return out


def one_hot(xs):
    return torch.nn.functional.one_hot(torch.tensor(xs), V).float()


def test_a_resumed_request_keeps_its_x_and_verifies_one_hot_counted_once_shipped(sg) -> None:
    """In-band sparse: the first build hands the prefill's proposal; after SGLang retracts and
    resumes the request, its second build keeps X with the one-hot (exact), and neither the
    pipeline nor its counters see it again: ``requests``, ``proposal:prefill`` and
    ``payloads_received`` stay at one, ``retracted`` is one."""
    inst, pub = shipped()
    room = 501
    _, (payload,) = pub.encode(
        [room], torch.softmax(2 * torch.randn(1, V, generator=torch.Generator().manual_seed(3)), -1)
    )
    x = payload.draft_tokens[0]
    req = committed(sg, room, x)
    inst.proposer.on_row(req, payload)  # what the in-band commit attaches
    first = build(sg, [req])
    assert int((first.draft_probs[0] > 0).sum()) > 1  # the shipped proposal
    counts = dict(inst.proposer.counts)
    assert counts["requests"] == 1 and counts["proposal:prefill"] == 1
    received = inst.metrics.received
    (back,) = retract_and_resume(sg, [req])
    again = build(sg, [back])
    assert torch.equal(again.topk_index, torch.tensor([[x]]))
    assert torch.equal(again.draft_probs, one_hot([x]))
    assert inst.proposer.counts["retracted"] == 1
    assert {k: v for k, v in inst.proposer.counts.items() if k != "retracted"} == counts
    assert inst.metrics.received == received and not inst.guard.counts


def test_a_resumed_request_is_not_recomputed_and_a_fresh_one_beside_it_is(sg) -> None:
    """Recompute: the first build redraws X' from q' = softmax(head(h)) and counts it; after
    SGLang retracts and resumes the request, a batch with it and a fresh request recomputes
    only the fresh one: the resumed one keeps X' (not redrawn from the prompt's hidden
    state for a verify at another position) with the one-hot, ``recomputed`` grows by one,
    ``retracted`` is one. Control: a rebootstrapped request (SGLang committed a new transfer:
    a new row) is recomputed again."""
    inst = recompute()
    rc = inst.recompute
    req = committed(sg, 601, x=3)
    first = build(sg, [req])
    x1 = int(first.topk_index[0, 0])
    assert rc.counts["recomputed"] == 1 and int((first.draft_probs[0] > 0).sum()) > 1
    (back,) = retract_and_resume(sg, [req])
    fresh = committed(sg, 602, x=3)
    out = build(sg, [back, fresh])
    assert int(out.topk_index[0, 0]) == x1 and int(back.output_topk_index[0]) == x1
    assert torch.equal(out.draft_probs[0], one_hot([x1])[0])
    assert int((out.draft_probs[1] > 0).sum()) > 1  # the fresh request: recomputed q'
    assert rc.counts["recomputed"] == 2 and rc.counts["retracted"] == 1
    assert not [k for k in rc.counts if k.startswith("fallback:")] and not inst.guard.counts
    # Rebootstrap: SGLang's commit gives the request a new transfer's row: fresh again.
    back.output_topk_index = back.output_topk_index.clone()
    build(sg, [back])
    assert rc.counts["recomputed"] == 3 and rc.counts["retracted"] == 1


def test_a_live_ab_with_a_recompute_arm_counts_a_returning_request_once() -> None:
    """ArmedSource (live A/B arms mixing recompute and shipped) counts ``retracted`` in the
    shipped arms' part, once per returning request; without it the return went uncounted."""
    from pd_middleware.core.events import Events
    from pd_middleware.integrations.sglang.arms import ArmedSource

    decode, recompute = Events("decode"), Events("recompute")
    shipped = SimpleNamespace(name="metadata", features=frozenset({"prefill"}), events=decode)
    rc = SimpleNamespace(features=frozenset({"recompute"}), events=recompute)
    armed = ArmedSource(shipped, rc, "recompute")  # type: ignore[arg-type]
    armed.returned(2)
    assert decode.counts["retracted"] == 2 and recompute.counts["retracted"] == 0
