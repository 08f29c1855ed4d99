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

SGLang's retract-mode pause (``pause_generation(mode="retract")``, the RL weight-sync loop)
instead sends every running request back to the prefill (a rebootstrap: same rid and room,
the prompt plus the output so far); the last tests check that its new life draws X from
uniforms its first life never used (issue 40), single step and multi-layer chain.

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


# ---------------------------------------------------------------- a rebootstrap draws afresh (issue 40)
#
# Real: SGLang's Req (constructor, finished, reset_for_retract, build_rebootstrap_payload),
# Scheduler.pause_generation(mode="retract") and continue_generation, the prealloc queue's
# hold_rebootstrap / enqueue_held_rebootstrap / _submit_prefill_recompute, and the drop-in's
# prefill path (the wrapper of process_batch_result_disagg_prefill, the chain's draw step).
# Stand-ins, said where used: the scheduler and the prealloc queue are namespaces with the
# attributes those methods read; retract_all's KV release is skipped (it only frees pools)
# and ends, as SGLang's release_req does, in req.reset_for_retract(); the queue's add
# (which opens a KV receiver) records the request; the kv manager's HTTP POST of the
# rebootstrap /generate records its payload, and the prefill's Req is built from it as
# the prefill's scheduler does from a /generate (rid, input_ids, sampling params, room).

N_LIVES = 2000
PROMPT_LEN = 6
RL_V = 64


def sparse_floor_config(steps=1):
    """configs/sparse_floor.toml (in-band), at this test's vocabulary and chain length."""
    import tomllib
    from pathlib import Path

    data = tomllib.loads((Path(__file__).resolve().parents[1] / "configs" / "sparse_floor.toml").read_text())
    data["model"] = {"vocab_size": RL_V, "num_steps": steps}
    data["sglang"] = {"capacity_bytes": 16384, "seed": 5}
    return parse_config(data)


def prefill_reqs(sg, generates):
    """The prefill's Reqs for /generate bodies (what its scheduler builds from each)."""
    out = []
    for g in generates:
        req = sg.sb.Req(
            g["rid"],
            "",
            list(g["input_ids"]),
            sg.sp.SamplingParams(**{k: v for k, v in g["sampling_params"].items() if k != "max_new_tokens"}),
            bootstrap_host=g["bootstrap_host"],
            bootstrap_port=g["bootstrap_port"],
            bootstrap_room=g["bootstrap_room"],
        )
        out.append(req)
    return out


def first_generates(n):
    return [
        {
            "rid": f"rl-{i}",
            "input_ids": [3 + (i + j) % 50 for j in range(PROMPT_LEN + i % 5)],
            "sampling_params": {"temperature": 1.0},
            "bootstrap_host": "10.0.0.2",
            "bootstrap_port": 8998,
            "bootstrap_room": 7000 + i,
        }
        for i in range(n)
    ]


def decode_lives(sg, generates, xs, bonus):
    """The decode's Reqs for ``generates`` after their first life: the commit's first token
    (9), then a verify step that committed Y1 = X1 (accepted: q = p) and a bonus token."""
    out = []
    for g, x, b in zip(generates, xs, bonus):
        req = sg.sb.Req(
            g["rid"],
            "",
            list(g["input_ids"]),
            sg.sp.SamplingParams(max_new_tokens=64, temperature=1.0),
            bootstrap_host=g["bootstrap_host"],
            bootstrap_port=g["bootstrap_port"],
            bootstrap_room=g["bootstrap_room"],
        )
        req.output_ids.extend([9, x, b])
        out.append(req)
    return out


def pause_and_resume(sg, running):
    """SGLang's pause_generation(mode="retract") then continue_generation on a decode whose
    running batch is ``running``; returns the /generate bodies its rebootstraps send."""
    import types

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers import scheduler as sched
    from sglang.srt.managers.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

    added, posted = [], []
    queue = SimpleNamespace(
        held_rebootstrap_reqs=[],
        add=lambda req, is_rebootstrap=False: added.append((req, is_rebootstrap)),
        kv_manager=SimpleNamespace(submit_prefill_recompute=lambda receiver, payload: posted.append(payload)),
    )
    for name in ("hold_rebootstrap", "enqueue_held_rebootstrap", "_submit_prefill_recompute"):
        setattr(queue, name, types.MethodType(getattr(sg.decode.DecodePreallocQueue, name), queue))
    scheduler = SimpleNamespace(
        _engine_paused=False,
        enable_overlap=False,
        enable_overlap_mlx=False,
        _pause_started_at=None,
        _pause_intervals=[],
        running_batch=SimpleNamespace(reqs=list(running), batch_is_full=True),
        last_batch=None,
        cur_batch_for_debug=None,
        chunked_req=None,
        disaggregation_mode=DisaggregationMode.DECODE,
        waiting_queue=[],
        decode_offload_manager=None,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        tree_cache=None,
        hisparse_coordinator=None,
        disagg_decode_prealloc_queue=queue,
        metrics_reporter=SimpleNamespace(last_gen_throughput=1.0, current_scheduler_metrics_enabled=False),
        kv_events_publisher=SimpleNamespace(publish_kv_events=lambda: None),
    )

    def release(*, reqs, **kw):  # retract_all without the pools: release_req ends with this
        for r in reqs:
            r.reset_for_retract()

    with patch.object(sched, "retract_all", release):
        sched.Scheduler.pause_generation(scheduler, PauseGenerationReqInput(mode="retract"))
        assert scheduler.running_batch.reqs == [] and queue.held_rebootstrap_reqs == list(running)
        sched.Scheduler.continue_generation(scheduler, ContinueGenerationReqInput(torch_empty_cache=False))
    assert [r for r, again in added if again] == list(running) and not scheduler._engine_paused
    for req, _ in added:  # the early-allocation policy's /generate, right after send_metadata
        sg.decode.DecodePreallocQueue._submit_prefill_recompute(queue, SimpleNamespace(req=req, kv_receiver=None))
    return posted


def recorded(inst):
    """Record the uniforms each encoder call of ``inst``'s prefill is handed."""
    enc = inst.publisher.encoder
    real, seen = enc.encode, []

    def encode(probs, *, temperature=1.0, generator=None, uniforms=None):
        seen.append(uniforms.clone())
        return real(probs, temperature=temperature, uniforms=uniforms)

    enc.encode = encode
    return seen


def prefill_single(inst, reqs, q):
    """One prefill batch of ``reqs`` through the drop-in's wrapper (SGLang's draw replaced by
    the encoder's); returns each request's X."""
    from pd_middleware.integrations.sglang.prefill import wrap_prefill_result

    b = len(reqs)
    di = SimpleNamespace(
        topk_index=torch.zeros((b, 1), dtype=torch.int64), topk_p=torch.full((b, 1), 0.5), draft_probs=q
    )
    batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(temperatures=torch.ones((b, 1))))

    def sglang_copies(self, batch, result):  # what process_batch_result_disagg_prefill copies
        for i, r in enumerate(batch.reqs):
            r.output_topk_index = result.next_draft_input.topk_index[i]

    wrap_prefill_result(sglang_copies, inst)(None, batch, SimpleNamespace(next_draft_input=di))
    assert inst.publisher.counts["staged"] == b, dict(inst.publisher.counts)
    inst.publisher.counts.clear()
    return [int(r.output_topk_index[0]) for r in reqs]


def match_bound(law, n, alpha=1e-6):
    """Largest count of X2 == X1 over n independent pairs (each with probability
    sum_x law(x)^2) that Hoeffding's bound lets pass: P(count > bound) <= alpha."""
    import math

    pi = float((law.double() ** 2).sum())
    return n * (pi + math.sqrt(math.log(1 / alpha) / (2 * n)))


def test_a_rebootstrapped_request_draws_its_x_from_a_fresh_uniform(sg) -> None:
    """Issue 40, single step, configs/sparse_floor.toml in-band: 2,000 requests' first lives
    draw X1 at the prefill; the decode commits Y1 = X1 (q = p flat: always accepted) and a
    bonus; SGLang's real retract-mode pause retracts every running request and its resume
    sends each back to the prefill (same rid and room, the prompt plus the output so far).
    Each second life is drawn from another uniform than its first life's, and X2 == X1 no
    more often than independence allows (q flat: probability sum s(x)^2 = 1/64 each;
    Hoeffding, false-positive bound 1e-6, fixed seeds). On the key without the position,
    every X2 equals X1 (negative control)."""
    from pd_middleware.integrations.sglang import prefill as sglang_prefill

    def run():
        S.uninstall()
        inst = S.install(sparse_floor_config(), S.InstallOptions(channel="metadata", facts=prefill_facts(1)))
        seen = recorded(inst)
        q = torch.full((N_LIVES, RL_V), 1.0 / RL_V)
        gens = first_generates(N_LIVES)
        x1 = prefill_single(inst, prefill_reqs(sg, gens), q)
        bonus = torch.randint(0, RL_V, (N_LIVES,), generator=torch.Generator().manual_seed(11)).tolist()
        again = pause_and_resume(sg, decode_lives(sg, gens, x1, bonus))
        assert [(g["rid"], g["bootstrap_room"]) for g in again] == [(g["rid"], g["bootstrap_room"]) for g in gens]
        assert [len(g["input_ids"]) for g in again] == [len(g["input_ids"]) + 2 for g in gens]
        x2 = prefill_single(inst, prefill_reqs(sg, again), q)
        return seen, x1, x2

    seen, x1, x2 = run()
    u1, u2 = seen  # one encoder call per prefill batch (one temperature)
    assert bool((u1 != u2).all()), "a second life reused its first life's uniform"
    law = torch.full((RL_V,), 1.0 / RL_V)  # sparse_floor lists every token of a flat q
    matches = sum(a == b for a, b in zip(x1, x2))
    assert matches <= match_bound(law, N_LIVES), f"{matches} of {N_LIVES} second lives copied X1"
    # Negative control: the old key (seed, room, rid) alone.
    with patch.object(sglang_prefill, "draw_position", lambda req: None):
        seen, x1, x2 = run()
    assert torch.equal(seen[0], seen[1]) and x1 == x2


def prefill_facts(steps):
    return S.EngineFacts(
        role="prefill", vocab_size=RL_V, num_steps=steps, algorithm="EAGLE", topk=1, rejection_sampling=True
    )


def test_a_rebootstrapped_requests_chain_draws_every_step_from_fresh_uniforms(sg) -> None:
    """Issue 40, a 3-step multi-layer chain (configs/sparse_floor.toml in-band, the chain's
    draw step, :mod:`pd_middleware.integrations.sglang.chain`): after SGLang's real
    retract-mode pause and resume, every step k of each second life is drawn from another
    uniform than step k of its first life (and the steps stay distinct), and X2_k == X1_k
    no more often than independence allows, per step (Hoeffding, Bonferroni over the 3
    steps: family-wise false-positive bound 1e-6). Negative control: the old key repeats
    every step."""
    from pd_middleware.integrations.sglang import chain as sglang_chain
    from pd_middleware.integrations.sglang import prefill as sglang_prefill

    steps = 3

    def chain(inst, reqs):
        b = len(reqs)
        batch = SimpleNamespace(reqs=reqs, sampling_info=SimpleNamespace(temperatures=torch.ones((b, 1))))
        draw = sglang_chain.chain_for(inst.publisher, batch)
        q = torch.full((b, RL_V), 1.0 / RL_V)
        zp, zi = torch.zeros(b, 1), torch.zeros(b, 1, dtype=torch.int64)
        with sglang_chain.CHAIN.enter(draw):
            for k in range(steps):  # what SGLang's sample_draft_proposal does at each step
                assert sglang_chain.draw_step(k, q, zp, zi) is not None
        return [list(p.draft_tokens) for p in draw.payloads()]

    def run():
        S.uninstall()
        inst = S.install(sparse_floor_config(steps), S.InstallOptions(channel="metadata", facts=prefill_facts(steps)))
        seen = recorded(inst)
        gens = first_generates(N_LIVES)
        x1 = chain(inst, prefill_reqs(sg, gens))
        bonus = torch.randint(0, RL_V, (N_LIVES,), generator=torch.Generator().manual_seed(12)).tolist()
        again = pause_and_resume(sg, decode_lives(sg, gens, [x[0] for x in x1], bonus))
        x2 = chain(inst, prefill_reqs(sg, again))
        return torch.cat([s.reshape(N_LIVES, 1) for s in seen], 1), x1, x2

    u, x1, x2 = run()
    first, second = u[:, :steps], u[:, steps:]
    assert bool((first != second).all()), "a step of a second life reused its first life's uniform"
    assert all(len(set(row)) == 2 * steps for row in u.tolist()), "every (life, step) has its own uniform"
    law = torch.full((RL_V,), 1.0 / RL_V)
    for k in range(steps):
        matches = sum(a[k] == b[k] for a, b in zip(x1, x2))
        assert matches <= match_bound(law, N_LIVES, 1e-6 / steps), f"step {k}: {matches} of {N_LIVES} copied"
    with patch.object(sglang_prefill, "draw_position", lambda req: None):  # through draw_keys, the chain's too
        u, x1, x2 = run()
    assert torch.equal(u[:, :steps], u[:, steps:]) and x1 == x2


def test_stage_requests_keys_each_draw_on_the_reqs_seq_len_by_default(sg) -> None:
    """The harness entry ``Installation.stage_requests`` keys each request's draw as the
    prefill wrapper does: by default on the Req's ``len(origin_input_ids) + len(output_ids)``;
    ``positions`` given, on those (another position: another uniform for every request)."""
    from pd_middleware.sampling.draws import request_uniforms

    inst = S.install(sparse_floor_config(), S.InstallOptions(channel="metadata", facts=prefill_facts(1)))
    seen = recorded(inst)
    gens = first_generates(8)
    reqs = prefill_reqs(sg, gens)
    q = torch.softmax(2 * torch.randn(8, RL_V, generator=torch.Generator().manual_seed(4)), -1)
    lens = [len(g["input_ids"]) for g in gens]
    enc = inst.stage_requests(reqs, q)
    assert [int(r.output_topk_index[0]) for r in reqs] == enc.tokens[:, 0].tolist()
    inst.stage_requests(reqs, q, positions=lens)
    inst.stage_requests(reqs, q, positions=[n + 1 for n in lens])
    want = request_uniforms(5, [g["bootstrap_room"] for g in gens], [g["rid"] for g in gens], positions=lens)
    assert torch.equal(seen[0], want) and torch.equal(seen[1], want)
    assert bool((seen[2] != want).all())
