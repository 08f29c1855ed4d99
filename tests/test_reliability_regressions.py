"""Regression tests for the bugs the reliability campaign (reliability/) found.

One test (or pair) per bug, each with the campaign family that found it:

1. fuzz ``unknown``: every unknown wire field name became its own failure counter (and
   Prometheus label), so a hostile prefill grew decode memory by one entry per message.
2. fuzz ``frames``: extra inline frames that no TensorRef names were accepted silently.
3. config fuzz ``unknown_key``: an unknown key of the root table raised ConfigError with
   an empty ``.path``.
4. config fuzz ``duplicate_key``: YAML keys written twice were accepted (last one won).
5. config fuzz ``unknown_key``: ``ab.workload.options`` passed ``check-config`` unchecked.
6. security ``plugin path``: ``"plugin.py:SPEC"`` was imported as package ``plugin``
   (running a same-named file on ``sys.path``) instead of being refused as a file path.
7. faults ``decode_restart_inline``: an idle sender never noticed a dead decode; and (a
   flaky run of that test) ``flush()`` left the silence watch and the heartbeats to the
   background thread, which rarely got the lock flush() holds through its polls.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from _helpers import OneHot, inline_frames, make  # tests/ is on sys.path (no __init__.py)
from _transport_peer import collect_outcomes  # tests/ is on sys.path (no __init__.py)

from pd_middleware import ConfigError, PluginError, WireError
from pd_middleware.config import load_config, parse_config, resolve_plugins
from pd_middleware.core.metrics import MAX_REASON_CHARS, MAX_REASONS, Metrics
from pd_middleware.decode.pipeline import Failure, ReceivePipeline
from pd_middleware.registry import PluginRegistry, default_registry
from pd_middleware.transport import DecodeReceiver, LimitsConfig, PrefillSender, TransportConfig, payload_codec, wire

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


# ---- 1. failure-reason cardinality -----------------------------------------------------------


def test_metrics_cap_distinct_and_long_failure_reasons() -> None:
    m = Metrics()
    for i in range(MAX_REASONS + 500):
        m.record_failure(f"wire:field{i}")
    m.record_failure("wire:" + "x" * (MAX_REASON_CHARS + 1))
    assert len(m.failed) == MAX_REASONS + 1  # the first MAX_REASONS keys plus "wire:other"
    assert m.failed["wire:other"] == 501 and m.failed_total == MAX_REASONS + 501
    m.record_failure("wire:field3")  # keys already kept still count under their own name
    assert m.failed["wire:field3"] == 2
    # Negative control: below the cap nothing is folded.
    small = Metrics()
    small.record_failure("wire:a")
    small.record_failure("hook:rec:b")
    assert dict(small.failed) == {"wire:a": 1, "hook:rec:b": 1}


def test_unique_unknown_wire_fields_do_not_grow_decode_counters() -> None:
    ctx = zmq.Context()
    rx = DecodeReceiver(
        TransportConfig(heartbeat_s=0.05, peer_timeout_s=30.0),
        ReceivePipeline([], {"default": ("one_hot", OneHot())}),
        context=ctx,
    ).start()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(rx.address)
        s.send_multipart([wire.encode(wire.Hello(name="p", want_slots=0))])
        assert s.poll(5000)
        s.recv_multipart()
        frames = inline_frames(make(rid="r"))
        raw = msgspec.msgpack.decode(frames[0])
        n = MAX_REASONS + 200
        for i in range(n):
            s.send_multipart([msgspec.msgpack.encode({**raw, f"u{i}": 1}), *frames[1:]])
        got = collect_outcomes(rx, n)
        assert all(isinstance(o, Failure) and o.stage == "wire" for o in got)
        assert got[-1].field == f"u{n - 1}"  # the Failure itself still names the field
        snap = rx.metrics.snapshot()
        assert len(snap["failed_by_reason"]) <= MAX_REASONS + 1
        assert snap["failed"] == n and snap["received"] == n
        s.close(0)
    finally:
        rx.stop()
        ctx.term()


# ---- 2. unnamed inline frames ------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: [*f, b"junk"], "the message has 3 tensor frame(s) but its header names frames [1, 2]"),
        (lambda f: [f[0], f[1], f[2], f[2]], "the message has 3 tensor frame(s) but its header names frames [1, 2]"),
    ],
)
def test_unnamed_inline_frames_are_rejected(change, message) -> None:
    frames = inline_frames(make(1, "bf16", "dense", rid="extra"))
    assert len(frames) == 3
    with pytest.raises(WireError) as info:
        msg = wire.decode_frame(frames[0], LimitsConfig())
        payload_codec.payload_from_header(msg, change(frames), LimitsConfig())
    assert info.value.field == "frames" and info.value.request_id == "extra" and message in str(info.value)
    # A frame named twice (hidden and proposal both frame 1) is refused too.
    raw = msgspec.msgpack.decode(frames[0])
    raw["proposal"]["data"]["frame"] = 1
    raw["proposal"]["data"]["nbytes"] = raw["hidden"]["nbytes"]
    with pytest.raises(WireError) as info:
        msg = wire.decode_frame(msgspec.msgpack.encode(raw), LimitsConfig())
        payload_codec.payload_from_header(msg, frames[:2], LimitsConfig())
    assert info.value.field in ("frames", "proposal.data.shape", "proposal.data.nbytes")
    # Negative control: the untouched message decodes.
    msg = wire.decode_frame(frames[0], LimitsConfig())
    assert payload_codec.payload_from_header(msg, frames, LimitsConfig())[0].request_id == "extra"


# ---- 3.-5. config ------------------------------------------------------------------------------


def test_unknown_root_key_names_itself() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"modle": {}})
    assert info.value.path == "modle" and "at modle" in str(info.value) and "unknown field `modle`" in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_config({"model": {"vocab_sise": 1}})
    assert info.value.path == "model.vocab_sise"  # nested too: the key itself, not its table


def test_yaml_duplicate_keys_are_rejected(tmp_path) -> None:
    f = tmp_path / "dup.yaml"
    f.write_text("model:\n  vocab_size: 100\n  vocab_size: 200\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert (
        info.value.source == str(f)
        and "found duplicate key 'vocab_size'" in str(info.value)
        and "line 3" in str(info.value)
    )
    f.write_text("model:\n  vocab_size: 100\nmodel:\n  num_steps: 2\n")
    with pytest.raises(ConfigError, match="found duplicate key 'model'"):
        load_config(f)
    # Negative controls: distinct keys, and a merge key overridden on purpose, still load.
    f.write_text("base: &b {vocab_size: 100, num_steps: 2}\n")
    f.write_text("model:\n  <<: {vocab_size: 100, num_steps: 2}\n  vocab_size: 200\n")
    cfg = load_config(f)
    assert cfg.model.vocab_size == 200 and cfg.model.num_steps == 2


def test_workload_options_are_checked_by_resolve_plugins(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[ab]\nworkload = { name = "synthetic", options = { nosie_std = 0.5 } }\n')
    cfg = load_config(f)
    with pytest.raises(ConfigError) as info:
        resolve_plugins(cfg, default_registry(), source=str(f))
    assert info.value.path == "ab.workload.options.nosie_std" and "unknown field `nosie_std`" in str(info.value)
    f.write_text('[ab]\nworkload = { name = "synthetic", options = { noise_std = "x" } }\n')
    with pytest.raises(ConfigError) as info:
        resolve_plugins(load_config(f), default_registry(), source=str(f))
    assert info.value.path == "ab.workload.options.noise_std"
    # The decode side does not need the workload and does not check it.
    resolve_plugins(load_config(f), default_registry(), sides=("decode",))
    # Negative control: good options pass.
    f.write_text('[ab]\nworkload = { name = "synthetic", options = { noise_std = 0.25 } }\n')
    resolve_plugins(load_config(f), default_registry(), source=str(f))


# ---- 6. "plugin.py:SPEC" -----------------------------------------------------------------------


def test_py_file_reference_is_refused_before_import(tmp_path, monkeypatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "evilplug.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # as with `python -m` from that directory
    with pytest.raises(PluginError) as info:
        PluginRegistry().resolve("synthesizer", "evilplug.py:SPEC", key="synthesizer.name")
    assert info.value.key == "synthesizer.name" and "names a .py file" in str(info.value)
    assert not marker.exists()
    sys.modules.pop("evilplug", None)


# ---- the campaign's config fuzz, small -----------------------------------------------------------


def test_config_fuzz_smoke() -> None:
    """120 broken configs through reliability/config_fuzz.py: all rejected with a path (~5 s)."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "reliability" / "config_fuzz.py"),
            "--cases",
            "120",
            "--seed",
            "11",
            "--budget-s",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 or result["tried"] < 1000, out.stderr[-500:]
    assert result["tried"] == 120 and result["rejected_with_path"] == 120, result
    assert result["accepted_silently"] == result["crashes"] == result["rejected_without_path"] == 0, result["examples"]


# ---- 7. an idle sender never noticed a dead decode --------------------------------------------


def test_idle_sender_notices_a_silent_decode_without_sending() -> None:
    """faults ``decode_restart_inline``: flush() waited its whole timeout and
    statuses()['connected'] stayed True when the decode died after the last send."""
    from pd_middleware.transport import PrefillSender

    ctx = zmq.Context()
    c = TransportConfig(heartbeat_s=0.05, peer_timeout_s=0.3)
    rx = DecodeReceiver(c, ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=ctx).start()
    tx = PrefillSender(c, context=ctx, name="idle").connect(rx.address)
    try:
        rx._running = False  # the decode hangs: its loop stops without a bye
        rx._shutdown = lambda: None  # type: ignore[method-assign]
        rx._wake()
        rx._thread.join(5.0)  # type: ignore[union-attr]
        tx._send_msg(wire.Heartbeat())  # something in flight nobody will acknowledge
        tx._outstanding[99] = "pending"  # a request awaiting its ack
        t0 = time.monotonic()
        assert tx.flush(60.0) is False
        waited = time.monotonic() - t0
        print(f"\nsilent decode: flush() gave up after {waited:.2f} s (peer_timeout_s=0.3)")
        # Noticed at peer_timeout_s, not at flush's own timeout: only the latter crosses half of it.
        assert waited < 30.0, f"flush waited {waited:.1f} s of its 60 s for a decode silent past peer_timeout_s=0.3"
        assert tx.statuses()["connected"] is False
    finally:
        tx.close()
        if rx._sock is not None:
            rx._sock.close(0)
        rx._thread = None
        ctx.term()
    assert tx.failed["transfer:decode_lost"] == 1  # close() accounted the pending request


# ---- 7b. flush() starved the background thread of its lock ------------------------------------
# flush() holds the sender's lock through each poll and takes it straight back; a Python lock
# is not fair, so the background thread (the only one that watched for silence and sent
# heartbeats while idle) could wait tens of seconds for it: flush waited 45 s of its 60 s for
# a decode silent past peer_timeout_s = 0.3 in one CI run. These two tests stop the background
# thread, the worst case of that starvation, so what they check never depends on who wins
# the lock; each fails on the old flush() (the first: connected stays True until the timeout;
# the second: the decode drops this prefill). Each is the other's control: the same flush,
# the same stopped thread, and only the decode's silence differs in the outcome.


def _idle_pair(ctx: zmq.Context) -> tuple[DecodeReceiver, PrefillSender]:
    c = TransportConfig(heartbeat_s=0.05, peer_timeout_s=0.3)
    rx = DecodeReceiver(c, ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=ctx).start()
    tx = PrefillSender(c, context=ctx, name="idle").connect(rx.address)
    tx._hb_stop.set()  # the background thread never gets the lock: stop it
    tx._work.set()
    thread = tx._hb_thread
    assert thread is not None
    thread.join(5.0)
    assert not thread.is_alive()
    return rx, tx


def test_flush_notices_a_silent_decode_without_the_background_thread() -> None:
    ctx = zmq.Context()
    rx, tx = _idle_pair(ctx)
    try:
        rx._running = False  # the decode hangs: its loop stops without a bye
        rx._shutdown = lambda: None  # type: ignore[method-assign]
        rx._wake()
        rx._thread.join(5.0)  # type: ignore[union-attr]
        tx._outstanding[99] = "pending"  # a request awaiting its ack
        # Ten times peer_timeout_s: the old flush() returned False at this timeout, still connected.
        assert tx.flush(3.0) is False
        assert tx.statuses()["connected"] is False
        assert "silent" in (tx._control.lost or "")
    finally:
        tx.close()
        if rx._sock is not None:
            rx._sock.close(0)
        rx._thread = None
        ctx.term()
    assert tx.failed["transfer:decode_lost"] == 1


def test_a_long_flush_keeps_a_live_decode_hearing_from_the_sender() -> None:
    ctx = zmq.Context()
    rx, tx = _idle_pair(ctx)
    try:
        tx._outstanding[99] = "pending"  # never sent: no ack will come
        # Three times peer_timeout_s of a flush that cannot succeed: the decode keeps this
        # prefill only if flush() sends the heartbeats the stopped thread does not.
        assert tx.flush(0.9) is False
        assert tx.statuses()["connected"] is True  # the decode's heartbeats came
        assert [p.name for p in rx._peers] == ["idle"]
    finally:
        tx._outstanding.clear()
        tx.close()
        rx.stop()
        ctx.term()
