"""The metadata channel's rows where SGLang does the slot reset and the peer check inline (before 0.5.23).

From 0.5.23 the decode resets a freed metadata slot in ``MetadataBuffers.clear_slot``
(:mod:`.metadata` wraps it); before, ``decode.py`` zeroes ``bootstrap_room[idx]`` and frees
the slot inline. The registration's layout frame has its own module (:mod:`.registration`).

- **The slot reset.** ``DecodeTransferQueue.__init__`` binds the queue's allocator to its
  metadata buffers; ``ReqToMetadataIdxAllocator.free(idx)`` of a bound allocator clears our
  row of that slot before the slot is handed out again (every free, the abort paths too).
- **The peer check** (feature ``peer_check``). 0.5.22 has SGLang's per-session rejection
  hook (``_validate_peer_state_layout``); before it, the prefill's ``MooncakeKVManager.send_aux``
  checks the session once (:func:`~.draft_kv.session_verdict`, cached on the session's
  registration) and fails each transfer to a mismatched decode (a nonzero return: SGLang
  fails that request; the reason, naming both layouts, is logged once).
- **0.5.18's** ``_is_fake_transfer(req, server_args)`` in the one-argument contract.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

logger = logging.getLogger("pd_middleware.integrations.sglang")

#: Allocator attribute holding the metadata buffers whose rows its slots index.
BUFFERS_ATTR = "_pd_middleware_buffers"
#: Registration-info attribute caching the prefill's verdict on that decode session.
VERDICT_ATTR = "_pd_middleware_verdict"
_UNCHECKED = object()


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
