"""The decode's Mooncake registration and the metadata channel's layout frame.

The decode appends one trailing frame to its KV-args registration,
``pd-middleware-row <layout>`` (and, before 0.5.23, ``;ptr=<address>``: its proposal
buffer's address, moved out of SGLang's aux-pointer frame); SGLang's parser reads fixed
positions and ignores it. Here: the frame's format and parse, the prefill's wrapper of
``KVArgsRegisterInfo.from_zmq`` (the layout, and the address appended last to
``dst_aux_ptrs``), and the decode's two ways of adding the frame: SGLang's builder
``MooncakeKVManager.build_receiver_registration_message`` from 0.5.23, and before it a
socket around the inline ``MooncakeKVReceiver._register_kv_args`` that rewrites the
registration it sends (a stock prefill of those releases walks the decode's aux list with
its own item lengths, so the address must not stay in SGLang's list). The rows are the
``metadata`` feature's (:mod:`.metadata`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any

#: Marker of the layout frame appended to the decode's Mooncake registration.
FRAME_MARK = b"pd-middleware-row "
#: KVArgsRegisterInfo attribute the decode's layout (or None) is parsed into.
LAYOUT_ATTR = "pd_middleware_layout"
#: Separates the layout from the proposal buffer's address in the trailing frame (before
#: 0.5.23 the address rides there, not in SGLang's aux list).
PTR_SEP = b";ptr="


def parse_frame(msg: Any) -> tuple[str | None, int | None]:
    """The layout our trailing frame names in a registration message and the proposal
    buffer's address it carries: (None, None) without our frame, (layout, None) from a
    0.5.23 decode (its address is in SGLang's aux list). ValueError on a malformed address."""
    last = bytes(msg[-1]) if len(msg) else b""
    if not last.startswith(FRAME_MARK):
        return None, None
    layout, sep, ptr = last[len(FRAME_MARK) :].partition(PTR_SEP)
    address = int(ptr.decode("ascii")) if sep else None
    if address is not None and not 0 < address < 1 << 64:
        raise ValueError(f"the proposal buffer's address {address} is not a 64-bit address")
    return layout.decode("ascii", "replace"), address


def layout_of(msg: Any) -> str | None:
    """The layout our trailing frame names in a registration message, or None (no frame)."""
    return parse_frame(msg)[0]


#: Frame 0 of a decode's KV-args registration (the room field of a registration).
REGISTRATION_ROOM = b"None"


def _pack(ptrs: Sequence[int]) -> bytes:
    return b"".join(struct.pack("Q", int(p)) for p in ptrs)


def rewrite_registration(channel: Any, aux_ptrs: Sequence[int], msg: Sequence[Any]) -> list[Any]:
    """The registration ``msg`` with the proposal buffer's address moved from SGLang's
    aux-pointer frame into our trailing frame. Any other message, or a registration
    whose aux list does not end with this process's proposal buffer (buffers made before
    the drop-in), goes as it is: the prefill then serves that decode SGLang's buffers only."""
    out = list(msg)
    if not out or bytes(out[0]) != REGISTRATION_ROOM:
        return out
    ptrs = [int(p) for p in aux_ptrs]
    if not ptrs or ptrs[-1] not in channel.row_ptrs:
        return out
    packed = _pack(ptrs)
    for i, frame in enumerate(out):
        if i > 0 and bytes(frame) == packed:
            out[i] = _pack(ptrs[:-1])
            return [*out, channel.registration_frame(ptrs[-1])]
    raise ValueError("no frame of the registration lists the decode's aux buffer addresses")


class _RegisteringSocket:
    """A bootstrap socket whose ``send_multipart`` rewrites a registration; the rest is the socket's."""

    def __init__(self, sock: Any, rewrite: Callable[[Any], Any]) -> None:
        self._sock = sock
        self._rewrite = rewrite

    def send_multipart(self, msg: Any, *args: Any, **kwargs: Any) -> Any:
        return self._sock.send_multipart(self._rewrite(msg), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def wrap_register_kv_args(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def _register_kv_args(self: Any) -> Any:
        connect = self._connect_to_bootstrap_server  # SGLang's (a classmethod)

        def rewrite(msg: Any) -> Any:
            try:
                return rewrite_registration(inst.channel, self.kv_mgr.kv_args.aux_data_ptrs, msg)
            except Exception as exc:
                inst.events.failed(
                    "registration", exc, "SGLang's registration as built (a prefill with the drop-in rejects it)"
                )
                return msg

        def _connect_to_bootstrap_server(bootstrap_info: Any) -> Any:
            sock, lock = connect(bootstrap_info)
            return _RegisteringSocket(sock, rewrite), lock

        self._connect_to_bootstrap_server = _connect_to_bootstrap_server
        try:
            return orig(self)
        finally:
            self.__dict__.pop("_connect_to_bootstrap_server", None)

    return _register_kv_args


def wrap_registration(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def build_receiver_registration_message(self: Any) -> Any:
        msg = orig(self)
        try:
            return [*msg, inst.channel.registration_frame()]
        except Exception as exc:
            inst.events.failed("registration", exc, "a registration without our frame (the prefill rejects it)")
            return msg

    return build_receiver_registration_message


def wrap_from_zmq(func: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def from_zmq(cls: Any, msg: Any) -> Any:
        info = func(cls, msg)
        try:
            layout, ptr = parse_frame(msg)
        except Exception as exc:
            inst.events.failed("from_zmq", exc, "no layout (served as a decode without the drop-in, or rejected)")
            layout, ptr = None, None
        setattr(info, LAYOUT_ATTR, layout)
        if ptr is not None:  # before 0.5.23: our row's address, last after SGLang's (as our buffer here)
            info.dst_aux_ptrs = [*info.dst_aux_ptrs, ptr]
        return info

    return from_zmq
