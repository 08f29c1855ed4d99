"""The side channel never races and never mixes a request's lives (issue 45, item 2).

- a payload is bound to its request's life (``Payload.life``: the draw's position, which a
  rebootstrap after SGLang's retract-mode pause makes longer): exact enumeration with
  ``Fraction`` of the two-life case, with today's unbound payload as the negative control;
- the receiver admits a new life of a request id it still holds (never ``wire:duplicate``);
- a request whose KV transfer is done waits for its payload, bounded (:class:`ArrivalWait`,
  a fake clock), inside SGLang's transfer poll (:func:`hold_arrivals`, before the MIN);
- a payload that arrives after its request was built is released at once and counted, so
  orphans never hold a receiver at its inline byte cap (a real receiver on loopback).
"""

from __future__ import annotations

import time
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
import zmq
from _helpers import OneHot, inline_frames  # tests/ is on sys.path (no __init__.py)
from _transport_peer import collect_outcomes
from test_sglang import batch_of, fake_decode_module, install, make_config, req

from pd_middleware import Payload, Provenance, SparseProposal
from pd_middleware.decode.pipeline import Delivery, ReceivePipeline
from pd_middleware.evaluation.verify_exact import exact_verify_law
from pd_middleware.integrations.sglang.arrivals import KVPOLL, hold_arrivals
from pd_middleware.integrations.sglang.common import LIFE_ATTR, life_of
from pd_middleware.integrations.sglang.store import ArrivalWait, ProposalStore
from pd_middleware.transport import DecodeReceiver, LimitsConfig, TransportConfig, wire

pytestmark = pytest.mark.usefixtures("sglang_uninstall")

V2 = 2


def _delivery(rid: str, x: int, q: tuple[float, float], life: int | None, released: list[str]) -> Delivery:
    """A shipped full q over V = 2 (as a 2-entry sparse law), X = x, for ``life``."""
    p = Payload(rid, (x,), (q[x],), V2, provenance=Provenance(sampled_from="sparse-fp32"), life=life)
    prop = SparseProposal((2,), torch.tensor([0, 1]), torch.tensor(q, dtype=torch.float32), (0.0,))
    return Delivery(p, prop, "default", time.perf_counter(), lambda: released.append(f"{rid}@{life}"))


def _second_life_law(bind: bool) -> list[Fraction]:
    """Law of the committed token of a rebootstrapped request's second life, by enumeration.

    The first life's payload (X_old ~ q_old) lost the race and sits in the store; the second
    life's X ~ q_new is what SGLang verifies; its own payload has not arrived. p = (1/2, 1/2),
    q_old = (7/8, 1/8), q_new = (1/8, 7/8) (dyadic: fp32 holds them exactly). ``bind``: the
    payloads carry their life (today's prefill); else none does (a payload without a life,
    matched by room and tokens alone, as before)."""
    p = [Fraction(1, 2), Fraction(1, 2)]
    q_old, q_new = (0.875, 0.125), (0.125, 0.875)
    old_life, new_life = 40, 47
    m = fake_decode_module()
    store = ProposalStore()
    inst = install(make_config(model={"vocab_size": V2}), decode_module=m, version="0.5.23", store=store)
    law = [Fraction(0), Fraction(0)]
    for x_old in (0, 1):

        def handed(x: int, x_old: int = x_old) -> list[Fraction]:
            store.clear()
            store.put(_delivery("5", x_old, q_old, old_life if bind else None, []))
            r = req([x], room=5)
            setattr(r, LIFE_ATTR, new_life)  # what the transfer poll's wait recorded before the commit
            row = m.build_eagle_disagg_draft_input(batch_of([r], vocab=V2), None, None).draft_probs[0]
            return [Fraction(v) for v in row.tolist()]

        part = exact_verify_law(p, handed, [Fraction(v) for v in q_new])
        law = [a + Fraction(q_old[x_old]) * b for a, b in zip(law, part)]
    inst.proposer.counts.clear()
    return law


def test_a_second_lifes_x_is_never_verified_against_the_first_lifes_q() -> None:
    """Bound to its life, the first life's payload is refused (counted ``other_life``) and
    the second life verifies the one-hot at its X: law = p exactly. Unbound (the negative
    control), a first-life payload whose token equals the second life's X hands its q to
    the verifier: P(token 0) = 29/64. (The issue's q_old = (0.9, 0.1), q_new = (0.1, 0.9)
    gives 23/50, below, with the same enumeration on exact fractions.)"""
    half = [Fraction(1, 2), Fraction(1, 2)]
    assert _second_life_law(bind=True) == half
    unbound = _second_life_law(bind=False)
    assert unbound == [Fraction(29, 64), Fraction(35, 64)]
    # The figures: the unbound case's law from exact_verify_law on the same mixture.
    q_old = [Fraction(9, 10), Fraction(1, 10)]
    q_new = [Fraction(1, 10), Fraction(9, 10)]

    def handed_unbound(x_old: int):
        return lambda x: q_old if x == x_old else [Fraction(int(i == x)) for i in range(2)]

    mix = [Fraction(0), Fraction(0)]
    for x_old in (0, 1):
        part = exact_verify_law(half, handed_unbound(x_old), q_new)
        mix = [a + q_old[x_old] * b for a, b in zip(mix, part)]
    assert mix[0] == Fraction(23, 50)


def test_the_proposer_counts_another_lifes_payload_and_marks_the_build() -> None:
    m = fake_decode_module()
    store = ProposalStore()
    inst = install(make_config(), decode_module=m, version="0.5.23", store=store)
    released: list[str] = []
    store.put(_delivery("9", 1, (0.5, 0.5), 30, released))
    r = req([1], room=9)
    setattr(r, LIFE_ATTR, 33)
    out = m.build_eagle_disagg_draft_input(batch_of([r]), None, None).draft_probs
    assert out[0].argmax() == 1 and out[0].max() == 1.0  # one-hot at X
    c = inst.proposer.counts
    assert c["fallback:other_life"] == 1 and c["proposal:prefill"] == 0 and released == ["9@30"]
    # The second life's own payload, arriving now, is an orphan: released at once.
    store.put(_delivery("9", 1, (0.5, 0.5), 33, released))
    assert released == ["9@30", "9@33"] and store.refused["orphan"] == 1 and len(store) == 0
    # The same life with its payload in time is taken (the control).
    store.put(_delivery("10", 1, (0.5, 0.5), 33, released))
    r2 = req([1], room=10)
    setattr(r2, LIFE_ATTR, 33)
    m.build_eagle_disagg_draft_input(batch_of([r2]), None, None)
    assert c["proposal:prefill"] == 1


def test_an_orphan_is_released_at_once_and_another_life_is_kept() -> None:
    store = ProposalStore()
    released: list[str] = []
    store.built("3", 12)
    store.put(_delivery("3", 0, (0.5, 0.5), 19, released))  # a later life: awaited anew
    assert released == [] and store.has("3", 19) and not store.has("3", 12)
    store.built("4", 12)
    store.put(_delivery("4", 0, (0.5, 0.5), 12, released))
    assert released == ["4@12"] and store.refused["orphan"] == 1 and not store.has("4")
    store.put(_delivery("4", 0, (0.5, 0.5), 12, released))  # the mark is spent: kept
    assert store.has("4", 12) and store.refused["orphan"] == 1
    for i in range(store.capacity + 1):  # marks are bounded by capacity
        store.built(f"m{i}", 1)
    assert len(store._built) == store.capacity


# ---------------------------------------------------------------- the bounded wait


def _wait(store, *, expecting=True, wait_s=2.0):
    now = [100.0]
    counts: list[str] = []
    w = ArrivalWait(store, wait_s, expecting=lambda: expecting, count=counts.append, clock=lambda: now[0])
    return w, now, counts


def test_a_request_is_held_until_its_payload_is_stored_and_no_longer_than_the_bound() -> None:
    store = ProposalStore()
    w, now, counts = _wait(store)
    assert w.hold([("1", 5), ("2", 5), (None, None)]) == [True, True, False]
    now[0] += 1.0
    store.put(_delivery("1", 0, (0.5, 0.5), 5, []))
    assert w.hold([("1", 5), ("2", 5)]) == [False, True]
    now[0] += 0.99
    assert w.hold([("2", 5)]) == [True]
    now[0] += 0.02  # 2.01 s after "2" was first seen done
    assert w.hold([("2", 5)]) == [False]
    assert counts == ["wait:held", "wait:held", "wait:arrived", "wait:expired"]
    # Another life's payload does not end the wait; this life's does.
    store.put(_delivery("7", 0, (0.5, 0.5), 3, []))
    assert w.hold([("7", 9)]) == [True]
    store.put(_delivery("7", 0, (0.5, 0.5), 9, []))
    assert w.hold([("7", 9)]) == [False]


def test_nothing_is_held_without_a_shipping_prefill_or_with_a_zero_bound() -> None:
    w, _, counts = _wait(ProposalStore(), expecting=False)
    assert w.hold([("1", 5)]) == [False] and counts == []
    w, _, counts = _wait(ProposalStore(), wait_s=0.0)
    assert w.hold([("1", 5)]) == [False] and counts == []


def test_the_wait_pumps_the_receiver_each_poll() -> None:
    got = [[_delivery("1", 0, (0.5, 0.5), 5, [])], []]
    store = ProposalStore(SimpleNamespace(drain=lambda: got.pop(0) if got else []))
    w, _, _ = _wait(store)
    assert w.hold([("1", 5)]) == [False]  # drained by this very poll: never held


class _KVPoll:
    Failed, Bootstrapping, WaitingForInput, Transferring, Success = 0, 1, 2, 3, 4


def test_the_transfer_poll_reports_a_held_request_still_transferring_and_records_its_life() -> None:
    """:func:`hold_arrivals` as SGLang's ``_apply_metadata_gate`` wrapper calls it, before the
    ranks' MIN: Success becomes Transferring for a held request only; the life is read from
    the Req before the commit (a fresh request: its prompt; a rebootstrapped one: prompt plus
    output so far); a probe (SGLang's warmup) is never held."""
    asked: list[list[tuple[str | None, int | None]]] = []

    def hold(keys):
        asked.append(list(keys))
        return [k[0] == "11" for k in keys]

    inst = SimpleNamespace(symbols={KVPOLL: _KVPoll}, source=SimpleNamespace(hold=hold))
    fresh = SimpleNamespace(bootstrap_room=11, origin_input_ids=[1] * 9, output_ids=[], rid="a")
    again = SimpleNamespace(bootstrap_room=12, origin_input_ids=[1] * 9, output_ids=[5] * 4, rid="b")
    probe = SimpleNamespace(bootstrap_room=0, bootstrap_host="2.2.2.2", origin_input_ids=[1], output_ids=[], rid="w")
    moving = SimpleNamespace(bootstrap_room=13, origin_input_ids=[1], output_ids=[], rid="c")
    polls = [_KVPoll.Success, _KVPoll.Success, _KVPoll.Success, _KVPoll.Transferring]
    reqs = [SimpleNamespace(req=r) for r in (fresh, again, probe, moving)]
    hold_arrivals(inst, polls, reqs)
    assert polls == [_KVPoll.Transferring, _KVPoll.Success, _KVPoll.Success, _KVPoll.Transferring]
    assert asked == [[("11", 9), ("12", 13), (None, None)]]
    assert getattr(fresh, LIFE_ATTR) == 9 and getattr(again, LIFE_ATTR) == 13 == life_of(again)
    assert not hasattr(moving, LIFE_ATTR)


# ---------------------------------------------------------------- real receiver, loopback


def _receiver(zctx, **limits):
    cfg = TransportConfig(heartbeat_s=0.05, peer_timeout_s=5.0, limits=LimitsConfig(**limits))
    return DecodeReceiver(cfg, ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx).start()


def _peer(zctx, address: str) -> zmq.Socket:
    s = zctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    s.send_multipart([wire.encode(wire.Hello(name="prefill", want_slots=0, ts=time.time()))])
    assert s.poll(3000)
    s.recv_multipart()
    return s


def _payload(rid: str, life: int | None, nbytes: int = 128) -> Payload:
    return Payload(rid, (1,), (0.5,), 8, hidden=bytes(nbytes), provenance=Provenance("sampled", 1.0, None), life=life)


def test_the_receiver_admits_a_new_life_of_a_request_it_still_holds(zctx) -> None:
    rx = _receiver(zctx)
    try:
        s = _peer(zctx, rx.address)
        s.send_multipart(inline_frames(_payload("5", 10), 1))
        (first,) = collect_outcomes(rx, 1)
        assert isinstance(first, Delivery)  # held, not released: the first life is live
        s.send_multipart(inline_frames(_payload("5", 12), 2))
        (second,) = collect_outcomes(rx, 1)
        assert isinstance(second, Delivery) and second.payload.life == 12
        s.send_multipart(inline_frames(_payload("5", 12), 3))  # the same life again: the control
        (dup,) = collect_outcomes(rx, 1)
        assert not isinstance(dup, Delivery) and dup.key == "wire:duplicate"
        first.release()
        second.release()
        s.close(0)
    finally:
        rx.stop()


def _fill(zctx, mark: bool) -> tuple[ProposalStore, bool]:
    """Six 24 KB payloads whose requests were built without them, then one awaited, to a
    receiver whose inline cap is 64 KB; pumped for at most 1.5 s. Returns the store and
    whether the awaited payload arrived."""
    rx = _receiver(zctx, max_queued_inline_bytes=1 << 16)
    store = ProposalStore(rx)
    try:
        if mark:
            for i in range(6):
                store.built(f"o{i}", 7)
        s = _peer(zctx, rx.address)
        for i in range(6):
            s.send_multipart(inline_frames(_payload(f"o{i}", 7, 24_000), i + 1))
        s.send_multipart(inline_frames(_payload("awaited", 3), 7))
        deadline = time.monotonic() + 1.5
        while not store.has("awaited") and time.monotonic() < deadline:
            store.pump()
            time.sleep(0.01)
        s.close(0)
        return store, store.has("awaited")
    finally:
        store.clear()
        rx.stop()


def test_orphans_never_hold_a_receiver_at_its_inline_byte_cap(zctx) -> None:
    """Orphans released at once: every one counted, and the awaited payload behind them
    arrives. Negative control: kept (no build marked them), they hold the cap and the
    awaited payload is still unread when the bounded pumping ends."""
    store, arrived = _fill(zctx, mark=True)
    assert arrived and store.refused["orphan"] == 6
    store, arrived = _fill(zctx, mark=False)
    assert not arrived and store.refused["orphan"] == 0


def test_the_prefill_sends_each_payload_with_its_life() -> None:
    """The life is the draw's position: the Req's prompt plus output at the draw, the
    number the decode reads before its transfer commits. A target that is no Req (a bare
    room) sends no life."""
    from test_sglang import RecordingSender, draft_rows, sparse_encoder

    from pd_middleware.integrations.sglang.prefill import ProposalPublisher

    tx = RecordingSender()
    pub = ProposalPublisher(sparse_encoder(), tx, vocab_size=16, seed=3)
    fresh = SimpleNamespace(bootstrap_room=21, rid="a", origin_input_ids=[1] * 6, output_ids=[])
    again = SimpleNamespace(bootstrap_room=22, rid="b", origin_input_ids=[1] * 6 + [4] * 3, output_ids=[])
    pub.publish([21, 22], draft_rows(2), targets=[fresh, again])
    assert [p.life for p in tx.sent] == [6, 9] == [life_of(fresh), life_of(again)]
    pub.publish([23], draft_rows(1))
    assert tx.sent[-1].life is None


@pytest.mark.sglang
def test_sglangs_own_poll_holds_a_request_until_its_payload_is_stored(sglang_importable, zctx, monkeypatch) -> None:
    """SGLang's real ``poll_and_all_reduce`` (its real ``_apply_metadata_gate``, wrapped by the
    drop-in, and the real side-channel decode with its receiver on loopback): a request whose
    KV is done is reported transferring while its payload is missing and a prefill is
    connected, and done once the payload is stored. The ranks' MIN all-reduce is the one
    stand-in (one rank: the identity), and so are the KV receivers (their poll says done)."""
    import importlib

    from pd_middleware.integrations import sglang as S

    utils = importlib.import_module("sglang.srt.disaggregation.utils")
    monkeypatch.setattr(utils, "_all_reduce_polls", lambda polls, group: polls)
    facts = S.EngineFacts(role="decode", vocab_size=16, num_steps=1, algorithm="EAGLE", topk=1, rejection_sampling=True)
    inst = S.install(make_config(), S.InstallOptions(channel="sidechannel", facts=facts))
    assert inst.receiver is not None and isinstance(inst.source.arrivals, ArrivalWait)
    poll = utils.KVPoll
    r = SimpleNamespace(bootstrap_room=77, bootstrap_host="127.0.0.1", rid="u", origin_input_ids=[1] * 5, output_ids=[])
    decode_req = SimpleNamespace(req=r, metadata_buffer_index=0)
    buffers = SimpleNamespace(bootstrap_room=torch.tensor([[77]]))
    done = SimpleNamespace(poll=lambda: poll.Success)

    def polled() -> int:
        return utils.poll_and_all_reduce([done], None, decode_reqs=[decode_req], metadata_buffers=buffers)[0]

    assert polled() == poll.Success  # no prefill connected: nothing is awaited
    s = _peer(zctx, inst.receiver.address)
    deadline = time.monotonic() + 5.0
    while not inst.receiver.peers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert polled() == poll.Transferring and getattr(r, LIFE_ATTR) == 5
    s.send_multipart(inline_frames(Payload("77", (3,), (0.5,), 16, provenance=Provenance(), life=5), 1))
    deadline = time.monotonic() + 5.0
    got = polled()
    while got != poll.Success and time.monotonic() < deadline:
        time.sleep(0.01)
        got = polled()
    assert got == poll.Success
    counts = inst.source.proposer.counts
    assert counts["wait:held"] == 1 and counts["wait:arrived"] == 1
    s.close(0)
