"""Structure-aware fuzz of a LIVE decode receiver (real ROUTER socket, real synthesizers).

``python reliability/fuzz.py [--cases 100000] [--seed 1] [--budget-s 240]``

A :class:`~pd_middleware.transport.DecodeReceiver` with a Mooncake engine (so payloads
may name receive slots) runs in this process behind the real ``one_hot``, ``sparse``
and ``full_distribution`` synthesizers. Raw DEALER sockets send it valid messages with
one thing broken, in these families (``--cases`` in total, round-robin with a seeded
choice inside each family):

- ``field``: one leaf anywhere in the header replaced by a value of another type or out
  of range; ``missing``/``unknown``: a field removed / an unknown key added at any depth;
- ``truncate``: the header or one tensor frame cut short; ``bytes``: random byte flips;
- ``swap``: the whole frame another msgpack type, or another (misdirected) ``kind``;
- ``huge``: huge declared shapes/nbytes, msgpack array/str/bin/map headers declaring
  2**32-1 elements, long lists, frames above ``max_message_bytes`` or above the
  libzmq cap (``ZMQ_MAXMSGSIZE``: dropped before Python, on a throwaway socket);
- ``version``: ``v`` other than 1 (numbers, strings, null);
- ``prob``: NaN / inf / negative / > 1 / unnormalised values in ``draft_probs``, in
  dense rows and in sparse values and tail masses;
- ``range``: out-of-range draft token ids, sparse indices (negative, V, 2**31-1) and
  repeated indices within a step;
- ``dup``: a valid payload resent with the same request id (same or new seq), and two
  headers naming the same held slot;
- ``frames``: zero, too many or extra frames; ``peer``: payloads before any hello;
- ``valid``: unmodified messages (control: they must be delivered).

Every message that reaches Python must end as exactly one outcome. Figures: ``tried``,
``rejected_with_field`` (a Failure naming a field), ``accepted`` (Deliveries, each
checked by an oracle: ``accepted_invalid`` must be 0), ``control_accepted`` (valid
hello/ping/bye: no outcome by design), ``dropped_by_libzmq`` (frames above the cap),
``crashes`` (receiver thread died or a failure without a field: 0), ``hangs``
(messages without an outcome after 10 s: 0), ``receiver_alive`` and
``final_valid_delivered`` (a clean sender's inline and Mooncake payloads after the run).
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.setup_env()

import msgspec
import zmq

from pd_middleware import WireError
from pd_middleware.decode.pipeline import Delivery, Failure
from pd_middleware.transport import (
    DecodeReceiver,
    LimitsConfig,
    SlotsConfig,
    TransportConfig,
    integrity,
    payload_codec,
    wire,
)

FAMILIES = (
    "field",
    "missing",
    "unknown",
    "truncate",
    "bytes",
    "swap",
    "huge",
    "version",
    "prob",
    "range",
    "dup",
    "frames",
    "peer",
    "valid",
)
KINDS = ("none", "dense", "dense16", "sparse", "sparse_floor")
V = C.VOCAB
MAX_TENSOR = 1 << 20
HUGE = b"HUGEMARK"
HUGE_HEADERS = (
    b"\xdd\xff\xff\xff\xff",
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xdc\xff\xff",
)


def config() -> TransportConfig:
    return TransportConfig(
        heartbeat_s=0.5,
        peer_timeout_s=3600.0,  # fuzz peers are slow on purpose: never time them out
        hwm=1_000_000,
        slots=SlotsConfig(count=96, size_bytes=16384, per_peer=32, wait_s=5.0),
        limits=LimitsConfig(max_tensor_bytes=MAX_TENSOR, max_steps=8),
    )


# ---- mutation helpers --------------------------------------------------------------


def _leaves(node: Any, path: tuple = ()) -> list[tuple]:
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((*path, k))
            out += _leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((*path, i))
            out += _leaves(v, (*path, i))
    return out


def _get(node: Any, path: tuple) -> Any:
    for k in path:
        node = node[k]
    return node


def _set(node: Any, path: tuple, value: Any) -> None:
    _get(node, path[:-1])[path[-1]] = value


def _wrong_value(rng: random.Random, old: Any) -> Any:
    """A value of another type, or the same type out of range."""
    if isinstance(old, bool):
        pool = [None, 0, "true", 2]
    elif isinstance(old, int):
        pool = [-1, -(2**63), 2**64 - 1, 2**40, 1.5, "1", None, [old], True, float("nan")]
    elif isinstance(old, float):
        pool = [float("nan"), float("inf"), -float("inf"), -0.5, 1.5, 1e308, "0.5", None, [old], 2**64 - 1]
    elif isinstance(old, str):
        pool = ["", "x" * 300, "\u0000", "é" * 40, 7, None, ["a"], b"bytes", "bf32", "int64", "grant"]
    elif isinstance(old, list):
        pool = [[], old * 3, old[:-1], [old], {"a": 1}, "list", None, [None] * max(1, len(old)), [2**64 - 1]]
    elif isinstance(old, dict):
        pool = [{}, [], None, "map", 5, {"kind": "dense"}]
    else:
        pool = [0, "", None, [], {}]
    return rng.choice(pool)


class Peer:
    """A raw DEALER that said hello: tracks its slot grant from the decode's replies."""

    def __init__(self, ctx: zmq.Context, address: str, name: str, want: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 1_000_000)
        self.sock.setsockopt(zmq.RCVHWM, 1_000_000)
        self.sock.connect(address)
        self.name = name
        self.want = want
        self.free: set[int] = set()
        self.slots: tuple[int, ...] = ()
        self.slot_size = 0
        self.gens: dict[int, int] = {}  # each slot's last generation: a valid header names the next
        self.replies: Counter[str] = Counter()
        self.hello()

    def hello(self) -> None:
        self.sock.send_multipart([wire.encode(wire.Hello(name=self.name, want_slots=self.want))])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.sock.poll(200) and self._recv():
                return
        raise SystemExit(f"no grant for fuzz peer {self.name}")

    def _recv(self) -> bool:
        msg = wire.decode_frame(self.sock.recv_multipart()[0], LimitsConfig(), wire.OUTBOUND_DECODER)
        self.replies[type(msg).__name__] += 1
        if isinstance(msg, wire.Grant):
            self.slots, self.slot_size = msg.slots, msg.slot_size
            self.free = set(msg.slots)
            self.gens = dict(zip(msg.slots, msg.gens))
            return True
        if isinstance(msg, wire.Ack):
            self.free.update(s for s in msg.freed if s in self.slots)
        return False

    def drain(self) -> None:
        while self.sock.poll(0):
            self._recv()


class Fuzzer:
    def __init__(self, rng: random.Random, rx: DecodeReceiver, main: Peer) -> None:
        self.rng = rng
        self.rx = rx
        self.main = main
        self.limits = rx.config.limits
        self.n = 0
        self.corpus: list[tuple[str, int]] = [(k, s) for k in KINDS for s in (1, 2, 3)]
        self.family_of: dict[str, str] = {}  # request id -> family, for per-family figures
        self.family = "valid"

    # A base case: (header dict, tensor parts, slot or -1). Parts are bytearrays in frame order.
    def base(self, slot_mode: bool, control_ok: bool = False) -> tuple[dict, list[bytearray], int]:
        self.n += 1
        if control_ok and self.rng.random() < 0.1:  # hello / ping / bye as the base message
            msg = self.rng.choice(
                [
                    wire.Hello(name=f"side-{self.n}", want_slots=2, mooncake=None),
                    wire.Heartbeat(),
                    wire.Bye(reason="fuzz"),
                ]
            )
            return msgspec.msgpack.decode(wire.encode(msg)), [], -1
        kind, steps = self.rng.choice(self.corpus)
        self.family_of[f"fz-{self.n}"] = self.family
        p = C.make_payload(f"fz-{self.n}", kind, steps, seed=self.n % 97)
        slot = -1
        if slot_mode and self.main.free:
            slot = min(self.main.free)
        gen = 0
        if slot >= 0:  # a valid bulk header: the slot's next generation and the bytes' digest
            gen = self.main.gens[slot] = self.main.gens.get(slot, 0) + 1
        header, parts = payload_codec.build_header(p, self.n, slot, gen=gen, digest=integrity.Binder("xxh3_128"))
        raw = msgspec.msgpack.decode(wire.encode(header))
        return raw, [bytearray(bytes(b)) for b, _ in parts], slot

    def tensor_index(self, raw: dict, name: str) -> int:
        """Position in ``parts`` of tensor ``name`` (hidden, data, indices, values), or -1."""
        order = ["hidden"] if raw.get("hidden") else []
        p = raw.get("proposal")
        if isinstance(p, dict):
            order += ["data"] if p.get("kind") == "dense" else ["indices", "values"]
        return order.index(name) if name in order else -1

    def case(self, family: str) -> tuple[list[bytes], int, list[bytearray], dict, str]:
        """One test message of ``family``: (frames, slot, parts, header dict, route).

        ``slot``: the slot whose memory ``parts`` must be written to first (-1: inline);
        ``route``: the socket to use (``main``, ``fresh`` = never said hello, ``big`` =
        a throwaway socket for frames above the libzmq cap).
        """
        rng = self.rng
        self.family = family
        control_ok = family in ("field", "missing", "unknown", "truncate", "bytes", "swap", "version", "valid")
        raw, parts, slot = self.base(slot_mode=family != "frames" and rng.random() < 0.35, control_ok=control_ok)
        route = "main"
        header: bytes | None = None
        if family == "field":
            path = rng.choice(_leaves(raw))
            _set(raw, path, _wrong_value(rng, _get(raw, path)))
        elif family == "missing":
            path = rng.choice([p for p in _leaves(raw) if isinstance(_get(raw, p[:-1]), dict)] or [("seq",)])
            del _get(raw, path[:-1])[path[-1]]
        elif family == "unknown":
            dicts = [()] + [p for p in _leaves(raw) if isinstance(_get(raw, p), dict)]
            _get(raw, rng.choice(dicts))[rng.choice(["extra", "Kind", "v2", "__class__", "x" * 40])] = rng.choice(
                [1, "x", None, [1]]
            )
        elif family == "truncate":
            enc = msgspec.msgpack.encode(raw)
            if parts and rng.random() < 0.5:
                i = rng.randrange(len(parts))
                del parts[i][rng.randrange(max(1, len(parts[i]))) :]
            else:
                header = enc[: rng.randrange(len(enc))]
        elif family == "bytes":
            enc = bytearray(msgspec.msgpack.encode(raw))
            for _ in range(rng.randint(1, 6)):
                enc[rng.randrange(len(enc))] = rng.randrange(256)
            header = bytes(enc)
        elif family == "swap":
            r = rng.random()
            if r < 0.4:
                header = msgspec.msgpack.encode(
                    rng.choice([[1, 2, 3], 7, "payload", None, 1.5, b"\x00" * 8, [raw], True])
                )
            elif r < 0.8:
                raw["kind"] = rng.choice(["grant", "ack", "error", "ping", "bye", "hello", "Payload", "", 1, None])
            else:
                raw["proposal"] = {"kind": rng.choice(["dense", "sparse", "onehot", 3])}
        elif family == "huge":
            r = rng.random()
            if r < 0.3:
                ref = rng.choice([["hidden"], ["proposal", "data"], ["proposal", "indices"], ["proposal", "values"]])
                try:
                    node = _get(raw, tuple(ref))
                except (KeyError, TypeError):
                    node = None
                if isinstance(node, dict):
                    n = rng.choice([1 << 31, 1 << 38, (1 << 40), MAX_TENSOR])
                    node["shape"] = [n] if len(node["shape"]) == 1 else [n, V]
                    node["nbytes"] = rng.choice([n * 4, 1 << 40, n])
                else:
                    raw["vocab_size"] = rng.choice([1 << 31, 1 << 62, 2**64 - 1])
            elif r < 0.6:
                path = rng.choice(_leaves(raw))
                _set(raw, path, HUGE.decode())
                enc = msgspec.msgpack.encode(raw)
                header = enc.replace(b"\xa8" + HUGE, rng.choice(HUGE_HEADERS) + b"\x01\x02", 1)
            elif r < 0.8:
                key = rng.choice(["draft_tokens", "draft_probs", "request_id"])
                raw[key] = [1] * 20000 if key != "request_id" else "r" * 70000
            elif r < 0.95:
                header = msgspec.msgpack.encode(raw) + b"\x00" * (self.limits.max_message_bytes + 1)
            else:
                route = "big"  # above ZMQ_MAXMSGSIZE: libzmq drops the frame and the connection
                parts = [bytearray(max(self.limits.max_message_bytes, MAX_TENSOR) + 1)]
        elif family == "version":
            raw["v"] = rng.choice([0, 2, -1, 255, 2**63, "1", 1.0, None, [1]])
        elif family == "prob":
            bad = rng.choice([float("nan"), float("inf"), -float("inf"), -0.25, 1.5, 2.0, 1e30])
            r = rng.random()
            if r < 0.3:
                probs = raw["draft_probs"]
                probs[rng.randrange(len(probs))] = bad
            elif self.tensor_index(raw, "data") >= 0:
                i = self.tensor_index(raw, "data")
                dt = raw["proposal"]["dtype"]
                fmt, size = ("<f", 4) if dt == "fp32" else ("<e", 2)
                if rng.random() < 0.5:
                    at = rng.randrange(len(parts[i]) // size) * size
                    try:
                        parts[i][at : at + size] = struct.pack(fmt, bad)
                    except OverflowError:
                        parts[i][at : at + size] = b"\xff" * size  # NaN pattern
                else:  # unnormalised: scale a whole row
                    n = len(parts[i]) // size
                    vals = [x * 1.5 for x in struct.unpack(f"<{n}{fmt[1]}", bytes(parts[i]))]
                    parts[i][:] = struct.pack(f"<{n}{fmt[1]}", *vals)
            elif self.tensor_index(raw, "values") >= 0:
                if rng.random() < 0.3:
                    tm = raw["proposal"]["tail_mass"]
                    if tm:
                        tm[rng.randrange(len(tm))] = bad
                    else:
                        raw["proposal"]["tail_mass"] = [bad] * len(raw["draft_tokens"])
                else:
                    i = self.tensor_index(raw, "values")
                    at = rng.randrange(len(parts[i]) // 4) * 4
                    parts[i][at : at + 4] = (
                        struct.pack("<f", bad) if abs(bad) < 3e38 or bad != bad else struct.pack("<f", float("inf"))
                    )
            else:
                raw["draft_probs"] = [bad] * len(raw["draft_probs"])
        elif family == "range":
            bad_tok = rng.choice([-1, V, V + 1, 2**31 - 1, 2**63 - 1, -(2**63)])
            i = self.tensor_index(raw, "indices")
            if i >= 0 and rng.random() < 0.6:
                n = len(parts[i]) // 4
                idx = list(struct.unpack(f"<{n}i", bytes(parts[i])))
                if rng.random() < 0.3 and raw["proposal"]["lengths"][0] > 1:
                    idx[1] = idx[0]  # repeated index within step 0
                else:
                    idx[rng.randrange(n)] = rng.choice([-1, V, V + 7, 2**31 - 1, -(2**31)])
                parts[i][:] = struct.pack(f"<{n}i", *idx)
            else:
                toks = raw["draft_tokens"]
                toks[rng.randrange(len(toks))] = bad_tok
        elif family == "dup":
            pass  # handled by the caller: the same message twice
        elif family == "frames":
            r = rng.random()
            if r < 0.3:
                parts = parts + [bytearray(b"x")] * (self.limits.max_frames + rng.randint(0, 3))
            elif r < 0.6:
                parts = [*parts, bytearray(rng.randrange(64))]
            elif r < 0.8 and parts:
                parts = parts[:-1]
            else:
                header = b""
        elif family == "peer":
            route = "fresh"
        # "valid": unchanged
        if header is None:
            header = msgspec.msgpack.encode(raw)
        frames = [header, *(bytes(b) for b in parts)] if slot < 0 else [header]
        return frames, slot, parts, raw, route


def predict(frames: list[bytes], limits: LimitsConfig) -> str:
    """Which message class the receiver will see: 'outcome' or 'control' (no outcome)."""
    if not frames or len(frames) > limits.max_frames:
        return "outcome"
    try:
        msg = wire.decode_frame(frames[0], limits)
    except WireError:
        return "outcome"
    return "outcome" if isinstance(msg, wire.PayloadHeader) else "control"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--chunk", type=int, default=400)
    args = ap.parse_args()

    from pd_middleware.transport import MooncakeEngine, PrefillSender

    budget = C.Budget(args.budget_s)
    rng = random.Random(args.seed)
    ctx = zmq.Context()
    engine = MooncakeEngine.open()
    rx = DecodeReceiver(config(), C.build_pipeline(V, 4), engine=engine, context=ctx).start()
    main_peer = Peer(ctx, rx.address, "fuzz-main", 32)
    side = Peer(ctx, rx.address, "fuzz-side", 0)  # gets mutated messages that decode as valid control
    fresh = ctx.socket(zmq.DEALER)  # never says hello
    fresh.setsockopt(zmq.LINGER, 0)
    fresh.connect(rx.address)
    fz = Fuzzer(rng, rx, main_peer)
    pool = rx._pool
    assert pool is not None
    rss0 = _rss_mb()

    tried = 0
    expected = 0
    got = 0
    fig: Counter[str] = Counter()
    by_family: dict[str, Counter[str]] = {f: Counter() for f in (*FAMILIES, "unattributed")}
    fields: Counter[str] = Counter()
    problems: list[str] = []
    crashed = False

    def collect(until: int, timeout: float) -> None:
        nonlocal got
        deadline = time.monotonic() + timeout
        while got < until and time.monotonic() < deadline:
            items = rx.drain() or [x for x in [rx.get(timeout=0.05)] if x is not None]
            for o in items:
                got += 1
                fam = (
                    by_family[fz.family_of.get(o.request_id, "unattributed")]
                    if o.request_id
                    else by_family["unattributed"]
                )
                fam["accepted" if isinstance(o, Delivery) else "rejected"] += 1
                if isinstance(o, Delivery):
                    bad = C.check_delivery(o, V)
                    fig["accepted"] += 1
                    if bad is not None:
                        fig["accepted_invalid"] += 1
                        if len(problems) < 10:
                            problems.append(f"accepted invalid {o.request_id}: {bad}")
                    o.release()
                elif isinstance(o, Failure):
                    if o.field:
                        fig["rejected_with_field"] += 1
                        fields[f"{o.stage}:{o.field.split('.')[0]}"] += 1
                    else:
                        fig["failed_without_field"] += 1
                        if len(problems) < 10:
                            problems.append(f"failure without a field: {o}")
            main_peer.drain()
            side.drain()

    t0 = time.monotonic()
    i = 0
    while tried < args.cases and not budget.over():
        family = FAMILIES[i % len(FAMILIES)]
        i += 1
        frames, slot, parts, raw, route = fz.case(family)
        if slot >= 0:  # what the Mooncake write would have put in the slot
            main_peer.free.discard(slot)
            off = 0
            base = slot * pool.size
            for b in parts:
                n = min(len(b), pool.size - off)
                if n > 0:
                    pool.view[base + off : base + off + n] = bytes(b[:n])
                off += (len(b) + wire.SLOT_ALIGN - 1) // wire.SLOT_ALIGN * wire.SLOT_ALIGN
        copies = 2 if family == "dup" else 1
        for c in range(copies):
            if family == "dup" and c == 1 and rng.random() < 0.5:
                raw["seq"] = raw["seq"] + 1_000_000  # same request id, new seq
                frames = [msgspec.msgpack.encode(raw), *frames[1:]]
            tried += 1
            by_family[family]["tried"] += 1
            if route == "big":
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(rx.address)
                s.send_multipart(frames)
                time.sleep(0.02)
                s.close(0)
                fig["dropped_by_libzmq"] += 1
                continue
            if route == "fresh":
                fresh.send_multipart(frames)
                expected += 1
                continue
            kind = predict(frames, fz.limits)
            if kind == "control":
                side.sock.send_multipart(frames)
                fig["control_accepted"] += 1
                by_family[family]["control"] += 1
                continue
            main_peer.sock.send_multipart(frames)
            expected += 1
        if tried % args.chunk < copies or not main_peer.free:
            collect(expected, 10.0)
            if got < expected:
                fig["hangs"] += expected - got
                problems.append(f"{expected - got} messages without an outcome near case {tried}")
                got = expected
            if rx._thread is None or not rx._thread.is_alive():
                crashed = True
                problems.append(f"receiver thread died near case {tried}")
                break
            deadline = time.monotonic() + 0.5
            while not main_peer.free and time.monotonic() < deadline and main_peer.sock.poll(50):
                main_peer.drain()  # the acks freeing released slots may still be on their way
            if not main_peer.free:  # garbled headers cannot name their slot: say hello again
                main_peer.hello()
                fig["rehello"] += 1
    collect(expected, 10.0)
    if got < expected:
        fig["hangs"] += expected - got
        problems.append(f"{expected - got} messages without an outcome at the end")
    elapsed = time.monotonic() - t0
    alive = rx._thread is not None and rx._thread.is_alive()
    rss1 = _rss_mb()

    # Still serving: a clean sender's inline and Mooncake payloads are delivered intact.
    final_ok = False
    if alive:
        tx_engine = MooncakeEngine.open()
        tx = PrefillSender(config(), engine=tx_engine, context=ctx, name="clean").connect(rx.address)
        want = {
            "final-inline": C.make_payload("final-inline", "dense", 1),
            "final-bulk": C.make_payload("final-bulk", "sparse", 2),
        }
        tx.send(want["final-inline"])
        big = PrefillSender(
            TransportConfig(**{**_cfg_dict(), "inline_threshold_bytes": 0}),
            engine=tx_engine,
            context=ctx,
            name="clean-bulk",
        ).connect(rx.address)
        big.send(want["final-bulk"])
        seen = {}
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            o = rx.get(timeout=0.2)
            if isinstance(o, Delivery) and o.request_id in want:
                seen[o.request_id] = C.check_delivery(o, V) is None and bytes(o.payload.hidden) == bytes(
                    want[o.request_id].hidden
                )
                o.release()
        final_ok = len(seen) == 2 and all(seen.values())
        tx.close()
        big.close()
        tx_engine.close()
    snap = rx.metrics.snapshot()
    rx.stop()
    for s in (main_peer.sock, side.sock, fresh):
        s.close(0)
    engine.close()
    ctx.term()

    crashes = int(crashed) + fig["failed_without_field"]
    result = {
        "script": "fuzz",
        "seed": args.seed,
        "tried": tried,
        "rejected_with_field": fig["rejected_with_field"],
        "accepted": fig["accepted"],
        "control_accepted": fig["control_accepted"],
        "dropped_by_libzmq": fig["dropped_by_libzmq"],
        "accepted_invalid": fig["accepted_invalid"],
        "crashes": crashes,
        "hangs": fig["hangs"],
        "receiver_alive": alive,
        "final_valid_delivered": final_ok,
        "outcomes_reconcile": snap["received"] == snap["delivered"] + snap["failed"],
        "rehello": fig["rehello"],
        "seconds": round(elapsed, 1),
        "msgs_per_s": round(tried / elapsed, 1) if elapsed else 0.0,
        "rss_mb_start": rss0,
        "rss_mb_end": rss1,
        "rejections_by_field": dict(fields.most_common(40)),
        "by_family": {f: dict(c) for f, c in by_family.items()},
        "problems": problems,
        "machine": C.machine(),
        "must_be_zero": ["crashes", "hangs", "accepted_invalid"],
    }
    C.emit(result)
    ok = crashes == 0 and fig["hangs"] == 0 and fig["accepted_invalid"] == 0 and alive and final_ok
    return 0 if ok else 1


def _cfg_dict() -> dict[str, Any]:
    c = config()
    return {f: getattr(c, f) for f in c.__struct_fields__}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


if __name__ == "__main__":
    sys.exit(main())
