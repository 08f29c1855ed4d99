"""The metadata channel's registration, peer check and slot reset on one SGLang release (run
by ``tests/_sglang_release_check.py`` in that release's process; asserted by
``tests/test_sglang_releases.py``).

Real: the release's ``MooncakeKVReceiver._register_kv_args`` (its own frames, its own
``_connect_to_bootstrap_server`` and zmq PUSH socket) sending to a zmq PULL socket on
127.0.0.1 at a random port, the release's ``KVArgsRegisterInfo.from_zmq`` with and without
the drop-in, ``MooncakeKVManager.send_aux`` (before 0.5.22), ``DecodeTransferQueue.__init__``
and ``ReqToMetadataIdxAllocator``. Stand-ins, where the real thing needs a whole server: the
receiver's and the managers' attributes (namespaces with the fields these methods read),
and ``_transfer_data`` (Mooncake's transfer: records the blocks it was given).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import torch
import zmq
from _sglang_import import import_sglang

V = 13
AUX = [0x10000, 0x20000]  # SGLang's own aux buffers on the "decode"
ITEM = [64, 128]


def _kv_args(aux: list[int]) -> Any:
    return SimpleNamespace(
        kv_data_ptrs=[0x1000, 0x2000],
        aux_data_ptrs=list(aux),
        aux_item_lens=[*ITEM, 32][: len(aux)],
        state_data_ptrs=[],
        state_item_lens=[],
        state_dim_per_tensor=[],
        state_layer_ids=[],
        kv_layer_ids=[0, 1],
        kv_item_lens=[64],
        engine_rank=0,
        state_types=[],
    )


def _register(conn: Any, aux: list[int]) -> list[bytes]:
    """One registration through the release's real ``_register_kv_args`` and zmq, as received."""
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    try:
        recv = object.__new__(conn.MooncakeKVReceiver)
        mgr = SimpleNamespace(
            kv_args=_kv_args(aux),
            local_ip="127.0.0.1",
            rank_port=17000,
            attn_tp_size=1,
            dcp_size=1,
            dcp_rank=0,
            enable_staging=False,
            _staging_ctx=SimpleNamespace(allocator=None),
            kv_buffer_tensors=None,
            get_session_id=lambda: "127.0.0.1:17001",
        )
        if hasattr(conn.MooncakeKVManager, "build_receiver_registration_message"):  # 0.5.23: not inline
            mgr.build_receiver_registration_message = lambda: (
                conn.MooncakeKVManager.build_receiver_registration_message(mgr)
            )
        recv.__dict__.update(
            kv_mgr=mgr,
            session_id="127.0.0.1:17001",
            bootstrap_infos=[{"rank_ip": "127.0.0.1", "rank_port": port}],
            bootstrap_room=None,
            conclude_state=None,
        )
        assert recv._register_kv_args() is not False
        if not pull.poll(10_000):
            raise TimeoutError("no registration arrived within 10 s")
        return [bytes(f) for f in pull.recv_multipart()]
    finally:
        pull.close(linger=0)


def _fields(info: Any) -> dict[str, Any]:
    return {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}


def _json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    return value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)


def registration_check(version: str) -> dict[str, Any]:
    from pd_middleware.codecs.inband import HEADER_BYTES
    from pd_middleware.config import parse_config
    from pd_middleware.integrations import sglang as S
    from pd_middleware.integrations.sglang import metadata_inline
    from pd_middleware.integrations.sglang.patching import (
        DECODE_QUEUE_MODULE,
        MOONCAKE_MODULE,
        UTILS_MODULE,
        parse_version,
    )
    from pd_middleware.integrations.sglang.registration import LAYOUT_ATTR

    conn = import_sglang(MOONCAKE_MODULE)
    utils = import_sglang(UTILS_MODULE)
    decode = import_sglang(DECODE_QUEUE_MODULE)
    row = torch.zeros((2, 64), dtype=torch.uint8)
    ours = row.data_ptr()
    out: dict[str, Any] = {}
    # Negative control: SGLang's own registration lists every aux buffer, ours too.
    stock_msg = _register(conn, [*AUX, ours])
    out["stock"] = {"frames": len(stock_msg), "aux": list(conn.KVArgsRegisterInfo.from_zmq(stock_msg).dst_aux_ptrs)}
    # ... which a stock prefill's send_aux walks with its own (two) item lengths.
    try:
        mgr = SimpleNamespace(kv_args=_kv_args(AUX), enable_custom_mem_pool=False, custom_mem_pool_type=None)
        mgr._transfer_data = lambda sid, blocks: 0
        req = SimpleNamespace(mooncake_session_id="s", dst_aux_index=0)
        out["stock"]["send_aux"] = repr(conn.MooncakeKVManager.send_aux(mgr, req, 0, out["stock"]["aux"]))
    except Exception as exc:
        out["stock"]["send_aux"] = type(exc).__name__
    cfg = parse_config(
        {"model": {"vocab_size": V, "num_steps": 1}, "transport": {"mooncake": {"enabled": False}}, "sglang": {}}
    )
    inst = S.install(cfg, S.InstallOptions(channel="metadata", hook_scheduler=False, version=version))
    try:
        inst.channel.bind(V, 1)
        inst.channel.append_info(SimpleNamespace(pd_proposal=row), (list(AUX), [0, 0], [0, 0]))
        msg = _register(conn, [*AUX, ours])
        info = conn.KVArgsRegisterInfo.from_zmq(msg)  # the drop-in's prefill reads it
        out["dropin"] = {
            "frames": len(msg),
            "aux": list(info.dst_aux_ptrs),
            "layout": getattr(info, LAYOUT_ATTR, None),
            "mine": inst.channel.describe(),
            "row_ptr": ours,
        }
        dropin_fields = _fields(info)
        # The slot reset: the decode queue binds its allocator; free clears our row first.
        buffers = SimpleNamespace(pd_proposal=row)
        alloc = utils.ReqToMetadataIdxAllocator(2)
        params = list(inspect.signature(decode.DecodeTransferQueue.__init__).parameters)[1:]
        given = {
            "req_to_metadata_buffer_idx_allocator": alloc,
            "metadata_buffers": buffers,
            "scheduler": SimpleNamespace(spec_algorithm=None, enable_overlap=False),
            "tp_rank": 0,
        }
        bound = False
        # What a scheduler publishes before it builds the queue (0.5.21+ read it there).
        published = {
            "get_parallel": lambda: SimpleNamespace(tp_rank=0, attn_tp_group=SimpleNamespace(cpu_group=None)),
            "get_disagg": lambda: SimpleNamespace(disaggregation_decode_host_receive_threshold=0),
        }
        try:
            with contextlib.ExitStack() as stack:
                for name, fn in published.items():
                    if hasattr(decode, name):
                        stack.enter_context(patch.object(decode, name, fn))
                decode.DecodeTransferQueue(**{p: given.get(p) for p in params})
            bound = getattr(alloc, metadata_inline.BUFFERS_ATTR, None) is buffers
        except Exception as exc:
            out["queue_error"] = f"{type(exc).__name__}: {exc}"
        row.fill_(7)
        alloc.free(1)
        out["slot_reset"] = {
            "bound": bound,
            "header_after_free": int(row[1, :HEADER_BYTES].sum()),  # zero magic: "never written"
            "rest_after_free": int(row[1, HEADER_BYTES:].sum()),
            "other_row": int(row[0].sum()),
        }
        if parse_version(version) <= parse_version("0.5.21"):
            out["send_aux"] = _send_aux_check(conn, inst.channel.describe(), info)
    finally:
        S.uninstall()
    stock_fields = _fields(conn.KVArgsRegisterInfo.from_zmq(msg))  # a stock prefill reads the same message
    out["stock_reads_dropin"] = {
        "aux": list(stock_fields["dst_aux_ptrs"]),
        "other_fields_equal": {k: v for k, v in stock_fields.items() if k != "dst_aux_ptrs"}
        == {k: v for k, v in dropin_fields.items() if k not in ("dst_aux_ptrs", LAYOUT_ATTR)},
    }
    return _json(out)


def _send_aux_check(conn: Any, mine: str, good: Any) -> dict[str, Any]:
    """The prefill's check at the session's aux transfer (before 0.5.22): a matching decode,
    a decode without the drop-in and a decode of another layout, each its own session."""
    from pd_middleware.integrations.sglang.registration import LAYOUT_ATTR

    sent: list[Any] = []
    mgr = SimpleNamespace(
        kv_args=_kv_args([*AUX, 0x30000]),
        enable_custom_mem_pool=False,
        custom_mem_pool_type=None,
        decode_kv_args_table={},
        _transfer_data=lambda sid, blocks: sent.append((sid, len(blocks))) or 0,
    )
    bare = dataclasses.replace(good, dst_aux_ptrs=list(AUX))
    setattr(bare, LAYOUT_ATTR, None)
    other = dataclasses.replace(good)
    setattr(other, LAYOUT_ATTR, mine.replace("capacity=", "capacity=1"))
    results = {}
    for sid, info in (("match", good), ("without_dropin", bare), ("other_layout", other)):
        mgr.decode_kv_args_table[sid] = info
        req = SimpleNamespace(mooncake_session_id=sid, dst_aux_index=0)
        results[sid] = conn.MooncakeKVManager.send_aux(mgr, req, 0, info.dst_aux_ptrs)
        results[sid + "_again"] = conn.MooncakeKVManager.send_aux(mgr, req, 0, info.dst_aux_ptrs)
    return {"returns": results, "sent": sent}
