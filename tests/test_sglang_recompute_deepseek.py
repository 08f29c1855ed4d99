"""The recompute head against SGLang's real DeepSeek-V3 NextN (MTP) draft, at fp32 on CPU.

Issue 34's head check. ``ARCHITECTURES`` says ``DeepseekV3ForCausalLMNextN`` ships its hidden
state **after** ``shared_head.norm`` and that its logits are ``lm_head(h)``. Here that is
proven on SGLang 0.5.23's own classes, not read:

- SGLang's real ``DeepseekV3ForCausalLMNextN`` (MLA with q and kv LoRA ranks, a MoE layer
  with routed and shared experts and ``noaux_tc`` routing; tiny, random, fp32, TP 1 in a
  one-rank gloo group) runs its real ``forward`` on the batch the EAGLE worker builds for
  the prefill's draft extend (``EAGLEWorkerV2._draft_extend_for_prefill``: EXTEND,
  ``CaptureHiddenMode.LAST``, ``return_hidden_states_before_norm=False``, the target's
  hidden states in ``EagleDraftExtendInput``). Its ``LogitsProcessor`` returns the hidden
  state the prefill ships (``logits_output.hidden_states``) and the draft's logits; the
  draft's own distribution is SGLang's ``renorm_draft_probs`` of those logits under
  rejection sampling, softmax(logits / T), as aggregated serving computes it.
- The same hidden state goes, as each request's ``hidden_states_tensor``, through the
  drop-in installed from ``configs/sglang.toml`` and SGLang's real
  ``build_eagle_disagg_draft_input``: the ``draft_probs`` it builds (the drop-in's q')
  equal SGLang's bit for bit, every request is counted ``recomputed`` and none
  ``unknown_head``.

Negative controls: the head given the pre-norm residual sum (what the NextN layer holds
just before ``shared_head.norm``), and the head under the other convention of the table
(EAGLE3's: norm at the decode), each give a different q'; without the table's row every
request falls back, counted ``unknown_head``.

Stand-ins, each for a part that does not decide which hidden state is shipped, and why:
the attention kernel (this CPU has no sgl-kernel CPU build; ``PlainPrefillAttention``
computes the contract of SGLang's extend kernel for a prefill with no cached prefix:
causal softmax attention over the new tokens' own K/V, which is what the MHA path of MLA
hands it with ``save_kv_cache=False``); the rotary module's CPU-engine flag (as in
``tests/test_sglang_recompute.py``); inductor is off for the MoE's ``noaux_tc`` routing
(``torch.compiler.set_stance("force_eager")``: the same function, run eagerly; compiling
it costs tens of seconds on two cores). The ``ForwardBatch`` is built field by field as
``ForwardBatch.init_new`` would for that batch (no model runner here); the KV pool is
SGLang's real ``MLATokenToKVPool``.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _sglang_builder import build_draft_input, namespace_batch

from pd_middleware.config import load_config
from pd_middleware.integrations import sglang as S
from pd_middleware.integrations.sglang.draft_head import ARCHITECTURES, HeadRule, SGLangDraftHead
from pd_middleware.integrations.sglang.recompute import capture

pytestmark = [pytest.mark.sglang]

ARCH = "DeepseekV3ForCausalLMNextN"
V, H = 97, 64
KV_LORA, ROPE = 32, 8
LENS = [5, 3, 6]  # three prompts, each its own length (the LAST rows are not the same offset)
TEMPS = [0.7, 1.0, 1.3]
SEED = 20261205
CONFIG = Path(__file__).parent.parent / "configs" / "sglang.toml"


@pytest.fixture(scope="module")
def sgl(sglang_importable):
    """SGLang's runtime context and a one-rank gloo model-parallel group (TP 1)."""
    from _sglang_import import import_sglang
    from _sglang_tp1 import tp1

    with tp1():  # taken down after the module; the rotary CPU flag too (see the module docstring)
        yield SimpleNamespace(
            nextn=import_sglang("sglang.srt.models.deepseek_nextn"),
            fb=import_sglang("sglang.srt.model_executor.forward_batch_info"),
            fc=import_sglang("sglang.srt.model_executor.forward_context"),
            pool=import_sglang("sglang.srt.mem_cache.memory_pool"),
            info=import_sglang("sglang.srt.speculative.eagle_info"),
            spec_utils=import_sglang("sglang.srt.speculative.spec_utils"),
            builder=import_sglang("sglang.srt.speculative.eagle_disaggregation"),
        )


def nextn_config() -> object:
    """A tiny DeepSeek-V3 with one NextN layer: MLA (q/kv LoRA 32, nope/rope/v 16/8/16, two
    heads), MoE (4 routed experts, top 2 in 2 groups, 1 shared; ``noaux_tc``, sigmoid)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        architectures=[ARCH],
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,  # SGLang reads it; transformers' config has no such field
        topk_method="noaux_tc",  # the same
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        intermediate_size=64,
        q_lora_rank=32,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=16,
        qk_rope_head_dim=ROPE,
        v_head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling={
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        hidden_act="silu",
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
    )


def nextn_model(sgl) -> torch.nn.Module:
    """SGLang's real NextN draft, every parameter drawn from a fixed seed, then SGLang's own
    ``post_load_weights`` (MLA's absorbed ``w_kc``/``w_vc`` from ``kv_b_proj``)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # SGLang builds the parameters in the default dtype
    try:
        m = sgl.nextn.DeepseekV3ForCausalLMNextN(nextn_config())
    finally:
        torch.set_default_dtype(dtype)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    m.post_load_weights()
    assert type(m).__name__ == ARCH
    return m.eval()


class PlainPrefillAttention:
    """The attention backend's contract for a prefill with no cached prefix (the MHA path
    of MLA: per-head K/V of the new tokens, ``save_kv_cache=False``): causal softmax
    attention within each request. The latent goes to SGLang's real MLA pool."""

    prefill_attention_backend_str = "triton"  # the backend name the CPU's DeepSeek dispatch falls back to
    decode_attention_backend_str = "triton"
    req_to_token_pool = None

    def __init__(self, sgl, tokens: int) -> None:
        self.token_to_kv_pool = sgl.pool.MLATokenToKVPool(tokens, 1, torch.float32, KV_LORA, ROPE, 1, "cpu", False)
        self.calls = 0

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **_):
        assert forward_batch.extend_prefix_lens_cpu == [0] * forward_batch.batch_size and not save_kv_cache
        self.calls += 1
        out = torch.empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        start = 0
        for n in forward_batch.extend_seq_lens_cpu:
            qq, kk, vv = (t[start : start + n].float() for t in (q, k, v))
            scores = torch.einsum("qhd,khd->hqk", qq, kk) * layer.scaling
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out[start : start + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
            start += n
        return out.reshape(q.shape[0], -1)


def draft_extend_for_prefill(sgl, m) -> SimpleNamespace:
    """The NextN draft's forward on the prefill's draft-extend batch, as EAGLEWorkerV2 runs it.

    Returns ``shipped`` (B, H): ``logits_output.hidden_states`` (what the prefill ships),
    ``logits`` (B, V): the draft's ``next_token_logits``, and ``pre_norm`` (B, H): the
    residual sum ``shared_head.norm`` received at each request's last position."""
    fb = sgl.fb
    g = torch.Generator().manual_seed(SEED + 1)
    t = sum(LENS)
    ids = torch.randint(0, V, (t,), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENS])
    target_hidden = torch.randn(t, H, generator=g)
    lens = torch.tensor(LENS)
    batch = fb.ForwardBatch(
        forward_mode=fb.ForwardMode.EXTEND,
        batch_size=len(LENS),
        input_ids=ids,
        req_pool_indices=torch.arange(len(LENS)),
        seq_lens=lens,
        seq_lens_cpu=lens,
        out_cache_loc=torch.arange(t),
        seq_lens_sum=t,
        positions=positions,
        extend_num_tokens=t,
        extend_seq_lens=lens,
        extend_prefix_lens=torch.zeros(len(LENS), dtype=torch.int64),
        extend_start_loc=torch.cumsum(lens, 0) - lens,
        extend_prefix_lens_cpu=[0] * len(LENS),
        extend_seq_lens_cpu=list(LENS),
        extend_logprob_start_lens_cpu=list(LENS),
        return_logprob=False,
        capture_hidden_mode=fb.CaptureHiddenMode.LAST,
        return_hidden_states_before_norm=False,
        spec_info=sgl.info.EagleDraftExtendInput(
            hidden_states=target_hidden, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1
        ),
    )
    seen: dict[str, torch.Tensor] = {}

    def keep_residual(_mod, _args, out):  # RMSNorm(x, residual) -> (normed, x + residual)
        seen["pre_norm"] = out[1].detach().clone()

    backend = PlainPrefillAttention(sgl, t)
    hook = m.model.shared_head.norm.register_forward_hook(keep_residual)
    try:
        ctx = sgl.fc.ForwardContext(attn_backend=backend)
        # 0.5.23's context takes the batch (the MoE's non-padded token count); earlier
        # releases' take the backend only (tests/_sglang_release_check.py runs this on them).
        takes_batch = "forward_batch" in inspect.signature(sgl.fc.forward_context).parameters
        with (
            torch.no_grad(),
            torch.compiler.set_stance("force_eager"),
            sgl.fc.forward_context(ctx, **({"forward_batch": batch} if takes_batch else {})),
        ):
            out = m(ids, positions, batch)
    finally:
        hook.remove()
    assert backend.calls == 1  # the real MLA layer ran (MHA prefill path)
    last = torch.cumsum(lens, 0) - 1
    return SimpleNamespace(shipped=out.hidden_states, logits=out.next_token_logits, pre_norm=seen["pre_norm"][last])


def aggregated_q(sgl, logits: torch.Tensor) -> torch.Tensor:
    """The draft's own distribution in aggregated serving (rejection sampling): SGLang's
    ``renorm_draft_probs``, softmax(logits / T)."""
    si = SimpleNamespace(temperatures=torch.tensor(TEMPS).view(-1, 1))
    q: torch.Tensor = sgl.spec_utils.renorm_draft_probs(logits, si, True)
    return q


@pytest.fixture(scope="module")
def drafted(sgl):
    m = nextn_model(sgl)
    run = draft_extend_for_prefill(sgl, m)
    return SimpleNamespace(model=m, q=aggregated_q(sgl, run.logits), **vars(run))


@pytest.fixture
def installed(sgl):
    cfg = load_config(CONFIG)
    assert cfg.synthesizer.name == "recompute"
    inst = S.install(cfg, S.InstallOptions(hook_scheduler=False))
    yield inst
    S.uninstall()


def start(inst, model) -> None:
    """What the scheduler-start hook does, on a scheduler-shaped object holding the real model."""
    sched = SimpleNamespace(
        draft_worker=SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=SimpleNamespace(model=model))),
        enable_overlap=False,
    )
    capture(inst.recompute, sched, vocab_size=V, num_steps=1, rs=True)


def decode_batch(hidden: torch.Tensor) -> SimpleNamespace:
    """The decode's prebuilt batch: each request carries the prefill's shipped hidden state."""
    b = hidden.shape[0]
    reqs = [
        SimpleNamespace(
            output_topk_p=torch.tensor([0.5]),
            output_topk_index=torch.tensor([5]),  # the prefill's X
            hidden_states_tensor=hidden[i].clone(),
            output_dsa_topk_indices=None,
            bootstrap_room=3000 + i,
            rid=f"ds{i}",
        )
        for i in range(b)
    ]
    return namespace_batch(
        reqs,
        V,
        req_pool_indices=torch.arange(b),
        seq_lens=torch.tensor(LENS, dtype=torch.int64),
        sampling_info=SimpleNamespace(
            temperatures=torch.tensor(TEMPS).view(b, 1),
            sampling_seed=torch.arange(b, dtype=torch.int64) + 41,
            top_ks=torch.full((b,), 50),
        ),
    )


def build(sgl, b):
    return build_draft_input(sgl.builder, b, steps=3)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per row, (B, V) x (B, V) -> (B,)."""
    return 0.5 * (p - q).abs().sum(dim=1)


def test_the_table_says_lm_head_of_the_shipped_state():
    assert ARCHITECTURES[ARCH].norm is None and ARCHITECTURES[ARCH].normed_if is None


def test_the_head_equals_the_nextn_logits_processor_bit_for_bit(sgl, drafted):
    head = SGLangDraftHead(drafted.model, V)
    assert head.norm is None and head.logits_width == V
    got = head.logits(drafted.shipped)
    assert got.dtype == torch.float32 and got.shape == (len(LENS), V)
    assert torch.equal(got, drafted.logits)
    # What the forward ships is normed: it is not the residual sum the norm received.
    assert not torch.allclose(drafted.shipped, drafted.pre_norm)


def test_the_drop_ins_q_prime_is_the_nextn_drafts_own_distribution(sgl, drafted, installed):
    start(installed, drafted.model)
    rc = installed.recompute
    assert rc.head is not None and rc.head.arch == ARCH
    si = build(sgl, decode_batch(drafted.shipped))
    assert si.draft_probs.dtype == torch.float32
    assert torch.equal(si.draft_probs, drafted.q)
    assert torch.equal(si.topk_p[:, 0], si.draft_probs.gather(1, si.topk_index)[:, 0])
    assert rc.counts["recomputed"] == len(LENS)
    assert not any(k.startswith("fallback:") for k in rc.counts), dict(rc.counts)
    assert rc.synth is not None and not any("unknown_head" in k for k in rc.synth.counts), dict(rc.synth.counts)


def test_negative_control_the_pre_norm_state_gives_another_law(sgl, drafted, installed):
    start(installed, drafted.model)
    si = build(sgl, decode_batch(drafted.pre_norm))
    assert installed.recompute.counts["recomputed"] == len(LENS)  # served, silently: only the law differs
    assert (total_variation(si.draft_probs, drafted.q) > 0.1).all()  # 0.73 to 0.84 per row, seen


def test_negative_control_the_eagle3_convention_gives_another_law(sgl, drafted, installed, monkeypatch):
    monkeypatch.setitem(ARCHITECTURES, ARCH, HeadRule("model.shared_head.norm", None, "pre-norm (wrong)"))
    start(installed, drafted.model)
    assert installed.recompute.head is not None and installed.recompute.head.norm is not None
    si = build(sgl, decode_batch(drafted.shipped))
    assert (total_variation(si.draft_probs, drafted.q) > 0.1).all()  # 0.51 to 0.68 per row, seen


def test_negative_control_without_the_tables_row_every_request_counts_unknown_head(
    sgl, drafted, installed, monkeypatch
):
    monkeypatch.delitem(ARCHITECTURES, ARCH)
    start(installed, drafted.model)
    si = build(sgl, decode_batch(drafted.shipped))
    want = torch.zeros(len(LENS), V)
    want[:, 5] = 1.0
    assert torch.equal(si.draft_probs, want)
    rc = installed.recompute
    assert rc.head is None
    assert rc.counts["fallback:unknown_head"] == len(LENS) and rc.counts["recomputed"] == 0
    assert any("unknown_head" in k for k in rc.synth.counts), dict(rc.synth.counts)
