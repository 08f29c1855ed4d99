"""Decode-only recompute through SGLang's real code on CPU.

SGLang's real ``LlamaForCausalLMEagle3`` is built with tiny random weights in a one-rank
gloo group (SGLang's own ``init_distributed_environment``/``initialize_model_parallel``);
the head's logits must equal the model's own ``LogitsProcessor`` output bit for bit.
Then the drop-in is installed from ``configs/sglang.toml`` (decode-only recompute) and
SGLang's real ``build_eagle_disagg_draft_input`` builds the first draft input: its
``EagleDraftInput`` (and, under the overlap scheduler, the ``RelayPayload`` it stashes)
carries X' drawn by SGLang's real ``fast_sample`` from q' = SGLang's real
``sampling_softmax`` of the head's logits.

Through the same real builder: a non-identity, full-size token map (the builder's X is
the draft id of X', q' is over target ids); invalid rows (a NaN q' row, q'(X') = 0) get
the one-hot at their own X; with SGLang's own ``pd_first_draft_proposal`` made inert, a
fallen-back batch still gets the drop-in's one-hot, X outside [0, V) included. At
scheduler start, ``capture`` refuses a token map that is not the identity (the EAGLE
worker's ``--speculative-token-map`` and the EAGLE3 model's own) and a draft whose
logits are not the target's width. Each test carries a negative control.

Two stand-ins, because the real part cannot run here: the rotary embedding's
constructor picks a vLLM kernel unless SGLang's CPU engine flag is set (the CPU engine
itself needs sgl-kernel's CPU build, not installable here), so the flag of that one
module is set (the head never calls rotary); the ``ScheduleBatch`` and ``FutureMap`` are
plain objects with the fields the builder reads, and the future map records what it
is handed.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from _sglang_builder import build_draft_input, namespace_batch

from pd_middleware import ConfigError
from pd_middleware.config import load_config
from pd_middleware.decode.recompute import inverse_cdf
from pd_middleware.integrations import sglang as S
from pd_middleware.integrations.sglang.draft_head import ARCHITECTURES, SGLangDraftHead, find_draft_model
from pd_middleware.integrations.sglang.recompute import capture
from pd_middleware.integrations.sglang.startup import check_placement

pytestmark = [pytest.mark.sglang]

V, H = 97, 32
CONFIG = Path(__file__).parent.parent / "configs" / "sglang.toml"


@pytest.fixture(scope="module")
def sgl(sglang_importable):
    """SGLang's runtime context and a one-rank gloo model-parallel group."""
    from _sglang_import import import_sglang
    from _sglang_tp1 import tp1

    with tp1():  # taken down after the module; the rotary CPU flag too (module docstring; never called by the head)
        yield SimpleNamespace(
            eagle3=import_sglang("sglang.srt.models.llama_eagle3"),
            eagle1=import_sglang("sglang.srt.models.llama_eagle"),
            lp=import_sglang("sglang.srt.layers.logits_processor"),
            fb=import_sglang("sglang.srt.model_executor.forward_batch_info"),
            spec_utils=import_sglang("sglang.srt.speculative.spec_utils"),
            builder=import_sglang("sglang.srt.speculative.eagle_disaggregation"),
            info=import_sglang("sglang.srt.speculative.eagle_info"),
        )


def llama_config(vocab=V, **extra):
    from _sglang_import import tiny_llama_config

    return tiny_llama_config(vocab, H, **extra)


def randomized(m, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def eagle3(sgl, *, dtype=torch.float32, seed=0, norm_output=False, vocab=V, draft_vocab=None):
    """SGLang's real EAGLE3 draft; ``draft_vocab``: its own vocabulary (lm_head and
    LogitsProcessor width), the target's ``vocab`` unless given."""
    cfg = llama_config(vocab)
    cfg.draft_vocab_size = vocab if draft_vocab is None else draft_vocab
    cfg.norm_output = norm_output
    return randomized(sgl.eagle3.LlamaForCausalLMEagle3(cfg), seed).to(dtype)


def eagle1(sgl, *, seed=0):
    """SGLang's real EAGLE (not EAGLE3) draft, ``LlamaForCausalLMEagle``: lm_head(h), no final norm."""
    return randomized(sgl.eagle1.LlamaForCausalLMEagle(llama_config(tie_word_embeddings=False)), seed)


def own_logits(sgl, m, hidden):
    """The model's own LogitsProcessor on what its forward hands it: norm(h) (EAGLE3)."""
    meta = sgl.lp.LogitsMetadata(forward_mode=sgl.fb.ForwardMode.DECODE)
    x = hidden if m.model.norm_output else m.model.norm(hidden)
    with torch.no_grad():
        return m.logits_processor(torch.zeros(hidden.shape[0], dtype=torch.long), x, m.lm_head, meta).next_token_logits


# ----------------------------------------------------------------------------- the head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "norm_output", "logit_scale", "softcap"])
def test_head_equals_the_models_own_logits_processor_bit_for_bit(sgl, dtype, variant, monkeypatch):
    if variant == "softcap":
        # This CPU is not SGLang's CPU engine, so LogitsProcessor would pick the CUDA Triton
        # softcap kernel; its CPU path (the engine flag of that module) is what runs here.
        monkeypatch.setattr(sgl.lp, "_is_cpu", True)
    m = eagle3(sgl, dtype=dtype, norm_output=variant == "norm_output")
    if variant == "logit_scale":
        m.logits_processor.logit_scale = 0.625
    if variant == "softcap":
        m.logits_processor.final_logit_softcapping = 3.0
    hidden = torch.randn(7, H, generator=torch.Generator().manual_seed(1)).to(dtype)
    head = SGLangDraftHead(m, V)
    got = head.logits(hidden)
    want = own_logits(sgl, m, hidden)
    assert got.dtype == torch.float32 and got.shape == (7, V)
    assert torch.equal(got, want)
    # Negative control: forgetting the EAGLE3 norm (the table's row) changes the logits.
    if variant == "plain":
        head.norm = None
        assert not torch.equal(head.logits(hidden), want)


def test_head_scatters_through_an_equal_size_hot_token_map(sgl):
    m = eagle3(sgl)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(3))
    m.hot_token_id = perm
    hidden = torch.randn(3, H)
    head = SGLangDraftHead(m, V)
    draft = own_logits(sgl, m, hidden)  # over draft ids
    got = head.logits(hidden)  # over target ids
    assert torch.equal(got[:, perm], draft)
    assert torch.equal(head.draft_id_of[perm], torch.arange(V))


def test_head_table_is_checked(sgl):
    assert set(ARCHITECTURES) >= {"LlamaForCausalLMEagle3", "LlamaForCausalLMEagle", "DeepseekV3ForCausalLMNextN"}
    with pytest.raises(S.PluginError, match="not in the recompute head table"):
        SGLangDraftHead(torch.nn.Linear(2, 2), V)


def quantised(kind):
    """A real SGLang ``ParallelLMHead`` built under a real quantisation config."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp8Config
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    if kind == "fp8_leaves_lm_head":
        config = Fp8Config()  # quantises linear layers; the lm_head keeps UnquantizedEmbeddingMethod
    else:
        config = ModelOptFp8Config(
            is_checkpoint_fp8_serialized=kind == "modelopt_fp8", exclude_modules=[], packed_modules_mapping={}
        )
    return ParallelLMHead(V, H, quant_config=config, prefix="lm_head")


def lora_wrapped(base):
    """SGLang's real ``ParallelLMHeadWithLoRA`` around ``base``. Its own constructor pins a host
    tensor, which CPU torch cannot; the state that matters here is its base class's
    (``BaseLayerWithLoRA.__init__``: ``base_layer``, ``weight``, ``set_lora``)."""
    from sglang.srt.lora.layers import BaseLayerWithLoRA, ParallelLMHeadWithLoRA

    head = ParallelLMHeadWithLoRA.__new__(ParallelLMHeadWithLoRA)
    BaseLayerWithLoRA.__init__(head, base, None)
    return head


QUANT_REFUSAL = r"quantised draft lm_head \(ParallelLMHead: modelopt_fp8, ModelOptFp8LinearMethod, "


@pytest.mark.parametrize(
    ("kind", "refusal"),
    [
        (
            "modelopt_fp8",
            QUANT_REFUSAL + r"weight torch.float8_e4m3fn\).*--speculative-draft-model-quantization unquant",
        ),
        ("modelopt_fp8_at_load", QUANT_REFUSAL + r"weight torch.float32\)"),
        ("lora", r"LoRA draft lm_head \(ParallelLMHeadWithLoRA\).*lm_head out of --lora-target-modules"),
        ("fp8_leaves_lm_head", None),
        ("lora_off", None),
    ],
)
def test_quantised_and_lora_lm_heads_are_refused_at_start_naming_the_flag(sgl, installed, kind, refusal):
    """SGLang's real lm_head classes: a ModelOpt FP8 head (fp8 weight; or a float weight its
    method quantises when the checkpoint loads) and a LoRA-wrapped head are refused at
    scheduler start, naming the quantisation or the flag, and nothing is bound (before,
    they were accepted and every batch failed, counted ``failed``: one-hot in disguise).
    Controls: a quantisation config that leaves the lm_head unquantised, and the plain head
    a LoRA wrapper would wrap, are accepted; SGLang's own dispatch really takes its quantised
    (``should_apply_lm_head_quant_method``) or LoRA branch for the refused heads."""
    m = eagle3(sgl)
    if kind == "lora":
        m.lm_head = lora_wrapped(m.lm_head)
        assert hasattr(m.lm_head, "set_lora") and hasattr(m.lm_head, "apply_lora"), "SGLang's LoRA branch"
    elif kind != "lora_off":
        m.lm_head = quantised(kind)
    if kind == "modelopt_fp8":
        assert sgl.lp.should_apply_lm_head_quant_method(m.lm_head, m.lm_head.quant_method), "SGLang's quant branch"
    rc = installed.recompute
    if refusal is None:
        start(sgl, installed, m)
        assert rc.head is not None and rc.head.out_dtype == torch.float32
        return
    with pytest.raises(ConfigError, match=refusal):
        start(sgl, installed, m)
    assert rc.head is None and rc.synth is None


@pytest.mark.parametrize("attn_tp", [True, False])
def test_a_vocab_parallel_head_gathers_with_sglangs_attention_tp_gather_under_attention_tp(sgl, attn_tp):
    """Which of its LogitsProcessor's gathers the head calls: under ``--enable-dp-lm-head``
    (``use_attn_tp_group``) SGLang's ``_gather_attn_tp_logits`` (the attention-TP group),
    else ``_logits_gatherer`` (the TP group), once per batch, never both. Both are
    recorded stand-ins here (one rank has no group to gather over)."""
    m = eagle3(sgl)
    head = SGLangDraftHead(m, V)
    calls = []

    def recorder(name):
        def gather(x):
            calls.append((name, str(x.dtype), tuple(x.shape)))
            return x

        return gather

    lp = head.lp  # the model's own, dropped with it
    lp.do_tensor_parallel_all_gather, lp.use_attn_tp_group = True, attn_tp
    lp._gather_attn_tp_logits = recorder("attn_tp")
    lp._logits_gatherer = recorder("tp")
    head.logits(torch.randn(3, H))
    assert calls == [("attn_tp" if attn_tp else "tp", "torch.float32", (3, head.local_width))], calls


def test_placement_refusals_name_the_flag():
    with pytest.raises(ConfigError, match="--enable-dp-lm-head"):
        check_placement(SimpleNamespace(do_tensor_parallel_all_gather_dp_attn=True), enable_overlap=False)
    stream = object()
    # A gathering head under overlap is served where the scheduler has a forward stream to
    # issue it on (ordering.py), refused where it has none, naming both ways out.
    check_placement(SimpleNamespace(do_tensor_parallel_all_gather=True), enable_overlap=True, forward_stream=stream)
    with pytest.raises(ConfigError, match=r"TP > 1.*has none.*--disable-overlap-schedule.*sparse_floor"):
        check_placement(SimpleNamespace(do_tensor_parallel_all_gather=True), enable_overlap=True)
    check_placement(SimpleNamespace(do_tensor_parallel_all_gather=True), enable_overlap=False)
    check_placement(SimpleNamespace(do_tensor_parallel_all_gather=False), enable_overlap=True)
    # The attention-TP gather (--enable-dp-lm-head at attention TP > 1): the same rule.
    attn_tp = SimpleNamespace(do_tensor_parallel_all_gather=True, use_attn_tp_group=True)
    with pytest.raises(ConfigError, match=r"attention TP > 1 with --enable-dp-lm-head.*--disable-overlap-schedule"):
        check_placement(attn_tp, enable_overlap=True)
    check_placement(attn_tp, enable_overlap=True, forward_stream=stream)
    check_placement(attn_tp, enable_overlap=False)
    # Under DP attention without --enable-dp-lm-head: refused whatever the stream.
    with pytest.raises(ConfigError, match="--enable-dp-lm-head"):
        check_placement(
            SimpleNamespace(do_tensor_parallel_all_gather_dp_attn=True), enable_overlap=True, forward_stream=stream
        )


# ----------------------------------------------------------------------------- the builder


class RecordingFutureMap:
    """Stand-in for SGLang's FutureMap: records what the builder publishes and stashes."""

    def __init__(self) -> None:
        self.stashed = None

    def publish(self, indices, seq_lens) -> None:
        pass

    def stash(self, indices, payload) -> None:
        self.stashed = payload


def batch(b, *, seeds=None, top_ks=None, overlap=False, temps=None):
    g = torch.Generator().manual_seed(11)
    reqs = [
        SimpleNamespace(
            output_topk_p=torch.tensor([0.5]),
            output_topk_index=torch.tensor([5]),  # the prefill's X: the same for every request
            hidden_states_tensor=torch.randn(H, generator=g),
            output_dsa_topk_indices=None,
            bootstrap_room=1000 + i,
            rid=f"r{i}",
        )
        for i in range(b)
    ]
    return namespace_batch(
        reqs,
        V,
        overlap=overlap,
        req_pool_indices=torch.arange(b),
        seq_lens=torch.arange(b, dtype=torch.int64) + 9,
        sampling_info=SimpleNamespace(
            temperatures=(temps if temps is not None else torch.full((b,), 0.8)).view(b, 1),
            sampling_seed=seeds,
            top_ks=top_ks if top_ks is not None else torch.full((b,), 50),
        ),
    )


@pytest.fixture
def installed(sgl):
    cfg = load_config(CONFIG)
    assert cfg.synthesizer.name == "recompute" and cfg.sglang.channel == "none"
    inst = S.install(cfg, S.InstallOptions(hook_scheduler=False))
    yield inst
    S.uninstall()


def start(sgl, inst, model, overlap=False):
    """What the scheduler-start hook does, on a scheduler-shaped object with the real model."""
    sched = SimpleNamespace(
        draft_worker=SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=SimpleNamespace(model=model))),
        enable_overlap=overlap,
    )
    assert find_draft_model(sched) is model
    capture(inst.recompute, sched, vocab_size=V, num_steps=1, rs=True)


def build(sgl, b, fm=None):
    return build_draft_input(sgl.builder, b, steps=3, future_map=fm)


@pytest.mark.parametrize("overlap", [False, True])
def test_builder_hands_q_prime_and_x_prime_drawn_from_it(sgl, installed, overlap):
    m = eagle3(sgl)
    start(sgl, installed, m, overlap)
    seeds = torch.tensor([7, 8, 9, 10, 11, 12], dtype=torch.int64)
    b = batch(6, seeds=seeds, overlap=overlap)
    hidden = torch.stack([r.hidden_states_tensor for r in b.reqs])
    fm = RecordingFutureMap()
    si = build(sgl, b, fm)
    assert isinstance(si, sgl.info.EagleDraftInput)
    # q' = SGLang's sampling_softmax(head(h) / T); X' = SGLang's fast_sample from it.
    q = sgl.spec_utils.sampling_softmax(own_logits(sgl, m, hidden), temperatures=b.sampling_info.temperatures)
    rc = installed.recompute
    if rc.sampler == "sglang.fast_sample":
        p_x, x = sgl.spec_utils.fast_sample(q, 1, sampling_seed=seeds, positions=b.seq_lens)
    else:  # no sgl-kernel CPU build here for murmur_hash32: the core's seeded inverse-CDF draw (logged)
        assert rc.sampler == "pd_middleware.inverse_cdf"
        p_x, x = inverse_cdf(q, seeds, b.seq_lens)
    assert torch.equal(si.draft_probs, q)
    assert torch.equal(si.topk_index, x)
    assert torch.equal(si.topk_p, p_x)
    assert torch.equal(si.topk_p[:, 0], si.draft_probs.gather(1, si.topk_index)[:, 0])
    assert (si.topk_index[:, 0] != 5).any()  # redrawn, not the prefill's X
    if overlap:  # acted before the stash: the relay carries the same X', q'(X'), q'
        assert torch.equal(fm.stashed.topk_index, x) and torch.equal(fm.stashed.draft_probs, q)
    assert installed.recompute.counts["recomputed"] == 6


def test_builder_without_seed_draws_from_the_room_the_same_on_every_rank(sgl, sglang_importable):
    """Two installations (two TP ranks) over the same batch: bit-identical q' and the same X'."""
    m = eagle3(sgl)
    outs = []
    for _ in range(2):
        inst = S.install(load_config(CONFIG), S.InstallOptions(hook_scheduler=False))
        try:
            start(sgl, inst, m)
            outs.append(build(sgl, batch(16)))
        finally:
            S.uninstall()
    assert torch.equal(outs[0].draft_probs, outs[1].draft_probs)
    assert torch.equal(outs[0].topk_index, outs[1].topk_index)
    assert len(set(outs[0].topk_index[:, 0].tolist())) > 1  # per-room seeds differ


def test_greedy_rows_propose_their_argmax(sgl, installed):
    m = eagle3(sgl)
    start(sgl, installed, m)
    top_ks = torch.tensor([1, 50, 1, 50])
    si = build(sgl, batch(4, top_ks=top_ks, temps=torch.ones(4)))
    arg = si.draft_probs.argmax(dim=1)
    assert si.topk_index[0, 0] == arg[0] and si.topk_index[2, 0] == arg[2]


def test_no_head_falls_back_to_one_hot_counted(sgl, installed):
    b = batch(3)
    si = build(sgl, b)  # the scheduler never started: no head captured
    want = torch.zeros(3, V)
    want[:, 5] = 1.0
    assert torch.equal(si.draft_probs, want) and torch.equal(si.topk_index, torch.full((3, 1), 5))
    assert installed.recompute.counts["fallback:unknown_head"] == 3


def test_missing_hidden_state_falls_back_to_one_hot_counted(sgl, installed):
    start(sgl, installed, eagle3(sgl))
    b = batch(2)
    b.reqs[1].hidden_states_tensor = None
    with pytest.raises(Exception):  # noqa: B017  SGLang's own stack of hidden states fails on None
        build(sgl, b)
    assert installed.recompute.counts["fallback:no_hidden"] == 2


def test_a_q_prime_of_the_wrong_width_keeps_the_prefills_x_counted_once(sgl, installed):
    """The startup checks make it impossible, so it is forced here: the head's logits gain
    one column (probability 0), so the recomputed q' is V + 1 wide while the head, the
    synthesizer and SGLang's batch all say V (the batch-wide ``unusable`` check passes).
    q''s width is checked before any X' is written (every rank alike: the shapes are the
    same on all): no row keeps X', the builder verifies the one-hot at the prefill's X, and
    each user row is counted ``fallback:shape`` once, never ``recomputed`` nor
    ``propose_shape``. Negative control tried: without that check the X' drawn from the
    wide q' is written, and the builder verifies the one-hot at X' (``propose_shape``)."""
    start(sgl, installed, eagle3(sgl))
    rc = installed.recompute
    logits = rc.head.logits
    rc.head.logits = lambda h: torch.nn.functional.pad(logits(h), (0, 1), value=float("-inf"))
    control = batch(3)
    assert rc.synth.recompute(
        torch.stack([r.hidden_states_tensor for r in control.reqs]),
        temperatures=control.sampling_info.temperatures,
        seeds=torch.arange(3),
        positions=control.seq_lens,
    ).probs.shape == (3, V + 1), "control: the recomputed q' is one wider"
    si = build(sgl, batch(3))
    del rc.head.logits
    assert torch.equal(si.topk_index, torch.full((3, 1), 5))
    assert torch.equal(si.draft_probs, one_hots([5] * 3))
    assert rc.counts["fallback:shape"] == 3 and rc.counts["recomputed"] == 0
    assert "fallback:propose_shape" not in rc.counts


def test_propose_writes_the_fallen_back_rows_into_q_prime_itself_with_the_landed_values(installed):
    """The builder's (b, 1, V) proposal: the agreed rows of q' as recomputed, the others the
    one-hot at their X (clamped into [0, V), as ``one_hot_at``), bit for bit the values the
    landed ``torch.where(agreed, q', one-hot)`` gave, written into q' itself: the result is a
    view of q', and the call allocates less than one row (tests/_alloc_peak.py). Negative
    control: the landed form allocates a one-hot and the where's output, two (b, V)."""
    from _alloc_peak import allocation_peak

    from pd_middleware.decode.recompute import draw_proposal
    from pd_middleware.integrations.sglang.common import one_hot_at
    from pd_middleware.integrations.sglang.recompute import Prepared

    b, v = 6, 4096
    q = torch.softmax(torch.randn(b, v, generator=torch.Generator().manual_seed(29)), dim=1)
    rec = draw_proposal(q.clone(), seeds=torch.arange(b), positions=torch.zeros(b, dtype=torch.int64))
    agreed = torch.tensor([True, False, True, False, False, True])
    x = torch.tensor([[3], [7], [1], [-4], [v + 9], [0]])  # X outside [0, V) included

    def landed():
        return torch.where(agreed.view(-1, 1), q, one_hot_at(x, v)[:, 0]).unsqueeze(1)

    state = Prepared(rec, agreed, torch.ones(b, dtype=torch.bool))
    peak, out = allocation_peak(lambda: installed.recompute.propose(None, state, x, v))
    assert out.shape == (b, 1, v) and torch.equal(out, landed())
    assert out.untyped_storage().data_ptr() == rec.probs.untyped_storage().data_ptr()
    assert peak < v * 4, peak
    assert allocation_peak(landed)[0] >= 2 * b * v * 4


def test_a_failure_counting_after_the_vote_never_changes_what_sglang_is_handed(sgl, installed, monkeypatch):
    """After the vote a rank only assigns what it staged, then counts: a failure while
    counting is reported (``guard:recompute_count:<error>``) and the batch keeps what the
    ranks agreed, X' with q' (a peer whose counting worked hands the same). Negative
    control tried: an unguarded count makes prepare raise, and this rank verifies the
    one-hot at X' while its peers verify q'."""
    m = eagle3(sgl)
    start(sgl, installed, m)
    rc = installed.recompute
    seeds = torch.arange(4, dtype=torch.int64) + 60
    want = build(sgl, batch(4, seeds=seeds))  # the same batch, counted normally
    monkeypatch.setattr(rc, "_count", _boom)
    got = build(sgl, batch(4, seeds=seeds))
    assert torch.equal(got.topk_index, want.topk_index) and torch.equal(got.draft_probs, want.draft_probs)
    assert not torch.equal(got.draft_probs, one_hots(got.topk_index[:, 0].tolist()))  # q', not a one-hot
    assert installed.guard.counts["guard:recompute_count:RuntimeError"] == 1
    assert not [k for k in installed.guard.counts if k.startswith(("guard:prepare", "guard:propose"))]


def test_sglangs_health_checks_in_a_batch_are_counted_apart_never_as_user_rows(sgl, installed):
    """A router's health check (rid ``HEALTH_CHECK_...``) or a warmup (the fake bootstrap
    host) rides in a prebuilt batch with user requests: it is served like them, and counted
    ``probe``, so ``recomputed`` and every ``fallback:*`` count user requests only (a
    server's /metrics read one row per request plus the probes before this). Checked on the
    normal path, on a per-row fallback and on a batch-wide one."""
    from pd_middleware.integrations.sglang.common import FAKE_BOOTSTRAP_HOST, HEALTH_CHECK_RID_PREFIX

    def with_probes(b):
        b.reqs[1].rid = f"{HEALTH_CHECK_RID_PREFIX}_0a1b"
        b.reqs[3].bootstrap_host = FAKE_BOOTSTRAP_HOST
        return b

    rc = installed.recompute
    si = build(sgl, with_probes(batch(4)))  # no head yet: the batch-wide fallback
    assert si.draft_probs.shape == (4, V)
    assert rc.counts["fallback:unknown_head"] == 2 and rc.counts["probe"] == 2
    start(sgl, installed, eagle3(sgl))
    build(sgl, with_probes(batch(4)))
    assert rc.counts["recomputed"] == 2 and rc.counts["probe"] == 4
    b = with_probes(batch(5))
    b.sampling_info.temperatures[0] = float("nan")  # row 0 (a user row) cannot be served
    b.sampling_info.temperatures[1] = float("nan")  # row 1 (a probe) neither
    si = build(sgl, b)
    assert si.draft_probs.shape == (5, V)
    assert rc.counts["fallback:invalid_row"] == 1, dict(rc.counts)
    assert rc.counts["recomputed"] == 2 + 2 and rc.counts["probe"] == 6
    # Every fallback key, exactly: the probe's fallen-back row is in none of them.
    fallbacks = {k: n for k, n in rc.counts.items() if k.startswith("fallback:")}
    assert fallbacks == {"fallback:unknown_head": 2, "fallback:invalid_row": 1}, fallbacks
    assert dict(rc.synth.counts) == {"invalid_row": 1}, dict(rc.synth.counts)


def test_a_broken_agreement_collective_is_counted_agreement_failed_never_failed(sgl, installed, monkeypatch):
    """The vote's all-reduce itself raises (the group is broken): nothing is agreed, every
    request keeps the prefill's X with the one-hot, and each is counted
    ``agreement_failed`` once (the guard logs ``recompute_agreement``), never ``failed``
    (this rank's own step did not fail). Control: the same batch with a working vote
    recomputes."""
    import torch.distributed as dist

    start(sgl, installed, eagle3(sgl))
    rc = installed.recompute
    calls = []

    def broken(tensor, *args, **kwargs):
        calls.append(kwargs.get("group"))
        raise RuntimeError("injected: the group is broken")

    rc.group = group = object()  # a group of more than one rank, as bind_head keeps it
    monkeypatch.setattr(dist, "all_reduce", broken)
    si = build(sgl, batch(3))
    assert calls == [group]  # the vote ran, over the source's group, and failed
    assert torch.equal(si.topk_index, torch.full((3, 1), 5)) and torch.equal(si.draft_probs, one_hots([5] * 3))
    fallbacks = {k: n for k, n in rc.counts.items() if k.startswith("fallback:")}
    assert fallbacks == {"fallback:agreement_failed": 3}, fallbacks
    assert installed.guard.counts["guard:recompute_agreement:RuntimeError"] == 1
    assert "guard:recompute:RuntimeError" not in installed.guard.counts
    rc.group = None
    monkeypatch.undo()
    build(sgl, batch(3))
    assert rc.counts["recomputed"] == 3


def test_no_draft_worker_is_refused_at_startup(sgl, installed):
    with pytest.raises(ConfigError, match=r"at synthesizer: .*needs the decode's EAGLE draft worker"):
        capture(installed.recompute, SimpleNamespace(draft_worker=None), vocab_size=V, num_steps=1, rs=True)


def test_scheduler_start_hook_captures_the_head_and_runs_the_checks(sgl):
    """install() from configs/sglang.toml patches Scheduler.init_disaggregation (a stand-in
    class: the real Scheduler's constructor needs a whole model runner); at start
    the decode captures the draft model, a prefill does nothing, a bad flag stops it."""
    import types
    from importlib import import_module

    from sglang.srt.runtime_context import get_context

    m = eagle3(sgl)

    class Scheduler:
        def __init__(self) -> None:
            self.model_config = SimpleNamespace(vocab_size=V)
            self.enable_overlap = True
            self.forward_stream = torch.cpu.Stream()  # what get_worker_info sets before init_disaggregation
            self.draft_worker = SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=SimpleNamespace(model=m)))

        def init_disaggregation(self):
            self.inited = True

    mod = types.ModuleType("scheduler_stand_in")
    mod.Scheduler = Scheduler
    # SGLang's own runtime context (the scheduler's READ targets), the builder, the stand-in class.
    rc = import_module("sglang.srt.runtime_context")
    mods = S.SGLangModules(builder=sgl.builder, scheduler=mod, only_given=True, extra={rc.__name__: rc})
    inst = S.install(load_config(CONFIG), S.InstallOptions(modules=mods))
    try:
        assert inst.channel_name == "none" and {p.name for p in inst.patches} == {
            "build_eagle_disagg_draft_input",
            "pd_first_draft_proposal",
            "init_disaggregation",
        }
        flags = dict(
            speculative_algorithm="EAGLE3",
            speculative_eagle_topk=1,
            speculative_num_steps=3,
            speculative_use_rejection_sampling=True,
            disaggregation_transfer_backend="mooncake",
        )
        with get_context().override_server_args(disaggregation_mode="prefill", **flags):
            s = Scheduler()
            s.init_disaggregation()
            assert s.inited and inst.recompute.head is None  # nothing on a prefill
        with get_context().override_server_args(disaggregation_mode="decode", **flags):
            s = Scheduler()
            s.init_disaggregation()
            assert s.inited and inst.recompute.head is not None and inst.recompute.head.arch == "LlamaForCausalLMEagle3"
        flags["speculative_use_rejection_sampling"] = False
        with (
            get_context().override_server_args(disaggregation_mode="decode", **flags),
            pytest.raises(ConfigError, match="without --speculative-use-rejection-sampling"),
        ):
            Scheduler().init_disaggregation()
    finally:
        S.uninstall()


@pytest.mark.parametrize("where", ["prepare", "propose"])
def test_a_failing_recompute_step_gives_sglang_its_one_hot_counted(sgl, installed, where):
    """Fault injection: the recompute step (or its proposal) raises inside SGLang's builder.
    SGLang still gets a valid EagleDraftInput with its own one-hot at the X the builder read,
    and the failure is counted by the guard. Negative control: the bare step raises."""
    start(sgl, installed, eagle3(sgl))
    rc = installed.recompute

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    with patch.object(rc, where, boom):
        with pytest.raises(RuntimeError, match="injected"):
            getattr(rc, where)(batch(1))  # the negative control: the step itself raises
        si = build(sgl, batch(3))
    x = si.topk_index[:, 0]
    want = torch.zeros(3, V)
    want[torch.arange(3), x] = 1.0
    assert torch.equal(si.draft_probs, want)  # one-hot at the builder's X: exact for any X
    key = f"guard:{where}:RuntimeError"
    assert installed.guard.counts[key] == 1


# ----------------------------------------------------------------------------- token maps, invalid rows, an inert SGLang


def reference_draw(rc, q, seeds, positions):
    """(q(X), X) as the bound source draws them: SGLang's fast_sample where it runs, else
    the core's seeded inverse-CDF draw (this CPU: no sgl-kernel murmur_hash32_cpu)."""
    if rc.sampler == "sglang.fast_sample":
        from sglang.srt.speculative.spec_utils import fast_sample

        return fast_sample(q, 1, sampling_seed=seeds, positions=positions)
    assert rc.sampler == "pd_middleware.inverse_cdf", rc.sampler
    return inverse_cdf(q, seeds, positions)


def one_hots(xs, v=V):
    out = torch.zeros(len(xs), v)
    out[torch.arange(len(xs)), torch.tensor(xs)] = 1.0
    return out


def test_builder_with_a_non_identity_hot_map_hands_the_draft_id_of_x_prime_and_q_prime_over_target_ids(sgl, installed):
    """A full-size, non-identity EAGLE3 map (draft id -> target id), bound directly (capture
    refuses it at startup, see below): the builder's topk_index is the draft id of X', so
    SGLang's own mapping (hot[topk_index], eagle_worker_v2.py around 757) gives back
    exactly the X' drawn from q'; draft_probs is q' over target ids, and q'(X') = topk_p.
    Negative controls: a head that forgets the inverse map, or the scatter into target ids,
    fails these checks."""
    m = eagle3(sgl)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(5))
    assert not torch.equal(perm, torch.arange(V))
    m.hot_token_id = perm  # where SGLang's EAGLE3 keeps its map
    head = SGLangDraftHead(m, V)
    rc = installed.recompute
    rc.bind_head(head, vocab_size=V, num_steps=1, rejection_sampling=True)
    seeds = torch.arange(16, dtype=torch.int64) + 100

    b = batch(16, seeds=seeds)
    hidden = torch.stack([r.hidden_states_tensor for r in b.reqs])
    si = build(sgl, b)

    draft_logits = own_logits(sgl, m, hidden)  # over draft ids
    target_logits = torch.empty_like(draft_logits)
    target_logits[:, perm] = draft_logits  # target id hot[j] carries draft id j's logit
    temps = b.sampling_info.temperatures
    q = sgl.spec_utils.sampling_softmax(target_logits, temperatures=temps)
    # q' at target id hot[j] is the draft's probability of draft id j (any summation order).
    torch.testing.assert_close(q[:, perm], sgl.spec_utils.sampling_softmax(draft_logits, temperatures=temps))
    _, x = reference_draw(rc, q, seeds, b.seq_lens)  # X' over target ids

    assert torch.equal(si.draft_probs, q)
    assert torch.equal(perm[si.topk_index], x), "SGLang's map of the builder's X must be the X' drawn from q'"
    assert torch.equal(si.topk_p, q.gather(1, x))
    assert torch.equal(si.topk_p, si.draft_probs.gather(1, perm[si.topk_index]))
    assert (si.topk_index != x).any(), "the map moves this batch's tokens, so the check can see a missing inverse"
    assert rc.counts["recomputed"] == 16

    inverse = head.draft_id_of
    head.draft_id_of = None  # negative control: X' handed over as a target id, SGLang maps it again
    bad = build(sgl, batch(16, seeds=seeds))
    assert not torch.equal(perm[bad.topk_index], x)
    head.draft_id_of, hot = inverse, head.hot_token_id
    head.hot_token_id = None  # negative control: q' left in draft order
    bad = build(sgl, batch(16, seeds=seeds))
    assert not torch.equal(bad.draft_probs, q)
    head.hot_token_id = hot


def test_invalid_rows_go_through_the_builder_as_the_one_hot_at_their_prefill_x(sgl, installed):
    """Row 1's hidden state is NaN (its q' row is NaN); row 2's sampler returns a token q'
    gives 0 (a near-greedy T underflows q' to exact zeros, and the engine's seeded draw
    offered to the synthesizer returns the least likely one). Through the real builder the
    verifier gets, for those rows, the one-hot at the request's own X (the prefill's),
    never the row; rows 0 and 3 of the same batch keep q' and X'. Counted invalid_row.
    The controls inside: the two rows really are invalid (NaN, q'(X') == 0)."""
    m = eagle3(sgl)
    rc = installed.recompute
    zero_row = 2

    def draws_a_zero(probs, seeds, positions):
        _, x = inverse_cdf(probs, seeds, positions)
        x = x.clone()
        x[zero_row, 0] = probs[zero_row].argmin()
        return probs.gather(1, x), x

    rc.bind_head(SGLangDraftHead(m, V), vocab_size=V, num_steps=1, rejection_sampling=True, draw=draws_a_zero)
    seeds = torch.tensor([21, 22, 23, 24], dtype=torch.int64)
    b = batch(4, seeds=seeds, temps=torch.tensor([0.8, 0.8, 1e-3, 0.8]))
    prefill_x = [3, 4, 5, 6]
    for r, x in zip(b.reqs, prefill_x):
        r.output_topk_index = torch.tensor([x])
    b.reqs[1].hidden_states_tensor = torch.full((H,), float("nan"))
    hidden = torch.stack([r.hidden_states_tensor for r in b.reqs])
    q = sgl.spec_utils.sampling_softmax(own_logits(sgl, m, hidden), temperatures=b.sampling_info.temperatures)
    _, x = draws_a_zero(q, seeds, b.seq_lens)
    assert bool(torch.isnan(q[1]).all()), "control: the NaN row's q' is NaN"
    assert float(q[zero_row, x[zero_row, 0]]) == 0.0, "control: the sampler's X' has q'(X') = 0"
    assert bool(torch.isfinite(q[[0, 3]]).all()) and bool((q.gather(1, x)[[0, 3]] > 0).all())

    si = build(sgl, b)

    for i in (1, zero_row):
        assert torch.equal(si.draft_probs[i], one_hots([prefill_x[i]])[0]), f"row {i}"
        assert int(si.topk_index[i, 0]) == prefill_x[i]
        assert float(si.topk_p[i, 0]) == 0.5  # the prefill's own q(X), untouched
    for i in (0, 3):
        assert torch.equal(si.draft_probs[i], q[i]) and torch.equal(si.topk_index[i], x[i])
        assert torch.equal(si.topk_p[i], q[i].gather(0, x[i]))
    assert bool(torch.isfinite(si.draft_probs).all())
    assert rc.counts["fallback:invalid_row"] == 2 and rc.counts["recomputed"] == 2
    assert rc.synth.counts["invalid_row"] == 2


def _boom(*args, **kwargs):
    raise RuntimeError("injected")


@pytest.mark.parametrize("fallback", ["unknown_head", "prepare"])
@pytest.mark.parametrize("inert", ["returns_none", "raises"])
def test_an_inert_sglang_proposal_still_gets_the_drop_ins_one_hot_even_for_x_out_of_range(
    sgl, monkeypatch, inert, fallback
):
    """SGLang's own pd_first_draft_proposal made inert before the drop-in wraps it (as the
    server tier's seed_builder override does): a fallen-back batch (no head bound, or a
    prepare that raises) still gets the drop-in's own one-hot at X, float32, each row
    summing to 1, even for X = V and X = -1 (clamped into [0, V)), with no exception into
    SGLang, and SGLang's function is never called. Controls: the wrapped function is the
    inert one, it gives nothing usable, and SGLang's real one raises for X = V or -1."""
    real = sgl.builder.pd_first_draft_proposal
    for bad in (V, -1):
        with pytest.raises((RuntimeError, IndexError)):
            real(torch.tensor([[bad]]), V)
    calls = []

    def pd_first_draft_proposal(topk_index, vocab_size):
        calls.append(topk_index)
        if inert == "raises":
            raise RuntimeError("SGLang's own proposal made inert")
        return None

    monkeypatch.setattr(sgl.builder, "pd_first_draft_proposal", pd_first_draft_proposal)
    inst = S.install(load_config(CONFIG), S.InstallOptions(hook_scheduler=False))
    try:
        (wrapped,) = [p for p in inst.patches if p.name == "pd_first_draft_proposal"]
        assert wrapped.original is pd_first_draft_proposal
        if inert == "raises":
            with pytest.raises(RuntimeError, match="made inert"):
                wrapped.original(torch.tensor([[5]]), V)
        else:
            assert wrapped.original(torch.tensor([[5]]), V) is None
        calls.clear()
        rc = inst.recompute
        if fallback == "prepare":
            start(sgl, inst, eagle3(sgl))
            monkeypatch.setattr(rc, "prepare", _boom)
        for x in (5, V, -1):
            b = batch(3)
            for r in b.reqs:
                r.output_topk_index = torch.tensor([x])
            si = build(sgl, b)
            p = si.draft_probs
            assert p.dtype == torch.float32 and p.shape == (3, V), (x, p.dtype, p.shape)
            assert torch.equal(p, one_hots([min(max(x, 0), V - 1)] * 3)), x
            assert torch.equal(p.sum(dim=1), torch.ones(3)), x
            assert si.topk_index.view(-1).tolist() == [x] * 3
        assert calls == [], "the fallback must never reach SGLang's own (inert) function"
        if fallback == "unknown_head":
            assert rc.counts["fallback:unknown_head"] == 9
        else:
            assert inst.guard.counts["guard:prepare:RuntimeError"] == 3
        assert not [k for k in inst.guard.counts if k.startswith("guard:propose")]
    finally:
        S.uninstall()


# ----------------------------------------------------------------------------- startup refusals: token map, width


class EagleDraftWorker:
    """Scheduler-shaped stand-in for SGLang's EagleDraftWorker (named like it, so capture checks
    its attributes against the table): EAGLE keeps --speculative-token-map here
    (eagle_worker_v2.py around 332 and 372), not on the model."""

    def __init__(self, model, hot_token_id):
        self.hot_token_id = hot_token_id
        self.draft_runner = SimpleNamespace(model=model)
        self.parallel_layout = None


TOKEN_MAPS = {
    "permutation": lambda: torch.randperm(V, generator=torch.Generator().manual_seed(9)),
    "partial": lambda: torch.arange(V - 33),  # a hot vocabulary smaller than the target's
    "identity": lambda: torch.arange(V),
    "none": lambda: None,
}


@pytest.mark.parametrize("hot", list(TOKEN_MAPS))
def test_a_worker_level_token_map_is_refused_at_start_unless_it_is_the_identity(sgl, installed, hot):
    """EAGLE with --speculative-token-map keeps hot_token_id on the worker; the head read only
    the model's, so q' stayed in draft order while SGLang mapped X' (defect 4). capture
    refuses a map that is not the identity, naming the flag, and binds nothing; an identity
    map and no map are accepted, and the EAGLE head then serves q' = softmax of the model's
    own LogitsProcessor output (no norm), X' drawn from it."""
    m = eagle1(sgl)
    worker = EagleDraftWorker(m, TOKEN_MAPS[hot]())
    assert getattr(m, "hot_token_id", None) is None, "the map is the worker's alone"
    sched = SimpleNamespace(draft_worker=SimpleNamespace(draft_worker=worker), enable_overlap=False)
    rc = installed.recompute
    if hot in ("permutation", "partial"):
        with pytest.raises(ConfigError, match=r"not the identity \(--speculative-token-map"):
            capture(rc, sched, vocab_size=V, num_steps=1, rs=True)
        assert rc.head is None and rc.synth is None  # nothing bound: no X' is ever drawn
        return
    capture(rc, sched, vocab_size=V, num_steps=1, rs=True)
    assert rc.head is not None and rc.head.arch == "LlamaForCausalLMEagle"
    seeds = torch.arange(6, dtype=torch.int64) + 40
    b = batch(6, seeds=seeds)
    hidden = torch.stack([r.hidden_states_tensor for r in b.reqs])
    meta = sgl.lp.LogitsMetadata(forward_mode=sgl.fb.ForwardMode.DECODE)
    with torch.no_grad():
        logits = m.logits_processor(torch.zeros(6, dtype=torch.long), hidden, m.lm_head, meta).next_token_logits
    q = sgl.spec_utils.sampling_softmax(logits, temperatures=b.sampling_info.temperatures)
    p_x, x = reference_draw(rc, q, seeds, b.seq_lens)
    si = build(sgl, b)
    assert torch.equal(si.draft_probs, q) and torch.equal(si.topk_index, x) and torch.equal(si.topk_p, p_x)
    assert rc.counts["recomputed"] == 6


def test_an_eagle3_models_own_non_identity_map_is_refused_at_start(sgl, installed):
    """The same refusal for the map SGLang's EAGLE3 keeps on the model (its d2t)."""
    m = eagle3(sgl)
    m.hot_token_id = TOKEN_MAPS["permutation"]()
    with pytest.raises(ConfigError, match="not the identity"):
        start(sgl, installed, m)
    assert installed.recompute.head is None
    m.hot_token_id = torch.arange(V)  # control: the identity is accepted
    start(sgl, installed, m)
    assert installed.recompute.head is not None


@pytest.mark.parametrize("delta", [-8, 8])
def test_a_draft_whose_logits_are_not_the_target_width_is_refused_at_start(sgl, installed, delta):
    """The draft logits' real width (its LogitsProcessor's vocab_size, what the head's slice
    leaves) is checked at startup, before any X' can be drawn or written (defect 5: the old
    check compared the target V with itself, head.vocab_size being V): a narrower draft and
    a wider one are refused. Negative control: the same model at the target's width is
    accepted."""
    other = eagle3(sgl, draft_vocab=V + delta)
    probe = SGLangDraftHead(other, V)
    assert probe.vocab_size == V and probe.logits_width == V + delta
    assert probe.logits(torch.randn(2, H)).shape == (2, V + delta), "the real width of the draft's logits"
    rc = installed.recompute
    with pytest.raises(ConfigError, match=rf"logits over {V + delta} ids, the target's vocabulary is {V}"):
        start(sgl, installed, other)
    assert rc.head is None and rc.synth is None
    b = batch(3)
    si = build(sgl, b)  # nothing bound: every request keeps the prefill's X, one-hot
    assert si.topk_index.view(-1).tolist() == [5, 5, 5] and torch.equal(si.draft_probs, one_hots([5] * 3))
    assert [r.output_topk_index.tolist() for r in b.reqs] == [[5]] * 3
    start(sgl, installed, eagle3(sgl, draft_vocab=V))
    assert rc.head is not None and rc.head.logits_width == V


# ----------------------------------------------------------------------------- a live A/B arm

ARMS_CONFIG = Path(__file__).parent.parent / "configs" / "sglang_live_ab_recompute.toml"


@pytest.fixture
def armed(sgl):
    """configs/sglang_live_ab_recompute.toml (arms recompute, sparse, one_hot) on an
    activated decode with the in-band channel, V = 97, and the real EAGLE3 head captured."""
    facts = S.EngineFacts(role="decode", vocab_size=V, num_steps=1, algorithm="EAGLE", topk=1, rejection_sampling=True)
    inst = S.install(load_config(ARMS_CONFIG), S.InstallOptions(channel="metadata", facts=facts))
    m = eagle3(sgl)
    start(sgl, inst, m)
    yield inst, m
    S.uninstall()


def arms_of(rooms):
    """The arm ab_split gives each room (the plugin's own hash), for the config's three arms."""
    from pd_middleware_plugins.ab_split import arm_for

    return [arm_for(str(r), ("recompute", "sparse", "one_hot"), (1, 2, 3)) for r in rooms]


def shipped(inst, b, seed=5):
    """What the prefill ships for every request of ``b`` (the config's sparse encoder, X ~ q_k),
    committed as the in-band commit does (the request's X, then ``on_row``); the payloads."""
    import msgspec

    from pd_middleware.core.payload import Payload
    from pd_middleware.middleware import build_encoders

    cfg = inst.config
    cfg = msgspec.structs.replace(cfg, arms=[], model=cfg.model.with_shapes(V, 1, engine="test"))
    enc = build_encoders(cfg)["default"]
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(len(b.reqs), V, generator=g) * 2, -1)
    out = enc.encode(q, generator=g)
    payloads = []
    for i, r in enumerate(b.reqs):
        x = int(out.tokens[i, 0])
        p = Payload(
            request_id=str(r.bootstrap_room),
            draft_tokens=(x,),
            draft_probs=(float(out.token_probs[i, 0]),),
            vocab_size=V,
            provenance=out.provenance,
            proposal=out.proposals[i],
        )
        r.output_topk_index = torch.tensor([x])
        r.output_topk_p = out.token_probs[i].clone()
        inst.proposer.on_row(r, p)
        payloads.append(p)
    return payloads


@pytest.mark.parametrize("overlap", [False, True])
def test_live_ab_arms_mix_recompute_shipped_and_one_hot_each_row_with_its_own_law(sgl, armed, overlap):
    """One mixed batch through SGLang's real builder: every row gets its arm's law, and the
    pair (X, q) handed per row is one X drawn from that q. Recompute rows: X' drawn (SGLang's
    seeded sampler, the row's own seed and position) from q' = softmax(head(h)/T) of that
    row, q' handed; sparse rows: the prefill's X with the shipped q_k it was drawn from;
    one-hot rows: δ at the prefill's X. Only the recompute rows are recomputed (counted)."""
    from pd_middleware.sampling.encodings import sparse_law_tensor

    inst, m = armed
    seeds = torch.arange(24, dtype=torch.int64) + 40
    b = batch(24, seeds=seeds, overlap=overlap)
    arms = arms_of(r.bootstrap_room for r in b.reqs)
    assert set(arms) == {"recompute", "sparse", "one_hot"}
    payloads = shipped(inst, b)
    fm = RecordingFutureMap()
    si = build(sgl, b, fm)
    if overlap:  # acted before the stash: the relay carries every row's X and q
        assert torch.equal(fm.stashed.topk_index, si.topk_index) and torch.equal(fm.stashed.draft_probs, si.draft_probs)
    mine = [i for i, a in enumerate(arms) if a == "recompute"]
    idx = torch.tensor(mine)
    hidden = torch.stack([b.reqs[i].hidden_states_tensor for i in mine])
    q = sgl.spec_utils.sampling_softmax(own_logits(sgl, m, hidden), temperatures=b.sampling_info.temperatures[idx])
    if inst.recompute.sampler == "sglang.fast_sample":
        p_x, x = sgl.spec_utils.fast_sample(q, 1, sampling_seed=seeds[idx], positions=b.seq_lens[idx])
    else:
        p_x, x = inverse_cdf(q, seeds[idx], b.seq_lens[idx])
    assert torch.equal(si.draft_probs[idx], q)
    assert torch.equal(si.topk_index[idx], x) and torch.equal(si.topk_p[idx], p_x)
    for i, a in enumerate(arms):
        row, xi = si.draft_probs[i], int(si.topk_index[i, 0])
        assert row[xi] > 0, (i, a)  # X is in the support of the q handed with it
        assert b.reqs[i].pd_middleware.arm == a
        if a == "sparse":
            assert xi == payloads[i].draft_tokens[0]
            assert torch.equal(row, sparse_law_tensor(payloads[i].proposal, 1, V)[0]), i
            assert (row < 1).all()
        elif a == "one_hot":
            assert xi == payloads[i].draft_tokens[0]
            assert torch.equal(row, torch.nn.functional.one_hot(torch.tensor(xi), V).float()), i
        else:
            assert b.reqs[i].pd_middleware.reason == "recompute"
    assert inst.recompute.counts["recomputed"] == len(mine)
    assert inst.proposer.counts["proposal:prefill"] == 24 - len(mine)


def test_the_arm_split_is_a_function_of_the_request_the_same_on_every_rank(sgl, armed):
    """Two installations (two TP ranks) over one batch: the same recompute rows, bit-identical
    q and X; the batch in another order: each request keeps its arm."""
    inst, m = armed
    b0 = batch(16)
    shipped(inst, b0)
    first = build(sgl, b0)
    rows0 = inst.source.prepare(b0).mine
    S.uninstall()
    facts = S.EngineFacts(role="decode", vocab_size=V, num_steps=1, algorithm="EAGLE", topk=1, rejection_sampling=True)
    other = S.install(load_config(ARMS_CONFIG), S.InstallOptions(channel="metadata", facts=facts))
    start(sgl, other, m)
    b1 = batch(16)
    shipped(other, b1)
    second = build(sgl, b1)
    assert other.source.prepare(b1).mine == rows0
    assert torch.equal(first.draft_probs, second.draft_probs) and torch.equal(first.topk_index, second.topk_index)
    rev = batch(16)
    rev.reqs.reverse()
    got = other.source.prepare(rev)
    assert sorted(rev.reqs[i].bootstrap_room for i in got.mine) == sorted(b0.reqs[i].bootstrap_room for i in rows0)


def test_live_ab_reports_the_recompute_arm(sgl, armed, tmp_path):
    """The first verify of each request of the mixed batch is counted under its arm, and
    ``pd-middleware live-ab`` lists the recompute arm beside the shipped ones."""
    import json
    import subprocess
    import sys

    inst, _ = armed
    b = batch(24)
    shipped(inst, b)
    build(sgl, b)
    for r in b.reqs:
        r.spec_verify_ct = 0
    before = inst.recorder.before(b)
    for r in b.reqs:
        r.spec_verify_ct = 1
    accepted = [i % 2 for i in range(24)]
    assert inst.recorder.after(b, SimpleNamespace(num_correct_drafts_per_req_cpu=accepted), before) == 24
    snap = tmp_path / "snapshot.json"
    snap.write_text(json.dumps(inst.metrics.snapshot()))
    out = subprocess.run(
        [sys.executable, "-m", "pd_middleware.cli", "live-ab", "--from", str(snap), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["arm"]: r for r in json.loads(out.stdout)["arms"]}
    arms = arms_of(r.bootstrap_room for r in b.reqs)
    for a in ("recompute", "sparse", "one_hot"):
        mine = [accepted[i] for i in range(24) if arms[i] == a]
        assert rows[a]["first_verifies"] == len(mine) and rows[a]["acceptance"] == pytest.approx(sum(mine) / len(mine))
    assert set(rows) == {"recompute", "sparse", "one_hot"}


def test_two_recompute_arms_and_the_side_channel_are_refused(sgl):
    import msgspec

    cfg = load_config(ARMS_CONFIG)
    arms = [*cfg.arms, msgspec.structs.replace(cfg.arms[0], name="recompute2")]
    with pytest.raises(
        ConfigError, match=r"at arms: .*2 arms whose synthesizer needs the draft head \(recompute, recompute2\)"
    ):
        S.install(msgspec.structs.replace(cfg, arms=arms), S.InstallOptions(channel="metadata"))
    with pytest.raises(ConfigError, match=r'at sglang.channel: .*recompute arm .* channel = "metadata" only'):
        S.install(cfg, S.InstallOptions(channel="sidechannel"))
    assert S.current() is None


def test_a_prefill_with_a_recompute_arm_ships_every_request_and_captures_no_head(sgl):
    """The same config on the prefill: its top-level encoder ships a row for every request
    (whatever its arm: the decode splits), and nothing of the recompute runs there."""
    from pd_middleware.integrations.sglang.arms import ArmedSource

    facts = S.EngineFacts(role="prefill", vocab_size=V, num_steps=1, algorithm="EAGLE", topk=1, rejection_sampling=True)
    inst = S.install(load_config(ARMS_CONFIG), S.InstallOptions(channel="metadata", facts=facts))
    try:
        assert isinstance(inst.source, ArmedSource) and inst.recompute.head is None
        reqs = [
            SimpleNamespace(bootstrap_room=100 + i, rid=f"r{i}", origin_input_ids=[1, 2, 3], output_ids=[])
            for i in range(6)
        ]
        enc = inst.stage_requests(
            reqs, torch.softmax(torch.randn(6, V, generator=torch.Generator().manual_seed(2)), -1)
        )
        assert enc.tokens.shape == (6, 1)
        assert all(p is not None and p.kind == "sparse" for p in enc.proposals)
        assert inst.publisher.counts["staged"] == 6, dict(inst.publisher.counts)
    finally:
        S.uninstall()


def test_a_recompute_arm_without_a_scheduler_splits_by_the_batchs_shapes(sgl):
    """Function-level use (``hook_scheduler=False``, no activation: SGLang's own builder
    tests): the split still routes with the batch's V, the recompute rows are recomputed
    and the others, with no row committed, verify the one-hot at their X; no guard event."""
    inst = S.install(load_config(ARMS_CONFIG), S.InstallOptions(channel="metadata", hook_scheduler=False))
    try:
        start(sgl, inst, eagle3(sgl))
        b = batch(12)
        arms = arms_of(r.bootstrap_room for r in b.reqs)
        si = build(sgl, b)
        mine = [i for i, a in enumerate(arms) if a == "recompute"]
        assert mine and inst.recompute.counts["recomputed"] == len(mine)
        assert not inst.events.snapshot(), inst.events.snapshot()
        for i, a in enumerate(arms):
            if a != "recompute":
                assert int(si.topk_index[i, 0]) == 5 and float(si.draft_probs[i, 5]) == 1.0
    finally:
        S.uninstall()
