"""Attacks on the bulk plane (issue 13): unwritten, stale, tampered and two-slot payloads.

``python reliability/attacks_bulk.py [--rounds N] [--budget-s S]``

A real :class:`DecodeReceiver` with a real Mooncake engine, in this process, is attacked
by hand-driven prefills (``tests/_bulk_peer.py``: a real DEALER and a real engine that
write, or not, into granted slots and send any header):

- ``unwritten``: a header names a granted slot that no write reached (the slot holds the
  previous use's bytes);
- ``stale_after_reconnect``: a prefill fills every slot and leaves; a new peer gets the
  same slots and sends headers naming them unwritten, then replays the old peer's
  headers (whose bytes are still in the slots);
- ``tampered``: after the legitimate write lands, a second engine overwrites a few bytes
  of the slot, then the header goes out; once with the always-on digest and once
  authenticated (HMAC headers, BLAKE3 digests);
- ``two_slot``: one payload whose hidden state and proposal name two different slots;
- ``copied_digest`` (plain, and ``_hmac``; issue 23): a new peer copies an old header's
  digests, with its own request id and the new grant's generation;
- ``forged_freed`` (issue 23): a fake decode acks slots the prefill does not have in use
  (three duplicates of one slot and one never sent) to a real ``PrefillSender``.

Each attack is interleaved with a valid payload (the control, which must be delivered
bit-exact). Figures per case: ``attacks`` sent, ``refused`` with the expected failure
key, ``controls_delivered``, and the must-be-zero ``crashes`` (receiver thread died or
the script raised), ``hangs`` (no outcome within 5 s), ``lost`` (a refused slot never
freed), ``wrong_deliveries`` (an attack delivered, or a control with wrong bytes).

``--negative-control`` runs the same cases with the decode's integrity check switched off
(``SlotPool.admit`` only records the generation): the campaign must then report wrong
deliveries and exit 1, which shows it can fail.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.setup_env()
sys.path.insert(0, str(C.ROOT / "tests"))

import msgspec
import zmq
from _bulk_peer import RawPrefill

from pd_middleware import DenseEncoding, NoSlotError, OneHotProposal, Payload
from pd_middleware.decode.pipeline import Delivery, Failure, ReceivePipeline
from pd_middleware.transport import DecodeReceiver, MooncakeConfig, MooncakeEngine, SlotsConfig, TransportConfig

KEY = "bulk-attack-key-0123456789abcdef"
VOCAB = 512
OUTCOME_S = 5.0


def config(authenticated: bool) -> TransportConfig:
    return TransportConfig(
        heartbeat_s=0.1,
        peer_timeout_s=5.0,
        inline_threshold_bytes=0,
        hmac_key=KEY if authenticated else None,
        slots=SlotsConfig(count=32, size_bytes=64 * 1024, per_peer=4, wait_s=5.0),
        mooncake=MooncakeConfig(),
    )


def payload(rid: str, seed: int) -> Payload:
    """A dense payload whose bytes depend on ``seed`` (so a stale slot never matches)."""
    rnd = (seed * 2654435761) & 0xFFFFFFFF
    data = bytes((rnd >> (i % 24) ^ i * 7) & 0xFF for i in range(VOCAB * 4))
    return Payload(
        rid, (seed % VOCAB,), (0.5,), VOCAB, hidden=bytes([seed & 0xFF]) * 512, proposal=DenseEncoding("fp32", data)
    )


class OneHot:
    """The bulk plane is under test, not a synthesizer: a one-hot proposal from the tokens."""

    def synthesize(self, payload: Payload) -> OneHotProposal:
        return OneHotProposal(payload.draft_tokens)


class Case:
    """Counts for one attack class, and the receiver's outcomes sorted by request id."""

    def __init__(self, name: str, rx: DecodeReceiver) -> None:
        self.name = name
        self.rx = rx
        self.fig: Counter[str] = Counter()
        self.keys: Counter[str] = Counter()
        self.problems: list[str] = []

    def outcome(self, rid: str) -> Delivery | Failure | None:
        deadline = time.monotonic() + OUTCOME_S
        while time.monotonic() < deadline:
            o = self.rx.get(timeout=0.05)
            if o is None:
                continue
            if o.request_id == rid:
                return o
            self.problems.append(f"unexpected outcome for {o.request_id}")
            self.fig["wrong_deliveries" if isinstance(o, Delivery) else "unexpected_failures"] += 1
            if isinstance(o, Delivery):
                o.release()
        self.fig["hangs"] += 1
        self.problems.append(f"no outcome for {rid} within {OUTCOME_S} s")
        return None

    def attack(self, rid: str, expect: str, send: Callable[[], None], peer: RawPrefill, slot: int) -> None:
        """Send one attack; it must fail with ``expect`` and its slot must come back."""
        self.fig["attacks"] += 1
        peer.freed.clear()
        send()
        o = self.outcome(rid)
        if isinstance(o, Delivery):
            self.fig["wrong_deliveries"] += 1
            self.problems.append(f"attack {rid} was delivered")
            o.release()
        elif isinstance(o, Failure):
            self.keys[o.key] += 1
            if o.key == expect:
                self.fig["refused"] += 1
            else:
                self.problems.append(f"attack {rid} failed as {o.key}, expected {expect}")
                self.fig["refused_other"] += 1
        if slot >= 0 and o is not None and not peer.wait_freed(slot):
            self.fig["lost"] += 1
            self.problems.append(f"slot {slot} of {rid} never freed")

    def control(self, peer: RawPrefill, slot: int, rid: str, seed: int) -> None:
        """A valid payload through ``slot``: must be delivered bit-exact, then released."""
        p = payload(rid, seed)
        h, parts = peer.header(p, slot, algorithm=peer_algorithm(peer))
        peer.write(slot, parts)
        peer.freed.clear()
        peer.send_header(h)
        o = self.outcome(rid)
        if isinstance(o, Delivery):
            got = (bytes(o.payload.hidden), bytes(o.payload.proposal.data))  # type: ignore[union-attr]
            if got != (bytes(p.hidden), bytes(p.proposal.data)):  # type: ignore[union-attr]
                self.fig["wrong_deliveries"] += 1
                self.problems.append(f"control {rid} delivered with wrong bytes")
            else:
                self.fig["controls_delivered"] += 1
            o.release()
            if not peer.wait_freed(slot):
                self.fig["lost"] += 1
                self.problems.append(f"slot {slot} of control {rid} never freed")
        elif isinstance(o, Failure):
            self.fig["controls_failed"] += 1
            self.problems.append(f"control {rid} failed: {o.key} {o.reason[:120]}")

    def result(self) -> dict[str, Any]:
        alive = self.rx._thread is not None and self.rx._thread.is_alive()
        if not alive:
            self.fig["crashes"] += 1
        out = {
            k: self.fig[k]
            for k in ("attacks", "refused", "controls_delivered", "crashes", "hangs", "lost", "wrong_deliveries")
        }
        out["failure_keys"] = dict(self.keys)
        out["problems"] = self.problems[:10]
        return out


def peer_algorithm(peer: RawPrefill) -> str:
    return "blake3" if peer.signer is not None else "xxh3_128"


def unwritten(case: Case, ctx: zmq.Context, engine: MooncakeEngine, rounds: int) -> None:
    peer = RawPrefill(ctx, case.rx.address, engine, "unwritten", want=4)
    peer.hello()
    try:
        for i in range(rounds):
            s = peer.grant.slots[i % 4]  # type: ignore[union-attr]
            case.control(peer, s, f"uw-ok-{i}", 2 * i)  # the slot now holds these bytes
            h, _ = peer.header(payload(f"uw-{i}", 2 * i + 1), s)
            case.attack(f"uw-{i}", "transfer:digest", lambda h=h: peer.send_header(h), peer, s)
    finally:
        peer.close()


def stale_after_reconnect(case: Case, ctx: zmq.Context, engine: MooncakeEngine, rounds: int) -> None:
    for r in range(max(1, rounds // 8)):
        old = RawPrefill(ctx, case.rx.address, engine, f"stale-old-{r}", want=4)
        old.hello()
        headers = []
        for j, s in enumerate(old.grant.slots):  # type: ignore[union-attr]
            rid = f"st-old-{r}-{j}"
            p = payload(rid, 1000 + 8 * r + j)
            h, parts = old.header(p, s)
            old.write(s, parts)
            old.send_header(h)
            o = case.outcome(rid)
            if isinstance(o, Delivery):
                o.release()
            headers.append((s, h))
        old.close()
        time.sleep(0.05)  # the bye is processed before the next hello
        new = RawPrefill(ctx, case.rx.address, engine, f"stale-new-{r}", want=4)
        new.hello()
        try:
            for j, (s, h_old) in enumerate(headers):
                if s not in new.grant.slots:  # type: ignore[union-attr]
                    continue
                h, _ = new.header(payload(f"st-new-{r}-{j}", 2000 + 8 * r + j), s)
                case.attack(f"st-new-{r}-{j}", "transfer:digest", lambda h=h, new=new: new.send_header(h), new, s)
                # The old header, replayed: its digest matches the slot; its generation does not.
                replay = msgspec.structs.replace(h_old, request_id=f"st-replay-{r}-{j}")
                case.attack(
                    f"st-replay-{r}-{j}", "transfer:digest", lambda h=replay, new=new: new.send_header(h), new, s
                )
                case.control(new, s, f"st-ok-{r}-{j}", 3000 + 8 * r + j)
        finally:
            new.close()
            time.sleep(0.05)


def tampered(
    case: Case, ctx: zmq.Context, engine: MooncakeEngine, other: MooncakeEngine, rounds: int, key: bytes | None
) -> None:
    peer = RawPrefill(ctx, case.rx.address, engine, f"tamper-{case.name}", want=4, key=key)
    peer.hello()
    algorithm = peer_algorithm(peer)
    try:
        for i in range(rounds):
            s = peer.grant.slots[i % 4]  # type: ignore[union-attr]
            rid = f"tp-{case.name}-{i}"
            p = payload(rid, 5000 + i)
            h, parts = peer.header(p, s, algorithm=algorithm)
            peer.write(s, parts)
            buf, off = parts[i % 2]
            evil = bytearray(bytes(buf))
            at = (i * 37) % len(evil)
            evil[at] ^= 1 << (i % 8)  # one bit
            peer.write(s, [(bytes(evil), off)], engine=other)  # a second engine: nothing checks who writes
            case.attack(rid, "transfer:digest", lambda h=h: peer.send_header(h), peer, s)
            case.control(peer, s, f"tp-ok-{case.name}-{i}", 6000 + i)
    finally:
        peer.close()


def two_slot(case: Case, ctx: zmq.Context, engine: MooncakeEngine, rounds: int) -> None:
    peer = RawPrefill(ctx, case.rx.address, engine, "two-slot", want=4)
    peer.hello()
    try:
        for i in range(rounds):
            a, b = peer.grant.slots[i % 2], peer.grant.slots[2 + i % 2]  # type: ignore[union-attr]
            rid = f"ts-{i}"
            p = payload(rid, 7000 + i)
            h, parts = peer.header(p, a)
            peer.write(a, parts)
            hb, parts_b = peer.header(p, b)
            peer.write(b, parts_b)
            two = msgspec.structs.replace(h, proposal=hb.proposal)
            case.attack(rid, "wire:proposal.data.slot", lambda two=two: peer.send_header(two), peer, a)
            case.control(peer, b, f"ts-ok-{i}", 8000 + i)
    finally:
        peer.close()


def copied_digest(case: Case, ctx: zmq.Context, engine: MooncakeEngine, rounds: int, key: bytes | None) -> None:
    """Issue 23: a new peer copies an old header's digests (the bytes are still in the slot)
    under its own request id and the new grant's generation: the digest is bound to
    (request id, slot, generation, offset), so it must fail as ``transfer:digest``."""
    for r in range(max(1, rounds // 16)):
        old = RawPrefill(ctx, case.rx.address, engine, f"cd-old-{case.name}-{r}", want=4, key=key)
        old.hello()
        headers = []
        for j, s in enumerate(old.grant.slots):  # type: ignore[union-attr]
            rid = f"cd-old-{case.name}-{r}-{j}"
            h, parts = old.header(payload(rid, 9000 + 8 * r + j), s, algorithm=peer_algorithm(old))
            old.write(s, parts)
            old.send_header(h)
            o = case.outcome(rid)
            if isinstance(o, Delivery):
                o.release()
            headers.append((s, h))
        old.close()
        time.sleep(0.05)
        new = RawPrefill(ctx, case.rx.address, engine, f"cd-new-{case.name}-{r}", want=4, key=key)
        new.hello()
        try:
            for j, (s, h_old) in enumerate(headers):
                if s not in new.grant.slots:  # type: ignore[union-attr]
                    continue
                g = new.gens[s] = new.gens[s] + 1
                refs = {}
                for fld in ("hidden", "proposal"):
                    ref = getattr(h_old, fld)
                    if fld == "proposal":
                        refs[fld] = msgspec.structs.replace(ref, data=msgspec.structs.replace(ref.data, gen=g))
                    else:
                        refs[fld] = msgspec.structs.replace(ref, gen=g)
                forged = msgspec.structs.replace(h_old, request_id=f"cd-{case.name}-{r}-{j}", seq=new.seq + 1, **refs)
                new.seq += 1
                case.attack(forged.request_id, "transfer:digest", lambda f=forged, new=new: new.send_header(f), new, s)
                case.control(new, s, f"cd-ok-{case.name}-{r}-{j}", 9500 + 8 * r + j)
        finally:
            new.close()
            time.sleep(0.05)


def forged_freed(
    case: Case, ctx: zmq.Context, engine: MooncakeEngine, decode_engine: MooncakeEngine, rounds: int
) -> None:
    """Issue 23: a fake decode acks slots the prefill never had back in use (duplicates, an
    unknown one). A real :class:`PrefillSender` must refuse and count them, and never let
    two payloads in flight share a slot."""
    import mmap

    from pd_middleware.transport import PrefillSender, wire

    size = 1 << 16
    buf = mmap.mmap(-1, 4 * size)
    base = decode_engine.register(buf)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    tx = PrefillSender(
        TransportConfig(
            inline_threshold_bytes=0,
            heartbeat_s=0.05,
            slots=SlotsConfig(per_peer=4, wait_s=0.3),
            mooncake=MooncakeConfig(max_inflight_writes=1),
        ),
        engine=engine,
        context=ctx,
        name="victim",
    )
    ident = b""

    def serve(until: float, want_headers: int = 0) -> list[Any]:
        nonlocal ident
        heads = []
        while time.monotonic() < until and (want_headers == 0 or len(heads) < want_headers):
            if not router.poll(20):
                continue
            who, *frames = router.recv_multipart()
            msg = wire.decode_frame(frames[0], TransportConfig().limits)
            if isinstance(msg, wire.Hello):
                ident = who
                g = tuple(1 << 32 for _ in range(4))
                grant = wire.Grant(
                    session="fake",
                    mooncake=decode_engine.peer_name,
                    slot_size=size,
                    slots=(0, 1, 2, 3),
                    addrs=tuple(base + i * size for i in range(4)),
                    heartbeat_s=1.0,
                    gens=g,
                )
                router.send_multipart([who, wire.encode(grant)])
                return heads
            if isinstance(msg, wire.PayloadHeader):
                heads.append(msg)
        return heads

    import threading

    try:
        th = threading.Thread(target=serve, args=(time.monotonic() + 5.0,))
        th.start()
        tx.connect(f"tcp://127.0.0.1:{port}", timeout=5.0)
        th.join()
        for r in range(max(1, rounds // 16)):
            tx.send(payload(f"ff-a-{r}", 100 + r))
            (h,) = serve(time.monotonic() + 5.0, 1)
            a = h.hidden.slot  # type: ignore[union-attr]
            others = [s for s in range(4) if s != a]
            before = tx.statuses()["refused_slot_frees"]
            # a once (honest: it is in use), a twice more, and a slot never sent
            router.send_multipart(
                [ident, wire.encode(wire.Ack(freed=(a, a, a, others[0]), delivered=(h.seq,), failed=()))]
            )
            time.sleep(0.05)
            case.fig["attacks"] += 3
            for i in range(4):
                tx.send(payload(f"ff-{r}-{i}", 200 + 8 * r + i))
            try:  # a fifth: every slot is in use now (the forged frees gave none back twice)
                tx.send(payload(f"ff-{r}-extra", 300 + r))
                extra = 1
            except NoSlotError:
                extra = 0
            heads = serve(time.monotonic() + 1.0 + 4.0 * extra, 4 + extra)
            slots = [x.hidden.slot for x in heads]  # type: ignore[union-attr]
            st = tx.statuses()
            if len(heads) < 4:
                case.fig["hangs"] += 1
            if len(set(slots)) != len(slots):
                case.fig["wrong_deliveries"] += 1  # two payloads in one slot
                case.problems.append(f"slots {slots} after a forged freed list")
            refused = st["refused_slot_frees"] - before
            case.fig["refused"] += refused
            if refused != 3 or not st["decode_suspect"]:
                case.problems.append(f"refused {refused} forged frees (expected 3), suspect {st['decode_suspect']!r}")
            case.fig["controls_delivered"] += len(set(slots))
            # give every slot back, honestly
            router.send_multipart(
                [ident, wire.encode(wire.Ack(freed=tuple(slots), delivered=tuple(x.seq for x in heads), failed=()))]
            )
            time.sleep(0.05)
    finally:
        tx.close(timeout=0.2)
        router.close(0)
        decode_engine.unregister(base)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rounds", type=int, default=200, help="attacks per case (stale: rounds/8 reconnects x 4 slots x 2)"
    )
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--negative-control", action="store_true", help="switch the integrity check off: must fail")
    args = ap.parse_args()
    if args.negative_control:
        from pd_middleware.transport.slots import SlotPool

        def unchecked(self: SlotPool, slot: int, refs: list, rid: str, key: bytes | None = None) -> int:
            self.gen[slot] = refs[0][1].gen
            return self.gen[slot]

        SlotPool.admit = unchecked  # type: ignore[method-assign]
    budget = C.Budget(args.budget_s)
    decode_engine, prefill_engine, other_engine = MooncakeEngine.open(), MooncakeEngine.open(), MooncakeEngine.open()
    ctx = zmq.Context()
    cases: dict[str, dict[str, Any]] = {}
    plan: list[tuple[str, bool, Callable[[Case], None]]] = [
        ("unwritten", False, lambda c: unwritten(c, ctx, prefill_engine, args.rounds)),
        ("stale_after_reconnect", False, lambda c: stale_after_reconnect(c, ctx, prefill_engine, args.rounds)),
        ("tampered_fast", False, lambda c: tampered(c, ctx, prefill_engine, other_engine, args.rounds, None)),
        (
            "tampered_authenticated",
            True,
            lambda c: tampered(c, ctx, prefill_engine, other_engine, args.rounds, KEY.encode()),
        ),
        ("two_slot", False, lambda c: two_slot(c, ctx, prefill_engine, args.rounds)),
        ("copied_digest", False, lambda c: copied_digest(c, ctx, prefill_engine, args.rounds, None)),
        ("copied_digest_hmac", True, lambda c: copied_digest(c, ctx, prefill_engine, args.rounds, KEY.encode())),
        ("forged_freed", False, lambda c: forged_freed(c, ctx, prefill_engine, other_engine, args.rounds)),
    ]
    t0 = time.monotonic()
    for name, auth, run in plan:
        if budget.over():
            cases[name] = {"skipped": "budget spent"}
            continue
        pipeline = ReceivePipeline([], {"default": ("one_hot", OneHot())})
        rx = DecodeReceiver(config(auth), pipeline, engine=decode_engine, context=ctx).start()
        case = Case(name, rx)
        try:
            run(case)
        except Exception:  # the script itself failed: counted as a crash, with the traceback
            case.fig["crashes"] += 1
            case.problems.append(traceback.format_exc(limit=3))
        finally:
            cases[name] = case.result()
            rx.stop()
            for o in rx.drain():
                if isinstance(o, Delivery):
                    o.release()
    ctx.term()
    for e in (decode_engine, prefill_engine, other_engine):
        e.close()
    totals = Counter[str]()
    for r in cases.values():
        for k in ("attacks", "refused", "controls_delivered", "crashes", "hangs", "lost", "wrong_deliveries"):
            totals[k] += int(r.get(k, 0))
    skipped = [n for n, r in cases.items() if "skipped" in r]
    result = {
        "script": "attacks_bulk",
        "negative_control": args.negative_control,
        **{
            k: totals[k]
            for k in ("attacks", "refused", "controls_delivered", "crashes", "hangs", "lost", "wrong_deliveries")
        },
        "skipped": skipped,
        "cases": cases,
        "seconds": round(time.monotonic() - t0, 1),
        "machine": C.machine(),
        "must_be_zero": ["crashes", "hangs", "lost", "wrong_deliveries", "skipped"],
    }
    C.emit(result)
    bad = any(totals[k] for k in ("crashes", "hangs", "lost", "wrong_deliveries")) or skipped
    return 1 if bad or totals["refused"] != totals["attacks"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
