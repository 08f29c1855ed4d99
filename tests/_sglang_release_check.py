"""One SGLang release against the drop-in's table, in a process of its own (``tests/test_sglang_releases.py``).

Run as ``python tests/_sglang_release_check.py`` with that release's folder first on
``PYTHONPATH`` (a release cannot share a process with the venv's SGLang: one ``sglang``
package per process). Prints one JSON object:

- ``version``/``file``: what ``importlib.metadata`` and ``import sglang`` found (the test
  checks both are the release's);
- ``rows``: every row of every feature the release does not refuse, resolved against the
  real modules with :func:`~pd_middleware.integrations.sglang.patching.resolve` (present,
  unpatched, the row's parameters): ``{"feature path span": "ok" | error}``;
- ``relay``: the real builder with the drop-in installed (decode-only recompute, and a
  shipped sparse proposal on the side channel's store), through the real ``FutureMap``
  stash and resolve under the overlap scheduler: the draft input's proposal and the
  relay's, single-layer (b, V) and multi-layer (b, S, V);
- ``recompute_head`` / ``nextn_head``: the decode-only default with SGLang's real EAGLE3
  draft head, and with its real DeepSeek-V3 NextN draft (``tests/test_sglang_recompute_deepseek.py``'s
  model and forward, run on this release): q' against the model's own distribution;
- ``stock``: the same builder without the drop-in (the negative control): its proposal,
  and what SGLang's first draft step does with it (``torch.stack([draft_probs])``).

Stand-ins, where the real thing needs a running scheduler: the batch (a namespace with
the fields the builder reads, ``tests/_sglang_builder.py``); the speculative settings are
SGLang's own runtime context, overridden as a scheduler would publish them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import inspect
import json
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from _sglang_builder import namespace_batch  # noqa: E402
from _sglang_import import import_sglang  # noqa: E402

V = 13
ROOMS = [501, 502]


def rows(version: str) -> dict[str, str]:
    from pd_middleware.integrations import sglang as S
    from pd_middleware.integrations.sglang.patching import FEATURES, parse_version, resolve

    out = {}
    for f in FEATURES.values():
        for t in f.targets_for(parse_version(version)):
            key = f"{f.name} {t.path} {t.span}"
            try:
                resolve(t, importlib.import_module(t.module))
                out[key] = "ok"
            except S.PluginError as exc:
                out[key] = exc.detail
    return out


def _req(tokens: list[int], room: int) -> Any:
    return SimpleNamespace(
        output_topk_index=list(tokens),
        output_topk_p=[0.5] * len(tokens),
        hidden_states_tensor=torch.zeros(4),
        output_dsa_topk_indices=None,
        bootstrap_room=room,
        rid=f"r{room}",
        origin_input_ids=[1, 2, 3],  # the draw's position (prefill.draw_position)
        output_ids=[],
    )


def _future_map() -> Any:
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return FutureMap(
        torch.device("cpu"),
        SpeculativeAlgorithm.EAGLE,
        SimpleNamespace(req_to_token=torch.zeros((8, 64), dtype=torch.int32)),
    )


def spec(steps: int, multi_layer: bool) -> Any:
    """SGLang's own runtime settings (EAGLE, top-k 1, rejection sampling), as a scheduler publishes them."""
    from sglang.srt.runtime_context import get_context

    return get_context().override_server_args(
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        speculative_num_steps=steps,
        enable_multi_layer_eagle=multi_layer,
        speculative_use_rejection_sampling=True,
    )


def build_and_relay(builder: Any, steps: int, multi_layer: bool) -> dict[str, Any]:
    """The real builder under the overlap scheduler, then the real relay's resolve."""
    chains = [[(3 + 2 * k + i) % V for k in range(steps)] for i in range(len(ROOMS))]
    batch = namespace_batch(
        [_req(c, r) for c, r in zip(chains, ROOMS, strict=True)],
        V,
        overlap=True,
        req_pool_indices=torch.arange(1, len(ROOMS) + 1),
        seq_lens=torch.full((len(ROOMS),), 10),
    )
    fm = _future_map()
    with spec(steps, multi_layer):
        got = builder.build_eagle_disagg_draft_input(batch, torch.zeros(len(ROOMS), dtype=torch.int64), fm)
    built = got.draft_probs
    out: dict[str, Any] = {"chains": chains, "built": None if built is None else built.tolist()}
    if built is None:
        return out
    # The next iteration's resolve (the relay trap up to 0.5.21 replaces a non-None proposal
    # by the relay's rows): what the draft step reads.
    nxt = SimpleNamespace(**{k: getattr(got, k) for k in ("future_indices", "future_dsa_topk_indices_available")})
    nxt.draft_probs = torch.zeros_like(built)  # a placeholder the relay must overwrite
    nxt.topk_p = nxt.topk_index = nxt.hidden_states = nxt.bonus_tokens = nxt.dsa_topk_indices = None
    # Stand-ins for the two CUDA-only calls of the resolve: Tensor.record_stream (a stream
    # hint; CPU has no streams) as a no-op, and the Triton row gather as torch indexing.
    import sglang.srt.managers.overlap_utils as ou

    def gather_rows(indices: Any, topk_p: Any, topk_index: Any, tokens: Any, hidden: Any) -> Any:
        return topk_p[indices], topk_index[indices], tokens[indices], None if hidden is None else hidden[indices]

    record = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign,assignment]
    try:
        with spec(steps, multi_layer), patch.object(ou, "gather_spec_extras", gather_rows):
            fm._resolve_spec_extras(SimpleNamespace(spec_info=nxt))
    finally:
        torch.Tensor.record_stream = record  # type: ignore[method-assign]
    out["relayed"] = nxt.draft_probs.tolist()
    return out


def relay_checks() -> dict[str, Any]:
    from pd_middleware import Payload, Provenance, SparseProposal
    from pd_middleware.config import load_config, parse_config
    from pd_middleware.decode.pipeline import Delivery
    from pd_middleware.integrations import sglang as S
    from pd_middleware.integrations.sglang.store import ProposalStore

    builder = import_sglang(S.BUILDER_MODULE)
    out: dict[str, Any] = {}
    # Negative control first: SGLang's own builder, no drop-in.
    stock = build_and_relay(builder, 1, False)
    try:
        torch.stack([None if stock["built"] is None else torch.tensor(stock["built"])])  # type: ignore[list-item]
        stock["draft_step"] = "ok"
    except TypeError as exc:
        stock["draft_step"] = f"TypeError: {exc}"
    out["stock"] = stock
    out["stock_multi"] = build_and_relay(builder, 3, True)  # a chain: the verify reads (b, S, V) or None
    # Decode-only recompute (configs/sglang.toml): no scheduler here, so no draft head is
    # bound; the source's proposal is then the one-hot at the builder's X (counted).
    root = HERE.parent
    cfg = load_config(root / "configs" / "sglang.toml")
    S.install(cfg, S.InstallOptions(hook_scheduler=False))
    try:
        out["recompute_single"] = build_and_relay(builder, 1, False)
        out["recompute_multi"] = build_and_relay(builder, 3, True)
    finally:
        S.uninstall()
    # The builder's settings unreadable: another plugin's wrapper around the builder, in a
    # module of its own (its globals hold no get_spec). The draft input still gets the
    # one-hot at X, shaped by the start's facts, counted (up to 0.5.21: the drop-in's
    # EagleDraftInput row; from 0.5.22 SGLang's builder asks pd_first_draft_proposal).
    original = builder.build_eagle_disagg_draft_input
    ns: dict[str, Any] = {"inner": original}
    exec(
        "def build_eagle_disagg_draft_input(batch, last_tokens_tensor, future_map):\n"
        "    return inner(batch, last_tokens_tensor, future_map)\n",
        ns,
    )
    builder.build_eagle_disagg_draft_input = ns["build_eagle_disagg_draft_input"]
    try:
        for steps, key in ((1, "unread_spec_single"), (3, "unread_spec_multi")):
            inst = S.install(cfg, S.InstallOptions(hook_scheduler=False))
            try:
                inst.facts = S.EngineFacts(
                    role="decode", vocab_size=V, num_steps=steps, algorithm="EAGLE", topk=1, rejection_sampling=True
                )
                out[key] = build_and_relay(builder, steps, steps > 1)
                out[key]["guard"] = dict(inst.guard.counts)
            finally:
                S.uninstall()
    finally:
        builder.build_eagle_disagg_draft_input = original
    # A shipped sparse proposal on the side channel's store (the decode's half of a
    # shipped strategy): the proposal must be the store's law, not a one-hot.
    store = ProposalStore()
    shipped = parse_config(
        {
            "model": {"vocab_size": V, "num_steps": 1},
            "transport": {"mooncake": {"enabled": False}},
            "sglang": {"draft_kv": "first_step"},  # "all_steps" is refused before 0.5.23 (checked by the test)
        }
    )
    S.install(shipped, S.InstallOptions(channel="sidechannel", store=store, hook_scheduler=False))
    try:
        for room, x in zip(ROOMS, [3, 4], strict=True):
            p = Payload(str(room), (x,), (0.75,), V, provenance=Provenance(sampled_from="sparse-fp32"))
            law = SparseProposal((2,), torch.tensor([x, (x + 5) % V]), torch.tensor([0.75, 0.25]), (0.0,))
            store.put(Delivery(p, law, "default", 0.0, lambda: None))
        out["shipped_single"] = build_and_relay(builder, 1, False)
    finally:
        S.uninstall()
    return out


def recompute_head_check() -> dict[str, Any]:
    """The decode-only default with SGLang's real EAGLE3 draft head (one layer, V = 13, H = 16,
    random weights) at TP 1: the builder's proposal must be q' = softmax(head(h) / T) from the
    model's own LogitsProcessor, with X' drawn from it by the sampler the release's row picks."""
    from _sglang_import import tiny_llama_config
    from _sglang_tp1 import init_tp1

    from pd_middleware.config import load_config
    from pd_middleware.decode.recompute import inverse_cdf
    from pd_middleware.integrations import sglang as S
    from pd_middleware.integrations.sglang.recompute import capture

    init_tp1()
    eagle3 = import_sglang("sglang.srt.models.llama_eagle3")
    lp = import_sglang("sglang.srt.layers.logits_processor")
    fb = import_sglang("sglang.srt.model_executor.forward_batch_info")
    builder = import_sglang(S.BUILDER_MODULE)
    hidden_size, b = 16, 4
    cfg = tiny_llama_config(V, hidden_size)
    cfg.draft_vocab_size, cfg.norm_output = V, False
    model = eagle3.LlamaForCausalLMEagle3(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.5)
    inst = S.install(load_config(HERE.parent / "configs" / "sglang.toml"), S.InstallOptions(hook_scheduler=False))
    try:
        sched = SimpleNamespace(
            draft_worker=SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=SimpleNamespace(model=model))),
            enable_overlap=False,
        )
        capture(inst.recompute, sched, vocab_size=V, num_steps=1, rs=True)
        hidden = torch.randn((b, hidden_size), generator=g)
        temps, seeds = torch.full((b, 1), 0.8), torch.tensor([7, 8, 9, 10])
        reqs = [
            SimpleNamespace(
                output_topk_p=torch.tensor([0.5]),
                output_topk_index=torch.tensor([5]),
                hidden_states_tensor=hidden[i],
                output_dsa_topk_indices=None,
                bootstrap_room=1000 + i,
                rid=f"r{i}",
                origin_input_ids=[1, 2, 3],
                output_ids=[],
            )
            for i in range(b)
        ]
        seq_lens = torch.arange(b, dtype=torch.int64) + 9
        batch = namespace_batch(
            reqs,
            V,
            req_pool_indices=torch.arange(b),
            seq_lens=seq_lens,
            sampling_info=SimpleNamespace(temperatures=temps, sampling_seed=seeds, top_ks=torch.full((b,), 50)),
        )
        with spec(1, False):
            si = builder.build_eagle_disagg_draft_input(batch, torch.zeros(b, dtype=torch.int64), None)
        meta = lp.LogitsMetadata(forward_mode=fb.ForwardMode.DECODE)
        with torch.no_grad():
            own = model.logits_processor(
                torch.zeros(b, dtype=torch.long), model.model.norm(hidden), model.lm_head, meta
            )
        q = torch.softmax(own.next_token_logits.float() / temps, dim=-1)
        rc = inst.recompute
        out: dict[str, Any] = {"sampler": rc.sampler, "counts": dict(rc.counts)}
        out["q_max_abs_diff"] = float((si.draft_probs - q).abs().max())
        out["shape"] = list(si.draft_probs.shape)
        if rc.sampler == "pd_middleware.inverse_cdf":
            p_x, x = inverse_cdf(si.draft_probs, seeds, seq_lens)
            out["x_is_the_draw"] = bool(torch.equal(si.topk_index, x) and torch.equal(si.topk_p, p_x))
        out["x_redrawn"] = bool((si.topk_index[:, 0] != 5).any())
        return out
    finally:
        S.uninstall()


def nextn_head_check() -> dict[str, Any]:
    """The decode-only default with SGLang's real DeepSeek-V3 NextN draft (MLA, MoE with
    ``noaux_tc`` routing; tiny, random, fp32, TP 1), as ``tests/test_sglang_recompute_deepseek.py``
    builds and runs it (its helpers and stand-ins, said there: the prefill attention's contract,
    eager MoE routing): the hidden state the draft's forward ships (after ``shared_head.norm``)
    goes through the drop-in's head and the real builder; q' must be SGLang's own draft
    distribution (``renorm_draft_probs`` of the draft's logits). Negative controls: the pre-norm
    residual sum, and the table's other convention (norm at the decode), each give another law."""
    import test_sglang_recompute_deepseek as D
    from _sglang_tp1 import init_tp1

    from pd_middleware.config import load_config
    from pd_middleware.integrations import sglang as S
    from pd_middleware.integrations.sglang import draft_head
    from pd_middleware.integrations.sglang.recompute import capture

    ps = import_sglang("sglang.srt.distributed.parallel_state")
    if not ps.model_parallel_is_initialized():  # recompute_head_check built TP 1 already when it ran first
        init_tp1()
    dpa = import_sglang("sglang.srt.layers.dp_attention")
    if "model_config" in inspect.signature(dpa.initialize_dp_attention).parameters and dpa._ATTN_DP_SIZE is None:
        # Up to 0.5.20 the DeepSeek layers read the attention-DP size from module state that
        # SGLang's bootstrap sets right after the model-parallel groups (init_tp1 builds the
        # groups only): its own initializer, with the model config fields it reads.
        from sglang.srt.server_args import ServerArgs

        cfg = D.nextn_config()
        dpa.initialize_dp_attention(
            ServerArgs(model_path="dummy", device="cpu", tp_size=1),
            SimpleNamespace(hf_config=cfg, hidden_size=cfg.hidden_size, dtype=torch.float32),
        )
    sgl = SimpleNamespace(
        nextn=import_sglang("sglang.srt.models.deepseek_nextn"),
        fb=import_sglang("sglang.srt.model_executor.forward_batch_info"),
        fc=import_sglang("sglang.srt.model_executor.forward_context"),
        pool=import_sglang("sglang.srt.mem_cache.memory_pool"),
        info=import_sglang("sglang.srt.speculative.eagle_info"),
        spec_utils=import_sglang("sglang.srt.speculative.spec_utils"),
    )
    builder = import_sglang(S.BUILDER_MODULE)
    model = D.nextn_model(sgl)
    run = D.draft_extend_for_prefill(sgl, model)
    q = D.aggregated_q(sgl, run.logits)
    b = len(D.LENS)
    out: dict[str, Any] = {"arch": type(model).__name__}
    out["shipped_is_normed"] = not torch.allclose(run.shipped, run.pre_norm)

    def served(hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        inst = S.install(load_config(D.CONFIG), S.InstallOptions(hook_scheduler=False))
        try:
            sched = SimpleNamespace(
                draft_worker=SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=SimpleNamespace(model=model))),
                enable_overlap=False,
            )
            capture(inst.recompute, sched, vocab_size=D.V, num_steps=1, rs=True)
            with spec(1, False):
                si = builder.build_eagle_disagg_draft_input(
                    D.decode_batch(hidden), torch.zeros(b, dtype=torch.int64), None
                )
            rc = inst.recompute
            seen: dict[str, Any] = {"counts": dict(rc.counts), "head": None if rc.head is None else rc.head.arch}
            if rc.head is not None:  # the head as bound, with the installation's symbols for this release
                seen["head_logits_equal"] = bool(torch.equal(rc.head.logits(run.shipped), run.logits))
            return si.draft_probs, seen
        finally:
            S.uninstall()

    probs, seen = served(run.shipped)
    out.update(seen)
    out["dtype"], out["shape"] = str(probs.dtype), list(probs.shape)
    out["q_max_abs_diff"] = float((probs - q).abs().max())
    out["q_equal"] = bool(torch.equal(probs, q))
    wrong, seen = served(run.pre_norm)
    out["pre_norm_tv_min"] = float(D.total_variation(wrong, q).min())
    out["pre_norm_recomputed"] = seen["counts"].get("recomputed", 0)  # served silently: only the law differs
    rule = draft_head.ARCHITECTURES[D.ARCH]
    draft_head.ARCHITECTURES[D.ARCH] = draft_head.HeadRule("model.shared_head.norm", None, "pre-norm (wrong)")
    try:
        wrong, _ = served(run.shipped)
    finally:
        draft_head.ARCHITECTURES[D.ARCH] = rule
    out["eagle3_convention_tv_min"] = float(D.total_variation(wrong, q).min())
    return out


def chain_check() -> dict[str, Any]:
    """The chain feature's REPLACE of ``sample_draft_proposal`` on the release's real function
    (its own parameters: no draft step before 0.5.23), called step by step as SGLang's
    multi-layer prefill does inside a chain in scope: every step drawn from the encoder."""
    from pd_middleware.core.contracts import PluginContext
    from pd_middleware.integrations.sglang.chain import CHAIN, chain_for
    from pd_middleware.integrations.sglang.patching import FEATURES, build, parse_version, resolve
    from pd_middleware.integrations.sglang.prefill import ProposalPublisher
    from pd_middleware_plugins.sparse import SparseEncoder, SparseEncoderOptions

    version = importlib.metadata.version("sglang")
    (row,) = [t for t in FEATURES["chain"].targets_for(parse_version(version)) if t.attr == "sample_draft_proposal"]
    module = import_sglang(row.module)
    encoder = SparseEncoder(SparseEncoderOptions(mode="topk", k=3, value_dtype="fp32"), PluginContext(V, 3, True))
    sent: list[Any] = []
    publisher = ProposalPublisher(encoder, SimpleNamespace(send=sent.append), vocab_size=V, num_steps=3)
    inst = SimpleNamespace(publisher=publisher, events=SimpleNamespace(failed=lambda *a: sent.append(("failed", a))))
    sample = build(resolve(row, module), inst).replacement
    b = 2
    batch = SimpleNamespace(
        reqs=[
            SimpleNamespace(bootstrap_room=700 + i, rid=f"c{i}", origin_input_ids=[1, 2], output_ids=[])
            for i in range(b)
        ],
        sampling_info=SimpleNamespace(temperatures=torch.full((b, 1), 0.9)),
    )
    chain = chain_for(publisher, batch)
    g = torch.Generator().manual_seed(3)
    xs = []
    # Stand-in where the release draws with a Triton row argmax (0.5.22 on): torch's argmax on
    # the CPU (the server tier's cpu_gaps "row_argmax" override does the same).
    spec_utils = import_sglang("sglang.srt.speculative.spec_utils")
    argmax = patch.object(spec_utils, "row_argmax", lambda x: x.argmax(dim=-1), create=False)
    with CHAIN.enter(chain), argmax if hasattr(spec_utils, "row_argmax") else contextlib.nullcontext():
        for k in range(3):  # as the release's prefill loop calls it: the step only where the row takes one
            kw = (
                {"sampling_seed": None, "positions": None, "draft_step": k}
                if "draft_step" in (row.params or ())
                else {}
            )
            _probs, _p, x = sample(torch.randn((b, V), generator=g), batch.sampling_info.temperatures, **kw)
            xs.append(x.reshape(b).tolist())
    payloads = chain.payloads()
    return {
        "params": list(row.params or ()),
        "steps": len(chain.steps),
        "broken": chain.broken,
        "failures": [str(f) for f in sent if isinstance(f, tuple)],
        "xs": xs,
        "payload_tokens": [list(p.draft_tokens) if p is not None else None for p in payloads],
    }


def main() -> None:
    warnings.simplefilter("ignore")
    import_sglang("sglang")
    import sglang

    version = importlib.metadata.version("sglang")
    report: dict[str, Any] = {"version": version, "file": str(Path(sglang.__file__).resolve())}
    report["rows"] = rows(version)
    report["relay"] = relay_checks()
    report["recompute_head"] = recompute_head_check()
    report["nextn_head"] = nextn_head_check()
    report["chain"] = chain_check()
    from _sglang_release_inband import registration_check

    report["inband"] = registration_check(version)
    print("PDM-RELEASE-CHECK " + json.dumps(report))


if __name__ == "__main__":
    main()
