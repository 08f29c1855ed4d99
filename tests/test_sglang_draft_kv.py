"""Every chain step's draft KV across the PD transfer, through SGLang 0.5.23's real code.

Real: ``MHATokenToKVPool`` (target and one pool per chain step, on the CPU), their
``get_contiguous_buf_infos``, ``BaseSpecWorker.primary_draft_kv_pool`` (the property the
scheduler hands the transfer), ``MooncakeKVManager._send_kvcache_generic`` and
``CommonKVManager.get_mha_kv_ptrs_with_pp`` (how Mooncake pairs the two nodes' KV entries),
``MooncakeKVManager._validate_peer_state_layout``, ``KVArgsRegisterInfo.from_zmq`` and
``CommonKVManager.try_ensure_parallel_info``. Stand-ins, said where used: the transfer
engine is ``ctypes.memmove`` of each block SGLang plans (``_transfer_data``), the KV
managers and the scheduler are namespaces with the attributes those functions read, and
the bootstrap server's answer is a patched ``requests.get``.
"""

from __future__ import annotations

import ctypes
import struct
from types import MethodType, SimpleNamespace
from unittest.mock import patch

import numpy as np
import pytest
import torch

from pd_middleware.config import parse_config
from pd_middleware.integrations import sglang as S
from pd_middleware.integrations.sglang import draft_kv as D

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("sglang_uninstall")]

STEPS = 3
SLOTS = 24
HEADS, DIM = 2, 4
SEED = 5


@pytest.fixture
def sg(sglang_importable):
    import importlib

    return SimpleNamespace(
        pool=importlib.import_module("sglang.srt.mem_cache.memory_pool"),
        mooncake=importlib.import_module("sglang.srt.disaggregation.mooncake.conn"),
        common=importlib.import_module("sglang.srt.disaggregation.common.conn"),
        spec=importlib.import_module("sglang.srt.speculative.base_spec_worker"),
        prefill=importlib.import_module("sglang.srt.disaggregation.prefill"),
        decode=importlib.import_module("sglang.srt.disaggregation.decode"),
    )


def pool(sg, layers=1, heads=HEADS):
    return sg.pool.MHATokenToKVPool(SLOTS, 1, torch.bfloat16, heads, DIM, layers, "cpu", False)


def sg_pool_heads(node, heads):
    return pool(node.sg, heads=heads)


class Node:
    """One node's pools: the target's and one per chain step, sharing one slot index space."""

    def __init__(self, sg, target_layers, steps=STEPS):
        self.sg = sg
        self.target = pool(sg, target_layers)
        self.steps = [pool(sg) for _ in range(steps)]
        allocator = object()  # the one allocator every runner shares (tp_worker.py around 405)
        slots = SimpleNamespace(req_to_token=torch.zeros((2, SLOTS), dtype=torch.int32))
        self.runners = [
            SimpleNamespace(token_to_kv_pool=p, token_to_kv_pool_allocator=allocator, req_to_token_pool=slots)
            for p in self.steps
        ]
        runners = self.runners

        class SpecWorker:  # the scheduler's draft_worker: SGLang's own property picks the primary pool
            primary_draft_kv_pool = sg.spec.BaseSpecWorker.primary_draft_kv_pool
            draft_worker = SimpleNamespace(draft_runners=runners)

            def _draft_model_runners(self):
                return tuple(runners)

        self.scheduler = SimpleNamespace(
            draft_worker=SpecWorker(),
            token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: self.target),
        )

    def fill(self, gen, slots):
        for p in [self.target, *self.steps]:
            for buf in [*p.k_buffer, *p.v_buffer]:
                buf[slots] = torch.randn(buf[slots].shape, generator=gen).to(buf.dtype)

    def kv_data(self):
        """``kv_args.kv_data_ptrs/lens/item_lens`` as prefill.py/decode.py build them: the
        target's, then SGLang's primary draft pool's ``get_contiguous_buf_infos()``."""
        ptrs, lens, items = (list(x) for x in self.target.get_contiguous_buf_infos())
        primary = self.scheduler.draft_worker.primary_draft_kv_pool
        p, n, i = primary.get_contiguous_buf_infos()
        return ptrs + list(p), lens + list(n), items + list(i), len(p)


def transfer(sg, src: Node, dst: Node, src_slots, dst_slots, dst_ptrs=None) -> int:
    """Mooncake's send path for one request (real pairing; memmove as the engine).
    ``dst_ptrs``: the decode's registered list (its ``kv_args.kv_data_ptrs`` if None)."""
    ptrs, _, items, num_draft = src.kv_data()
    dst_ptrs = dst.kv_data()[0] if dst_ptrs is None else dst_ptrs

    def _transfer_data(session, blocks):
        for s, d, n in blocks:
            ctypes.memmove(int(d), int(s), int(n))
        return 0

    mgr = SimpleNamespace(
        kv_args=SimpleNamespace(prefill_start_layer=0, num_draft_entries=num_draft),
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        enable_custom_mem_pool=False,
        max_transfer_batch_indices=0,
        pp_size=1,
        _transfer_data=_transfer_data,
    )
    mgr.get_mha_kv_ptrs_with_pp = MethodType(sg.common.CommonKVManager.get_mha_kv_ptrs_with_pp, mgr)
    return sg.mooncake.MooncakeKVManager._send_kvcache_generic(
        mgr,
        mooncake_session_id="decode",
        src_data_ptrs=ptrs,
        dst_data_ptrs=dst_ptrs,
        item_lens=items,
        prefill_data_indices=np.asarray(src_slots, dtype=np.int32),
        dst_data_indices=np.asarray(dst_slots, dtype=np.int32),
        executor=None,
    )


def equal_at(a, b, a_slots, b_slots) -> bool:
    return all(
        torch.equal(x[a_slots], y[b_slots]) for x, y in zip([*a.k_buffer, *a.v_buffer], [*b.k_buffer, *b.v_buffer])
    )


def per_step(src: Node, dst: Node, s, d) -> list[bool]:
    return [equal_at(p, q, s, d) for p, q in zip(src.steps, dst.steps)]


PROMPT_SRC, PROMPT_DST = [3, 4, 5, 9, 10], [7, 8, 2, 12, 13]


def test_facts_every_step_owns_a_pool_in_one_slot_space_and_sglang_transfers_the_first(sg) -> None:
    """The code read as facts: the primary pool is step 1's, and SGLang's list holds it alone."""
    node = Node(sg, target_layers=2)
    assert node.scheduler.draft_worker.primary_draft_kv_pool is node.steps[0]
    ptrs, _, _, num_draft = node.kv_data()
    assert num_draft == 2 and ptrs[-2:] == node.steps[0].get_contiguous_buf_infos()[0]
    others = {p for s in node.steps[1:] for p in s.get_contiguous_buf_infos()[0]}
    assert not others & set(ptrs)  # steps 2..S are not in the transfer


@pytest.mark.parametrize("target_layers", [1, 2, 3])
def test_stock_pairing_sends_step_one_only_and_all_steps_sends_every_step(sg, target_layers) -> None:
    gen = torch.Generator().manual_seed(SEED)
    p, d = Node(sg, target_layers), Node(sg, target_layers)
    p.fill(gen, PROMPT_SRC)
    # Stock SGLang on both nodes (negative control): steps 2..S never arrive.
    assert transfer(sg, p, d, PROMPT_SRC, PROMPT_DST) == 0
    assert equal_at(p.target, d.target, PROMPT_SRC, PROMPT_DST)
    assert per_step(p, d, PROMPT_SRC, PROMPT_DST) == [True, False, False]
    # The drop-in on both nodes: every step's pool in step order, the same pairing code.
    dp, dd = D.DraftKV(p.steps), D.DraftKV(d.steps)
    dp.install()
    dd.install()
    assert dp.entries == dd.entries == 2 * STEPS and dp.marker() == dd.marker()
    assert transfer(sg, p, d, PROMPT_SRC, PROMPT_DST) == 0
    assert equal_at(p.target, d.target, PROMPT_SRC, PROMPT_DST)
    assert per_step(p, d, PROMPT_SRC, PROMPT_DST) == [True, True, True]


def test_install_touches_only_the_primary_pool_and_remove_restores_it(sg) -> None:
    node = Node(sg, target_layers=2)
    own = [p.get_contiguous_buf_infos() for p in node.steps]
    dk = D.DraftKV(node.steps)
    dk.install()
    got = node.steps[0].get_contiguous_buf_infos()
    assert got == tuple([x for o in own for x in o[k]] for k in range(3))  # step order, each pool's order
    assert [p.get_contiguous_buf_infos() for p in node.steps[1:]] == own[1:]
    assert type(node.steps[0]).get_contiguous_buf_infos is sg.pool.MHATokenToKVPool.get_contiguous_buf_infos
    dk.remove()
    assert node.steps[0].get_contiguous_buf_infos() == own[0]
    assert "get_contiguous_buf_infos" not in vars(node.steps[0])


def test_a_pair_that_disagrees_would_write_into_the_wrong_buffers(sg) -> None:
    """Why the pair must refuse (negative control of the checks below): a prefill with
    SGLang's list and a decode with every step's pool, one target layer: SGLang pairs the
    prefill's step-1 KV with the decode's step-2 pool; the other way round the send fails."""
    gen = torch.Generator().manual_seed(SEED)
    p, d = Node(sg, 1), Node(sg, 1)
    p.fill(gen, PROMPT_SRC)
    D.DraftKV(d.steps).install()
    assert transfer(sg, p, d, PROMPT_SRC, PROMPT_DST) == 0
    assert equal_at(p.steps[0], d.steps[1], PROMPT_SRC, PROMPT_DST)  # the wrong pool
    assert not equal_at(p.steps[0], d.steps[0], PROMPT_SRC, PROMPT_DST)
    p2, d2 = Node(sg, 1), Node(sg, 1)
    D.DraftKV(p2.steps).install()
    with pytest.raises(IndexError):  # SGLang's pairing runs past the decode's shorter list
        transfer(sg, p2, d2, PROMPT_SRC, PROMPT_DST)


# ------------------------------------------------------------------ the drop-in, activated


def config(draft_kv="all_steps"):
    return parse_config(
        {
            "decode": {"max_batch": 8},
            "synthesizer": {"name": "sparse"},
            "encoder": {"name": "sparse", "options": {"mode": "topk", "k": 5, "value_dtype": "fp32"}},
            "sglang": {"seed": 7, "draft_kv": draft_kv},
        }
    )


def engine(role="decode", steps=STEPS, backend="mooncake", **settings):
    return S.EngineFacts(
        role=role,
        vocab_size=64,
        num_steps=steps,
        algorithm="EAGLE",
        topk=1,
        rejection_sampling=True,
        backend=backend,
        **settings,
    )


def activate(node, role, draft_kv="all_steps", steps=STEPS, backend="mooncake", **settings):
    inst = S.install(config(draft_kv), S.InstallOptions(channel="metadata", hook_scheduler=False))
    inst.activate(engine(role, steps, backend, **settings), scheduler=node.scheduler)
    return inst


def test_activation_registers_every_step_and_marks_the_layout(sg) -> None:
    node = Node(sg, 2)
    inst = activate(node, "prefill")
    assert inst.draft_kv is not None and inst.draft_kv.steps == STEPS
    assert node.kv_data()[3] == 2 * STEPS
    marker = f"pd-middleware-draft-kv steps={STEPS} entries={2 * STEPS}"
    assert manager_layout(sg, inst, None) == marker  # SGLang's own get_pd_kv_layout is None here
    assert manager_layout(sg, inst, "v4-layout") == f"v4-layout+{marker}"
    assert manager_layout(sg, inst, marker) == marker  # once
    assert S.uninstall()
    assert node.kv_data()[3] == 2
    assert not getattr(sg.common.CommonKVManager.__init__, "__pd_middleware__", False)


def manager_layout(sg, inst, layout):
    """``kv_args.kv_layout`` as SGLang's KV manager reads it (``self.kv_layout = args.kv_layout``):
    the installed wrapper of ``CommonKVManager.__init__``, around a stand-in of its body."""
    wrapped = sg.common.CommonKVManager.__init__
    assert wrapped.__pd_middleware__
    seen = []
    args = SimpleNamespace(kv_layout=layout)
    D.wrap_manager_init(lambda self, a, *rest: seen.append(a.kv_layout), inst)(None, args, "prefill", None, False)
    return seen[0]


def test_sglangs_manager_reads_the_layout_from_its_args(sg) -> None:
    import inspect

    src = inspect.getsource(sg.common.CommonKVManager.__init__)
    assert "self.kv_layout = args.kv_layout" in src
    assert "kv_args.kv_layout = get_pd_kv_layout(self.token_to_kv_pool)" in inspect.getsource(
        sg.prefill.PrefillBootstrapQueue._init_kv_manager
    )


@pytest.mark.parametrize(("draft_kv", "steps"), [("first_step", STEPS), ("all_steps", 1)])
def test_activation_keeps_sglangs_list_otherwise(sg, draft_kv, steps) -> None:
    node = Node(sg, 2, steps=steps)
    inst = activate(node, "decode", draft_kv=draft_kv, steps=steps)
    assert inst.draft_kv is None and node.kv_data()[3] == 2
    if draft_kv == "first_step":  # nothing of draft_kv is patched
        assert not getattr(sg.common.CommonKVManager.__init__, "__pd_middleware__", False)
    else:
        assert manager_layout(sg, inst, None) is None


def _shared_allocator_broken(node):
    node.runners[2].token_to_kv_pool_allocator = object()


def _pool_shared(node):
    node.runners[1].token_to_kv_pool = node.steps[0]


def _fused(node):
    type(node.scheduler.draft_worker).primary_draft_kv_pool = None  # SGLang's answer for a fused draft pool


def _layer_ids(node):
    node.target.get_kv_layer_ids = lambda: [0, 1]  # a HybridLinearKVPool-like target


def _step_slots_differ(node):
    # The allocator still shared: only step 3's req_to_token is its own.
    node.runners[2].req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros((2, SLOTS), dtype=torch.int32))


def _other_shape(node):
    # Step 2's MTP layer with twice the target's KV heads (its own pool, the same slots).
    other = node.steps[1] = sg_pool_heads(node, 2 * HEADS)
    node.runners[1].token_to_kv_pool = other


@pytest.mark.parametrize(
    ("spoil", "backend", "why"),
    [
        (None, "nixl", "the nixl backend"),
        (_shared_allocator_broken, "mooncake", "do not share one token index space"),
        (_pool_shared, "mooncake", "do not own one KV pool each"),
        (_fused, "mooncake", "a fused or unified draft pool"),
        (_layer_ids, "mooncake", "pairs its entries by layer id"),
        (_step_slots_differ, "mooncake", "do not share one token index space"),
        (_other_shape, "mooncake", "chain step 2's KV shape (4, 4, 4, (32,)) is not the target's (2, 4, 4, (16,))"),
    ],
)
def test_attach_keeps_sglangs_list_for_a_layout_it_does_not_read(sg, caplog, spoil, backend, why) -> None:
    node = Node(sg, 2)
    assert D.attach(Node(sg, 2).scheduler, engine()) is not None  # unspoiled: attached
    if spoil is not None:
        spoil(node)
    with caplog.at_level("WARNING", logger="pd_middleware.integrations.sglang"):
        assert D.attach(node.scheduler, engine(backend=backend)) is None
    assert why in caplog.text and '[sglang].draft_kv = "all_steps" left SGLang\'s draft KV transfer' in caplog.text
    assert "get_contiguous_buf_infos" not in vars(node.steps[0])


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"pp_size": 2}, "pipeline parallelism (2 stages"),
        ({"staging": True}, "SGLANG_DISAGG_STAGING_BUFFER is set"),
        ({"host_receive": True}, "host receive (--disaggregation-decode-host-receive-threshold"),
    ],
)
def test_attach_refuses_all_steps_where_sglang_would_not_move_every_entry(sg, caplog, settings, why) -> None:
    """The staging buffer (it gathers the primary draft pool only), a PP stage (stage-local
    pools), host receive (host buffers mirror SGLang's list): "all_steps" is refused at
    start with a line naming the flag, and nothing is advertised (no marker, SGLang's list
    and SGLang's own ``get_contiguous_buf_infos`` on pool 0, which its host-pool check reads)."""
    node = Node(sg, 2)
    assert D.attach(node.scheduler, engine()) is not None  # negative control
    node = Node(sg, 2)
    own = node.steps[0].get_contiguous_buf_infos()
    with caplog.at_level("WARNING", logger="pd_middleware.integrations.sglang"):
        assert D.attach(node.scheduler, engine(**settings)) is None
    assert why in caplog.text and '[sglang].draft_kv = "all_steps" left SGLang\'s draft KV transfer' in caplog.text
    assert "get_contiguous_buf_infos" not in vars(node.steps[0])
    assert node.steps[0].get_contiguous_buf_infos() == own and node.kv_data()[3] == 2


def _host_receive_check(sg, node):
    """SGLang's real host-pool check (``HostPoolGroup.get_contiguous_buf_infos``, which the
    decode runs at start under host receive and compares with its KV transfer list) on the
    target and the primary draft pool. Stand-ins: the group object and the host pool (its
    per-layer host buffers, the shapes of the device ones)."""
    import importlib

    group = importlib.import_module("sglang.srt.mem_cache.pool_host.group")
    pools = (node.target, node.steps[0])
    device = [b for p in pools for b in p.k_buffer] + [b for p in pools for b in p.v_buffer]
    host = SimpleNamespace(host_kv_data_refs=[torch.empty_like(b) for b in device], token_stride_size=HEADS * DIM * 2)
    entry = SimpleNamespace(
        name="kv", host_pool=host, device_pool=node.target, packed_draft_device_pools=(node.steps[0],)
    )
    return group.HostPoolGroup.get_contiguous_buf_infos(SimpleNamespace(entries=[entry], page_size=1))[0]


def test_host_receive_keeps_what_sglangs_host_pool_check_sees(sg) -> None:
    """The primary pool's override would reach SGLang's own host-pool check (the decode
    then fails at start: the negative control); under host receive "all_steps" is refused
    at start, so the check sees SGLang's own list, the one the decode transfers."""
    node = Node(sg, 2)
    sglang_list = node.kv_data()[:3]
    dk = D.DraftKV(node.steps)
    dk.install()
    with pytest.raises(ValueError, match="Host receive requires contiguous per-layer KV buffers"):
        _host_receive_check(sg, node)
    dk.remove()
    assert D.attach(node.scheduler, engine(host_receive=True)) is None
    assert _host_receive_check(sg, node) == tuple(sglang_list) == node.kv_data()[:3]


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"pp_size": 2}, "pipeline parallelism (2 stages"),
        ({"staging": True, "host_receive": True}, "SGLANG_DISAGG_STAGING_BUFFER is set"),
        ({"host_receive": True}, "host receive (--disaggregation-decode-host-receive-threshold"),
    ],
)
def test_activation_passes_sglangs_transfer_settings_to_the_attach(sg, caplog, settings, why) -> None:
    """Activation (not attach alone) under facts that say PP > 1, the staging buffer or
    host receive: "all_steps" is refused, with the line naming the flag and the setting,
    and SGLang's list is kept (the negative control: the same facts without them attach)."""
    node = Node(sg, 2)
    assert activate(node, "decode").draft_kv is not None  # negative control
    S.uninstall()
    node = Node(sg, 2)
    with caplog.at_level("WARNING", logger="pd_middleware.integrations.sglang"):
        inst = activate(node, "decode", **settings)
    assert inst.draft_kv is None and node.kv_data()[3] == 2
    assert why in caplog.text and '[sglang].draft_kv = "all_steps" left SGLang\'s draft KV transfer' in caplog.text


def test_the_facts_read_the_staging_switch_and_sglangs_runtime_context(monkeypatch) -> None:
    from pd_middleware.integrations.sglang import startup

    par = SimpleNamespace(tp_rank=0, pp_size=2)
    dis = SimpleNamespace(
        disaggregation_mode="decode",
        disaggregation_transfer_backend="mooncake",
        disaggregation_decode_host_receive_threshold=0.5,
    )
    spec = SimpleNamespace(
        enable_multi_layer_eagle=True,
        speculative_num_steps=STEPS,
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        speculative_use_rejection_sampling=True,
    )
    symbols = {startup.GET_PARALLEL: lambda: par, startup.GET_DISAGG: lambda: dis, startup.GET_SPEC: lambda: spec}
    scheduler = SimpleNamespace(model_config=SimpleNamespace(vocab_size=64))
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "true")
    assert startup.facts_from_scheduler(scheduler, symbols) == engine(pp_size=2, staging=True, host_receive=True)
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "0")
    par.pp_size, dis.disaggregation_decode_host_receive_threshold = 1, 1
    assert startup.facts_from_scheduler(scheduler, symbols) == engine()
    del dis.disaggregation_decode_host_receive_threshold  # releases before 0.5.21: no host receive
    assert startup.facts_from_scheduler(scheduler, symbols) == engine()
    del par.pp_size  # a published context without the field: another SGLang, said, not defaulted
    with pytest.raises(AttributeError, match="pp_size"):
        startup.facts_from_scheduler(scheduler, symbols)


@pytest.mark.parametrize(
    ("channel", "backend", "attached"), [("sidechannel", "mooncake", True), ("sidechannel", "nixl", False)]
)
def test_a_multi_layer_decode_with_a_non_metadata_source_honours_the_backend(
    sg, caplog, channel, backend, attached
) -> None:
    """Activation (not attach alone): a side-channel decode with "all_steps" attaches on
    Mooncake and keeps SGLang's list on another backend, naming it (the pair's check
    reads Mooncake's registration); a wrapper then passes SGLang's own answer through."""
    node = Node(sg, 2)
    cfg = config()
    inst = S.install(cfg, S.InstallOptions(channel=channel, hook_scheduler=False))
    facts = S.EngineFacts(
        role="decode",
        vocab_size=64,
        num_steps=STEPS,
        algorithm="EAGLE",
        topk=1,
        rejection_sampling=True,
        backend=backend,
    )
    with (
        caplog.at_level("WARNING", logger="pd_middleware.integrations.sglang"),
        patch.dict("os.environ", {"PD_MIDDLEWARE_DECODE_ADDRESS": "tcp://127.0.0.1:1"}),
    ):
        inst.activate(facts, scheduler=node.scheduler)
    assert (inst.draft_kv is not None) is attached
    assert node.kv_data()[3] == (2 * STEPS if attached else 2)
    if not attached:
        assert f"the {backend} backend" in caplog.text and "[sglang].draft_kv" in caplog.text
        # Layouts SGLang compares (both set): its own answer, accepted or raised.
        assert _ask(sg, _decode_manager(sg, "B"), "B") is True
        with pytest.raises(RuntimeError, match="KV layout mismatch"):
            _ask(sg, _decode_manager(sg, "B"), "A")


def _registration(kv_ptrs, aux_ptrs, frame):
    from sglang.srt.disaggregation.common.utils import pack_int_lists

    msg = [b"None", b"127.0.0.1", b"17000", b"127.0.0.1:17001", struct.pack(f"{len(kv_ptrs)}Q", *kv_ptrs)]
    msg += [struct.pack(f"{len(aux_ptrs)}Q", *aux_ptrs), pack_int_lists([], "Q"), b"0", b"1", b"0"]
    msg += [pack_int_lists([], "I"), pack_int_lists([], "I"), b"", b"", b"", b"", b"1", b"0", b"", b""]
    return [*msg, frame]


def _validate(sg, inst, node, decode_kv):
    info = sg.mooncake.KVArgsRegisterInfo.from_zmq(
        _registration([1] * decode_kv, [1] * 16, inst.channel.registration_frame())
    )
    mgr = SimpleNamespace(
        kv_args=SimpleNamespace(state_types=[], aux_data_ptrs=[0] * 16, kv_data_ptrs=node.kv_data()[0]),
        state_tp_size=1,
        attn_tp_size=1,
    )
    with patch.object(sg.mooncake, "get_spec", return_value=SimpleNamespace(speculative_algorithm="EAGLE")):
        return sg.mooncake.MooncakeKVManager._validate_peer_state_layout(mgr, info)[1]


def test_the_prefill_rejects_a_decode_session_with_another_kv_list(sg) -> None:
    node = Node(sg, 2)
    inst = activate(node, "prefill")
    local = len(node.kv_data()[0])  # 2 target layers x K,V + 3 steps x K,V
    assert local == 4 + 2 * STEPS
    assert _validate(sg, inst, node, local) is None
    why = _validate(sg, inst, node, 4 + 2)  # a decode with SGLang's list (step 1 only)
    assert why.startswith("pd-middleware: decode session 127.0.0.1:17001 registered 6 KV buffers, this prefill 10")
    assert '[sglang].draft_kv = "all_steps"' in why and '[sglang].draft_kv = "first_step" on this prefill' in why
    assert inst.guard.counts["draft_kv:peer_rejected"] == 1
    # The in-band row's own check still runs behind it (a row layout that differs).
    info_frame = b"pd-middleware-row rowv1 capacity=8192 vocab=64 steps=3 sig=0"
    info = sg.mooncake.KVArgsRegisterInfo.from_zmq(_registration([1] * local, [1] * 16, info_frame))
    mgr = SimpleNamespace(
        kv_args=SimpleNamespace(state_types=[], aux_data_ptrs=[0] * 16, kv_data_ptrs=node.kv_data()[0]),
        state_tp_size=1,
        attn_tp_size=1,
    )
    with patch.object(sg.mooncake, "get_spec", return_value=SimpleNamespace(speculative_algorithm="EAGLE")):
        assert (
            "pd-middleware proposal rows differ"
            in sg.mooncake.MooncakeKVManager._validate_peer_state_layout(mgr, info)[1]
        )


@pytest.mark.parametrize("extra", [-2, 2, 2 * STEPS])
def test_the_prefill_rejects_a_decode_with_fewer_or_more_kv_buffers(sg, extra) -> None:
    """Both directions: a decode that registered fewer buffers than this prefill (SGLang's
    list) and one that registered more (a longer chain, another target): each is rejected."""
    node = Node(sg, 2)
    inst = activate(node, "prefill")
    local = len(node.kv_data()[0])
    why = _validate(sg, inst, node, local + extra)
    assert why is not None and f"registered {local + extra} KV buffers, this prefill {local}" in why
    assert inst.guard.counts["draft_kv:peer_rejected"] == 1


def test_a_prefill_without_all_steps_does_not_check_kv_counts(sg) -> None:
    node = Node(sg, 2)
    inst = activate(node, "prefill", draft_kv="first_step")
    assert inst.draft_kv is None
    assert _validate(sg, inst, node, 4 + 2 * STEPS + 7) is None  # SGLang's own tolerance, as before


def _decode_manager(sg, layout):
    mgr = SimpleNamespace(
        prefill_info_table={},
        kv_args=SimpleNamespace(page_size=1, engine_rank=0, state_types=[]),
        kv_cache_dtype_str="auto",
        kv_layout=layout,
        dsv41_spec_layout=None,
        attn_tp_size=1,
        attn_cp_size=1,
        dcp_size=1,
        is_mla_backend=False,
        is_hybrid_mla_backend=False,
        _resolve_rank_mapping=lambda info: None,
    )
    return mgr


def _ask(sg, mgr, prefill_layout):
    data = dict(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=1, kv_cache_dtype=None)
    data["follow_bootstrap_room"] = True
    if prefill_layout is not None:
        data["kv_layout"] = prefill_layout
    answer = SimpleNamespace(status_code=200, json=lambda: data, text="")
    with patch.object(sg.common.requests, "get", return_value=answer):
        return sg.common.CommonKVManager.try_ensure_parallel_info(mgr, "10.0.0.1:8998")


GOOD, STOCK, OTHER = ("10.0.0.1", 8998), ("10.0.0.2", 8998), ("10.0.0.3", 8998)
OTHER_LAYOUT = "pd-middleware-draft-kv steps=2 entries=4"  # a peer with another chain length


def _real_decode_manager(sg, layout):
    """A real ``MooncakeKVManager`` object (its methods: ``try_ensure_parallel_info``,
    ``update_status``, ``record_failure``, ``check_status``), built without its
    ``__init__`` (which starts Mooncake's engine and threads): the state those methods
    read. Stand-in: ``_resolve_rank_mapping`` (TP/CP rank arithmetic, one rank here)."""
    import threading
    from collections import defaultdict

    mgr = object.__new__(sg.mooncake.MooncakeKVManager)
    vars(mgr).update(
        vars(_decode_manager(sg, layout)),
        request_status={},
        failure_records={},
        failure_lock=threading.Lock(),
        addr_to_rooms_tracker=defaultdict(set),
        prefill_response_tracker={},
        required_prefill_response_num_table={},
        deferred_bootstrap=None,
        defer_decode_allocation=False,
        _deferred_ack_targets={},
        _deferred_ack_poisoned_rooms=set(),
        _staging_outstanding={},
        enable_staging=False,
        waiting_timeout=300,
        local_ip="127.0.0.1",
        rank_port=17000,
        dcp_rank=0,
        get_session_id=lambda: "127.0.0.1:17001",  # Mooncake's engine's id (stand-in)
    )
    return mgr


def _answers(layouts):
    """The prefills' bootstrap servers (``GET /route``), by address: a patched ``requests.get``."""

    def get(url, timeout=None):
        host_port = url.split("//", 1)[1].split("/", 1)[0]
        data = dict(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=1, kv_cache_dtype=None)
        data["follow_bootstrap_room"] = True
        if layouts[host_port] is not None:
            data["kv_layout"] = layouts[host_port]
        return SimpleNamespace(status_code=200, json=lambda: data, text="")

    return get


def _queue(sg, mgr):
    """SGLang's real ``DecodePreallocQueue`` (built without its ``__init__``, which needs a
    scheduler and its pools): the state ``_resolve_pending_reqs``, ``_ensure_prefill_info``
    and ``_update_handshake_waiters`` read, with SGLang's own retry settings."""
    q = object.__new__(sg.decode.DecodePreallocQueue)
    vars(q).update(
        kv_manager=mgr,
        pending_reqs=[],
        queue=[],
        _ensure_last_attempt_time={},
        _ensure_retry_count={},
        _ensure_retry_interval=1.0,
        _max_ensure_retries=15,
        _prefill_dp_rank_queries={},
        pp_size=1,
        gloo_group=None,
        tp_rank=0,
        scheduler=SimpleNamespace(metrics_reporter=SimpleNamespace(enable_metrics=False)),
    )
    q.sent = {}  # the registration each prefill got (test only)
    return q


def _enqueue(sg, q, mgr, addr, room):
    """What ``DecodePreallocQueue.add`` does for a fresh request whose prefill is not yet
    known: a real ``MooncakeKVReceiver`` (stand-in: its ``_setup_bootstrap_infos``, the
    ZMQ connection to the prefill's ranks, which runs SGLang's real ``_register_kv_args``
    and captures the message), queued and pending."""
    req = SimpleNamespace(
        rid=f"rid-{room}",
        bootstrap_room=room,
        bootstrap_host=addr[0],
        bootstrap_port=addr[1],
        disagg_prefill_dp_rank=None,
        return_logprob=False,
        finished_reason=None,
        time_stats=SimpleNamespace(set_bootstrap_done_time=lambda: None),
    )
    receiver = sg.mooncake.MooncakeKVReceiver(mgr, f"{addr[0]}:{addr[1]}", room)

    def setup():  # SGLang's registration with one prefill rank, the ZMQ send captured
        receiver.bootstrap_infos = [{"rank_ip": addr[0], "rank_port": 9000}]
        receiver._send_bootstrap_message = lambda *, bootstrap_info, message, operation: (
            q.sent.setdefault(f"{addr[0]}:{addr[1]}", message) is not None
        )
        assert receiver._register_kv_args()

    receiver._setup_bootstrap_infos = setup
    dr = sg.decode.DecodeRequest(req=req, kv_receiver=receiver)
    q.queue.append(dr)
    q.pending_reqs.append(dr)
    return dr


def _step(sg, q, layouts):
    """One pass of the scheduler's prealloc loop over the handshake: resolve the pending
    requests (``_ensure_prefill_info`` calls ``try_ensure_parallel_info``), then the
    handshake waiters (a failed poll ends the request with SGLang's error). Stand-ins:
    the runtime context's allocation policy ("early", SGLang's default) and the one-rank
    gloo all-reduce of the polls (a MIN over one rank: the polls themselves)."""
    disagg = SimpleNamespace(disaggregation_decode_allocation_policy="early")
    with (
        patch.object(sg.common.requests, "get", _answers(layouts)),
        patch.object(sg.decode, "get_disagg", lambda: disagg),
        patch.object(sg.common, "get_disagg", lambda: disagg),
        patch.object(sg.decode, "poll_and_all_reduce", lambda pollers, group: [int(p.poll()) for p in pollers]),
    ):
        q._resolve_pending_reqs()
        q._update_handshake_waiters()


def _kv_args(node):
    ptrs, lens, items, num_draft = node.kv_data()
    return SimpleNamespace(
        kv_data_ptrs=ptrs,
        kv_data_lens=lens,
        kv_item_lens=items,
        num_draft_entries=num_draft,
        aux_data_ptrs=[1] * 16,
        state_data_ptrs=[],
        state_item_lens=[],
        state_layer_ids=[],
        kv_layer_ids=[],
        page_size=1,
        engine_rank=0,
        state_types=[],
    )


def test_a_prefill_with_another_draft_kv_layout_fails_its_requests_and_the_decode_serves_the_others(sg) -> None:
    """SGLang's real decode loop pieces, three prefills: one with the same layout, a stock
    one (no drop-in, or "first_step": SGLang's list) and one with another chain length.
    The last one's request ends with SGLang's handshake error carrying the reason (naming
    the flag), counted once; the stock prefill gets SGLang's list registered and its
    request is served with step 1's KV (counted); the matching one gets every step's. The
    scheduler never sees a raise: on the landed code ``_resolve_pending_reqs`` raised
    RuntimeError, which stops SGLang's scheduler with every in-flight request."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    node = Node(sg, 2)
    inst = activate(node, "decode")
    mine = inst.draft_kv.layout(None)
    layouts = {"10.0.0.1:8998": mine, "10.0.0.2:8998": None, "10.0.0.3:8998": OTHER_LAYOUT}
    mgr = _real_decode_manager(sg, mine)
    mgr.kv_args = SimpleNamespace(**{**vars(mgr.kv_args), **vars(_kv_args(node))})
    q = _queue(sg, mgr)
    good, stock, other = (_enqueue(sg, q, mgr, a, r) for a, r in ((GOOD, 11), (STOCK, 12), (OTHER, 13)))
    _step(sg, q, layouts)
    assert q.pending_reqs == []  # every prefill's info fetched and cached: no retries pending
    assert set(mgr.prefill_info_table) == set(layouts)
    # The refused request: SGLang's error, with the reason.
    assert isinstance(other.req.finished_reason, FINISH_ABORT)
    msg = other.req.finished_reason.message
    assert msg.startswith("Decode handshake failed for request rank=0")
    assert f"pd-middleware: the prefill at 10.0.0.3:8998 registers kv_layout '{OTHER_LAYOUT}'" in msg
    assert '[sglang].draft_kv = "first_step" on this decode' in msg
    assert inst.guard.counts["draft_kv:prefill_refused"] == 1
    # The matching and the stock prefills' requests are served: waiting for their KV.
    for served, room in ((good, 11), (stock, 12)):
        assert served.req.finished_reason is None and served.waiting_for_input
        assert mgr.request_status[room] == KVPoll.WaitingForInput
    assert inst.guard.counts["draft_kv:first_step_requests"] == 1
    # What each prefill was told: every step's pool, or SGLang's list (step 1's).
    registered = {a: sg.mooncake.KVArgsRegisterInfo.from_zmq(m).dst_kv_ptrs for a, m in q.sent.items()}
    assert set(registered) == {"10.0.0.1:8998", "10.0.0.2:8998"}  # the refused prefill is never contacted
    assert registered["10.0.0.1:8998"] == node.kv_data()[0] and len(node.kv_data()[0]) == 4 + 2 * STEPS
    assert registered["10.0.0.2:8998"] == node.kv_data()[0][: 4 + 2]
    assert mgr.kv_args.kv_data_ptrs == node.kv_data()[0]  # the decode's own list is left as it was
    # The loop keeps going: new requests from all three (the fast path: the info is cached).
    good2, stock2, other2 = (_enqueue(sg, q, mgr, a, r) for a, r in ((GOOD, 21), (STOCK, 22), (OTHER, 23)))
    _step(sg, q, layouts)
    assert (
        isinstance(other2.req.finished_reason, FINISH_ABORT)
        and "[sglang].draft_kv" in other2.req.finished_reason.message
    )
    assert good2.req.finished_reason is None and good2.waiting_for_input
    assert stock2.req.finished_reason is None and stock2.waiting_for_input
    assert inst.guard.counts["draft_kv:prefill_refused"] == 2  # once per refused request
    assert inst.guard.counts["draft_kv:first_step_requests"] == 2
    assert mgr.kv_layout == mine  # the decode's own layout is left as it was


def test_a_stock_prefill_sends_step_one_into_step_one_through_the_registered_list(sg) -> None:
    """Why SGLang's list is what the decode registers with a stock prefill: through
    Mooncake's real pairing, step 1's KV lands in the decode's step-1 pool and the target's
    in the target's (with the decode's full list it landed in step 2's: the negative
    control, ``test_a_pair_that_disagrees_would_write_into_the_wrong_buffers``)."""
    gen = torch.Generator().manual_seed(SEED)
    p, d = Node(sg, 1), Node(sg, 1)
    p.fill(gen, PROMPT_SRC)
    dk = D.DraftKV(d.steps)
    dk.install()
    full = d.kv_data()
    ptrs, items = dk.sglang_list(full[0], full[2])
    assert transfer(sg, p, d, PROMPT_SRC, PROMPT_DST, dst_ptrs=ptrs) == 0
    assert equal_at(p.target, d.target, PROMPT_SRC, PROMPT_DST)
    assert per_step(p, d, PROMPT_SRC, PROMPT_DST) == [True, False, False]
    assert items == full[2][: len(ptrs)]


def test_the_decode_refusal_names_the_flag_and_sglangs_own_fields_still_raise(sg) -> None:
    node = Node(sg, 2)
    inst = activate(node, "decode")
    dk = inst.draft_kv
    mine = dk.layout(None)
    assert _ask(sg, _decode_manager(sg, mine), mine) is True  # the drop-in on both nodes
    assert dk.refused == {} and dk.first_step_only == set()
    assert _ask(sg, _decode_manager(sg, mine), None) is True  # SGLang's list: served with step 1's KV
    assert dk.refused == {} and dk.first_step_only == {"10.0.0.1:8998"}
    assert _ask(sg, _decode_manager(sg, mine), OTHER_LAYOUT) is True  # another chain: refused, never raised
    why = dk.refused["10.0.0.1:8998"]
    assert dk.first_step_only == set()  # re-decided at each fetch
    assert why.startswith(f"pd-middleware: the prefill at 10.0.0.1:8998 registers kv_layout '{OTHER_LAYOUT}'")
    assert '[sglang].draft_kv = "first_step" on this decode' in why and mine in why
    # A prefill without the marker is SGLang's list, whatever SGLang's own part (SGLang's to compare).
    assert dk.first_step_only_from("v4", dk.layout("v4")) and dk.first_step_only_from(None, dk.layout("v4"))
    assert dk.decode_refusal("a", "v5", dk.layout("v4")) is None
    assert dk.decode_refusal("a", dk.layout("v4"), dk.layout("v4")) is None
    assert dk.decode_refusal("a", OTHER_LAYOUT, dk.layout("v4")) is not None
    # A page size mismatch is SGLang's own refusal, left as SGLang has it.
    mgr = _decode_manager(sg, mine)
    mgr.kv_args.page_size = 16
    with pytest.raises(RuntimeError, match="Page size mismatch"):
        _ask(sg, mgr, mine)


@pytest.mark.parametrize(
    ("prefill", "served"),
    [
        ("A", None),  # a stock prefill, another SGLang layout
        ("A+" + "pd-middleware-draft-kv steps=3 entries=6", None),  # the drop-in there, another SGLang layout
        ("B", "first_step"),  # a stock prefill, the same SGLang layout
        ("B+" + "pd-middleware-draft-kv steps=3 entries=6", "all_steps"),
        (None, "first_step"),  # SGLang compares only when both publish one
    ],
)
def test_sglangs_own_layout_check_is_sglangs_under_the_drop_in(sg, prefill, served) -> None:
    """A decode whose SGLang layout is "B" (``--dsv4-attn-backend`` / ``SGLANG_DSV4_KV_LAYOUT``)
    with the drop-in's marker: where the prefill's SGLang part is another ("A"), SGLang's own
    check raises its own mismatch, as it does without the drop-in (the negative control: a
    decode without the drop-in, "B" alone, raises the same); nothing is recorded as refused
    by the drop-in or served with step 1's KV. Otherwise the drop-in decides on its marker."""
    node = Node(sg, 2)
    inst = activate(node, "decode")
    dk = inst.draft_kv
    mine = dk.layout("B")
    assert mine == "B+pd-middleware-draft-kv steps=3 entries=6"
    if served is None:
        with pytest.raises(RuntimeError, match="KV layout mismatch") as stock:
            _ask(sg, _decode_manager(sg, "B"), prefill)  # without the drop-in
        with pytest.raises(RuntimeError, match="KV layout mismatch") as ours:
            _ask(sg, _decode_manager(sg, mine), prefill)
        assert str(ours.value) == str(stock.value)
        assert dk.refused == {} and dk.first_step_only == set()
        return
    mgr = _decode_manager(sg, mine)
    assert _ask(sg, mgr, prefill) is True and "10.0.0.1:8998" in mgr.prefill_info_table
    assert dk.refused == {} and mgr.kv_layout == mine
    assert dk.first_step_only == ({"10.0.0.1:8998"} if served == "first_step" else set())


def test_negative_control_without_the_drop_in_the_decode_accepts_that_prefill(sg) -> None:
    # SGLang alone compares kv_layout only when both nodes publish one: nothing refuses.
    mine = "pd-middleware-draft-kv steps=3 entries=6"
    assert _ask(sg, _decode_manager(sg, mine), None) is True


def test_the_flag_is_strict_and_its_default_follows_the_source() -> None:
    """Left out, "all_steps" only where the source ships proposals: a source that ships
    nothing (decode-only recompute, channel = "none") runs behind a stock prefill."""
    from pd_middleware import ConfigError
    from pd_middleware.integrations.sglang.patching import Plan
    from pd_middleware.integrations.sglang.recompute import RecomputeSource
    from pd_middleware.integrations.sglang.sources import InBandSource, SideChannelSource

    assert parse_config({}).sglang.draft_kv is None
    with pytest.raises(ConfigError, match=r"at sglang.draft_kv: Invalid enum value 'every'"):
        parse_config({"sglang": {"draft_kv": "every"}})

    def wanted(source, draft_kv=None):
        cfg = parse_config({"sglang": {} if draft_kv is None else {"draft_kv": draft_kv}})
        return D._all_steps(Plan(features=source.features, config=cfg, options=None))

    assert wanted(InBandSource) and wanted(SideChannelSource)
    assert not wanted(RecomputeSource)
    assert wanted(RecomputeSource, "all_steps") and not wanted(InBandSource, "first_step")


def test_the_shipped_recompute_config_keeps_sglangs_draft_kv_transfer() -> None:
    """configs/sglang.toml (a decode behind a stock prefill) says "first_step", written out
    so it stays: flipped to "all_steps", a multi-layer decode would patch SGLang's KV
    manager and receivers and register every step's pool for a prefill that never sends
    them (on the landed code it refused every request of that prefill)."""
    import tomllib
    from pathlib import Path

    from pd_middleware.integrations.sglang.patching import Plan
    from pd_middleware.integrations.sglang.recompute import RecomputeSource

    raw = tomllib.loads((Path(__file__).resolve().parents[1] / "configs" / "sglang.toml").read_text())
    cfg = parse_config(raw)
    assert cfg.sglang.draft_kv == "first_step" and cfg.sglang.channel == "none"  # a decode-only recompute
    assert not D._all_steps(Plan(features=RecomputeSource.features, config=cfg, options=None))
    # Negative control: the key flipped, the same source would run "all_steps".
    raw["sglang"]["draft_kv"] = "all_steps"
    assert D._all_steps(Plan(features=RecomputeSource.features, config=parse_config(raw), options=None))
