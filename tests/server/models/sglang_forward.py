"""Run SGLang's own DeepSeek-V3 forward on CPU in this process, without a server, and print its logits.

Run in a child process by ``tests/server/test_models.py`` with the server tier's
environment (``harness.server_env``: the sgl-kernel stand-ins and the CPU gap overrides)::

    python -m server.models.sglang_forward MODEL_DIR '[0, 5, 300]' 3

It builds SGLang's ``ModelRunner`` at TP 1 (``--device cpu --attention-backend intel_amx``,
no CUDA graphs) the way ``sglang.benchmark.one_batch`` does, prefills the ids (capturing
the final hidden state of every position, as the EAGLE worker does), then runs greedy
decode steps. Then SGLang's ``DeepseekV3ForCausalLMNextN``, built and loaded from the same
directory, runs the draft extend an EAGLE worker runs after that prefill: the ids shifted
left by one with the target's first greedy token last, at positions 0.., reading the
captured hidden states. Printed as one JSON line: the prefill's last-position logits, each
decode step's logits, the whole sequence (the ids, then the greedy tokens), the captured
hidden states and the NextN draft's logits at every position.

One change to SGLang, in this process only: every attention call takes the absorbed MLA
path (``AttnForwardMethod.MLA``), which SGLang already takes for every decode and for a
prefill on a cached prefix. A prefill without prefix would take the MHA path, which hands
the extend op the new tokens' per-head K/V apart (``save_kv_cache=False``); the tier's
extend stand-in reads every key from the KV buffer and refuses MLA's shapes there (the CPU
gap docs/server.md lists). The two paths compute the same attention.
"""

from __future__ import annotations

import json
import sys
import types
import warnings
from array import array
from typing import Any

import torch


def force_absorbed_mla() -> None:
    from sglang.srt.models import deepseek_v2
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    def dispatch(self: Any, forward_batch: Any) -> AttnForwardMethod:
        return AttnForwardMethod.MLA

    deepseek_v2.DeepseekV2AttentionMLA.dispatch_attn_forward_method = dispatch  # type: ignore[method-assign]


def _request(rid: int, ids: list[int], new_tokens: int) -> Any:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", ids),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=new_tokens),
    )
    req.full_untruncated_fill_ids = req.origin_input_ids
    req.logprob_start_len = -1
    req.extend_end = len(ids)
    return req


def _extend_batch(runner: Any, reqs: list[Any]) -> Any:
    """A prefill batch of ``reqs`` (``one_batch.extend``'s steps, without the forward)."""
    from sglang.benchmark.one_batch import TreeCacheNamespace, _maybe_prepare_mlp_sync_batch
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    cache = TreeCacheNamespace(
        page_size=get_schedule().page_size,
        device=runner.device,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
    )
    batch = ScheduleBatch.init_new(
        reqs=reqs,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
        tree_cache=cache,
        model_config=runner.model_config,
        enable_overlap=False,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    batch.prepare_for_extend()
    _maybe_prepare_mlp_sync_batch(batch, runner)
    if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
        batch.input_ids, batch.prefill_input_ids_cpu = batch.prefill_input_ids_cpu, None
    return batch


def _nextn_extend(runner: Any, model_dir: str, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """SGLang's ``DeepseekV3ForCausalLMNextN`` (bf16, loaded from ``model_dir`` by its own
    ``load_weights``, the target's embedding and head copied in as ``set_embed_and_head``
    would) over ``ids`` at positions 0.., reading ``hidden`` as the draft extend's
    ``spec_info.hidden_states``. Returns logits fp32 [len(ids), V]: ``lm_head`` of the
    model's output (after ``shared_head.norm``)."""
    from safetensors.torch import load_file
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
    from sglang.srt.runtime_context import get_model
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    config.architectures = ["DeepseekV3ForCausalLMNextN"]
    # Built under bf16 as SGLang's loader builds it: post_load_weights derives w_kc/w_vc,
    # plain attributes that a later .to() would not convert.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        draft = DeepseekV3ForCausalLMNextN(config)
        draft.load_weights(iter(load_file(f"{model_dir}/model.safetensors").items()))
    finally:
        torch.set_default_dtype(default)
    draft.model.embed_tokens.weight.data.copy_(runner.model.model.embed_tokens.weight.data)
    draft.lm_head.weight.data.copy_(runner.model.lm_head.weight.data)
    # The NextN layer's attention is layer 0 of this runner's KV pool, at the new request's slots.
    batch = _extend_batch(runner, [_request(1, ids, 1)])
    fb = ForwardBatch.init_new(batch, runner, return_hidden_states_before_norm=False)
    fb.spec_info = types.SimpleNamespace(hidden_states=hidden)
    runner.attn_backend.init_forward_metadata(fb)
    context = forward_context(ForwardContext(attn_backend=runner.attn_backend), forward_batch=fb)
    with get_model().override(shared_experts=runner.model.shared_experts_config), context:
        out = draft.model(fb.input_ids, fb.positions, fb)
    return out.float() @ draft.lm_head.weight.float().T


@torch.no_grad()
def run(model_dir: str, ids: list[int], decode_steps: int) -> dict[str, Any]:
    from sglang.benchmark import one_batch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import PortArgs, ServerArgs

    server_args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        attention_backend="intel_amx",
        disable_cuda_graph=True,
        max_total_tokens=512,
        max_running_requests=4,
        skip_server_warmup=True,
    )
    port_args = PortArgs.init_new(server_args)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    one_batch._init_process_global_configs()
    force_absorbed_mla()
    runner = one_batch.load_model(server_args, port_args, 0, 0)[0].torch_runner

    # The target's prefill, capturing every position's final hidden state (what the EAGLE
    # worker hands the draft extend).
    batch = _extend_batch(runner, [_request(0, ids, decode_steps + 1)])
    fb = ForwardBatch.init_new(batch, runner, return_hidden_states_before_norm=False)
    fb.capture_hidden_mode = CaptureHiddenMode.FULL
    logits_output = runner.forward(fb).logits_output
    hidden = logits_output.hidden_states
    token = runner.sample(logits_output, fb)
    out: dict[str, Any] = {"prefill_last": logits_output.next_token_logits[0].float().tolist(), "decode": []}
    seq = list(ids)
    for _ in range(decode_steps):
        seq.append(int(token[0]))
        token, step_logits = one_batch.decode(token, batch, runner)
        out["decode"].append(step_logits[0].float().tolist())
    out["seq"] = seq
    out["hidden"] = hidden.float().tolist()
    # The draft extend after the prefill: x_1 .. x_{n-1} and the target's greedy token.
    out["nextn_logits"] = _nextn_extend(runner, model_dir, [*ids[1:], seq[len(ids)]], hidden).tolist()
    return out


def main(argv: list[str]) -> int:
    model_dir, ids, steps = argv[0], json.loads(argv[1]), int(argv[2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run(model_dir, ids, steps)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
