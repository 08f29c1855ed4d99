"""Faults: kill, freeze and restart real processes mid-stream; exhaust slots; lose a Mooncake peer.

``python reliability/faults.py [--budget-s 180] [--only NAME ...]``

Five scenarios, each with real processes on loopback (ZMQ control plane, Mooncake TCP
data plane), ``heartbeat_s = 0.1`` and ``peer_timeout_s = 1.0``:

- ``prefill_sigkill``: a prefill process streaming through Mooncake is SIGKILLed; a second
  prefill keeps sending. Its expected requests must fail ``transfer:peer_lost``, the
  survivor's must all be delivered, the victim's slots must return to the pool.
- ``prefill_sigstop``: a prefill is frozen (SIGSTOP) mid-stream. After ``peer_timeout_s``
  its expected requests fail; another prefill is served meanwhile. Then SIGCONT: the
  frozen sender gets a clear error, reconnects and its new requests are delivered.
- ``decode_restart``: a decode *process* is SIGKILLed and a new one started on the same
  port; the prefill (this process) gets a clear ``TransferError``, reconnects, resends
  what was refused, and its in-flight requests are counted ``transfer:decode_lost``.
- ``slots_exhausted``: the decode holds every slot granted to a prefill; ``send`` raises
  ``NoSlotError`` after ``slots.wait_s`` and no held slot is overwritten; releasing one
  lets the next send through.
- ``mooncake_vanished``: a Mooncake write to a decode process that was just killed must
  raise ``TransferError`` with ``op``, ``code`` and ``peer`` within 2 s.

Figures per scenario: affected requests failed with a reason, unaffected delivered,
``lost`` (0: every request delivered, failed with a reason or refused by ``send``),
recovery time. Exit status 1 if any scenario breaks its promise.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C

C.setup_env()

HB, TIMEOUT = 0.1, 1.0


def tcfg(bulk: bool = True, port: int = 0, per_peer: int = 16, wait_s: float = 10.0):
    from pd_middleware.transport import SlotsConfig, TransportConfig

    return TransportConfig(
        port=port,
        heartbeat_s=HB,
        peer_timeout_s=TIMEOUT,
        connect_timeout_s=5.0,
        inline_threshold_bytes=0 if bulk else 1 << 30,
        slots=SlotsConfig(count=64, size_bytes=4096, per_peer=per_peer, wait_s=wait_s),
    )


def payload(rid: str) -> Any:
    return C.make_payload(rid, "sparse", 1, seed=rid)


# ---- child processes -----------------------------------------------------------------


def child_prefill(address: str, name: str, count: int, delay: float, after: int) -> None:
    """Send ``count`` payloads (``name-i``); on a TransferError print it, reconnect and send
    ``after`` new ones (``name-after-j``). Prints READY, ERROR/RECONNECTED lines, then JSON."""
    from pd_middleware import TransferError
    from pd_middleware.transport import MooncakeEngine, PrefillSender

    tx = PrefillSender(tcfg(), engine=MooncakeEngine.open(), name=name).connect(address, timeout=20.0)
    print("READY", flush=True)
    i = 0
    while i < count:
        try:
            tx.send(payload(f"{name}-{i}"))
            i += 1
        except TransferError as exc:
            print("ERROR " + json.dumps({"op": exc.op, "message": str(exc)}), flush=True)
            tx.reconnect(timeout=20.0)
            print("RECONNECTED", flush=True)
            for j in range(after):
                tx.send(payload(f"{name}-after-{j}"))
            break
        time.sleep(delay)
    tx.flush(20.0)
    print(json.dumps(tx.statuses()), flush=True)
    os._exit(0)


def child_decode(port: int) -> None:
    """A decode process on ``port``: prints READY, then ``D rid`` / ``F rid key`` per outcome."""
    from pd_middleware.decode.pipeline import Delivery
    from pd_middleware.transport import DecodeReceiver, MooncakeEngine

    rx = DecodeReceiver(tcfg(port=port), C.build_pipeline(C.VOCAB, 2), engine=MooncakeEngine.open()).start()
    print(f"READY {rx.address}", flush=True)
    while True:
        o = rx.get(timeout=0.5)
        if o is None:
            continue
        if isinstance(o, Delivery):
            print(f"D {o.request_id}", flush=True)
            o.release()
        else:
            print(f"F {o.request_id} {o.key}", flush=True)


class Child:
    """A child process whose stdout lines are read by a thread into a queue."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=C.child_env(),
        )
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.all: list[str] = []
        self.stamped: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            item = (time.monotonic(), line.rstrip("\n"))
            self.stamped.append(item)
            self.lines.put(item)

    def wait_for(self, prefix: str, timeout: float) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                t, line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            self.all.append(line)
            if line.startswith(prefix):
                return t, line
        raise TimeoutError(f"child did not print {prefix!r} within {timeout} s; got {self.all[-5:]}")

    def report(self, timeout: float = 30.0) -> dict:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        while True:
            try:
                self.all.append(self.lines.get(timeout=0.5)[1])
            except queue.Empty:
                break
        js = [x for x in self.all if x.startswith("{")]
        return json.loads(js[-1]) if js else {}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# ---- in-process helpers ----------------------------------------------------------------


class Collector:
    """Drains a receiver: outcomes per request id, with arrival times."""

    def __init__(self, rx: Any) -> None:
        self.rx = rx
        self.out: dict[str, list[tuple[float, Any]]] = {}

    def poll(self, timeout: float = 0.05) -> None:
        from pd_middleware.decode.pipeline import Delivery

        items = self.rx.drain() or [x for x in [self.rx.get(timeout=timeout)] if x is not None]
        now = time.monotonic()
        for o in items:
            self.out.setdefault(o.request_id or "?", []).append((now, o))
            if isinstance(o, Delivery):
                o.release()

    def send(self, tx: Any, p: Any, timeout: float = 10.0) -> None:
        """``tx.send(p)`` from the thread that also consumes the decode here.

        The decode frees a slot only once its delivery is released, and in these
        scenarios this same thread releases them: so while the sender has no free slot
        (its writes in flight or its payloads not yet consumed), consume first rather than
        block in ``send``. Bounded by ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while tx.engine is not None and tx.statuses()["free_slots"] == 0 and time.monotonic() < deadline:
            self.poll(0.002)
        tx.send(p)
        self.poll(0)

    def until(self, cond, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                return False
            self.poll()
        return True

    def count(self, prefix: str, kind: str) -> int:
        from pd_middleware.decode.pipeline import Delivery

        n = 0
        for rid, outs in self.out.items():
            if rid.startswith(prefix) and not rid.startswith(prefix + "after"):
                o = outs[0][1]
                n += isinstance(o, Delivery) if kind == "D" else not isinstance(o, Delivery)
        return n

    def reasons(self, prefix: str) -> dict[str, int]:
        from pd_middleware.decode.pipeline import Delivery

        c: Counter[str] = Counter()
        for rid, outs in self.out.items():
            if rid.startswith(prefix) and not isinstance(outs[0][1], Delivery):
                c[outs[0][1].key] += 1
        return dict(c)


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---- scenarios ---------------------------------------------------------------------------


def prefill_sigkill(env: dict) -> dict:
    from pd_middleware.transport import DecodeReceiver, PrefillSender

    n, m = 400, 300
    rx = DecodeReceiver(tcfg(), C.build_pipeline(C.VOCAB, 2), engine=env["dec"], context=env["ctx"]).start()
    col = Collector(rx)
    victim = Child("prefill", rx.address, "victim", str(n), "0.005", "0")
    try:
        victim.wait_for("READY", 30)
        survivor = PrefillSender(tcfg(), engine=env["pre"], context=env["ctx"], name="survivor").connect(rx.address)
        for i in range(n):
            rx.expect(f"victim-{i}", peer="victim", deadline=time.monotonic() + 120)
        for i in range(m):
            rx.expect(f"survivor-{i}", peer="survivor", deadline=time.monotonic() + 120)
        col.until(lambda: col.count("victim-", "D") >= 40, 30)
        os.kill(victim.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        victim.proc.wait(10)
        for i in range(m):
            col.send(survivor, payload(f"survivor-{i}"))
        col.until(lambda: sum(r.startswith("victim-") for r in col.out) >= n and col.count("survivor-", "D") >= m, 30)
        fails = [
            t
            for rid, outs in col.out.items()
            if rid.startswith("victim-")
            for t, o in outs[:1]
            if not hasattr(o, "payload")
        ]
        survivor.flush(5.0)
        free_back = rx.free_slots
        survivor.close()
    finally:
        victim.kill()
        rx.stop()
    vd, vf = col.count("victim-", "D"), col.count("victim-", "F")
    dups = sum(len(v) > 1 for v in col.out.values())
    return {
        "affected_failed_with_reason": vf,
        "affected_reasons": col.reasons("victim-"),
        "affected_delivered_before_kill": vd,
        "unaffected_delivered": col.count("survivor-", "D"),
        "unaffected_sent": m,
        "lost": n - vd - vf + m - col.count("survivor-", "D") - col.count("survivor-", "F"),
        "duplicates": dups,
        "recovery_s": round(max(fails) - t_kill, 3) if fails else None,
        "slots_back_in_pool": free_back == 64 - 16,
        "ok": vf > 0
        and set(col.reasons("victim-")) == {"transfer:peer_lost"}
        and vd + vf == n
        and col.count("survivor-", "D") == m
        and dups == 0
        and free_back == 64 - 16,
    }


def prefill_sigstop(env: dict) -> dict:
    from pd_middleware.decode.pipeline import Delivery
    from pd_middleware.transport import DecodeReceiver, PrefillSender

    n, m, after = 400, 300, 50
    rx = DecodeReceiver(tcfg(), C.build_pipeline(C.VOCAB, 2), engine=env["dec"], context=env["ctx"]).start()
    col = Collector(rx)
    victim = Child("prefill", rx.address, "frozen", str(n), "0.005", str(after))
    try:
        victim.wait_for("READY", 30)
        other = PrefillSender(tcfg(), engine=env["pre"], context=env["ctx"], name="other").connect(rx.address)
        for i in range(n):
            rx.expect(f"frozen-{i}", peer="frozen", deadline=time.monotonic() + 120)
        col.until(lambda: col.count("frozen-", "D") >= 40, 30)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        for i in range(m):  # served while the other prefill is frozen
            col.send(other, payload(f"other-{i}"))
        col.until(lambda: sum(r.startswith("frozen-") for r in col.out) >= n, 30)
        fail_times = [
            outs[0][0]
            for rid, outs in col.out.items()
            if rid.startswith("frozen-") and not isinstance(outs[0][1], Delivery)
        ]
        col.until(lambda: col.count("other-", "D") >= m, 15)
        for j in range(after):
            rx.expect(f"frozen-after-{j}", peer="frozen", deadline=time.monotonic() + 60)
        os.kill(victim.proc.pid, signal.SIGCONT)
        t_cont = time.monotonic()
        _, err = victim.wait_for("ERROR", 30)
        victim.wait_for("RECONNECTED", 30)
        col.until(
            lambda: (
                sum(isinstance(o[0][1], Delivery) for r, o in col.out.items() if r.startswith("frozen-after")) >= after
            ),
            30,
        )
        after_times = [
            o[0][0] for r, o in col.out.items() if r.startswith("frozen-after") and isinstance(o[0][1], Delivery)
        ]
        rep = victim.report(30)
        other.flush(5.0)
        other.close()
    finally:
        victim.kill()
        rx.stop()
    fd, ff = col.count("frozen-", "D"), col.count("frozen-", "F")
    late = sum(len(v) - 1 for r, v in col.out.items() if r.startswith("frozen-") and len(v) > 1)
    after_ok = sum(isinstance(o[0][1], Delivery) for r, o in col.out.items() if r.startswith("frozen-after"))
    return {
        "affected_failed_with_reason": ff,
        "affected_reasons": col.reasons("frozen-"),
        "affected_delivered_before_freeze": fd,
        "detected_after_s": round(min(fail_times) - t_stop, 3) if fail_times else None,
        "unaffected_delivered_during_freeze": col.count("other-", "D"),
        "unaffected_sent": m,
        "sender_error_after_sigcont": json.loads(err[6:])["message"],
        "resumed_delivered": after_ok,
        "recovery_s": round(min(after_times) - t_cont, 3) if after_times else None,
        "late_messages_rejected": late,
        "sender_statuses": {k: rep.get(k) for k in ("sent", "delivered", "failed", "failed_by_reason", "outstanding")},
        "lost": n - fd - ff,
        "ok": ff > 0
        and set(col.reasons("frozen-")) <= {"transfer:peer_lost", "wire:peer"}
        and fd + ff == n
        and col.count("other-", "D") == m
        and after_ok == after,
    }


def decode_restart(env: dict, bulk: bool = True) -> dict:
    from pd_middleware import TransferError
    from pd_middleware.transport import PrefillSender

    n, kill_at, burst = 600, 100, 20
    port = free_port()
    a = Child("decode", str(port))
    b = None
    errors: list[str] = []
    try:
        _, line = a.wait_for("READY", 30)
        address = line.split()[1]
        engine = env["pre"] if bulk else None
        tx = PrefillSender(tcfg(bulk), engine=engine, context=env["ctx"], name="restart").connect(address)
        t_kill = t_back = 0.0
        refused = 0
        i = 0
        while i < n:
            if i == kill_at + burst and b is None:
                a.kill()  # right after a burst: some requests are still unacknowledged
                t_kill = time.monotonic()
                b = Child("decode", str(port))
            try:
                tx.send(payload(f"restart-{i}"))
                i += 1
            except TransferError as exc:
                refused += 1
                errors.append(f"{type(exc).__name__}: {exc}")
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:  # the application's policy: reconnect, then resend
                    try:
                        tx.reconnect(timeout=2.0)
                        break
                    except TransferError:
                        time.sleep(0.1)
                if not t_back:
                    t_back = time.monotonic()
            if not kill_at <= i < kill_at + burst:
                time.sleep(0.005)
        flushed = tx.flush(10.0)
        if not flushed and not tx.connected:  # the decode died after the last send: same policy
            errors.append("flush: the decode is gone (statuses()['connected'] is False)")
            tx.reconnect(timeout=10.0)  # moves what was in flight to transfer:decode_lost
            t_back = t_back or time.monotonic()
        st = tx.statuses()
        tx.close()
        time.sleep(0.3)
    finally:
        a.kill()
        if b is not None:
            b.kill()
    a.report(1)
    b_ready = None
    if b is not None:
        b.report(1)
        b_ready = next((t for t, ln in b.stamped if ln.startswith("READY")), None)
    a_rids = {x.split()[1] for x in a.all if x.startswith("D ")}
    b_rids = {x.split()[1] for x in b.all if x.startswith("D ")} if b else set()
    lost = st["sent"] - st["delivered"] - st["failed"] - st["outstanding"]
    return {
        "mode": "bulk (Mooncake)" if bulk else "inline",
        "affected_failed_with_reason": st["failed"],
        "affected_reasons": st["failed_by_reason"],
        "refused_by_send_then_resent": refused,
        "first_error": errors[0] if errors else None,
        "unaffected_delivered": st["delivered"],
        "delivered_by_old_decode": len(a_rids),
        "delivered_by_new_decode": len(b_rids),
        "sent": st["sent"],
        "first_flush_ok": flushed,
        "lost": lost,
        "new_decode_ready_after_s": round(b_ready - t_kill, 3) if b_ready else None,
        "recovery_s": round(t_back - t_kill, 3) if t_back else None,
        "ok": bool(errors)
        and lost == 0
        and st["outstanding"] == 0
        # transfer:write: a pipelined write to the dead decode that failed after send returned
        and set(st["failed_by_reason"]) <= {"transfer:decode_lost", "transfer:write"}
        and st["delivered"] + st["failed"] == n
        and len(b_rids) > 0,
    }


def decode_restart_inline(env: dict) -> dict:
    return decode_restart(env, bulk=False)


def slots_exhausted(env: dict) -> dict:
    from pd_middleware import NoSlotError
    from pd_middleware.transport import DecodeReceiver, PrefillSender

    c = tcfg(per_peer=4, wait_s=0.5)
    rx = DecodeReceiver(c, C.build_pipeline(C.VOCAB, 2), engine=env["dec"], context=env["ctx"]).start()
    tx = PrefillSender(c, engine=env["pre"], context=env["ctx"], name="hog").connect(rx.address)
    try:
        held = []
        for i in range(4):
            tx.send(payload(f"held-{i}"))
            o = rx.get(timeout=5.0)
            held.append(o)
        before = [bytes(d.payload.hidden) + bytes(d.payload.proposal.indices) for d in held]
        t0 = time.monotonic()
        err = None
        try:
            tx.send(payload("refused"))
        except NoSlotError as exc:
            err = exc
        waited = time.monotonic() - t0
        intact = [bytes(d.payload.hidden) + bytes(d.payload.proposal.indices) for d in held] == before
        t_rel = time.monotonic()
        held[0].release()
        tx.send(payload("after-release"))
        o = rx.get(timeout=5.0)
        t_ok = time.monotonic()
        ok_after = o is not None and o.request_id == "after-release"
        if o is not None:
            o.release()
        for d in held[1:]:
            d.release()
        tx.flush(5.0)
        st = tx.statuses()
    finally:
        tx.close()
        rx.stop()
    return {
        "affected_failed_with_reason": int(err is not None),
        "error": str(err) if err else None,
        "error_after_s": round(waited, 3),
        "held_slots_intact": intact,
        "unaffected_delivered": st["delivered"],
        "lost": st["sent"] - st["delivered"] - st["failed"] - st["outstanding"],
        "recovery_s": round(t_ok - t_rel, 3),
        "ok": err is not None and 0.5 <= waited < 3.0 and intact and ok_after and st["delivered"] == 5,
    }


def mooncake_vanished(env: dict) -> dict:
    from pd_middleware import TransferError
    from pd_middleware.transport import PrefillSender

    port = free_port()
    d = Child("decode", str(port))
    try:
        _, line = d.wait_for("READY", 30)
        tx = PrefillSender(tcfg(), engine=env["pre"], context=env["ctx"], name="mc").connect(line.split()[1])
        for i in range(10):
            tx.send(payload(f"mc-{i}"))
        tx.flush(5.0)
        before = tx.statuses()["delivered"]
        d.kill()
        t0 = time.monotonic()
        err = None
        # A pipelined write (max_inflight_writes > 1) may be submitted before the engine
        # notices: that send returns, its request fails with transfer:write, and the next
        # send raises the write's error. Bounded: three sends at most.
        for k in range(3):
            try:
                tx.send(payload(f"mc-after-kill-{k}"))
                tx.flush(1.0)
            except TransferError as exc:
                err = exc
                break
        took = time.monotonic() - t0
        st = tx.statuses()
        tx.close()
    finally:
        d.kill()
    return {
        "affected_failed_with_reason": int(err is not None),
        "error": str(err) if err else None,
        "op": getattr(err, "op", None),
        "code": getattr(err, "code", None),
        "peer": getattr(err, "peer", None),
        "failed_after_s": round(took, 3),
        "unaffected_delivered": before,
        "lost": st["sent"] - st["delivered"] - st["failed"] - st["outstanding"],
        "recovery_s": None,
        "affected_reasons": st["failed_by_reason"],
        "ok": err is not None
        and err.op in ("transfer_submit_write", "transfer_check_status", "send_probe")
        and err.code is not None
        and bool(err.peer)
        and took < 2.0
        and before == 10
        and set(st["failed_by_reason"]) <= {"transfer:write"},
    }


SCENARIOS = {
    "prefill_sigkill": prefill_sigkill,
    "prefill_sigstop": prefill_sigstop,
    "decode_restart": decode_restart,
    "decode_restart_inline": decode_restart_inline,
    "slots_exhausted": slots_exhausted,
    "mooncake_vanished": mooncake_vanished,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=180.0)
    ap.add_argument("--only", nargs="*", default=list(SCENARIOS))
    ap.add_argument("--child", nargs="+")
    args = ap.parse_args()
    if args.child:
        if args.child[0] == "prefill":
            a, name, count, delay, after = args.child[1:]
            child_prefill(a, name, int(count), float(delay), int(after))
        else:
            child_decode(int(args.child[1]))
        return 0

    import zmq

    from pd_middleware.transport import MooncakeEngine

    budget = C.Budget(args.budget_s)
    env = {"ctx": zmq.Context(), "dec": MooncakeEngine.open(), "pre": MooncakeEngine.open()}
    results: dict[str, Any] = {}
    for name in args.only:
        if budget.over():
            results[name] = {"ok": False, "skipped": "budget spent"}
            continue
        t0 = time.monotonic()
        try:
            results[name] = SCENARIOS[name](env)
        except Exception as exc:
            results[name] = {"ok": False, "crash": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"# {name}: {json.dumps(results[name])}", flush=True)
    failed = [n for n, r in results.items() if not r.get("ok")]
    C.emit(
        {
            "script": "faults",
            "scenarios": results,
            "failed_scenarios": failed,
            "lost": sum(r.get("lost", 0) or 0 for r in results.values()),
            "crashes": sum("crash" in r for r in results.values()),
            "seconds": round(budget.elapsed(), 1),
            "machine": C.machine(),
            "must_be_zero": ["lost", "crashes", "failed_scenarios"],
        }
    )
    os._exit(0 if not failed else 1)  # skip Mooncake engine teardown


if __name__ == "__main__":
    sys.exit(main())
