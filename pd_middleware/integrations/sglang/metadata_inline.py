"""The metadata channel's rows where SGLang does two steps inline (0.5.18 to 0.5.22).

From 0.5.23 the decode resets a freed metadata slot in ``MetadataBuffers.clear_slot`` and
builds its Mooncake registration in ``MooncakeKVManager.build_receiver_registration_message``;
:mod:`.metadata` wraps both. Before 0.5.23 both are inline (``decode.py`` zeroes
``bootstrap_room[idx]`` then frees the slot; ``MooncakeKVReceiver._register_kv_args`` packs
the frames and sends them itself), so these rows wrap what those inline steps call:

- **The slot reset.** ``DecodeTransferQueue.__init__`` binds the queue's allocator to its
  metadata buffers; ``ReqToMetadataIdxAllocator.free(idx)`` of a bound allocator clears our
  row of that slot before the slot is handed out again (every free, the abort paths too).
- **The registration.** ``MooncakeKVReceiver._register_kv_args`` runs with an instance-level
  ``_connect_to_bootstrap_server`` whose socket rewrites the registration it sends (frame 0
  ``None``): the proposal buffer's address moves from SGLang's aux-pointer frame into the
  drop-in's trailing frame, ``pd-middleware-row <layout>;ptr=<address>``. SGLang's parser
  reads fixed positions and ignores the trailing frame, so a **stock prefill** pairs
  exactly SGLang's buffers (before 0.5.23 its ``send_aux`` walks the decode's list with its
  own item lengths: one more decode buffer would index past them). A prefill with the
  drop-in reads the address back in ``KVArgsRegisterInfo.from_zmq`` (:mod:`.metadata`'s
  wrapper) and appends it to ``dst_aux_ptrs``, where its own row buffer sits last.
- **The peer check** (feature ``peer_check``). 0.5.22 has SGLang's per-session rejection
  hook (``_validate_peer_state_layout``); before it, the prefill's ``MooncakeKVManager.send_aux``
  checks the session once (the same :func:`~.draft_kv.peer_mismatch`, cached on the
  session's registration) and fails each transfer to a mismatched decode (a nonzero
  return: SGLang fails that request; the reason, naming both layouts, is logged once).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger("pd_middleware.integrations.sglang")

#: Frame 0 of a decode's KV-args registration (the room field of a registration).
REGISTRATION_ROOM = b"None"
#: Allocator attribute holding the metadata buffers whose rows its slots index.
BUFFERS_ATTR = "_pd_middleware_buffers"
#: Registration-info attribute caching the prefill's verdict on that decode session.
VERDICT_ATTR = "_pd_middleware_verdict"
_UNCHECKED = object()


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


def wrap_queue_init(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        try:
            setattr(self.req_to_metadata_buffer_idx_allocator, BUFFERS_ATTR, self.metadata_buffers)
        except Exception as exc:
            inst.events.failed("queue_init", exc, "rows not cleared at free (the room check still binds each row)")

    return __init__


def wrap_free(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def free(self: Any, free_index: int) -> Any:
        buffers = self.__dict__.get(BUFFERS_ATTR)
        if buffers is not None:  # a decode queue's allocator: SGLang zeroed the room just before
            try:
                inst.channel.clear(buffers, free_index)
            except Exception as exc:
                inst.events.failed("free", exc, "the row as it was (its room no longer matches)")
        return orig(self, free_index)

    return free


def wrap_send_aux(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    from .draft_kv import session_verdict  # deferred: draft_kv imports this module

    def send_aux(self: Any, req: Any, prefill_aux_index: int, dst_aux_ptrs: list[int]) -> Any:
        info = self.decode_kv_args_table.get(req.mooncake_session_id)
        if info is not None:
            why = getattr(info, VERDICT_ATTR, _UNCHECKED)
            if why is _UNCHECKED:
                why = session_verdict(inst, self, info)
                setattr(info, VERDICT_ATTR, why)
            if why is not None:
                return 1  # SGLang's transfer result: nonzero fails this request
        return orig(self, req, prefill_aux_index, dst_aux_ptrs)

    return send_aux


#: What 0.5.18's ``_is_fake_transfer(req, server_args)`` reads of the server args: its
#: backend, which the metadata channel's startup check holds to "mooncake".
_MOONCAKE_ARGS = SimpleNamespace(disaggregation_transfer_backend="mooncake")


def host_only(is_fake: Callable[..., bool]) -> Callable[[Any], bool]:
    """0.5.18's ``_is_fake_transfer(req, server_args)`` in the one-argument contract."""
    return lambda req: bool(is_fake(req, _MOONCAKE_ARGS))
