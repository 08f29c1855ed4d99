"""The SGLang integration (pd_middleware.integrations.sglang).

Two tiers in one file:

- Unmarked tests run everywhere. They drive the adapter through small stand-in module
  objects that mirror the shape of SGLang 0.5.23's ``eagle_disaggregation`` (its
  function looks ``pd_first_draft_proposal`` up as a module global) and of the prefill
  mixin, to cover version and signature checks, install/uninstall bookkeeping, the
  proposal store, the decode proposer and the prefill publisher.
- Tests marked ``sglang`` call the REAL SGLang package (``make setup-sglang``) and are
  skipped with a reason when it is absent.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
import types
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from pd_middleware import ConfigError, OneHotProposal, PluginError, SparseProposal
from pd_middleware.config import parse_config
from pd_middleware.core.contracts import PluginContext
from pd_middleware.decode.pipeline import Delivery, Failure
from pd_middleware.evaluation.verify import exact_verify_law
from pd_middleware.integrations import sglang as S
from pd_middleware.integrations.sglang.prefill import ProposalPublisher
from pd_middleware.integrations.sglang.store import ProposalStore
from pd_middleware.sampling.encodings import sparse_law_tensor

SEED = 1234
V = 16


def make_config(**over):
    data = {
        "model": {"vocab_size": V, "num_steps": 1, "hidden_size": 4},
        "decode": {"max_batch": 4},
        "transport": {"mooncake": {"enabled": False}},
    }
    for k, v in over.items():
        if k in data:
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return parse_config(data)


def install(cfg, *, decode_module=None, prefill_module=None, version=None, channel="sidechannel", **kw):
    """S.install with the stand-in modules given (only those are patched) or the real SGLang."""
    mods = S.SGLangModules(builder=decode_module, prefill=prefill_module, only_given=decode_module is not None)
    kw.setdefault("hook_scheduler", False)  # function-level: no Scheduler here
    return S.install(cfg, S.InstallOptions(channel=channel, modules=mods, version=version, **kw))


pytestmark = pytest.mark.usefixtures("sglang_uninstall")  # conftest: no installation outlives a test


# ----------------------------------------------------------------- stand-in SGLang modules


def fake_decode_module(name="fake_sglang_ed", proposal=True, build_params=None):
    """A module shaped like SGLang 0.5.23's eagle_disaggregation (only what the adapter reads)."""
    m = types.ModuleType(name)
    m.SPEC = SimpleNamespace(rs=True, multi_layer=False, num_steps=1)

    def pd_first_draft_proposal(topk_index, vocab_size):
        probs = torch.zeros((*topk_index.shape, vocab_size), dtype=torch.float32, device=topk_index.device)
        probs.scatter_(-1, topk_index.unsqueeze(-1), 1.0)
        return probs

    def build_eagle_disagg_draft_input(batch, last_tokens_tensor, future_map):
        n = m.SPEC.num_steps if m.SPEC.multi_layer else 1
        topk_index = torch.stack([torch.as_tensor(r.output_topk_index[:n], dtype=torch.int64) for r in batch.reqs])
        draft_probs = None
        if m.SPEC.rs and hasattr(m, "pd_first_draft_proposal"):
            draft_probs = m.pd_first_draft_proposal(topk_index, batch.model_config.vocab_size)  # module global
            if not m.SPEC.multi_layer:
                draft_probs = draft_probs[:, 0]
        return SimpleNamespace(topk_index=topk_index, draft_probs=draft_probs, future_indices=None)

    if build_params is not None:
        exec(f"def build_eagle_disagg_draft_input({build_params}): pass", m.__dict__)
    else:
        m.build_eagle_disagg_draft_input = build_eagle_disagg_draft_input
    if proposal:
        m.pd_first_draft_proposal = pd_first_draft_proposal
    return m


def fake_prefill_module():
    m = types.ModuleType("fake_sglang_prefill")

    class SchedulerDisaggregationPrefillMixin:
        def process_batch_result_disagg_prefill(self, batch, result):
            # Like SGLang: copy the (possibly overwritten) rows onto each finished request.
            for i, req in enumerate(batch.reqs):
                req.output_topk_index = result.next_draft_input.topk_index[i]
                req.output_topk_p = result.next_draft_input.topk_p[i]

    m.SchedulerDisaggregationPrefillMixin = SchedulerDisaggregationPrefillMixin
    return m


def req(tokens, room=None, p=0.5):
    return SimpleNamespace(
        output_topk_index=list(tokens),
        output_topk_p=[p] * len(tokens),
        hidden_states_tensor=torch.zeros(4),
        output_dsa_topk_indices=None,
        bootstrap_room=room,
        origin_input_ids=[1, 2, 3],  # the Req fields its draw is keyed on (prefill.draw_position)
        output_ids=[],
    )


def batch_of(reqs, vocab=V, overlap=False):
    return SimpleNamespace(
        reqs=reqs,
        device=torch.device("cpu"),
        model_config=SimpleNamespace(vocab_size=vocab, hf_config=SimpleNamespace()),
        enable_overlap=overlap,
        req_pool_indices=torch.arange(1, len(reqs) + 1),
        seq_lens=torch.full((len(reqs),), 10),
    )


class RecordingSender:
    """In-memory stand-in for a PrefillSender (I/O injection; the real one is tested below)."""

    def __init__(self):
        self.sent = []

    def send(self, payload):
        self.sent.append(payload)


# ----------------------------------------------------------------- version and signature checks


def test_detect_version_without_sglang(monkeypatch) -> None:
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(PluginError, match="SGLang is not installed"):
        S.detect_version()


def test_unsupported_version_refused_and_nothing_patched() -> None:
    m = fake_decode_module()
    build, prop = m.build_eagle_disagg_draft_input, m.pd_first_draft_proposal
    with pytest.raises(PluginError, match=r"SGLang 0\.4\.0 is older than the oldest supported release 0\.5\.18"):
        install(make_config(), decode_module=m, version="0.4.0")
    with pytest.raises(PluginError, match=r"SGLang 0\.6\.0 is not a supported version \('0\.5\.18', .*'0\.5\.23'\)"):
        install(make_config(), decode_module=m, version="0.6.0")
    assert m.build_eagle_disagg_draft_input is build and m.pd_first_draft_proposal is prop
    assert S.current() is None


def test_missing_proposal_function_refused_on_supported_version() -> None:
    m = fake_decode_module(proposal=False)
    build = m.build_eagle_disagg_draft_input
    with pytest.raises(PluginError, match=r"fake_sglang_ed\.pd_first_draft_proposal not found"):
        install(make_config(), decode_module=m, version="0.5.23")
    assert m.build_eagle_disagg_draft_input is build


def test_missing_build_function_refused() -> None:
    m = types.ModuleType("empty_ed")
    with pytest.raises(PluginError, match=r"empty_ed\.build_eagle_disagg_draft_input not found"):
        install(make_config(), decode_module=m, version="0.5.23")


def test_changed_signature_refused_and_nothing_patched() -> None:
    m = fake_decode_module(build_params="batch, last_tokens_tensor, future_map, extra=None")
    build, prop = m.build_eagle_disagg_draft_input, m.pd_first_draft_proposal
    with pytest.raises(PluginError, match=r"has parameters \('batch', 'last_tokens_tensor', 'future_map', 'extra'\)"):
        install(make_config(), decode_module=m, version="0.5.23")
    assert m.build_eagle_disagg_draft_input is build and m.pd_first_draft_proposal is prop


def test_missing_prefill_class_refused_before_decode_is_patched() -> None:
    m = fake_decode_module()
    build = m.build_eagle_disagg_draft_input
    pub = ProposalPublisher(object(), RecordingSender(), vocab_size=V)
    with pytest.raises(PluginError, match=r"empty_pre\.SchedulerDisaggregationPrefillMixin not found"):
        install(
            make_config(),
            decode_module=m,
            prefill_module=types.ModuleType("empty_pre"),
            publisher=pub,
            version="0.5.23",
        )
    assert m.build_eagle_disagg_draft_input is build


def test_bad_config_leaves_sglang_untouched() -> None:
    m = fake_decode_module()
    build = m.build_eagle_disagg_draft_input
    cfg = make_config(synthesizer={"name": "no_such_synth"})
    with pytest.raises(PluginError, match="no_such_synth"):
        install(cfg, decode_module=m, version="0.5.23")
    assert m.build_eagle_disagg_draft_input is build


def test_install_uninstall_idempotent_and_restores_identity() -> None:
    m = fake_decode_module()
    build, prop = m.build_eagle_disagg_draft_input, m.pd_first_draft_proposal
    a = install(make_config(), decode_module=m, version="0.5.23")
    b = install(make_config(), decode_module=m, version="0.5.23")  # replaces, never stacks
    assert S.current() is b and a is not b
    assert m.build_eagle_disagg_draft_input.__wrapped__ is build
    assert m.pd_first_draft_proposal.__wrapped__ is prop
    assert S.uninstall() is True
    assert m.build_eagle_disagg_draft_input is build and m.pd_first_draft_proposal is prop
    assert S.uninstall() is False


def test_uninstall_refuses_to_drop_a_foreign_patch() -> None:
    m = fake_decode_module()
    install(make_config(), decode_module=m, version="0.5.23")
    ours = m.build_eagle_disagg_draft_input
    m.pd_first_draft_proposal = lambda topk_index, vocab_size: None  # someone patched on top
    with pytest.raises(PluginError, match=r"pd_first_draft_proposal was replaced by someone else after install"):
        S.uninstall()
    assert m.build_eagle_disagg_draft_input is ours  # nothing restored half-way
    m.pd_first_draft_proposal = S.current().patches[1].replacement
    assert S.uninstall() is True


# ----------------------------------------------------------------- decode proposer


def test_one_hot_through_the_wrapped_function_single_and_multi_layer() -> None:
    m = fake_decode_module()
    install(make_config(decode={"max_batch": 2}), decode_module=m, version="0.5.23")
    reqs = [req([3]), req([0]), req([15])]  # 3 requests > max_batch 2: assembled in chunks
    out = m.build_eagle_disagg_draft_input(batch_of(reqs), None, None).draft_probs
    assert out.dtype == torch.float32 and tuple(out.shape) == (3, V)
    assert torch.equal(out, torch.nn.functional.one_hot(torch.tensor([3, 0, 15]), V).float())
    install(make_config(model={"vocab_size": V, "num_steps": 3}), decode_module=m, version="0.5.23")
    m.SPEC = SimpleNamespace(rs=True, multi_layer=True, num_steps=3)
    out = m.build_eagle_disagg_draft_input(batch_of([req([1, 2, 3]), req([4, 5, 6])]), None, None).draft_probs
    assert tuple(out.shape) == (2, 3, V)
    assert torch.equal(out.argmax(-1), torch.tensor([[1, 2, 3], [4, 5, 6]])) and torch.equal(
        out.sum(-1), torch.ones(2, 3)
    )


def test_config_mismatches_at_run_time_give_sglang_its_one_hot_counted(caplog) -> None:
    # A shape the config does not allow (adaptive spec changing the step count at run
    # time, another V) is a ConfigError inside the proposer: it never reaches SGLang's
    # scheduler, which gets its own one-hot for that batch, counted and logged once.
    m = fake_decode_module()
    inst = install(make_config(), decode_module=m, version="0.5.23")
    out = m.build_eagle_disagg_draft_input(batch_of([req([1])], vocab=32), None, None).draft_probs
    assert torch.equal(out, torch.nn.functional.one_hot(torch.tensor([1]), 32).float())
    m.SPEC = SimpleNamespace(rs=True, multi_layer=True, num_steps=2)
    out = m.build_eagle_disagg_draft_input(batch_of([req([1, 2])]), None, None).draft_probs
    assert torch.equal(out, torch.nn.functional.one_hot(torch.tensor([[1, 2]]), V).float())
    assert inst.guard.counts == {"guard:propose:ConfigError": 2}
    assert inst.proposer.metrics.fallbacks["sglang:guard:propose:ConfigError"] == 2
    logged = [r.getMessage() for r in caplog.records if "guard:propose:ConfigError" in r.getMessage()]
    assert len(logged) == 1 and "SGLang runs with vocab_size = 32, the config says 16" in logged[0]
    inst = install(make_config(decode={"rejection_sampling": False}), decode_module=m, version="0.5.23")
    m.SPEC = SimpleNamespace(rs=True, multi_layer=False, num_steps=1)
    out = m.build_eagle_disagg_draft_input(batch_of([req([1])]), None, None).draft_probs
    assert torch.equal(out, torch.nn.functional.one_hot(torch.tensor([1]), V).float())
    assert inst.guard.counts == {"guard:propose:ConfigError": 1}


def test_proposal_outside_the_build_call_is_sglangs() -> None:
    m = fake_decode_module()
    install(make_config(), decode_module=m, version="0.5.23")
    out = m.pd_first_draft_proposal(torch.tensor([[2]]), V)  # no batch in context
    assert tuple(out.shape) == (1, 1, V) and out[0, 0, 2] == 1.0


def _delivery(rid, tokens, proposal, released):
    from pd_middleware import Payload, Provenance

    p = Payload(rid, tuple(tokens), (0.5,) * len(tokens), V, provenance=Provenance(sampled_from="sparse-fp32"))
    return Delivery(p, proposal, "default", time.perf_counter(), lambda: released.append(rid))


def _sparse(idx, val):
    return SparseProposal((len(idx),), torch.tensor(idx), torch.tensor(val, dtype=torch.float32), (0.0,))


def test_store_feeds_proposals_and_counts_every_fallback() -> None:
    m = fake_decode_module()
    store = ProposalStore()
    inst = install(make_config(), decode_module=m, version="0.5.23", store=store)
    released: list[str] = []
    store.put(_delivery("7", [2], _sparse([2, 5], [0.75, 0.25]), released))  # matches
    store.put(_delivery("8", [9], _sparse([9], [1.0]), released))  # SGLang received 4: mismatch
    store.put(Failure("9", "wire", "bad", field="draft_probs"))
    reqs = [req([2], room=7), req([4], room=8), req([1], room=9), req([3], room=10)]
    out = m.build_eagle_disagg_draft_input(batch_of(reqs), None, None).draft_probs
    assert out[0, 2] == 0.75 and out[0, 5] == 0.25 and out[0].sum() == 1.0
    assert torch.equal(out[1:].argmax(-1), torch.tensor([4, 1, 3])) and torch.equal(
        out[1:].max(-1).values, torch.ones(3)
    )
    assert sorted(released) == ["7", "8"] and len(store) == 0
    c = inst.proposer.counts
    assert (
        c["proposal:prefill"],
        c["fallback:token_mismatch"],
        c["fallback:failed:wire:draft_probs"],
        c["fallback:missing"],
    ) == (1, 1, 1, 1)
    assert inst.middleware.metrics.fallbacks["sglang:missing"] == 1


def test_store_bounds_capacity_and_age() -> None:
    now = [100.0]
    store = ProposalStore(capacity=2, ttl_s=10.0, clock=lambda: now[0])
    released: list[str] = []
    for rid in ("a", "b", "c"):
        store.put(_delivery(rid, [1], OneHotProposal((1,)), released)._replace(received_at=now[0]))
    assert released == ["a"] and store.evicted["capacity"] == 1 and len(store) == 2
    store.receiver = SimpleNamespace(drain=list)
    now[0] = 111.0
    store.pump()
    assert sorted(released) == ["a", "b", "c"] and store.evicted["ttl"] == 2 and len(store) == 0
    assert store.take(None) is None and store.take("zz") is None


def test_store_never_lets_a_failure_or_another_peer_replace_a_delivery() -> None:
    store = ProposalStore()
    released: list[str] = []
    legit = _delivery("r", [1], OneHotProposal((1,)), released)._replace(peer="A")
    store.put(legit)
    store.put(Failure("r", "wire", "forged", field="peer", peer="B"))  # a failure: refused
    store.put(Failure("r", "wire", "no peer named"))  # nor a peerless one
    store.put(_delivery("r", [2], OneHotProposal((2,)), released)._replace(peer="B"))  # another peer: refused
    assert store.refused == {"failure_over_delivery": 2, "other_peer": 1} and released == ["r"]  # B's, released
    assert store.take("r") is legit and not store.evicted
    # Negative controls: the same peer may replace its own Delivery (the old one is
    # released), and a Delivery may replace a Failure from the same peer.
    store.put(legit)
    again = _delivery("r", [3], OneHotProposal((3,)), released)._replace(peer="A")
    store.put(again)
    assert store.evicted["replaced"] == 1 and released == ["r", "r"] and store.take("r") is again
    store.put(Failure("s", "transfer", "digest", field="digest", peer="A"))
    store.put(_delivery("s", [1], OneHotProposal((1,)), released)._replace(peer="A"))
    assert isinstance(store.take("s"), Delivery) and store.refused["other_peer"] == 1


def test_store_byte_budget_fails_with_a_reason_never_silently() -> None:
    from pd_middleware import Payload, Provenance

    released: list[str] = []

    def big(rid: str) -> Delivery:
        p = Payload(rid, (1,), (0.5,), V, hidden=bytes(1000), provenance=Provenance(sampled_from="sparse-fp32"))
        return Delivery(p, OneHotProposal((1,)), "default", time.perf_counter(), lambda: released.append(rid), "A")

    store = ProposalStore(max_bytes=2500)
    for rid in ("a", "b", "c"):
        store.put(big(rid))
    assert store.bytes == 2000 and store.refused["bytes"] == 1 and released == ["c"]
    c = store.take("c")
    assert isinstance(c, Failure) and c.key == "store:bytes" and "max_bytes=2500" in c.reason and c.peer == "A"
    assert isinstance(store.take("a"), Delivery) and store.bytes == 1000
    # Negative control: with room again the same delivery is kept, and replacing one
    # counts only the difference.
    store.put(big("c"))
    store.put(big("c"))
    assert isinstance(store.take("c"), Delivery) and store.refused["bytes"] == 1 and store.bytes == 1000
    store.clear()
    assert store.bytes == 0 and len(store) == 0


def test_an_sglang_without_pd_first_draft_proposal_is_refused_whole() -> None:
    # Post-hoc mode (attaching draft_probs after an older SGLang's builder) is gone: an
    # SGLang without the proposal hook is refused, nothing patched, even when allowed.
    m = fake_decode_module(proposal=False)
    build = m.build_eagle_disagg_draft_input
    with pytest.raises(PluginError, match="not a supported version"):
        install(make_config(), decode_module=m, version="0.6.0")
    with pytest.raises(PluginError, match=r"fake_sglang_ed\.pd_first_draft_proposal not found"):
        install(make_config(), decode_module=m, version="0.6.0", allow_unsupported=True)
    # Older than the table: refused even when allowed (the table has no rows for it).
    with pytest.raises(PluginError, match="older than the oldest supported release"):
        install(make_config(), decode_module=m, version="0.5.9", allow_unsupported=True)
    assert m.build_eagle_disagg_draft_input is build and S.current() is None


# ----------------------------------------------------------------- prefill publisher


def sparse_encoder(k=3):
    from pd_middleware_plugins.sparse import SparseEncoder, SparseEncoderOptions

    return SparseEncoder(SparseEncoderOptions(mode="topk", k=k, value_dtype="fp32"), PluginContext(V, 1, True))


def draft_rows(b, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(b, V, generator=g) * 2, dim=-1)


def test_publisher_keys_by_room_and_sends_the_encoders_draw() -> None:
    tx = RecordingSender()
    pub = ProposalPublisher(sparse_encoder(), tx, vocab_size=V, seed=SEED)
    enc = pub.publish([11, 12], draft_rows(2), temperature=[0.7, 0.7])
    assert [p.request_id for p in tx.sent] == ["11", "12"], f"seed {SEED}"
    for i, p in enumerate(tx.sent):
        assert p.draft_tokens == (int(enc.tokens[i, 0]),) and p.proposal is enc.proposals[i]
        assert p.provenance.sampled_from == "sparse-fp32" and p.provenance.temperature == 0.7
    pub.publish([13, 14], draft_rows(2), temperature=torch.tensor([0.5, 1.0]))
    assert [p.provenance.temperature for p in tx.sent[2:]] == [0.5, 1.0]
    with pytest.raises(ValueError, match="1 rooms for 2 rows"):
        pub.publish([1], draft_rows(2))


def test_publisher_counts_send_failures() -> None:
    from pd_middleware import TransferError

    class Broken:
        def send(self, payload):
            raise TransferError("decode gone", op="send", peer="x")

    pub = ProposalPublisher(sparse_encoder(), lambda: Broken(), vocab_size=V)
    pub.publish([1, 2], draft_rows(2))  # the lazy sender connects off this thread
    assert pub.counts == {"send_failed:not_connected": 2}
    deadline = time.monotonic() + 5.0
    while pub.sender is None and time.monotonic() < deadline:
        time.sleep(0.01)
    pub.publish([3, 4], draft_rows(2))
    assert pub.counts == {"send_failed:not_connected": 2, "send_failed:TransferError": 2}


def test_prefill_wrapper_overwrites_sglangs_draw_and_skips_multi_layer() -> None:
    tx = RecordingSender()
    pub = ProposalPublisher(sparse_encoder(k=2), tx, vocab_size=V, seed=SEED)
    pre, dec = fake_prefill_module(), fake_decode_module()
    install(make_config(), decode_module=dec, prefill_module=pre, publisher=pub, version="0.5.23")
    reqs = [req([0], room=21), req([0], room=22), req([0], room=None)]
    reqs[1].inflight_middle_chunks = 1  # an unfinished chunk: not shipped
    q = draft_rows(3)
    di = SimpleNamespace(draft_probs=q, topk_index=torch.full((3, 1), 15), topk_p=torch.ones(3, 1))
    pre.SchedulerDisaggregationPrefillMixin().process_batch_result_disagg_prefill(
        SimpleNamespace(reqs=reqs), SimpleNamespace(next_draft_input=di)
    )
    assert [p.request_id for p in tx.sent] == ["21"]
    x = tx.sent[0].draft_tokens[0]
    assert int(reqs[0].output_topk_index[0]) == x and x in q[0].topk(2).indices.tolist(), f"seed {SEED}"
    assert int(reqs[1].output_topk_index[0]) == 15 and int(reqs[2].output_topk_index[0]) == 15
    pub.num_steps = 2  # a multi-layer engine (S comes from the engine at activation)
    di3 = SimpleNamespace(
        draft_probs=q.view(3, 1, V).expand(3, 2, V),
        topk_index=torch.tensor([[3, 4]] * 3),
        topk_p=torch.full((3, 2), 0.5),
    )
    pre.SchedulerDisaggregationPrefillMixin().process_batch_result_disagg_prefill(
        SimpleNamespace(reqs=reqs), SimpleNamespace(next_draft_input=di3)
    )
    # Multi-layer without the chain patches: SGLang's own chain, sent X only.
    assert pub.counts["skipped:multi_layer"] == 1 and len(tx.sent) == 2
    assert tx.sent[1].draft_tokens == (3, 4) and tx.sent[1].proposal is None
    assert S.current().guard.counts == {}
    assert S.uninstall() and not hasattr(
        pre.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill, "__wrapped__"
    )


@pytest.mark.parametrize("missing", ["origin_input_ids", "output_ids"])
def test_a_req_without_its_position_fields_is_sent_x_only_counted_never_keyed_without_them(missing) -> None:
    """A Req (it has a room) that lacks ``origin_input_ids`` or ``output_ids`` (another SGLang
    renamed them) cannot key its draw on its position: that is this rank's "not ok" vote,
    the batch keeps SGLang's X sent X only, counted ``guard:prefill_encode:DrawPositionError``.
    Negative control: the same batch with both fields is published with a proposal. A
    target that is no Req (no room: a benchmark's) still keys without the position."""
    from pd_middleware.integrations.sglang import prefill as sglang_prefill

    tx = RecordingSender()
    pub = ProposalPublisher(sparse_encoder(k=2), tx, vocab_size=V, seed=SEED)
    pre, dec = fake_prefill_module(), fake_decode_module()
    install(make_config(), decode_module=dec, prefill_module=pre, publisher=pub, version="0.5.23")

    def run(reqs):
        di = SimpleNamespace(draft_probs=draft_rows(2), topk_index=torch.full((2, 1), 15), topk_p=torch.ones(2, 1))
        pre.SchedulerDisaggregationPrefillMixin().process_batch_result_disagg_prefill(
            SimpleNamespace(reqs=reqs), SimpleNamespace(next_draft_input=di)
        )
        return reqs

    run([req([0], room=31), req([0], room=32)])  # negative control
    assert [p.proposal is not None for p in tx.sent] == [True, True] and S.current().guard.counts == {}
    reqs = [req([0], room=41), req([0], room=42)]
    delattr(reqs[1], missing)
    run(reqs)
    assert [p.request_id for p in tx.sent[2:]] == ["41", "42"] and all(p.proposal is None for p in tx.sent[2:])
    assert [int(r.output_topk_index[0]) for r in reqs] == [15, 15]  # SGLang's X
    assert S.current().guard.counts == {"guard:prefill_encode:DrawPositionError": 1}
    with pytest.raises(sglang_prefill.DrawPositionError, match=missing):
        sglang_prefill.draw_position(reqs[1])
    assert sglang_prefill.draw_position(SimpleNamespace(rid="bench")) is None
    assert S.uninstall()


# ----------------------------------------------------------------- activation


def test_activate_from_env(tmp_path, monkeypatch) -> None:
    assert S.activate_from_env({}) is None
    bad = tmp_path / "bad.toml"
    bad.write_text('[sglang]\nchannel = "carrier-pigeon"\n')
    monkeypatch.setenv("PD_MIDDLEWARE_CONFIG", str(bad))
    with pytest.raises(SystemExit, match=r"pd-middleware: install failed: config error at sglang\.channel"):
        S.sglang_plugin()
    monkeypatch.delenv("PD_MIDDLEWARE_CONFIG")
    assert S.sglang_plugin() is None and S.current() is None


def facts(**over):
    base = dict(role="decode", vocab_size=V, num_steps=1, algorithm="EAGLE", topk=1, rejection_sampling=True)
    return S.EngineFacts(**{**base, **over})


@pytest.mark.parametrize(
    ("over", "cfg_over", "channel", "message"),
    [
        ({"role": "null"}, {}, "metadata", "runs --disaggregation-mode null"),
        ({"algorithm": None}, {}, "metadata", "--speculative-algorithm is None"),
        ({"topk": 4}, {}, "metadata", "--speculative-eagle-topk is 4"),
        ({"rejection_sampling": False}, {}, "metadata", "without --speculative-use-rejection-sampling"),
        ({}, {"decode": {"rejection_sampling": False}}, "metadata", "at decode.rejection_sampling"),
        (
            {"vocab_size": 32},
            {},
            "metadata",
            "at model.vocab_size.*SGLang runs with vocab_size = 32, the config says 16",
        ),
        ({"num_steps": 3}, {}, "metadata", "at model.num_steps.*num_steps = 3, the config says 1"),
        ({"backend": "nixl"}, {}, "metadata", "at sglang.channel.*mooncake transfer backend only.*nixl"),
        ({"tp_rank": 1}, {"synthesizer": {"name": "sparse"}}, "sidechannel", "TP rank 1 would not see the payloads"),
    ],
)
def test_startup_checks_name_the_flag(over, cfg_over, channel, message) -> None:
    with pytest.raises(ConfigError, match=message):
        install(
            make_config(**cfg_over),
            decode_module=fake_decode_module(),
            version="0.5.23",
            channel=channel,
            facts=facts(**over),
        )
    assert S.current() is None  # a failed activation leaves SGLang unpatched


def test_startup_takes_shapes_from_the_engine_when_the_config_leaves_them_out() -> None:
    cfg = parse_config({"decode": {"max_batch": 4}, "transport": {"mooncake": {"enabled": False}}})
    assert cfg.model.declared_vocab_size is None and cfg.model.declared_num_steps is None
    m = fake_decode_module()
    inst = install(cfg, decode_module=m, version="0.5.23", channel="metadata", facts=facts(vocab_size=48, num_steps=1))
    assert inst.proposer.bound == (48, 1) and inst.channel.layout.vocab_size == 48
    assert inst.middleware.config.model.vocab_size == 48


def test_publisher_from_config_uses_the_top_level_encoder_under_ab() -> None:
    cfg = make_config(
        encoder={"name": "sparse", "options": {"k": 2}},
        hooks=[{"name": "ab_split"}],
        arms=[
            {"name": "one_hot", "synthesizer": {"name": "one_hot"}, "encoder": {"name": "softmax"}},
            {"name": "sparse", "synthesizer": {"name": "sparse"}},
        ],
    )
    tx = RecordingSender()
    ProposalPublisher.from_config(cfg, tx, seed=SEED).publish([1], draft_rows(1))
    assert tx.sent[0].proposal is not None and tx.sent[0].provenance.sampled_from == "sparse-fp16"
    ProposalPublisher.from_config(cfg, tx, arm="one_hot").publish([2], draft_rows(1))
    assert tx.sent[1].proposal is None
    with pytest.raises(ConfigError, match=r"at arms.*no arm named 'x'"):
        ProposalPublisher.from_config(cfg, tx, arm="x")


# ================================================================= the real SGLang package

SGLANG_ABSENT = importlib.util.find_spec("sglang") is None
needs_sglang = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        SGLANG_ABSENT, reason="SGLang is not installed; run `make setup-sglang` (requirements-sglang.txt)"
    ),
]


@pytest.fixture(scope="module")
def ed(sglang_importable):
    """SGLang 0.5.23's real eagle_disaggregation module (conftest: the torchvision stand-in)."""
    return importlib.import_module(S.BUILDER_MODULE)


def spec(num_steps=1, multi_layer=False, rs=True):
    from sglang.srt.runtime_context import get_context

    return get_context().override_server_args(
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=1,
        speculative_num_steps=num_steps,
        enable_multi_layer_eagle=multi_layer,
        speculative_use_rejection_sampling=rs,
    )


def real_batch(rows, vocab=V, overlap=False, rooms=None):
    reqs = [req(r, room=None if rooms is None else rooms[i]) for i, r in enumerate(rows)]
    return batch_of(reqs, vocab, overlap)


def build(ed, batch, future_map=None):
    return ed.build_eagle_disagg_draft_input(batch, torch.arange(len(batch.reqs), dtype=torch.int64), future_map)


def sglang_test(fn):
    for mark in reversed(needs_sglang):
        fn = mark(fn)
    return fn


@sglang_test
def test_real_version_is_supported(ed) -> None:
    assert S.detect_version() in S.SUPPORTED_SGLANG_VERSIONS
    assert ed.__name__ == S.BUILDER_MODULE


@sglang_test
def test_real_single_layer_one_hot_fp32_vocab_wide_and_identical_to_sglang(ed) -> None:
    rows = [[3], [0], [15]]
    with spec():
        ref = build(ed, real_batch(rows))
        install(make_config())
        got = build(ed, real_batch(rows))
    assert got.draft_probs.dtype == torch.float32 and tuple(got.draft_probs.shape) == (3, V)
    assert torch.equal(got.draft_probs, ref.draft_probs)  # SGLang's own one-hot, bit for bit
    assert torch.equal(got.draft_probs.argmax(-1), torch.tensor([3, 0, 15]))
    for f in ("topk_p", "topk_index", "hidden_states", "bonus_tokens"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    assert (got.capture_hidden_mode, got.cuda_graph_compatible) == (ref.capture_hidden_mode, ref.cuda_graph_compatible)
    assert S.current().proposer.counts["proposal:local"] == 3


@sglang_test
@pytest.mark.parametrize("multi_layer", [False, True])
def test_real_no_proposal_without_rejection_sampling(ed, multi_layer) -> None:
    install(make_config(model={"vocab_size": V, "num_steps": 3 if multi_layer else 1}))
    with spec(num_steps=3, multi_layer=multi_layer, rs=False):
        got = build(ed, real_batch([[1, 2, 3], [4, 5, 6]]))
    assert got.draft_probs is None
    assert S.current().proposer.counts["batches"] == 0  # never consulted


@sglang_test
def test_real_multi_layer_chain(ed) -> None:
    install(make_config(model={"vocab_size": V, "num_steps": 3}))
    with spec(num_steps=3, multi_layer=True):
        got = build(ed, real_batch([[1, 2, 3], [4, 5, 6]]))
    dp = got.draft_probs
    assert dp.dtype == torch.float32 and tuple(dp.shape) == (2, 3, V)
    assert torch.equal(dp.argmax(-1), torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert torch.equal(dp.sum(-1), torch.ones(2, 3)) and torch.equal(dp.max(-1).values, torch.ones(2, 3))


def _row_for(ed, x, vocab, delivered=None):
    """The q SGLang's function hands the verifier when the request drafted x."""
    store = S.current().store
    store.clear()  # each call is a request of its own (room 5 each time): no earlier build's mark
    if delivered is not None:
        store.put(delivered)
    with spec():
        return build(ed, real_batch([[x]], vocab=vocab, rooms=[5])).draft_probs[0].tolist()


@sglang_test
def test_real_exactness_by_enumeration(ed) -> None:
    vocab = 5
    p = [Fraction(1, 10), Fraction(2, 5), Fraction(1, 5), Fraction(1, 5), Fraction(1, 10)]
    s = [Fraction(1, 2), Fraction(1, 8), Fraction(1, 8), Fraction(1, 8), Fraction(1, 8)]
    install(make_config(model={"vocab_size": vocab}), store=ProposalStore())
    # One-hot, whatever law X was drawn from.
    law = exact_verify_law(p, lambda x: [Fraction(v) for v in _row_for(ed, x, vocab)], s)
    assert law == p
    # A shipped sparse q_k, with X drawn from q_k itself: exact.
    enc_idx, enc_val = [0, 1], [0.75, 0.25]  # dyadic: fp32 holds them exactly
    qk = [Fraction(3, 4), Fraction(1, 4), 0, 0, 0]

    def sparse_row(x):
        d = _delivery("5", [x], SparseProposal((2,), torch.tensor(enc_idx), torch.tensor(enc_val), (0.0,)), [])
        return [Fraction(v) for v in _row_for(ed, x, vocab, d)]

    assert exact_verify_law(p, sparse_row, qk) == p
    # Negative control: the same q_k handed over while X came from s: biased.
    assert exact_verify_law(p, sparse_row, s) != p


def _serve_and_publish(ed, cfg, rooms, rows_q, seed=SEED):
    """Real transport on loopback: decode receiver + prefill sender + publisher."""
    from pd_middleware.transport import open_receiver, open_sender

    inst = install(cfg)
    rx = open_receiver(cfg.transport, inst.middleware.pipeline)
    inst.receiver = rx
    inst.proposer.store = ProposalStore(rx)
    tx = open_sender(cfg.transport, rx.address, name="test-prefill")
    try:
        pub = ProposalPublisher.from_config(cfg, tx, seed=seed)
        enc = pub.publish(rooms, rows_q)
        assert tx.flush(timeout=10.0), tx.statuses()
    finally:
        tx.close()
    store = inst.store
    deadline = time.monotonic() + 10.0
    while len(store) < len(rooms) and time.monotonic() < deadline:
        store.pump()
        time.sleep(0.01)
    assert len(store) == len(rooms), f"only {len(store)} of {len(rooms)} payloads arrived"
    return inst, enc


def sparse_cfg(**over):
    return make_config(
        synthesizer={"name": "sparse"},
        encoder={"name": "sparse", "options": {"mode": "topk", "k": 3, "value_dtype": "fp32"}},
        **over,
    )


@sglang_test
def test_real_sparse_plugin_carries_the_published_proposal(ed) -> None:
    cfg = sparse_cfg()
    inst, enc = _serve_and_publish(ed, cfg, [101, 102], draft_rows(2))
    tokens = enc.tokens[:, 0].tolist()
    with spec():
        got = build(ed, real_batch([[t] for t in tokens], rooms=[101, 102]))
    for i in range(2):
        want = sparse_law_tensor(enc.proposals[i], 1, V)[0]
        assert torch.equal(got.draft_probs[i], want), f"seed {SEED} row {i}"
        assert (got.draft_probs[i] > 0).sum() == 3
    assert inst.proposer.counts["proposal:prefill"] == 2 and inst.middleware.metrics.delivered == 2


@sglang_test
def test_real_overlap_relay_carries_our_q(ed) -> None:
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    cfg = sparse_cfg()
    _inst, enc = _serve_and_publish(ed, cfg, [201, 202], draft_rows(2, seed=SEED + 1))
    fm = FutureMap(
        torch.device("cpu"),
        SpeculativeAlgorithm.EAGLE,
        SimpleNamespace(req_to_token=torch.zeros((8, 64), dtype=torch.int32)),
    )
    tokens = enc.tokens[:, 0].tolist()
    with spec():
        got = build(ed, real_batch([[t] for t in tokens], overlap=True, rooms=[201, 202]), fm)
    relay = fm.draft_probs_buf[got.future_indices]
    assert torch.equal(relay, got.draft_probs)
    for i in range(2):
        assert torch.equal(relay[i], sparse_law_tensor(enc.proposals[i], 1, V)[0]), f"seed {SEED + 1} row {i}"
    assert (relay.max(-1).values < 1.0).all()  # not SGLang's one-hot


@sglang_test
def test_real_uninstall_restores_sglang(ed) -> None:
    build_fn, prop_fn = ed.build_eagle_disagg_draft_input, ed.pd_first_draft_proposal
    from sglang.srt.disaggregation import prefill as pre

    pre_fn = pre.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill
    pub = ProposalPublisher(sparse_encoder(), RecordingSender(), vocab_size=V)
    store = ProposalStore()
    install(make_config(), publisher=pub, store=store)
    assert pre.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill is not pre_fn
    store.put(_delivery("9", [4], _sparse([4, 7], [0.5, 0.5]), []))
    with spec():
        assert build(ed, real_batch([[4]], rooms=[9])).draft_probs[0, 7] == 0.5
    assert S.uninstall()
    assert ed.build_eagle_disagg_draft_input is build_fn and ed.pd_first_draft_proposal is prop_fn
    assert pre.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill is pre_fn
    with spec():
        again = build(ed, real_batch([[4]], rooms=[9])).draft_probs
    assert torch.equal(again, torch.nn.functional.one_hot(torch.tensor([4]), V).float())


@sglang_test
def test_real_plugin_loader_activates_from_env(ed, tmp_path, monkeypatch) -> None:
    import sglang.srt.plugins as plugins

    cfg = tmp_path / "pd.toml"
    cfg.write_text(f"[model]\nvocab_size = {V}\n")
    ep = importlib.metadata.EntryPoint(
        name="pd_middleware",
        value="pd_middleware.integrations.sglang:sglang_plugin",
        group=plugins.GENERAL_PLUGINS_GROUP,
    )
    monkeypatch.setattr(plugins, "entry_points", lambda group: [ep] if group == plugins.GENERAL_PLUGINS_GROUP else [])
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setenv("PD_MIDDLEWARE_CONFIG", str(cfg))
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    plugins.load_plugins()
    inst = S.current()
    assert inst is not None and inst.channel_name == "metadata"
    assert inst.receiver is None and inst.facts is None  # no scheduler started: patches only, idle
    assert ed.pd_first_draft_proposal.__pd_middleware__
    # The REAL scheduler module (make setup-sglang installs its runtime packages): its
    # init_disaggregation is wrapped, and every checked target is one of SGLang's.
    from sglang.srt.managers.scheduler import Scheduler

    assert Scheduler.init_disaggregation.__pd_middleware__
    paths = {p.target.path for p in inst.patches}
    assert "sglang.srt.managers.scheduler.Scheduler.init_disaggregation" in paths
    assert "sglang.srt.disaggregation.mooncake.conn.KVArgsRegisterInfo.from_zmq" in paths
    assert set(inst.deferred) == {"chain"}  # checked at install, applied when a multi-layer prefill starts


def _loader(monkeypatch, func_path):
    import sglang.srt.plugins as plugins

    ep = importlib.metadata.EntryPoint(name="pd_middleware", value=func_path, group=plugins.GENERAL_PLUGINS_GROUP)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [ep] if group == plugins.GENERAL_PLUGINS_GROUP else [])
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    return plugins


def _raise_key_error():
    raise KeyError("MooncakeKVManager")


@sglang_test
def test_real_loader_any_install_exception_stops_the_process(ed, tmp_path, monkeypatch) -> None:
    cfg = tmp_path / "pd.toml"
    cfg.write_text(f"[model]\nvocab_size = {V}\n")
    monkeypatch.setenv("PD_MIDDLEWARE_CONFIG", str(cfg))
    # Negative control: SGLang's real loader swallows a plugin's plain exception...
    plugins = _loader(monkeypatch, f"{__name__}:_raise_key_error")
    plugins.load_plugins()  # logged by SGLang, not raised: the server would run without us
    # ... so ours turns any exception while installing (here a KeyError, not ours) into
    # SystemExit, which the loader does not catch.
    monkeypatch.setattr(S, "install", lambda *a, **k: _raise_key_error())
    plugins = _loader(monkeypatch, "pd_middleware.integrations.sglang:sglang_plugin")
    with pytest.raises(SystemExit, match=r"pd-middleware: install failed: KeyError: 'MooncakeKVManager'"):
        plugins.load_plugins()
    assert S.current() is None


@sglang_test
def test_real_scheduler_start_refuses_a_server_that_is_not_pd(ed, caplog) -> None:
    # The real Scheduler.init_disaggregation, wrapped: a server with PD_MIDDLEWARE_CONFIG
    # but --disaggregation-mode null stops at start, naming the mode (error, not idle).
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    S.install(make_config(), S.InstallOptions(channel="metadata"))
    reset_context()
    sa = ServerArgs(model_path="dummy", device="cpu", speculative_algorithm="EAGLE")
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))
    try:
        with pytest.raises(ConfigError, match="runs --disaggregation-mode null"):
            Scheduler.init_disaggregation(SimpleNamespace(model_config=SimpleNamespace(vocab_size=V)))
    finally:
        reset_context()


@sglang_test
def test_real_live_ab_split_routes_each_room_to_its_arm(ed) -> None:
    from pd_middleware_plugins.ab_split import arm_for

    cfg = sparse_cfg(
        hooks=[{"name": "ab_split"}],
        arms=[
            {"name": "one_hot", "synthesizer": {"name": "one_hot"}},
            {"name": "sparse", "synthesizer": {"name": "sparse"}},
        ],
    )
    rooms = list(range(300, 308))
    inst, enc = _serve_and_publish(ed, cfg, rooms, draft_rows(len(rooms), seed=SEED + 2))
    arms = [arm_for(str(r), ("one_hot", "sparse"), (1, 2)) for r in rooms]
    assert set(arms) == {"one_hot", "sparse"}, f"seed {SEED + 2}: pick other rooms"
    with spec():
        got = build(ed, real_batch([[t] for t in enc.tokens[:, 0].tolist()], rooms=rooms)).draft_probs
    for i, arm in enumerate(arms):
        want = (
            sparse_law_tensor(enc.proposals[i], 1, V)[0]
            if arm == "sparse"
            else torch.nn.functional.one_hot(enc.tokens[i, 0], V).float()
        )
        assert torch.equal(got[i], want), f"room {rooms[i]} arm {arm}"
    assert inst.middleware.metrics.snapshot()["delivered_by_arm"] == {a: arms.count(a) for a in set(arms)}


def test_sidechannel_activation_starts_the_receiver_and_needs_an_address(monkeypatch) -> None:
    cfg = make_config(synthesizer={"name": "sparse"}, encoder={"name": "sparse", "options": {"k": 3}})
    inst = install(cfg, decode_module=fake_decode_module(), version="0.5.23", channel="sidechannel", facts=facts())
    assert inst.receiver is not None and inst.store is not None and inst.receiver.address.startswith("tcp://127.0.0.1:")
    address = inst.receiver.address
    assert S.uninstall()
    monkeypatch.delenv("PD_MIDDLEWARE_DECODE_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="needs PD_MIDDLEWARE_DECODE_ADDRESS"):
        install(
            cfg,
            decode_module=fake_decode_module(),
            version="0.5.23",
            channel="sidechannel",
            facts=facts(role="prefill"),
        )
    monkeypatch.setenv("PD_MIDDLEWARE_DECODE_ADDRESS", address)
    inst = install(
        cfg, decode_module=fake_decode_module(), version="0.5.23", channel="sidechannel", facts=facts(role="prefill")
    )
    assert inst.publisher is not None and inst.publisher.stage is None  # connects on its first publish


class _SGLangBodyReached(Exception):
    """Raised by the stand-in scheduler once SGLang's own method body starts running."""


@sglang_test
def test_real_sidechannel_publishes_from_the_one_switch_with_nothing_injected(ed, monkeypatch) -> None:
    # The decode's receiver (the real transport; the decode drop-in would open it at its
    # scheduler start, but a process holds one installation, so the test opens it here).
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    from pd_middleware.middleware import DecodeMiddleware
    from pd_middleware.transport import open_receiver

    cfg = make_config(synthesizer={"name": "sparse"}, encoder={"name": "sparse", "options": {"k": 3}})
    mw = DecodeMiddleware.from_config(cfg, serve_metrics=False)
    rx = open_receiver(cfg.transport, mw.pipeline)
    try:
        monkeypatch.setenv("PD_MIDDLEWARE_DECODE_ADDRESS", rx.address)
        # The prefill: the real install(), real modules, channel from the config, nothing
        # injected (no publisher, no prefill module): what the one switch does.
        inst = S.install(
            make_config(
                synthesizer={"name": "sparse"},
                encoder={"name": "sparse", "options": {"k": 3}},
                sglang={"channel": "sidechannel"},
            ),
            S.InstallOptions(facts=facts(role="prefill")),
        )
        assert (
            "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill"
            in {p.target.path for p in inst.patches}
        )

        class SchedulerStandIn:
            # SGLang's method body needs a whole scheduler: stop it where it starts.
            batch_result_processor = SimpleNamespace(
                snapshot_auxiliary_output_starts=lambda b, r: (_ for _ in ()).throw(_SGLangBodyReached())
            )

        def prefill_batch(room):
            q = draft_rows(1)
            di = SimpleNamespace(
                draft_probs=q, topk_index=torch.zeros((1, 1), dtype=torch.int64), topk_p=torch.ones(1, 1)
            )
            r = req([0], room=room)
            result = SimpleNamespace(
                next_draft_input=di,
                copy_done=None,
                logits_output=None,
                next_token_ids=None,
                extend_input_len_per_req=None,
                extend_logprob_start_len_per_req=None,
            )
            with pytest.raises(_SGLangBodyReached):
                SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill(
                    SchedulerStandIn(), SimpleNamespace(reqs=[r]), result
                )
            return int(di.topk_index[0, 0])

        prefill_batch(501)  # the sender connects off the scheduler thread: this one goes X-only
        assert inst.publisher.counts["send_failed:not_connected"] == 1
        deadline = time.monotonic() + 10.0
        while inst.publisher.sender is None and time.monotonic() < deadline:
            time.sleep(0.02)
        x = prefill_batch(502)
        assert inst.publisher.counts["published"] == 1
        seen: list = []
        deadline = time.monotonic() + 10.0
        while not any(o.request_id == "502" for o in seen) and time.monotonic() < deadline:
            seen += rx.drain()
            time.sleep(0.01)
        got = [o for o in seen if o.request_id == "502"]
        # Negative control: the request published before the connection never arrives.
        assert not [o for o in seen if o.request_id == "501"]
        assert got and isinstance(got[0], Delivery) and got[0].payload.draft_tokens == (x,)
        assert got[0].proposal is not None  # the encoder's distribution, not X only
        got[0].release()
    finally:
        S.uninstall()
        rx.stop()
        mw.close()


def test_the_proposal_is_built_on_topk_index_device() -> None:
    # SGLang builds its one-hot on topk_index.device; so does the proposer, whatever
    # [decode].device says (no (b, n, V) host-to-device copy per prebuilt batch). The
    # "meta" device stands in for a GPU on this CPU machine: it has no values, only the
    # device and shape, which are what is bound here.
    from pd_middleware.integrations.sglang.proposer import DecodeProposer

    p = DecodeProposer(make_config())
    r = req([3])
    on_cpu = p.propose(batch_of([r]), torch.tensor([[3]]), V)
    assert on_cpu.device.type == "cpu" and not p._assemblers  # the configured assembler itself
    r = req([3])
    elsewhere = p.propose(batch_of([r]), torch.tensor([[3]], device="meta"), V)
    assert elsewhere.device.type == "meta" and tuple(elsewhere.shape) == (1, 1, V)
    assert len(p._assemblers) == 1  # one assembler bound to that device, made once
    p.propose(batch_of([req([3])]), torch.tensor([[3]], device="meta"), V)
    assert len(p._assemblers) == 1
    p.close()


def test_docs_show_the_whole_table_generated_from_the_code() -> None:
    """docs/sglang.md's target table is the code's (``patching.table_markdown``): every
    entry the drop-in patches or reads, nothing else. Regenerate it with
    ``python -c "import pd_middleware.integrations.sglang as S; print(S.patching.table_markdown())"``."""
    import re
    from pathlib import Path

    from pd_middleware.integrations.sglang.patching import FEATURES, table_markdown

    page = (Path(__file__).resolve().parents[1] / "docs" / "sglang.md").read_text(encoding="utf-8")
    (shown,) = re.findall(r"<!-- table:start -->\n(.*?)\n<!-- table:end -->", page, re.S)
    assert shown == table_markdown()
    rows = [line for line in shown.splitlines()[2:] if line.startswith("| `")]
    assert len(rows) == sum(len(f.targets) for f in FEATURES.values()) > 20  # the reader found the entries
    # Negative control: a page that lost one row no longer matches.
    assert "\n".join(line for line in shown.splitlines() if "fast_sample" not in line) != table_markdown()


def _sglang_imports(path) -> list[str]:
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "sglang"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "sglang":
            out.append(node.module or "")
    return out


def test_only_the_machinery_imports_sglang(tmp_path) -> None:
    """Every SGLang symbol reaches a feature module through the table: ``patching.py`` is the
    one module of the package that imports SGLang (by name, at install). Negative control:
    the scan finds an import where one is planted."""
    from pathlib import Path

    import pd_middleware.integrations.sglang as pkg

    here = Path(pkg.__file__).parent
    found = {p.name: _sglang_imports(p) for p in sorted(here.glob("*.py"))}
    assert len(found) > 10 and {k: v for k, v in found.items() if v} == {}
    assert "importlib.import_module(name)" in (here / "patching.py").read_text(encoding="utf-8")
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\nfrom sglang.srt.runtime_context import get_spec\n", encoding="utf-8")
    assert _sglang_imports(planted) == ["sglang.srt.runtime_context"]
