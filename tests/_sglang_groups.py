"""One rank of the two-process group test (``tests/test_sglang_groups.py``); imports SGLang.

Each rank process runs :func:`rank_main` for one case:

- ``tp2``: plain TP 2 (``--tp 2``);
- ``dp2``: DP attention, ``--tp 2 --dp 2 --enable-dp-attention`` (attention TP 1);
- ``dp2_lm_head``: the same with ``--enable-dp-lm-head``;
- ``attn_tp2_lm_head``: ``--tp 2 --dp 1 --enable-dp-attention --enable-dp-lm-head``
  (attention TP 2: the LogitsProcessor gathers over the attention-TP group,
  ``_gather_attn_tp_logits``).

What is real: SGLang's runtime context (``publish`` of a real ``ServerArgs``), its
``parallel_state`` over gloo on 127.0.0.1 (``init_distributed_environment(world_size=2)``,
``initialize_model_parallel()``), the draft layout SGLang resolves for a ``SINGLE_GROUP``
draft (``resolve_draft_parallel_layout``, EAGLE3's policy), its ``draft_tp_context``, the
draft model (``LlamaForCausalLMEagle3``, tiny random weights, built inside the draft
context as SGLang's worker builds it), its ``LogitsProcessor`` and
``tensor_model_parallel_all_gather``; and the drop-in, installed from
``configs/sglang.toml``, its scheduler-start ``capture`` and its per-batch ``prepare``.

Stand-ins: the scheduler (a namespace with ``draft_worker``, ``attn_tp_cpu_group`` and
``enable_overlap``) and the prebuilt batch (the fields ``prepare`` reads). Under the DP
layout the draft's own LogitsProcessor has no gather at all (its group is one rank), so a
copy of it with the gather forced on (``do_tensor_parallel_all_gather``) and a gatherer
that calls SGLang's ``tensor_model_parallel_all_gather`` stands for a draft group of
more than one rank: the test is which group that call resolves.

Every collective of ours is recorded: the head's gather (the TP group SGLang's
``get_tp_group()`` resolves at the moment of the call) and the recompute vote (every
``torch.distributed.all_reduce`` during ``prepare``: its group's ranks, and whether it is
SGLang's attention-TP CPU group).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

V, H = 128, 32
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "sglang.toml"
#: How long the negative control waits for the gather that only one DP rank entered.
HANG_WAIT_S = 5.0
#: How long a rank waits for its own prepare (seconds of work) before reporting it blocked.
PREPARE_WAIT_S = 60.0

CASES = {
    "tp2": {},
    "dp2": {"enable_dp_attention": True, "dp_size": 2},
    "dp2_lm_head": {"enable_dp_attention": True, "dp_size": 2, "enable_dp_lm_head": True},
    "attn_tp2_lm_head": {"enable_dp_attention": True, "dp_size": 1, "enable_dp_lm_head": True},
}


def rank_main(rank: int, port: int, case: str, out: Any, stop: Any) -> None:
    """Run ``case`` as rank ``rank`` of 2; put ``(rank, "ok", result)`` or ``(rank, "err", tb)`` on ``out``,
    then wait for ``stop`` (so a peer's blocked collective stays blocked, not broken) and exit."""
    try:
        out.put((rank, "ok", _run(rank, port, case)))
    except BaseException:
        out.put((rank, "err", traceback.format_exc()))
    stop.wait(120)
    sys.stdout.flush()
    os._exit(0)  # a thread may still sit in the negative control's gather: no teardown


def _run(rank: int, port: int, case: str) -> dict:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    from _sglang_import import import_sglang, install_torchvision_stand_in

    install_torchvision_stand_in()
    import torch

    rc = import_sglang("sglang.srt.runtime_context")
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu", tp_size=2, **CASES[case])
    rc.reset_context()
    rc.publish(args, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank))
    ps = import_sglang("sglang.srt.distributed.parallel_state")
    ps.init_distributed_environment(
        world_size=2,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank,
        backend="gloo",
        timeout=60,
    )
    ps.initialize_model_parallel()
    rb = import_sglang("sglang.srt.layers.rotary_embedding.base")
    rb._is_cpu = True  # the native rotary constructor (tests/test_sglang_recompute.py); the head never calls it
    from sglang.srt.configs.draft_parallel import DraftParallelSpec, DraftTPExecution
    from sglang.srt.distributed import tensor_model_parallel_all_gather
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.speculative.draft_parallel import resolve_draft_parallel_layout
    from sglang.srt.speculative.spec_utils import draft_tp_context

    from pd_middleware import ConfigError
    from pd_middleware.config import load_config
    from pd_middleware.integrations import sglang as S
    from pd_middleware.integrations.sglang.draft_head import SGLangDraftHead
    from pd_middleware.integrations.sglang.recompute import capture
    from pd_middleware.integrations.sglang.startup import check_placement

    parallel = rc.get_parallel()
    # What SGLang resolves for EAGLE3 (a SINGLE_GROUP draft): its own group under DP attention.
    layout = resolve_draft_parallel_layout(DraftParallelSpec(tp_execution=DraftTPExecution.SINGLE_GROUP))
    attn_cpu = ps.get_attn_tp_group().cpu_group
    res: dict[str, Any] = {
        "attn_dp_size": parallel.attn_dp_size,
        "attn_tp_size": parallel.attn_tp_size,
        "tp_size": ps.get_tp_group().world_size,
        "layout_group_size": None if layout.tp_group is None else layout.tp_group.world_size,
    }

    gathers: list[dict] = []

    def recorded(inner: Any, *, attn_tp: bool = False) -> Any:
        def gather(x: torch.Tensor) -> torch.Tensor:
            # What SGLang's gather resolves now: the TP group, or the attention-TP group for
            # the LogitsProcessor's _gather_attn_tp_logits (--enable-dp-lm-head).
            g = ps.get_attn_tp_group() if attn_tp else ps.get_tp_group()
            gathers.append({"size": g.world_size, "ranks": list(g.ranks), "draft_group": g is layout.tp_group})
            return inner(x)

        return gather

    votes: list[dict] = []
    real_all_reduce = torch.distributed.all_reduce

    def all_reduce(tensor: Any, *a: Any, group: Any = None, **k: Any) -> Any:
        g = group if group is not None else torch.distributed.group.WORLD
        votes.append({"ranks": torch.distributed.get_process_group_ranks(g), "attn_tp_cpu_group": g is attn_cpu})
        return real_all_reduce(tensor, *a, group=group, **k)

    # ---- check_placement against SGLang's real LogitsProcessor, built where SGLang builds it
    from _sglang_import import tiny_llama_config

    cfg = tiny_llama_config(V, H)
    cfg.draft_vocab_size = V

    def decision(lp: Any) -> dict:
        got = {}
        got["use_attn_tp_group"] = bool(lp.use_attn_tp_group)
        stream = torch.cpu.Stream()
        for key, overlap, fwd in (
            ("overlap=False", False, stream),
            ("overlap=True", True, stream),
            ("overlap=True, no stream", True, None),
        ):
            try:
                check_placement(lp, enable_overlap=overlap, forward_stream=fwd)
                got[key] = "accepted"
            except ConfigError as exc:
                got[key] = f"refused: {exc}"
        return got

    target_lp = LogitsProcessor(cfg)  # a draft that keeps the target's layout (TARGET_LAYOUT, e.g. NextN)
    with draft_tp_context(layout):
        draft_lp = LogitsProcessor(cfg)  # a SINGLE_GROUP draft (EAGLE3) in the group SGLang gives it
    res["placement"] = {
        "target_layout": {
            "gather": target_lp.do_tensor_parallel_all_gather,
            "gather_dp_attn": target_lp.do_tensor_parallel_all_gather_dp_attn,
            **decision(target_lp),
        },
        "single_group": {
            "gather": draft_lp.do_tensor_parallel_all_gather,
            "gather_dp_attn": draft_lp.do_tensor_parallel_all_gather_dp_attn,
            **decision(draft_lp),
        },
    }

    # ---- the drop-in's head and vote, through the scheduler-start capture and prepare
    eagle3 = import_sglang("sglang.srt.models.llama_eagle3")

    def draft(dtype: Any, **flags: Any) -> Any:
        """SGLang's EAGLE3 draft, built in the draft's group as SGLang's EAGLE worker builds it,
        the same seeded values on both ranks; ``flags``: config attributes its LogitsProcessor reads."""
        c = tiny_llama_config(V, H)
        c.draft_vocab_size = V
        for k, v in flags.items():
            setattr(c, k, v)
        with draft_tp_context(layout):
            m = eagle3.LlamaForCausalLMEagle3(c)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        return m.to(dtype)

    model = draft(torch.float32)
    inst = S.install(load_config(CONFIG), S.InstallOptions(hook_scheduler=False))
    source = inst.recompute
    sched = SimpleNamespace(
        draft_worker=SimpleNamespace(
            draft_worker=SimpleNamespace(
                draft_runner=SimpleNamespace(model=model), parallel_layout=layout, hot_token_id=None
            )
        ),
        attn_tp_cpu_group=attn_cpu,
        enable_overlap=False,
        # What SGLang's get_worker_info sets before init_disaggregation (a real CPU stream).
        forward_stream=torch.cpu.Stream(),
        device="cpu",
    )
    capture(source, sched, vocab_size=V, num_steps=1, rs=True)
    head = source.head
    lp = head.lp
    res["head_lp_gathers"] = bool(lp.do_tensor_parallel_all_gather)
    if lp.do_tensor_parallel_all_gather and lp.use_attn_tp_group:
        # SGLang's own attention-TP gather, recorded (the head calls it as the LP does).
        lp._gather_attn_tp_logits = recorded(lp._gather_attn_tp_logits, attn_tp=True)
        forced = None
    elif lp.do_tensor_parallel_all_gather:
        lp._logits_gatherer = recorded(lp._logits_gatherer)  # SGLang's own gatherer, recorded
        forced = None
    else:
        # The draft's group is one rank: stand in for a wider one (see the module docstring).
        forced = copy.copy(lp)
        forced.do_tensor_parallel_all_gather = True
        forced.use_attn_tp_group = False
        forced._logits_gatherer = recorded(tensor_model_parallel_all_gather)
        head.lp = forced
    res["vote_group"] = None if source.group is None else torch.distributed.get_process_group_ranks(source.group)

    # Under DP attention the DP ranks' prebuilt batches are not synchronised: rank 1 builds
    # another batch (another size) at another moment. Under TP 2 both build the same one.
    b = 2 if parallel.attn_dp_size == 1 or rank == 0 else 1
    batch = _batch(torch, b, seed=11 if parallel.attn_dp_size == 1 else 11 + rank)
    torch.distributed.all_reduce = all_reduce
    got: list[Any] = []
    worker = threading.Thread(target=lambda: got.append(source.prepare(batch)), daemon=True)
    t0 = time.perf_counter()
    worker.start()
    worker.join(PREPARE_WAIT_S)  # a collective left alone blocks: report it, never hang the case
    res["prepare_s"] = time.perf_counter() - t0
    torch.distributed.all_reduce = real_all_reduce
    if worker.is_alive():
        res["prepare_hung"], res["gathers"], res["votes"] = True, list(gathers), list(votes)
        return res
    prepared = got[0]
    res["gathers"], res["votes"] = list(gathers), list(votes)
    res["agreed"] = None if prepared is None else prepared.agreed.tolist()
    res["x"] = [int(r.output_topk_index[0]) for r in batch.reqs]
    res["counts"] = dict(source.counts)
    res["guard"] = dict(inst.guard.counts)

    if case == "tp2":
        res["scenarios"] = _tp2_scenarios(rank, source, sched, draft, capture)
    if case == "attn_tp2_lm_head":
        # The scheduler-start capture of this head under the overlap scheduler.
        sched.enable_overlap = True
        try:
            capture(source, sched, vocab_size=V, num_steps=1, rs=True)
            res["capture_under_overlap"] = "accepted"
            res["overlap_loop"] = _overlap_loop(rank, source, ps.get_attn_tp_group())
        except ConfigError as exc:
            res["capture_under_overlap"] = f"refused: {exc}"
        finally:
            sched.enable_overlap = False

    # ---- negative control: the same head, its gather called OUTSIDE the draft TP context,
    # on DP rank 0 alone (rank 1 has no batch): it resolves the full TP group and blocks.
    if forced is not None and rank == 0:
        gathers.clear()
        bare = SGLangDraftHead(model, V, scope=contextlib.nullcontext)
        bare.lp = forced
        hidden = torch.stack([r.hidden_states_tensor for r in batch.reqs])
        done = threading.Event()

        def call() -> None:
            with contextlib.suppress(Exception):
                bare.logits(hidden)
            done.set()

        threading.Thread(target=call, daemon=True).start()
        t0 = time.perf_counter()
        res["outside_returned"] = done.wait(HANG_WAIT_S)
        res["outside_waited_s"] = time.perf_counter() - t0
        res["outside_gathers"] = list(gathers)
    return res


def _batch(torch: Any, b: int, *, seed: int) -> Any:
    """The fields of a prebuilt decode batch that RecomputeSource.prepare reads."""
    g = torch.Generator().manual_seed(seed)
    reqs = [
        SimpleNamespace(
            output_topk_p=torch.tensor([0.5]),
            output_topk_index=torch.tensor([5]),  # the prefill's X
            hidden_states_tensor=torch.randn(H, generator=g),
            bootstrap_room=7000 + i,
            rid=f"r{i}",
        )
        for i in range(b)
    ]
    return SimpleNamespace(
        reqs=reqs,
        seq_lens=torch.full((b,), 9, dtype=torch.int64),
        model_config=SimpleNamespace(vocab_size=V),
        sampling_info=SimpleNamespace(temperatures=torch.ones((b, 1)), sampling_seed=None, top_ks=torch.full((b,), 50)),
    )


# ----------------------------------------------------------------------------- TP 2: one rank differs

#: How long a rank waits for one scenario's prepare before reporting it blocked.
SCENARIO_WAIT_S = 30.0


def _tp2_scenarios(rank: int, source: Any, sched: Any, draft: Callable[..., Any], capture: Callable[..., Any]) -> dict:
    """Under plain TP 2 (SGLang's real vocab-parallel LogitsProcessor, its gatherer over gloo),
    batches where one rank differs from the other: its head fails (a bf16 head, and a bf16
    head whose output is fp32: ``enable_lm_head_fp32``, the switch of ``--enable-fp32-lm-head``),
    its hidden state is missing, it draws another X', its row is invalid and its prefill X
    differs, the staging of its write fails, its head fails in one chunk of rows of three,
    and (last: on a build where that rank skips the gather, the ranks are left in different
    collectives) the copy of its batch to the head's device fails, reading its rows in the
    builder's split fails, and the copy fails with the blank inputs that stand in for it.
    Each runs both ranks' ``prepare`` in lockstep, bounded (a rank left alone in a
    collective is reported ``hung``, and no later scenario runs).
    Per scenario: the X each request hands SGLang, the agreed rows, the count deltas, and every
    gather's (dtype, shape)."""
    import torch

    out: dict[str, Any] = {}

    def bind(model: Any, *, head_fails_on: int | None = None) -> None:
        source.tp_rank = rank
        sched.draft_worker.draft_worker.draft_runner.model = model
        capture(source, sched, vocab_size=V, num_steps=1, rs=True)
        if head_fails_on == rank:
            # This rank's part of the head, before its gather, fails (what the tier's switch,
            # tests/server/site/recompute_fault.py, does with head:<rank>).
            def local(hidden: Any) -> Any:
                raise RuntimeError(f"injected: the head fails on rank {rank}")

            source.head._local = local

    def run(name: str, batch: Any, call: Callable[[Any], Any] | None = None) -> bool:
        lp = source.head.lp
        inner = lp._logits_gatherer
        seen: list[list[Any]] = []

        def gather(x: Any) -> Any:
            seen.append([str(x.dtype), list(x.shape)])
            return inner(x)

        lp._logits_gatherer = gather
        before, guard_before = dict(source.counts), dict(source.inst.guard.counts)
        got: list[Any] = []

        def work() -> None:
            try:
                got.append(("ok", (call or source.prepare)(batch)))
            except BaseException as exc:  # reported, never raised into the thread
                got.append(("raised", repr(exc)))

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        worker.join(SCENARIO_WAIT_S)
        lp._logits_gatherer = inner
        if worker.is_alive():
            out[name] = {"hung": True, "gathers": seen}
            return False
        status, value = got[0]
        after, guard_after = dict(source.counts), dict(source.inst.guard.counts)
        out[name] = {
            "hung": False,
            "status": status if status == "ok" else value,
            "agreed": None if status != "ok" or value is None else value.agreed.tolist(),
            "x": [int(r.output_topk_index[0]) for r in batch.reqs],
            "counts": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)},
            "guard": {
                k: guard_after[k] - guard_before.get(k, 0)
                for k in guard_after
                if guard_after[k] != guard_before.get(k, 0)
            },
            "gathers": seen,
            "out_dtype": str(source.head.out_dtype),
            "weight_dtype": str(source.head.dtype),
        }
        return status == "ok"

    # The head fails on rank 1: fp32 output of a bf16 head, then bf16.
    bind(draft(torch.bfloat16, enable_lm_head_fp32=True), head_fails_on=1)
    if not run("fp32_output_head_fault", _batch(torch, 2, seed=21)):
        return out
    bind(draft(torch.bfloat16), head_fails_on=1)
    if not run("bf16_head_fault", _batch(torch, 2, seed=22)):
        return out
    bind(draft(torch.float32))
    # Rank 1 has no hidden state for request 0: it still enters the head's gather.
    b = _batch(torch, 2, seed=23)
    if rank == 1:
        b.reqs[0].hidden_states_tensor = None
    if not run("no_hidden_on_one_rank", b):
        return out
    # Rank 1's sampler draws another X' for request 0.
    draw = source.synth.draw
    if rank == 1:

        def other(probs: Any, seeds: Any, positions: Any) -> Any:
            _, x = draw(probs, seeds, positions)
            x = x.clone()
            x[0, 0] = (x[0, 0] + 1) % V
            return probs.gather(1, x), x

        source.synth.draw = other
    ok = run("x_prime_differs", _batch(torch, 2, seed=24))
    source.synth.draw = draw
    if not ok:
        return out
    # Request 0: rank 1's row is invalid (NaN temperature) and its prefill X is 3 (rank 0's: 5).
    b = _batch(torch, 2, seed=25)
    if rank == 1:
        b.reqs[0].output_topk_index = torch.tensor([3])
        b.sampling_info.temperatures[0] = float("nan")
    if not run("invalid_row_and_prefill_x_differ", b):
        return out
    # The staging of what is written after the vote fails on rank 1.
    if rank == 1:

        def fails(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected: staging the write fails on this rank")

        source._stage = fails
    ok = run("write_staging_fails_on_one_rank", _batch(torch, 2, seed=26))
    source.__dict__.pop("_stage", None)
    if not ok:
        return out
    # Chunks of one row (the core's CHUNK_ROWS, on both ranks): rank 1's head fails on the
    # second of three chunks, and still enters the third chunk's gather.
    from pd_middleware.decode import recompute as core

    rows, core.CHUNK_ROWS = core.CHUNK_ROWS, 1
    bind(draft(torch.bfloat16))
    if rank == 1:
        local, calls = source.head._local, []

        def second_fails(hidden: Any) -> Any:
            calls.append(hidden.shape[0])
            if len(calls) == 2:
                raise RuntimeError("injected: the head fails on chunk 1 of rank 1")
            return local(hidden)

        source.head._local = second_fails
    ok = run("head_fails_in_one_chunk", _batch(torch, 3, seed=30))
    core.CHUNK_ROWS = rows
    if not ok:
        return out
    # A vocab-parallel head under the overlap scheduler, through the scheduler-start capture,
    # then three turns of the overlapped event loop (the order of collectives per rank), and
    # the same loop with the head left on the scheduler's stream (the negative control).
    sched.enable_overlap = True
    try:
        bind(draft(torch.float32))
        out["capture_under_overlap"] = "accepted"
        out["overlap_loop"] = _overlap_loop(rank, source, ps_tp_group())
        from pd_middleware.integrations.sglang.ordering import UNORDERED

        ordered, source.head.order = source.head.order, UNORDERED
        out["overlap_loop_unordered"] = _overlap_loop(rank, source, ps_tp_group())
        source.head.order = ordered
    except Exception as exc:
        out["capture_under_overlap"] = f"refused: {exc}"
    finally:
        sched.enable_overlap = False
    # Rank 1's copy of the batch's positions to the head's device fails (a rank-local error
    # between the start of its vote and the head's gather). Last: where that rank skips the
    # gather, the two ranks sit in different collectives and nothing after could run.
    bind(draft(torch.float32))
    b = _batch(torch, 2, seed=27)
    if rank == 1:
        b.seq_lens = _FailingCopy(b.seq_lens)
    if not run("device_copy_fails_on_one_rank", b):
        return out
    # Through the drop-in's builder (sources.wrap_build, SGLang's body a stand-in): request 0
    # came back from a retraction, so the source gets rows [1] of the batch, and on rank 1
    # reading the batch's positions raises (a rank-local error in the split). Last: where
    # that rank skips prepare, rank 0 is left alone in the head's gather.
    from pd_middleware.integrations.sglang.sources import BUILT_ATTR, wrap_build

    bind(draft(torch.float32))
    b = _batch(torch, 2, seed=28)
    setattr(b.reqs[0], BUILT_ATTR, b.reqs[0].output_topk_index)
    if rank == 1:
        b = _SplitFails(reqs=b.reqs, model_config=b.model_config, sampling_info=b.sampling_info)
    built = wrap_build(lambda batch, last, future: None, source.inst)
    out["builder_source_is_recompute"] = source.inst.source is source
    if not run("split_fails_on_one_rank", b, call=lambda batch: built(batch, None, None)):
        return out
    # Rank 1's copy of the batch to the head's device fails, and so does building the blank
    # inputs that stand in for it (an OOM on that rank). Last: where that rank skips the
    # gather, the two ranks sit in different collectives and nothing after could run.
    bind(draft(torch.float32))
    b = _batch(torch, 2, seed=29)
    if rank == 1:
        b.seq_lens = _FailingCopy(b.seq_lens)

        def no_memory(rows: int) -> Any:
            raise torch.OutOfMemoryError(f"injected: no memory for {rows} blank rows on this rank")

        source._blank = no_memory
    run("blank_fails_on_one_rank", b)
    source.__dict__.pop("_blank", None)
    return out


def ps_tp_group() -> Any:
    from sglang.srt.distributed import parallel_state as ps

    return ps.get_tp_group()


#: Turns of the overlapped event loop :func:`_overlap_loop` runs.
LOOP_TURNS = 3


def _overlap_loop(rank: int, source: Any, group: Any) -> list[list[str]]:
    """Three turns of SGLang's overlapped decode event loop as one rank runs it: launch
    forward k on the scheduler's forward stream (its collective: an all-reduce over the
    group the head gathers in, the communicator they share), then build the next prebuilt
    batch on the schedule stream (the drop-in's ``prepare``: the head's gather, the vote).
    Every collective is recorded in issue order with the stream current at the call:
    ``[what, stream]``, ``what`` one of ``forward``, ``head_gather``, ``vote``."""
    import torch

    # The scheduler's forward stream (the head's order's, or a new one where the head has none).
    fwd = source.head.order.stream if source.head.order.active else torch.cpu.Stream()
    seen: list[list[str]] = []

    def where() -> str:
        return "forward" if torch.cpu.current_stream() is fwd else "schedule"

    lp = source.head.lp
    name = "_gather_attn_tp_logits" if lp.use_attn_tp_group else "_logits_gatherer"
    inner = getattr(lp, name)

    def gather(x: Any) -> Any:
        seen.append(["head_gather", where()])
        return inner(x)

    real_all_reduce = torch.distributed.all_reduce

    def all_reduce(tensor: Any, *a: Any, **k: Any) -> Any:
        seen.append(["vote", where()])
        return real_all_reduce(tensor, *a, **k)

    setattr(lp, name, gather)
    torch.distributed.all_reduce = all_reduce
    try:
        for k in range(LOOP_TURNS):
            with torch.cpu.stream(fwd):  # run_batch: the forward's collectives on the forward stream
                seen.append(["forward", where()])
                real_all_reduce(torch.ones(4), group=group.device_group)
            source.prepare(_batch(torch, 2, seed=40 + k))  # the builder, on the schedule stream
    finally:
        setattr(lp, name, inner)
        torch.distributed.all_reduce = real_all_reduce
    return seen


class _SplitFails(SimpleNamespace):
    """A prebuilt batch whose positions raise when read on this rank (a rank-local error)."""

    @property
    def seq_lens(self) -> Any:
        raise RuntimeError("injected: reading the batch's positions fails on this rank")


class _FailingCopy:
    """A batch field whose copy to a device fails on this rank (``.to`` raises), as a rank-local
    device error would; everything else reads through to the tensor."""

    def __init__(self, tensor: Any) -> None:
        self._tensor = tensor

    def to(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: copying the batch to the head's device fails on this rank")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tensor, name)
