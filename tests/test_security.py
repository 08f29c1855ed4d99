"""Security properties of the decode node, over real sockets on loopback.

- With HMAC on, unsigned, forged and tampered messages never reach the pipeline
  (hooks, synthesizer) or the scheduler queue as deliveries; each is counted.
- The default bind is loopback only (read back from the socket's LAST_ENDPOINT).
- Size caps reject before allocating: RSS stays within a stated bound while many
  huge-declaring headers and oversize frames arrive.
- No code path unpickles or evaluates code; msgspec decoders have no ext hook.
- A plugin reference in a config can only name an importable module: file paths,
  shell and code strings are refused with a PluginError naming the config key, and
  nothing is imported for a malformed reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from _helpers import OneHot, inline_frames, make  # tests/ is on sys.path (no __init__.py)
from _transport_peer import collect_outcomes  # tests/ is on sys.path (no __init__.py)

from pd_middleware import ConfigError, Payload, PluginError, TransferError, WireError
from pd_middleware.config import load_config, resolve_plugins
from pd_middleware.decode.pipeline import Delivery, Failure, ReceivePipeline
from pd_middleware.registry import PluginRegistry, default_registry
from pd_middleware.transport import DecodeReceiver, LimitsConfig, PrefillSender, TransportConfig, wire
from pd_middleware.transport.auth import TO_DECODE, Signer, new_nonce

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

KEY = "security-test-key-0123456789"


class Recorder:
    """Hook that records every payload the pipeline ran (what the scheduler could see)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_receive(self, payload: Payload, context: object) -> None:
        self.seen.append(payload.request_id)


def cfg(**kw) -> TransportConfig:
    base = dict(heartbeat_s=0.05, peer_timeout_s=5.0)
    base.update(kw)
    return TransportConfig(**base)


def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


# ---- HMAC ------------------------------------------------------------------------------


def test_hmac_unsigned_forged_and_tampered_never_reach_the_scheduler(zctx) -> None:
    rec = Recorder()
    rx = DecodeReceiver(
        cfg(hmac_key=KEY), ReceivePipeline([("rec", rec)], {"default": ("one_hot", OneHot())}), context=zctx
    ).start()
    good = Signer(KEY.encode())
    nonce = new_nonce()
    try:
        attacker = dealer(zctx, rx.address)
        # A signed hello from the attacker socket would make it a peer; send one so that
        # payload rejections below are due to the signature, not to a missing hello.
        hello = [wire.encode(wire.Hello(name="attacker", want_slots=0, ts=time.time()))]
        attacker.send_multipart([*hello, *good.sign(hello, nonce, 0, TO_DECODE)])
        assert attacker.poll(5000)
        attacker.recv_multipart()
        n = 20
        for i in range(n):
            frames = inline_frames(make(rid=f"unsigned-{i}"))
            attacker.send_multipart(frames)
            frames = inline_frames(make(rid=f"forged-{i}"))
            attacker.send_multipart(
                [*frames, *Signer(b"not-the-key-not-the-key").sign(frames, nonce, 1 + i, TO_DECODE)]
            )
            frames = inline_frames(make(rid=f"tampered-{i}"))
            sig = good.sign(frames, nonce, 1 + i, TO_DECODE)
            frames[1] = bytes([frames[1][0] ^ 1]) + frames[1][1:]  # one bit of the tensor frame
            attacker.send_multipart([*frames, *sig])
            frames = inline_frames(make(rid=f"truncsig-{i}"))
            tail, mac = good.sign(frames, nonce, 1 + i, TO_DECODE)
            attacker.send_multipart([*frames, tail, mac[:16]])
        bad = collect_outcomes(rx, 4 * n)
        for o in bad:
            assert isinstance(o, Failure) and o.key == "wire:hmac" and o.request_id is None, o
            assert "missing or invalid HMAC signature" in o.reason
        assert rec.seen == []  # no hook or synthesizer ever ran on them
        assert rx.metrics.snapshot()["failed_by_reason"] == {"wire:hmac": 4 * n}
        # Negative control: the same socket, correctly signed, is delivered (the test can fail).
        frames = inline_frames(make(rid="signed-ok"))
        attacker.send_multipart([*frames, *good.sign(frames, nonce, 1, TO_DECODE)])
        (ok,) = collect_outcomes(rx, 1)
        assert isinstance(ok, Delivery) and ok.request_id == "signed-ok" and rec.seen == ["signed-ok"]
        assert rx.get(timeout=0.2) is None  # nothing else queued
        attacker.close(0)
    finally:
        rx.stop()


def test_hmac_sender_receiver_key_mismatch_cannot_connect(zctx) -> None:
    rx = DecodeReceiver(
        cfg(hmac_key=KEY), ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx
    ).start()
    try:
        with pytest.raises(Exception, match="no slot grant from the decode within 0.5 s"):
            PrefillSender(
                cfg(hmac_key="another-key-another-key", connect_timeout_s=0.5), context=zctx, name="x"
            ).connect(rx.address)
        assert rx.peers == {}
    finally:
        rx.stop()


# ---- bind address ------------------------------------------------------------------------


def _non_loopback_ip() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks a route
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


def test_default_bind_is_loopback_only(zctx) -> None:
    assert TransportConfig().bind_host == "127.0.0.1"
    rx = DecodeReceiver(
        TransportConfig(), ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx
    ).start()
    try:
        endpoint = rx._sock.getsockopt(zmq.LAST_ENDPOINT).decode()  # type: ignore[union-attr]
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", endpoint), endpoint
        assert endpoint == rx.address
        port = int(endpoint.rsplit(":", 1)[1])
        ip = _non_loopback_ip()
        if ip is not None:  # the same port on another interface of this host refuses connections
            s = socket.socket()
            s.settimeout(2.0)
            with pytest.raises(OSError):
                s.connect((ip, port))
            s.close()
        # Positive control: loopback does accept.
        s = socket.create_connection(("127.0.0.1", port), timeout=2.0)
        s.close()
    finally:
        rx.stop()


# ---- size caps before allocation ----------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _blast(address: str, n: int, size: int) -> None:
    """Send ``n`` single-frame messages of ``size`` bytes from ANOTHER process (so that
    only the receiver's memory is measured here)."""
    code = (
        "import sys, zmq\n"
        "ctx = zmq.Context(); big = bytes(int(sys.argv[3]))\n"
        "for _ in range(int(sys.argv[2])):\n"
        "    s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 2000); s.connect(sys.argv[1])\n"
        "    s.send(big); s.close()\n"
        "ctx.term()\n"
    )
    subprocess.run([sys.executable, "-c", code, address, str(n), str(size)], check=True, timeout=60)


RSS_BOUND = 24 << 20  # allowed growth; each attack below would allocate >= 1 TiB or 16 MiB x 10


def _oversize_peak(zctx, max_tensor_bytes: int) -> tuple[int, list]:
    """Peak RSS growth of this process while 10 frames of 16 MiB arrive from another process."""
    limits = LimitsConfig(max_message_bytes=4096, max_tensor_bytes=max_tensor_bytes)
    rx = DecodeReceiver(
        cfg(limits=limits), ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx
    ).start()
    try:
        _reset_peak()
        before = _peak_bytes()
        _blast(rx.address, 10, 16 << 20)
        time.sleep(0.3)
        got = rx.drain()
        return _peak_bytes() - before, got
    finally:
        rx.stop()


def test_size_caps_reject_before_allocating(zctx) -> None:
    """Huge declared tensors and oversize frames leave RSS flat (bound: +24 MiB).

    Limits: 4 KiB control frames, 64 KiB tensors (so libzmq caps every frame at 64 KiB).
    Sent: 2,000 headers each declaring a 1 TiB hidden state or a 2**40-entry sparse
    proposal and 200 control frames of 60 KiB (over max_message_bytes, under the libzmq
    cap), then, from another process, 10 frames of 16 MiB (over the cap: libzmq drops
    them). Current RSS (``/proc/self/statm``) and, where the kernel lets us reset it, peak
    RSS (``VmHWM``) must grow by less than 24 MiB; one 16 MiB frame alone would exceed
    that peak, and the declarations would need terabytes.
    """
    limits = LimitsConfig(max_message_bytes=4096, max_tensor_bytes=65536)
    rx = DecodeReceiver(
        cfg(limits=limits, peer_timeout_s=30.0), ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx
    ).start()
    try:
        s = dealer(zctx, rx.address)
        s.send_multipart([wire.encode(wire.Hello(name="big", want_slots=0))])
        assert s.poll(5000)
        s.recv_multipart()
        base = inline_frames(make(1, "bf16", "sparse", rid="huge"))
        raw = msgspec.msgpack.decode(base[0])
        raw["hidden"]["shape"], raw["hidden"]["nbytes"] = [1 << 39], 1 << 40
        declared_hidden = [msgspec.msgpack.encode(raw), *base[1:]]
        raw = msgspec.msgpack.decode(base[0])
        raw["proposal"]["lengths"] = [1 << 40]
        declared_sparse = [msgspec.msgpack.encode(raw), *base[1:]]
        # Warm up the path once (allocator pools, first-use caches), then measure.
        for _ in range(50):
            s.send_multipart(declared_hidden)
        collect_outcomes(rx, 50)
        before = _rss_bytes()
        peak_ok = _reset_peak()
        peak0 = _peak_bytes()
        for _i in range(1000):
            s.send_multipart(declared_hidden)
            s.send_multipart(declared_sparse)
        for _ in range(200):
            s.send_multipart([b"\x80" + b"\x00" * (60 * 1024)])
        got = collect_outcomes(rx, 2200, timeout=30.0)
        _blast(rx.address, 10, 16 << 20)
        time.sleep(0.3)
        grown = _rss_bytes() - before
        peak = _peak_bytes() - peak0
        fields = {o.field for o in got}
        assert all(isinstance(o, Failure) for o in got)
        assert fields == {"hidden.nbytes", "proposal.lengths", "message"}, fields
        assert grown < RSS_BOUND, f"RSS grew by {grown / 2**20:.1f} MiB (bound {RSS_BOUND >> 20} MiB)"
        if peak_ok:
            assert peak < RSS_BOUND, f"peak RSS grew by {peak / 2**20:.1f} MiB (bound {RSS_BOUND >> 20} MiB)"
        # The 16 MiB frames never reached Python (no outcome), and the receiver still serves.
        assert rx.get(timeout=0.3) is None
        s.send_multipart(inline_frames(make(rid="after")))
        (ok,) = collect_outcomes(rx, 1)
        assert isinstance(ok, Delivery) and ok.request_id == "after"
        s.close(0)
    finally:
        rx.stop()


def test_size_cap_measurement_can_fail(zctx) -> None:
    """Negative control: with a cap that admits 16 MiB frames, the same blast is allocated
    (they reach Python and are rejected there), and the peak measurement sees it."""
    if not _reset_peak():
        pytest.skip("this kernel does not allow resetting VmHWM")
    small, got_small = _oversize_peak(zctx, 65536)
    large, got_large = _oversize_peak(zctx, 32 << 20)
    assert got_small == [] and len(got_large) == 10 and {o.field for o in got_large} == {"message"}
    assert large >= 16 << 20 > small, (large >> 20, small >> 20)


# ---- no unpickling, no eval ------------------------------------------------------------------

_SOURCES = [p for d in ("pd_middleware", "plugins") for p in (ROOT / d).rglob("*.py") if "egg-info" not in str(p)]
_DANGEROUS = re.compile(
    r"^\s*(import|from)\s+(pickle|cPickle|_pickle|marshal|dill|cloudpickle|shelve|jsonpickle|joblib)\b"
    r"|\b(pickle|marshal|dill|cloudpickle)\.(loads?|Unpickler)\b"
    r"|(?<![\w.])(eval|exec)\s*\("
    r"|\btorch\.load\s*\(|allow_pickle\s*=\s*True|yaml\.(unsafe_load|full_load)\s*\(|Loader\s*=\s*yaml\.(Unsafe|Full)?Loader\b"
    r"|\bmsgpack\.(unpackb?|Unpacker)\s*\(",
    re.M,
)


def test_no_code_path_unpickles_or_evaluates() -> None:
    assert len(_SOURCES) > 20  # negative control: the scan sees the package and plugins
    offenders = [
        f"{p.relative_to(ROOT)}:{m.group(0).strip()}" for p in _SOURCES for m in _DANGEROUS.finditer(p.read_text())
    ]
    assert offenders == []
    # The scanner itself catches what it must (negative controls).
    for bad in (
        "import pickle",
        "from marshal import loads",
        "x = eval(s)",
        "exec(code)",
        "torch.load(f)",
        "yaml.load(t, Loader=yaml.Loader)",
    ):
        assert _DANGEROUS.search(bad), bad
    # The one yaml.load call uses a SafeLoader subclass.
    for p in _SOURCES:
        for line in p.read_text().splitlines():
            if "yaml.load(" in line:
                assert "Loader=_strict_yaml_loader()" in line or "Loader=yaml.SafeLoader" in line, (p, line)
    import yaml

    from pd_middleware.config_loader import _strict_yaml_loader

    assert issubclass(_strict_yaml_loader(), yaml.SafeLoader)


def test_yaml_config_cannot_construct_python_objects(tmp_path) -> None:
    f = tmp_path / "evil.yaml"
    marker = tmp_path / "pwned"
    f.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError, match="invalid YAML") as info:
        load_config(f)
    assert info.value.source == str(f) and not marker.exists()


def test_msgspec_decoders_have_no_ext_hook() -> None:
    decoders = {n: getattr(wire, n) for n in dir(wire) if isinstance(getattr(wire, n), msgspec.msgpack.Decoder)}
    from pd_middleware.workloads import trace

    decoders.update(
        {f"trace.{n}": getattr(trace, n) for n in dir(trace) if isinstance(getattr(trace, n), msgspec.msgpack.Decoder)}
    )
    assert {"INBOUND_DECODER", "OUTBOUND_DECODER", "_SHALLOW_DECODER"} <= set(decoders)
    for name, dec in decoders.items():
        assert dec.ext_hook is None, name
    # An ext value anywhere in a typed message is a WireError, and the shallow decoder
    # (used to sniff request ids on the error path) yields inert bytes, not objects.
    raw = msgspec.msgpack.decode(inline_frames(make())[0])
    frame = msgspec.msgpack.encode({**raw, "request_id": msgspec.msgpack.Ext(1, b"\x00")})
    with pytest.raises(WireError) as info:
        wire.decode_frame(frame, LimitsConfig())
    assert info.value.field == "request_id" and "Expected `str`, got `ext`" in str(info.value)
    got = wire._SHALLOW_DECODER.decode(msgspec.msgpack.encode({"request_id": msgspec.msgpack.Ext(1, b"\x00")}))
    assert type(got["request_id"]) is msgspec.Raw and bytes(got["request_id"]) == b"\xd4\x01\x00"


# ---- plugin references ------------------------------------------------------------------------

HOSTILE = [
    "/tmp/pdm_sec_plugin.py:SPEC",
    "./pdm_sec_plugin.py:SPEC",
    "pdm_sec_plugin.py:SPEC",
    "os.system('touch /tmp/pdm_sec_marker'):Y",
    "x; touch /tmp/pdm_sec_marker:Y",
    "$(touch /tmp/pdm_sec_marker):Y",
    "`touch /tmp/pdm_sec_marker`:Y",
    "__import__('os').system('true'):Y",
    "pdm_sec_plugin:SPEC; rm -rf /",
    "pdm_sec_plugin:SPEC:extra",
    "pdm_sec_plugin:__class__.__base__",
    "../pdm_sec_plugin:SPEC",
    "pdm sec plugin:SPEC",
    "pdm_sec_plugin:",
    ":SPEC",
]


@pytest.fixture
def plugin_on_disk(tmp_path, monkeypatch):
    """A module file that leaves a marker when imported, in a directory NOT on sys.path."""
    marker = tmp_path / "imported"
    (tmp_path / "pdm_sec_plugin.py").write_text(f"open({str(marker)!r}, 'w').close()\nSPEC = None\n")
    monkeypatch.chdir(tmp_path)  # relative paths would resolve here if anything tried
    return marker


@pytest.mark.parametrize("ref", HOSTILE)
def test_hostile_plugin_reference_is_refused_without_importing(ref, plugin_on_disk, monkeypatch) -> None:
    calls: list[str] = []
    real = importlib.import_module
    monkeypatch.setattr("pd_middleware.registry.importlib.import_module", lambda n, *a: calls.append(n) or real(n, *a))
    with pytest.raises(PluginError) as info:
        PluginRegistry().resolve("synthesizer", ref, key="synthesizer.name")
    assert info.value.key == "synthesizer.name" and "(config key synthesizer.name)" in str(info.value)
    assert "is not a 'package.module:attribute' reference" in str(info.value) or "names a .py file" in str(info.value)
    assert calls == [] and not plugin_on_disk.exists() and not os.path.exists("/tmp/pdm_sec_marker")


def test_plugin_reference_in_config_names_the_key(tmp_path, plugin_on_disk) -> None:
    cases = {
        "synthesizer.name": 'synthesizer = {name = "/tmp/pdm_sec_plugin.py:SPEC"}\n',
        "hooks[0].name": 'hooks = [{name = "x; rm -rf /:Y"}]\n',
        "arms[1].synthesizer.name": (
            'arms = [{name = "a", synthesizer = {name = "one_hot"}},'
            ' {name = "b", synthesizer = {name = "os.system(\'x\'):Y"}}]\n'
        ),
        "encoder.name": 'encoder = {name = "no_such_module_pdm_sec:SPEC"}\n',
    }
    reg = default_registry()
    for key, text in cases.items():
        f = tmp_path / "c.toml"
        f.write_text(text)
        with pytest.raises(PluginError) as info:
            resolve_plugins(load_config(f), reg, source=str(f))
        assert info.value.key == key, (key, str(info.value))
    # A well-formed but missing module is imported (that is the contract) and fails clearly.
    assert "cannot import 'no_such_module_pdm_sec': ModuleNotFoundError" in str(info.value)
    # Importable, but not a plugin: refused with the key named.
    with pytest.raises(
        PluginError,
        match=r"\(config key synthesizer.name\): os:system is a builtin_function_or_method, not a PluginSpec|not a PluginSpec",
    ):
        PluginRegistry().resolve("synthesizer", "os:system", key="synthesizer.name")
    assert not plugin_on_disk.exists()


# ---- CURVE: authenticated identity, allowlist, memory against raw ZMTP -----------------

import resource  # noqa: E402  # the CURVE section keeps its own imports

sys.path.insert(0, str(ROOT / "reliability"))
from _zmtp import RawZmtp  # noqa: E402  # after the sys.path line above

from pd_middleware.transport.config import CurveConfig  # noqa: E402  # with the section


def _keys(monkeypatch, name: str) -> tuple[str, str]:
    """A fresh keypair; the secret goes into the env var PDM_TEST_CURVE_<NAME>."""
    pub, sec = zmq.curve_keypair()
    monkeypatch.setenv(f"PDM_TEST_CURVE_{name.upper()}", sec.decode())
    return pub.decode(), f"PDM_TEST_CURVE_{name.upper()}"


@pytest.fixture
def curve_setup(monkeypatch):
    server_pub, server_env = _keys(monkeypatch, "server")
    alice_pub, alice_env = _keys(monkeypatch, "alice")
    bob_pub, bob_env = _keys(monkeypatch, "bob")
    _eve_pub, eve_env = _keys(monkeypatch, "eve")  # a valid key pair, not on the allowlist
    server = cfg(
        curve=CurveConfig(enabled=True, secret_key_env=server_env, clients={"alice": alice_pub, "bob": bob_pub})
    )

    def client(env: str, **kw) -> TransportConfig:
        return cfg(curve=CurveConfig(enabled=True, secret_key_env=env, server_key=server_pub), **kw)

    return server, {"alice": client(alice_env), "bob": client(bob_env), "eve": client(eve_env)}


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_curve_identity_is_the_key_and_strangers_never_reach_python(zctx, curve_setup) -> None:
    server, clients = curve_setup
    rec = Recorder()
    rx = DecodeReceiver(
        server, ReceivePipeline([("rec", rec)], {"default": ("one_hot", OneHot())}), context=zctx
    ).start()
    try:
        # The hello claims "bob", but the key is alice's: the identity is alice.
        a = PrefillSender(clients["alice"], context=zctx, name="bob").connect(rx.address)
        a.send(make(rid="from-alice"))
        (d,) = collect_outcomes(rx, 1)
        assert isinstance(d, Delivery) and d.peer == "alice" and rx.peers == {"alice": 0}
        # A valid key that is not allowed, and a plain (NULL) client: no grant, nothing received.
        for c in (clients["eve"], cfg(connect_timeout_s=0.5)):
            c = msgspec.structs.replace(c, connect_timeout_s=0.5)
            with pytest.raises(TransferError, match="no slot grant"):
                PrefillSender(c, context=zctx, name="alice").connect(rx.address)
        # Spoofing alice's name from bob's (allowed) key neither drops alice nor takes her id.
        b = PrefillSender(clients["bob"], context=zctx, name="alice").connect(rx.address)
        assert rx.peers == {"alice": 0, "bob": 0}
        a.send(make(rid="alice-again"))
        (d2,) = collect_outcomes(rx, 1)
        assert d2.peer == "alice" and a.flush(5) and a.statuses()["delivered"] == 2
        a.reconnect()  # the same key on a new connection replaces its old one, nobody else's
        deadline = time.monotonic() + 5
        while len(rx._peers) != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rx.peers == {"alice": 0, "bob": 0} and len(rx._peers) == 2
        assert rec.seen == ["from-alice", "alice-again"]
        assert rx.metrics.snapshot()["failed"] == 0
        a.close()
        b.close()
    finally:
        rx.stop()


def test_curve_raw_zmtp_stream_is_refused_at_the_handshake(zctx, curve_setup) -> None:
    server, _ = curve_setup
    rx = DecodeReceiver(server, ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx).start()
    plain = DecodeReceiver(cfg(), ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx).start()
    try:
        host, port = rx.address[len("tcp://") :].rsplit(":", 1)
        # Negative control: the same raw client completes a NULL handshake with a plain receiver.
        ctl = RawZmtp(host, int(plain.address.rsplit(":", 1)[1]))
        assert ctl.handshake()
        ctl.close()
        before = _rss_mb()
        raw = RawZmtp(host, int(port))
        assert not raw.handshake()  # a CURVE server closes a NULL client
        sent = raw.stream_more(64 << 20)  # a never-ending message: MORE on every empty frame
        raw.close()
        time.sleep(0.2)
        assert sent < 64 << 20 or _rss_mb() - before < 32, (sent, _rss_mb() - before)
        assert _rss_mb() - before < 32  # MB: nothing was buffered
        assert rx.healthy and rx.metrics.snapshot()["received"] == 0
    finally:
        rx.stop()
        plain.stop()


# ---- HMAC: replay --------------------------------------------------------------------------


def test_hmac_replayed_payload_and_hello_are_refused(zctx) -> None:
    rec = Recorder()
    rx = DecodeReceiver(
        cfg(hmac_key=KEY), ReceivePipeline([("rec", rec)], {"default": ("one_hot", OneHot())}), context=zctx
    ).start()
    good = Signer(KEY.encode())
    nonce = new_nonce()
    try:
        legit = dealer(zctx, rx.address)
        hello = [wire.encode(wire.Hello(name="legit", want_slots=0, ts=time.time()))]
        signed_hello = [*hello, *good.sign(hello, nonce, 0, TO_DECODE)]
        legit.send_multipart(signed_hello)
        assert legit.poll(5000)
        legit.recv_multipart()
        frames = inline_frames(make(rid="once"))
        captured = [*frames, *good.sign(frames, nonce, 1, TO_DECODE)]
        legit.send_multipart(captured)
        (d,) = collect_outcomes(rx, 1)
        assert isinstance(d, Delivery) and d.release() is None
        time.sleep(0.05)
        legit.send_multipart(captured)  # replay on the same connection
        (r1,) = collect_outcomes(rx, 1)
        assert r1.key == "wire:replay"
        # Replay the captured hello, then the payload, from another connection.
        thief = dealer(zctx, rx.address)
        thief.send_multipart(signed_hello)
        thief.send_multipart(captured)
        r2, r3 = collect_outcomes(rx, 2)
        assert r2.key == "wire:replay" and r3.key == "wire:peer"  # refused hello, then "unknown peer"
        # Unauthenticated: the refusal must not name (and so evict) the victim's request.
        assert r3.request_id is None and "'once'" in r3.reason
        assert rx.peers == {"legit": 0}  # the legit peer was not dropped
        # A stale hello (outside the freshness window) is refused too.
        old = [wire.encode(wire.Hello(name="late", want_slots=0, ts=time.time() - 3600))]
        thief.send_multipart([*old, *good.sign(old, new_nonce(), 0, TO_DECODE)])
        (r4,) = collect_outcomes(rx, 1)
        assert r4.key == "wire:replay" and "off this clock" in r4.reason
        # Negative control: the legit connection's next sequence is delivered.
        frames = inline_frames(make(rid="twice"))
        legit.send_multipart([*frames, *good.sign(frames, nonce, 2, TO_DECODE)])
        (ok,) = collect_outcomes(rx, 1)
        assert isinstance(ok, Delivery) and rec.seen == ["once", "twice"]
        legit.close(0)
        thief.close(0)
    finally:
        rx.stop()


def test_hmac_error_reply_keeps_the_peers_sequence(zctx) -> None:
    """One signed frame the decode cannot decode is answered on the peer's own sequence: a
    wall-clock one jumped the prefill's replay window past every later ack and heartbeat."""
    c = cfg(hmac_key=KEY, heartbeat_s=0.2, peer_timeout_s=3.0)
    rx = DecodeReceiver(c, ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx).start()
    tx = PrefillSender(c, context=zctx, name="A").connect(rx.address)
    try:
        tx.send(make(rid="before"))
        assert tx.flush(5.0)
        with tx._lock:  # a signed frame of a message kind this decode does not know
            frames = [b"\x82\xa4kind\xa4ping\xa5extra\x01"]
            frames += tx._signer.sign(frames, tx._nonce, tx._tx_seq, TO_DECODE)
            tx._tx_seq += 1
            tx._sock.send_multipart(frames)
        time.sleep(0.3)
        for i in range(5):
            tx.send(make(rid=f"after{i}"))
        assert tx.flush(5.0), tx.statuses()
        st = tx.statuses()
        # The control: the odd frame was refused (the reply arrived); no ack was taken for a replay.
        assert st["rejected_by_decode"] == {"wire": 1} and st["delivered"] == 6
        time.sleep(0.6)  # heartbeats after the reply are heard too
        tx.send(make(rid="later"))
        assert tx.flush(5.0)
    finally:
        tx.close()
        rx.stop()


def test_allowlist_refuses_two_keys_under_one_name_and_one_key_under_two(tmp_path) -> None:
    from pd_middleware.transport.auth import load_allowlist, write_keypair

    pub, _ = write_keypair(tmp_path / "a", "prefill-a")
    other_pub, _ = write_keypair(tmp_path / "b", "prefill-b")
    file_key = zmq.auth.load_certificate(pub)[0].decode()
    other_key = zmq.auth.load_certificate(other_pub)[0].decode()
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "prefill-a.key").write_text(pathlib.Path(pub).read_text())
    # Negative control: distinct names and keys load.
    ok = CurveConfig(clients={"prefill-b": other_key}, clients_dir=str(allowed))
    assert load_allowlist(ok) == {file_key: "prefill-a", other_key: "prefill-b"}
    two_keys = CurveConfig(clients={"prefill-a": other_key}, clients_dir=str(allowed))
    with pytest.raises(ConfigError, match="'prefill-a' is given twice") as err:
        load_allowlist(two_keys)
    assert err.value.path == "transport.curve.clients_dir"
    with pytest.raises(ConfigError, match="already allowed as 'x'"):
        load_allowlist(CurveConfig(clients={"x": other_key, "y": other_key}))


def test_curve_keys_from_files_and_config_checks(zctx, tmp_path) -> None:
    from pd_middleware.core._errors import OptionValueError
    from pd_middleware.transport.auth import write_keypair

    allowed = tmp_path / "allowed"
    _, decode_secret = write_keypair(tmp_path, "decode")
    pub, sec = write_keypair(tmp_path / "prefill", "prefill-a")
    allowed.mkdir()
    (allowed / "prefill-a.key").write_text(pathlib.Path(pub).read_text())
    server_pub = zmq.auth.load_certificate(str(tmp_path / "decode.key"))[0].decode()
    server = cfg(curve=CurveConfig(enabled=True, secret_key_file=decode_secret, clients_dir=str(allowed)))
    client = cfg(curve=CurveConfig(enabled=True, secret_key_file=sec, server_key=server_pub))
    rx = DecodeReceiver(server, ReceivePipeline([], {"default": ("one_hot", OneHot())}), context=zctx).start()
    try:
        tx = PrefillSender(client, context=zctx, name="whatever").connect(rx.address)
        tx.send(make(rid="k"))
        (d,) = collect_outcomes(rx, 1)
        assert isinstance(d, Delivery) and d.peer == "prefill-a"  # the certificate's file name
        tx.close()
    finally:
        rx.stop()
    # Config checks: each names its field.
    for kw, field in [
        (dict(server_key="short"), "server_key"),
        (dict(clients={"a": "not-a-key"}), "clients.a"),
        (dict(enabled=True), "secret_key_env"),
        (dict(secret_key_env="X", secret_key_file="y"), "secret_key_file"),
    ]:
        with pytest.raises(OptionValueError) as info:
            CurveConfig(**kw)
        assert info.value.field == field
    with pytest.raises(OptionValueError, match="hmac_key"):
        TransportConfig(hmac_key=KEY, curve=CurveConfig(enabled=True, secret_key_env="X"))
    # A missing secret or an empty allowlist fails at start with the config path, never silently open.
    with pytest.raises(ConfigError) as err:
        DecodeReceiver(
            cfg(curve=CurveConfig(enabled=True, secret_key_env="PDM_UNSET_VAR_XYZ")),
            ReceivePipeline([], {"default": ("one_hot", OneHot())}),
            context=zctx,
        ).start()
    assert err.value.path == "transport.curve.secret_key_env"
    with pytest.raises(ConfigError) as err:
        DecodeReceiver(
            cfg(curve=CurveConfig(enabled=True, secret_key_file=decode_secret)),
            ReceivePipeline([], {"default": ("one_hot", OneHot())}),
            context=zctx,
        ).start()
    assert err.value.path == "transport.curve.clients"
