"""Decode-side recompute: its cost against SGLang's own step-0 work, and its acceptance.

``ratio_vs_draft_head``: for a prebuilt batch of B requests, the decode's recompute
(:meth:`~pd_middleware.integrations.sglang.recompute.RecomputeSource.prepare`: the
head from SGLang's real ``LlamaForCausalLMEagle3`` with its norm, ``lm_head``, slice and
fp32 cast, the synthesizer's softmax, the seeded draw, q'(X') read back, X' written
into the requests) against what SGLang's prefill runs for the same batch in
``_draft_extend_for_prefill`` after its draft forward: ``LogitsProcessor`` on the
model's output, ``renorm_draft_probs`` and ``fast_sample``. Same process, same device,
side by side, medians; ratio = recompute / SGLang. Needs SGLang (``make setup-sglang``).

At V = 152064 the goal is <= 1.2 at B = 1, 16 and 256 with H = 4096. On CPU the
defaults are smaller (H = 256, B = 1, 16, 64: an lm_head of 152064 x 4096 at B = 256 is
160 GFLOP a call, minutes per median on two shared cores); ``--hidden``/``--batches``
set them, and the JSON says which were used.

On CPU, SGLang's unseeded ``fast_sample`` ends in a Triton kernel (``row_argmax``) that
runs only under Triton's interpreter, so the CPU run sets SGLang's own switch
``SGLANG_OPT_USE_GUMBEL_SAMPLE=0`` (its ``torch.multinomial`` path). Two draws differ: SGLang's own prefill draws *unseeded* (without
``--enable-deterministic-inference``) with fp32 exponentials; the recompute always
draws *seeded* (every TP rank must draw the same X'): SGLang's seeded ``fast_sample``
(float64 murmur hash) where its kernel exists, else the core's seeded inverse-CDF draw
(one uniform a request; on a CPU without sgl-kernel's CPU build).

``acceptance``: the paired exact first-verify acceptance over the same requests, for
one_hot (X ~ q, q' = delta: sum q.p), full_fp32 (sum min(p, q)) and recompute (sum
min(p, q') with q' from the workload's draft head and X' ~ q', through
:meth:`RecomputeSynthesizer.recompute <pd_middleware.decode.recompute.RecomputeSynthesizer.recompute>`),
on the ``synthetic`` and ``ngram`` workloads. Goal: recompute / full >= 0.999.

``peak_memory``: the extra peak memory of the drop-in's recompute for one prebuilt batch
(``RecomputeSource.prepare`` and ``propose``, the builder's (B, 1, V) proposal kept)
against SGLang's ``pd_first_draft_proposal`` at the same X (the (B, 1, V) fp32 one-hot rows
its builder allocates without the drop-in), at B = 64 and 256 (``--memory-batches``). On
the CPU from the allocator's own records under ``torch.profiler(profile_memory=True)``
(``tests/_alloc_peak.py``), on CUDA from ``torch.cuda.max_memory_allocated``; the JSON says which.

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "tests")]

from _common import emit

VOCAB = 152064


def _median(fn: Any, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _sglang_model(hidden: int, device: str, dtype: Any) -> Any:
    import torch
    import torch.distributed as dist
    from _sglang_import import import_sglang

    rc = import_sglang("sglang.srt.runtime_context")
    from sglang.srt.server_args import ServerArgs

    rc.reset_context()
    rc.publish(
        ServerArgs(model_path="dummy", device="cpu", tp_size=1), role="scheduler", ranks=rc.SpawnRanks(world_rank=0)
    )
    ps = import_sglang("sglang.srt.distributed.parallel_state")
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ps.init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    if device == "cpu":
        # The rotary constructor picks a vLLM kernel off SGLang's CPU engine; never called here.
        import_sglang("sglang.srt.layers.rotary_embedding.base")._is_cpu = True
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
    )
    cfg.draft_vocab_size = VOCAB
    m = import_sglang("sglang.srt.models.llama_eagle3").LlamaForCausalLMEagle3(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return m.to(device=device, dtype=dtype)


def _source(hidden: int, device: str) -> tuple[Any, Any]:
    """A RecomputeSource bound to SGLang's real EAGLE3 head (bf16) at V = 152064, and the model."""
    import torch

    from pd_middleware.config import parse_config
    from pd_middleware.integrations.sglang.draft_head import SGLangDraftHead
    from pd_middleware.integrations.sglang.recompute import RecomputeSource

    m = _sglang_model(hidden, device, torch.bfloat16)
    rc = RecomputeSource(parse_config({"synthesizer": {"name": "recompute"}, "sglang": {"channel": "none"}}))
    rc.bind_head(SGLangDraftHead(m, VOCAB), vocab_size=VOCAB, num_steps=1, rejection_sampling=True)
    return rc, m


def _prebuilt(b: int, h: Any, device: str) -> Any:
    """A prebuilt batch of ``b`` requests (hidden states ``h`` (b, H)) with the fields the recompute reads."""
    import torch

    si = SimpleNamespace(
        temperatures=torch.ones(b, 1, device=device),
        sampling_seed=None,
        top_ks=torch.full((b,), 50, device=device),
    )
    reqs = [
        SimpleNamespace(
            hidden_states_tensor=h[i],
            output_topk_index=torch.tensor([0]),
            output_topk_p=torch.tensor([1.0]),
            bootstrap_room=i,
        )
        for i in range(b)
    ]
    return SimpleNamespace(
        reqs=reqs,
        sampling_info=si,
        seq_lens=torch.full((b,), 100, device=device),
        model_config=SimpleNamespace(vocab_size=VOCAB),
    )


def cost(rc: Any, m: Any, batches: list[int], hidden: int, repeats: int, device: str) -> dict[str, Any]:
    """Recompute vs SGLang's step-0 work, per batch size (``rc``, ``m``: :func:`_source`'s)."""
    import torch

    lp_mod = sys.modules["sglang.srt.layers.logits_processor"]
    fb = sys.modules["sglang.srt.model_executor.forward_batch_info"]
    from sglang.srt.speculative.spec_utils import fast_sample, renorm_draft_probs

    meta = lp_mod.LogitsMetadata(forward_mode=fb.ForwardMode.DECODE)
    out: dict[str, Any] = {}
    for b in batches:
        g = torch.Generator().manual_seed(b)
        h = (torch.randn(b, hidden, generator=g)).to(device=device, dtype=torch.bfloat16)
        normed = m.model.norm(h)  # what the prefill's draft forward hands its LogitsProcessor
        batch = _prebuilt(b, h, device)

        def sglang_step0(normed: Any = normed, batch: Any = batch) -> None:
            with torch.no_grad():
                logits = m.logits_processor(None, normed, m.lm_head, meta).next_token_logits
                probs = renorm_draft_probs(logits, batch.sampling_info, True)
                fast_sample(probs, 1, sampling_seed=None, positions=batch.seq_lens)
            if device != "cpu":
                torch.cuda.synchronize()

        def recompute(batch: Any = batch) -> None:
            rc.prepare(batch)
            if device != "cpu":
                torch.cuda.synchronize()

        t_sgl = _median(sglang_step0, repeats)
        t_rec = _median(recompute, repeats)
        t_sgl2 = _median(sglang_step0, repeats)  # again, after: drift on a shared machine shows
        base = statistics.median([t_sgl, t_sgl2])
        out[f"B{b}"] = {
            "recompute_ms": round(t_rec * 1e3, 3),
            "sglang_step0_ms": round(base * 1e3, 3),
            "ratio": round(t_rec / base, 3),
        }
    out["sampler"] = rc.sampler
    return out


def _peak(fn: Any, device: str) -> int:
    """Peak bytes ``fn()`` holds at once above what was allocated before it (its result included)."""
    import torch

    if device == "cpu":
        from _alloc_peak import allocation_peak

        return allocation_peak(fn)[0]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return int(torch.cuda.max_memory_allocated() - base)


def memory(rc: Any, batches: list[int], hidden: int, device: str) -> dict[str, Any]:
    """The recompute's extra peak memory against SGLang's one-hot row set, per B (``rc``: :func:`_source`'s).

    Ours: ``RecomputeSource.prepare`` and ``propose`` for a prebuilt batch, what the drop-in
    runs in SGLang's builder (the head, q', the draw, the builder's (B, 1, V) proposal, kept).
    SGLang's: its builder's ``pd_first_draft_proposal`` at the same X (SGLang 0.5.22 on), the
    (B, 1, V) fp32 one-hot rows it allocates without the drop-in.
    """
    import torch
    from _sglang_import import import_sglang

    from pd_middleware.integrations.sglang.common import one_hot_at

    builder = import_sglang("sglang.srt.speculative.eagle_disaggregation")
    first = getattr(builder, "pd_first_draft_proposal", one_hot_at)
    out: dict[str, Any] = {}
    mb = 1e6
    for b in batches:
        g = torch.Generator().manual_seed(b)
        batch = _prebuilt(b, torch.randn(b, hidden, generator=g).to(device=device, dtype=torch.bfloat16), device)

        def ours(batch: Any = batch) -> Any:
            state = rc.prepare(batch)
            topk = torch.stack([r.output_topk_index for r in batch.reqs]).to(device)  # what the builder reads
            return rc.propose(batch, state, topk, VOCAB)

        topk = torch.zeros((b, 1), dtype=torch.int64, device=device)
        ours()  # warm-up: one-off allocations (the seeded draw's probe, caches) are not the batch's
        rec, sgl = _peak(ours, device), _peak(lambda topk=topk: first(topk, VOCAB), device)
        out[f"B{b}"] = {
            "recompute_peak_mb": round(rec / mb, 1),
            "sglang_one_hot_mb": round(sgl / mb, 1),
            "ratio": round(rec / sgl, 3),
            "q_prime_mb": round(b * VOCAB * 4 / mb, 1),
        }
    out["method"] = (
        "torch.profiler(profile_memory=True): the CPU allocator's own allocation and free records, replayed"
        if device == "cpu"
        else "torch.cuda.max_memory_allocated above memory_allocated before the call"
    )
    out["sglang_side"] = getattr(first, "__module__", "") + "." + getattr(first, "__name__", "")
    return out


def acceptance(n_synthetic: int, n_ngram: int) -> dict[str, Any]:
    """Paired exact first-verify acceptance: one_hot, full_fp32, recompute."""
    import torch

    from pd_middleware.core.contracts import PluginContext
    from pd_middleware.decode.recompute import RecomputeSynthesizer, seed_from_room
    from pd_middleware.evaluation.verify import sum_min
    from pd_middleware.workloads import make_workload, workload_draft_head
    from pd_middleware.workloads.heads import write_state

    hidden = 64
    out: dict[str, Any] = {}
    for name, n in (("synthetic", n_synthetic), ("ngram", n_ngram)):
        wl = make_workload(name)
        seed = 0
        head = workload_draft_head(wl, seed, hidden)
        ctx = PluginContext(
            vocab_size=wl.vocab_size, num_steps=1, rejection_sampling=True, capabilities={"draft_head": head}
        )
        synth = RecomputeSynthesizer(None, ctx)
        one = full = rec = 0.0
        count = 0
        for k, batch in enumerate(wl.batches(n, 32, seed)):
            b = batch.batch_size
            p, q = batch.target_probs[:, 0].double(), batch.draft_probs[:, 0].double()
            h = write_state(torch.zeros(b, hidden, dtype=torch.bfloat16), batch.draft_state)
            r = synth.recompute(
                h,
                temperatures=torch.ones(b),
                seeds=seed_from_room(range(k * 32, k * 32 + b)),
                positions=torch.zeros(b, dtype=torch.int64),
            )
            assert bool(r.valid.all())
            one += float((p * q).sum())
            full += float(sum_min(p, q).sum())
            rec += float(sum_min(p, r.probs.double()).sum())
            count += b
        out[name] = {
            "requests": count,
            "one_hot": round(one / count, 6),
            "full_fp32": round(full / count, 6),
            "recompute": round(rec / count, 6),
            "recompute_over_full": round(rec / full, 6),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=None, help="H (default 4096 on CUDA, 256 on CPU)")
    ap.add_argument("--batches", default=None, help="comma-separated B (default 1,16,256 on CUDA, 1,16,64 on CPU)")
    ap.add_argument("--memory-batches", default="64,256", help="comma-separated B for the peak memory")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=256, help="synthetic requests for acceptance (ngram: 4x)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run for tests)")
    args = ap.parse_args(argv)
    import importlib.util

    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        # SGLang's unseeded fast_sample ends in a Triton row_argmax, which runs on CPU only
        # under TRITON_INTERPRET=1; its own switch selects its torch.multinomial path instead.
        os.environ["SGLANG_OPT_USE_GUMBEL_SAMPLE"] = "0"
    hidden = args.hidden or (4096 if device == "cuda" else 256)
    batches = [int(x) for x in (args.batches or ("1,16,256" if device == "cuda" else "1,16,64")).split(",")]
    repeats, n_req = args.repeats, args.requests
    mem_batches = [int(x) for x in args.memory_batches.split(",")]
    if args.quick:
        hidden, batches, mem_batches, repeats, n_req = 64, [1, 16], [1, 16], 2, 32
    result: dict[str, Any] = {"benchmark": "recompute", "device": device, "vocab": VOCAB, "hidden": hidden}
    if importlib.util.find_spec("sglang") is None:
        result["ratio_vs_draft_head"] = {"skipped": "SGLang is not installed"}
        result["peak_memory"] = {"skipped": "SGLang is not installed"}
    else:
        rc, m = _source(hidden, device)
        result["ratio_vs_draft_head"] = cost(rc, m, batches, hidden, repeats, device)
        result["peak_memory"] = memory(rc, mem_batches, hidden, device)
    result["goal_ratio"] = 1.2
    ratios = result["ratio_vs_draft_head"]
    if "skipped" not in ratios:  # flat figures for run_all.py's table
        result["ratio_B1"] = ratios[f"B{batches[0]}"]["ratio"]
        result["ratio_B16"] = ratios.get("B16", {}).get("ratio")
        result["largest_B"] = batches[-1]
        result["ratio_largest_B"] = ratios[f"B{batches[-1]}"]["ratio"]
        peaks = result["peak_memory"]
        for b in mem_batches:
            result[f"peak_mb_B{b}"] = peaks[f"B{b}"]["recompute_peak_mb"]
            result[f"peak_over_one_hot_B{b}"] = peaks[f"B{b}"]["ratio"]
        result["largest_memory_B"] = mem_batches[-1]
        result["peak_over_one_hot_largest_B"] = peaks[f"B{mem_batches[-1]}"]["ratio"]
    result["acceptance"] = acceptance(n_req, 4 * n_req)
    for wl_name, acc in result["acceptance"].items():
        result[f"recompute_over_full_{wl_name}"] = acc["recompute_over_full"]
    result["goal_recompute_over_full"] = 0.999
    result["quick"] = bool(args.quick)
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
