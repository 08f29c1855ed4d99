"""The metadata channel's inline-step wrappers (0.5.18 to 0.5.22) without SGLang.

Each release's real receiver, parser, queue and allocator are exercised in
``tests/test_sglang_releases.py`` (``tests/_sglang_release_inband.py``); this file pins the
wrappers' own rules on stand-ins: which messages are rewritten, what a failed rewrite
sends, the instance-level connect being undone, and which allocators clear a row.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from pd_middleware.codecs.inband import HEADER_BYTES
from pd_middleware.core.events import Events
from pd_middleware.integrations.sglang.metadata import MetadataChannel
from pd_middleware.integrations.sglang.metadata_inline import BUFFERS_ATTR, wrap_free, wrap_queue_init
from pd_middleware.integrations.sglang.registration import (
    FRAME_MARK,
    parse_frame,
    rewrite_registration,
    wrap_from_zmq,
    wrap_register_kv_args,
)

AUX = [0x1000, 0x2000]


def channel_with_row() -> tuple[MetadataChannel, torch.Tensor]:
    ch = MetadataChannel(4096)
    ch.bind(13, 1)
    row = torch.zeros((2, 64), dtype=torch.uint8)
    ch.append_info(SimpleNamespace(pd_proposal=row), (list(AUX), [0, 0], [0, 0]))
    return ch, row


def registration(aux: list[int]) -> list[bytes]:
    return [b"None", b"127.0.0.1", b"17000", b"sid", struct.pack("2Q", 1, 2), struct.pack(f"{len(aux)}Q", *aux)]


def test_the_rewrite_moves_only_our_address_into_the_trailing_frame() -> None:
    ch, row = channel_with_row()
    ours = row.data_ptr()
    out = rewrite_registration(ch, [*AUX, ours], registration([*AUX, ours]))
    assert out[:5] == registration(AUX)[:5] and out[5] == struct.pack("2Q", *AUX)
    assert parse_frame(out) == (ch.describe(), ours)
    # Not a registration, or our buffer not last (made before the drop-in): sent as built.
    other = [b"ABORT", b"7"]
    assert rewrite_registration(ch, [*AUX, ours], other) == other
    assert rewrite_registration(ch, AUX, registration(AUX)) == registration(AUX)
    with pytest.raises(ValueError, match="aux buffer addresses"):
        rewrite_registration(ch, [*AUX, ours], registration(AUX))


def test_a_malformed_address_reads_as_no_layout_and_is_counted() -> None:
    inst = SimpleNamespace(events=Events("t"))
    info = SimpleNamespace(dst_aux_ptrs=list(AUX))
    parse = wrap_from_zmq(lambda cls, msg: info, inst)
    got = parse(None, [b"None", FRAME_MARK + b"rowv1 x;ptr=zz"])
    assert got.pd_middleware_layout is None and got.dst_aux_ptrs == AUX
    assert inst.events.counts["guard:from_zmq:ValueError"] == 1
    for spoofed in (b"0", b"-5", str(1 << 64).encode()):  # never handed to the transfer
        got = parse(None, [b"None", FRAME_MARK + b"rowv1 x;ptr=" + spoofed])
        assert got.pd_middleware_layout is None and got.dst_aux_ptrs == AUX
    got = parse(None, [b"None", FRAME_MARK + b"rowv1 x;ptr=4096"])
    assert got.pd_middleware_layout == "rowv1 x" and got.dst_aux_ptrs == [*AUX, 4096]


class Receiver:
    sent: ClassVar[list[Any]] = []

    @classmethod
    def _connect_to_bootstrap_server(cls, info: Any) -> Any:
        return SimpleNamespace(send_multipart=cls.sent.append, closed=False), None

    def __init__(self, aux: list[int], sends: list[int] | None = None) -> None:
        self.kv_mgr = SimpleNamespace(kv_args=SimpleNamespace(aux_data_ptrs=aux))
        self.sends = aux if sends is None else sends  # the aux list its frames carry

    def _register_kv_args(self) -> bool:
        sock, _lock = self._connect_to_bootstrap_server({})
        assert sock.closed is False  # every other attribute is the socket's
        sock.send_multipart(registration(self.sends))
        return True


def test_the_registration_is_rewritten_once_and_the_instance_is_left_as_it_was() -> None:
    ch, row = channel_with_row()
    inst = SimpleNamespace(channel=ch, events=Events("t"))
    register = wrap_register_kv_args(Receiver._register_kv_args, inst)
    Receiver.sent = []
    recv = Receiver([*AUX, row.data_ptr()])
    assert register(recv) is True
    assert parse_frame(Receiver.sent[0]) == (ch.describe(), row.data_ptr())
    assert "_connect_to_bootstrap_server" not in recv.__dict__
    # A registration whose aux frame cannot be found goes as SGLang built it, counted.
    register(Receiver([*AUX, row.data_ptr()], sends=[9, row.data_ptr()]))
    assert parse_frame(Receiver.sent[1]) == (None, None)
    assert inst.events.counts["guard:registration:ValueError"] == 1


def test_only_a_decode_queues_allocator_clears_our_row_at_free() -> None:
    ch, row = channel_with_row()
    inst = SimpleNamespace(channel=ch, events=Events("t"))
    freed: list[int] = []
    free = wrap_free(lambda self, idx: freed.append(idx), inst)
    bound, unbound = SimpleNamespace(), SimpleNamespace()
    buffers = SimpleNamespace(pd_proposal=row)

    def init(self: Any, allocator: Any, buffers: Any) -> None:
        self.req_to_metadata_buffer_idx_allocator, self.metadata_buffers = allocator, buffers

    wrap_queue_init(init, inst)(SimpleNamespace(), bound, buffers)
    assert getattr(bound, BUFFERS_ATTR) is buffers
    row.fill_(7)
    free(unbound, 1)  # a prefill's allocator: nothing cleared
    assert int(row[1].sum()) == 7 * 64
    free(bound, 1)
    assert np.all(row[1, :HEADER_BYTES].numpy() == 0) and int(row[1, HEADER_BYTES:].sum()) == 7 * (64 - HEADER_BYTES)
    assert int(row[0].sum()) == 7 * 64 and freed == [1, 1]
