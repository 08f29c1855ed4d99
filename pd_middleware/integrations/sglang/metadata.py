"""The in-band channel: proposals ride SGLang's own PD metadata transfer.

SGLang moves a fixed set of per-request rows from prefill to decode
(``sglang.srt.disaggregation.utils.MetadataBuffers``): both nodes register the buffers
of ``get_buf_infos()`` with the KV manager, the prefill fills its row in
``set_buf(req)`` and ``send_aux`` copies row i of each buffer into the decode's row,
buffer by buffer, in list order. :class:`MetadataChannel` appends ONE more buffer, a
``(rows, capacity_bytes)`` uint8 array holding :mod:`pd_middleware.codecs.inband` rows. The
wrappers around SGLang's methods (feature ``metadata`` of the table, declared at the
end of this module) each call one public method of :class:`MetadataChannel`:

- ``MetadataBuffers.__init__``: allocate it (CPU) as ``self.pd_proposal``;
- ``get_buf_infos``: append it at the very END of the lists (after ``kv_checksum``), so a
  peer without it still pairs every SGLang buffer with its own;
- ``set_buf(req)`` (prefill): write the row staged on ``req`` by the prefill wrapper
  (``req.pd_middleware_row``, a :class:`~pd_middleware.Payload`), or clear it;
- ``clear_slot(idx)``: clear the row (zero magic reads as "not sent");
- ``DecodeTransferQueue._commit_transfer_to_req`` (decode, every TP rank): after SGLang's
  own commit, the installation's proposal source (:class:`~.sources.InBandSource`)
  agrees on X across the ranks, reads the row and hands it to
  ``on_row(req, payload_or_fault)``, which runs the middleware pipeline and attaches the
  result to the Req. Never raises.

Layout handshake (Mooncake backend, :mod:`.registration`): the decode appends a trailing frame
``pd-middleware-row <layout>`` to its KV-args registration
(``MooncakeKVManager.build_receiver_registration_message``; inline before 0.5.23); SGLang's parser reads
fixed positions and ignores it (checked at scheduler start: :func:`~.startup.check_registration`
round-trips ``KVArgsRegisterInfo.from_zmq`` with the frame). The prefill's ``_validate_peer_state_layout`` (SGLang's
own per-session rejection hook, wrapped by the ``peer_check`` feature of :mod:`.draft_kv`) compares that layout and the aux buffer counts with
its own; a difference rejects the session, and every transfer to it then fails with a
reason that names both layouts (SGLang's ``conclude_failure``). Without the check a
larger prefill row would be written past the decode's buffer. A decode that has the
drop-in while its prefill has not sees zero rows: counted ``inband:not_sent`` and
logged once naming its own layout (exact one-hot for those requests).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from ...codecs.inband import (
    RowFault,
    RowLayout,
    RowOverflowError,
    clear_row,
    mark_overflow,
    read_row,
    row_digest,
    row_extent,
    write_row,
)
from ...core._errors import ConfigError
from ...core.events import Events
from ...core.payload import Payload
from .metadata_inline import host_only, wrap_free, wrap_queue_init
from .patching import (
    DECODE_QUEUE_MODULE,
    MOONCAKE_MODULE,
    UTILS_MODULE,
    Feature,
    Hook,
    Target,
    read,
    register_feature,
)
from .registration import (
    FRAME_MARK,
    LAYOUT_ATTR,
    PTR_SEP,
    wrap_from_zmq,
    wrap_register_kv_args,
    wrap_registration,
)

logger = logging.getLogger("pd_middleware.integrations.sglang")

#: Req attribute the prefill wrapper stages the row's payload under.
ROW_ATTR = "pd_middleware_row"
#: MetadataBuffers attribute of the proposal buffer (a torch uint8 (rows, capacity)).
BUFFER_ATTR = "pd_proposal"
#: Column of SGLang's 16-wide ``output_topk_index`` row that carries the proposal row's
#: binding tag. SGLang writes only the first ``topk * num_steps`` (<= 15) columns.
TAG_COLUMN = 15
#: A written row's tag is this bit plus its CRC-32; an unwritten row's tag is 0.
_TAG_WRITTEN = 1 << 32


def row_tag(row: np.ndarray) -> int:
    """The binding tag of a written row: it goes into the same SGLang buffer as X."""
    return _TAG_WRITTEN | row_digest(row)


class MetadataChannel:
    """One process's end of the in-band channel (either role, or both in a test).

    ``capacity_bytes``: bytes per row (:class:`~pd_middleware.codecs.inband.RowLayout`);
    ``on_row(req, payload_or_fault)``: decode callback after a transfer commits (the
    installation's proposer). The layout is bound to the engine's shapes with
    :meth:`bind` before SGLang allocates its buffers (the scheduler-init check does it).
    ``counts``: ``inband:<event>`` counters.
    """

    def __init__(self, capacity_bytes: int, on_row: Callable[[Any, Payload | RowFault], None] | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        self.on_row = on_row
        self.layout: RowLayout | None = None
        #: Addresses of this process's proposal buffers (the decode's own, at registration).
        self.row_ptrs: set[int] = set()
        self.events = Events("inband", logger=logger)
        self.counts: Counter[str] = self.events.counts

    # -- shapes ---------------------------------------------------------------------
    def bind(self, vocab_size: int, num_steps: int) -> RowLayout:
        """Fix V and S (both nodes must bind the same); returns the layout.

        Raises ConfigError when S leaves no spare ``output_topk_index`` column for the
        binding tag (S > 15).
        """
        if num_steps > TAG_COLUMN:
            raise ConfigError(
                f"the metadata channel carries at most {TAG_COLUMN} draft steps (SGLang's output_topk_index row "
                f"has 16 columns and one binds the proposal row), got {num_steps}",
                path="model.num_steps",
            )
        self.layout = RowLayout(self.capacity_bytes, vocab_size, num_steps)
        return self.layout

    def describe(self) -> str:
        """This node's layout for error messages (or its capacity while unbound)."""
        return (
            self.layout.describe() if self.layout is not None else f"capacity={self.capacity_bytes} (shapes not bound)"
        )

    def _count(self, event: str, detail: str = "") -> None:
        quiet = event in ("written", "read")
        self.events.count(f"inband:{event}", log=None if quiet else f"pd-middleware in-band {event}: {detail}")

    # -- buffers --------------------------------------------------------------------
    def rows(self, buffers: Any) -> np.ndarray | None:
        """The (rows, capacity) uint8 numpy view of ``buffers``' proposal buffer
        (None for buffers made before the drop-in was installed: SGLang's alone)."""
        arr: np.ndarray | None = buffers.__dict__.get("_pd_proposal_np")
        if arr is None:
            buf = buffers.__dict__.get(BUFFER_ATTR)
            if buf is None:
                return None
            arr = buf.numpy()
            buffers.__dict__["_pd_proposal_np"] = arr
        return arr

    def stage(self, req: Any, payload: Payload | None) -> None:
        """Prefill: the payload ``set_buf`` will write into ``req``'s row (None: no row)."""
        setattr(req, ROW_ATTR, payload)

    def write(self, buffers: Any, req: Any) -> None:
        """Prefill ``set_buf`` tail: write the staged row of ``req`` (or clear the row).

        Also writes the row's binding tag into the spare ``output_topk_index`` column of
        the same slot, next to X (0 when no row is written). Under TP, SGLang's transfer
        lets each aux buffer's last writer win buffer by buffer; the decode accepts a row
        only when the tag beside the X it verifies names that row, so X and q' always
        come from one prefill rank's one write. Never raises into SGLang.
        """
        rows = self.rows(buffers)
        if rows is None:
            return
        idx = req.metadata_buffer_index
        row = rows[idx]
        payload = getattr(req, ROW_ATTR, None)
        room = getattr(req, "bootstrap_room", None)
        tag = 0
        try:
            if payload is None or room is None or self.layout is None:
                clear_row(row)
            else:
                try:
                    write_row(row, int(room), payload, self.layout)
                    self._count("written")
                except RowOverflowError as exc:
                    mark_overflow(row, int(room), payload, self.layout)
                    self._count(
                        "overflow", f"{exc.needed} bytes > capacity {exc.capacity}; raise [sglang].capacity_bytes"
                    )
                tag = row_tag(row)
        except Exception as exc:
            clear_row(row)
            tag = 0
            self._count(f"write_failed:{type(exc).__name__}", str(exc))
        _set_tag(buffers, idx, tag)

    def read(self, buffers: Any, idx: int, req: Any) -> Payload | RowFault:
        """Decode: the row of metadata slot ``idx`` for ``req`` (a Payload or a RowFault)."""
        room = getattr(req, "bootstrap_room", None)
        if self.layout is None:
            return RowFault("layout", "the decode's layout is not bound (scheduler-init check did not run)")
        if room is None:
            return RowFault("not_sent", "request has no bootstrap room")
        rows = self.rows(buffers)
        if rows is None:
            return RowFault("not_sent", "these metadata buffers were made before the drop-in was installed")
        # One copy: the digest check and the decode read the same bytes even if a late
        # write lands in the buffer meanwhile (SGLang's TCP aux path writes from its own thread).
        # Only the bytes the prefill wrote (header + the length it declares), not the whole
        # capacity: a chain's row holds about 40% of an 80 KB capacity. A late write that
        # changes the length after it is read here leaves a snapshot that fails read_row's
        # length or digest check (a fault, never a wrong row).
        row = rows[idx][: row_extent(rows[idx])].copy()
        # The snapshot is this request's own: the payload's buffers may view it.
        got = read_row(row, int(room), self.layout, request_id=str(int(room)), copy=False)
        if not isinstance(got, RowFault):
            want, have = _committed_tag(req, buffers, idx), row_tag(row)
            if want != have:
                got = RowFault(
                    "binding",
                    f"the row's tag {have:#x} is not the one beside SGLang's X ({want:#x}): X and the row "
                    "come from different prefill writes",
                )
        if isinstance(got, RowFault):
            detail = got.detail
            if got.reason == "not_sent":
                detail = (
                    f"{detail}; this decode is {self.describe()}: the prefill runs without the drop-in, "
                    'or with [sglang].channel = "sidechannel"'
                )
            self._count(got.reason, detail)
        else:
            self._count("read")
        return got

    # -- what the wrappers (below) call -------------------------------------------------
    def allocate(self, buffers: Any) -> None:
        """``MetadataBuffers.__init__`` tail: allocate the proposal buffer (CPU) on ``buffers``.

        Raises ConfigError when SGLang keeps its metadata on a device (startup)."""
        import torch

        where = buffers.bootstrap_room.device
        if where.type != "cpu":
            # Our row is read with numpy on the scheduler thread; SGLang puts metadata
            # on a device only for NPU or a custom NVLink pool.
            raise ConfigError(
                f"SGLang keeps its PD metadata on {where}; the metadata channel needs CPU metadata "
                'buffers: use [sglang].channel = "sidechannel" on this deployment',
                path="sglang.channel",
            )
        rows = buffers.output_ids.shape[0]
        setattr(buffers, BUFFER_ATTR, torch.zeros((rows, self.capacity_bytes), dtype=torch.uint8))

    def append_info(self, buffers: Any, infos: Any) -> Any:
        """``get_buf_infos`` tail: our buffer at the very END of SGLang's three lists, so a
        peer without it still pairs every SGLang buffer with its own."""
        ptrs, data_lens, item_lens = infos
        buf = buffers.__dict__.get(BUFFER_ATTR)
        if buf is None:  # made before the drop-in was installed
            return ptrs, data_lens, item_lens
        self.row_ptrs.add(buf.data_ptr())
        return [*ptrs, buf.data_ptr()], [*data_lens, buf.nbytes], [*item_lens, buf[0].nbytes]

    def clear(self, buffers: Any, idx: int) -> None:
        """``clear_slot`` tail: clear the row (zero magic reads as "not sent")."""
        rows = self.rows(buffers)
        if rows is not None:
            clear_row(rows[idx])

    def commit(self, queue: Any, decode_req: Any, is_fake: Callable[[Any], bool] | None) -> None:
        """``_commit_transfer_to_req`` tail (decode, every rank): read the row, hand it to ``on_row``."""
        req = decode_req.req
        if getattr(req, "finished_reason", None) is not None or self.on_row is None:
            return  # SGLang aborted it (corruption, gate): nothing to attach
        if is_fake is not None and is_fake(req):
            return  # SGLang's warmup/fake transfer: no prefill wrote anything; the builder answers one-hot
        self.on_row(req, self.read(queue.metadata_buffers, decode_req.metadata_buffer_index, req))

    def registration_frame(self, row_ptr: int | None = None) -> bytes:
        """The trailing frame of the decode's registration (SGLang's parser reads fixed
        positions); ``row_ptr``: the proposal buffer's address where it rides this frame."""
        frame = FRAME_MARK + self.describe().encode("ascii")
        return frame if row_ptr is None else frame + PTR_SEP + str(int(row_ptr)).encode("ascii")

    def validate(self, manager: Any, info: Any) -> str | None:
        """Prefill ``_validate_peer_state_layout`` tail: why this decode session must be rejected.

        A decode without the drop-in (no layout frame, exactly our one buffer fewer) is
        served, not rejected: SGLang transfers the shorter list (its own buffers, paired
        by position, ours is last), so that decode verifies with SGLang's own exact
        one-hot proposal. Counted ``inband:peer_without_dropin`` and logged per session.
        """
        local, remote = len(manager.kv_args.aux_data_ptrs), len(info.dst_aux_ptrs)
        layout = getattr(info, LAYOUT_ATTR, None)
        if layout is None and remote == local - 1:
            self.events.count("inband:peer_without_dropin")
            logger.warning(
                "pd-middleware: decode session %s registered no proposal row (it runs without the drop-in, or "
                "with a decode-only config such as the default recompute): serving it with SGLang's own buffers "
                "only, so its requests verify with that decode's own proposal (SGLang's one-hot, or its "
                "recompute; exact either way); to ship this strategy, set the same PD_MIDDLEWARE_CONFIG on that "
                "decode (counted as inband:peer_without_dropin)",
                info.mooncake_session_id,
            )
            return None
        mismatch = self.peer_mismatch(local, remote, layout)
        if mismatch is not None:
            self._count("peer_rejected", mismatch)
            logger.error("pd-middleware: rejecting decode session %s: %s", info.mooncake_session_id, mismatch)
        return mismatch

    def peer_mismatch(self, local_aux: int, remote_aux: int, remote_layout: str | None) -> str | None:
        """Prefill, at a decode's registration: why the pair must not transfer, or None."""
        mine = self.describe()
        if remote_layout is None:
            return (
                f"pd-middleware proposal rows differ: this prefill appends one ({mine}), the decode registered "
                f"none ({remote_aux} metadata buffers vs {local_aux} here); run both nodes with the drop-in "
                'and [sglang].channel = "metadata", or neither'
            )
        if remote_layout != mine:
            return f"pd-middleware proposal rows differ: prefill {mine}, decode {remote_layout}; use one config on both nodes"
        if remote_aux != local_aux:
            return (
                f"metadata buffer count differs: prefill {local_aux}, decode {remote_aux} (both {mine}); an optional "
                "SGLang metadata buffer is enabled on one node only, so the proposal row would land in the wrong buffer"
            )
        return None


def _set_tag(buffers: Any, idx: int, tag: int) -> None:
    topk = getattr(buffers, "output_topk_index", None)
    if topk is not None and topk.shape[-1] > TAG_COLUMN:
        topk[idx, TAG_COLUMN] = tag


def _committed_tag(req: Any, buffers: Any, idx: int) -> int:
    """The tag beside the X SGLang committed to ``req`` (its cloned 16-wide row), else the slot's."""
    got = getattr(req, "output_topk_index", None)
    if got is None or getattr(got, "shape", (0,))[-1] <= TAG_COLUMN:
        got = getattr(buffers, "output_topk_index", None)
        if got is None or got.shape[-1] <= TAG_COLUMN:
            return -1
        got = got[idx]
    if getattr(got, "ndim", 0) == 1:
        # SGLang's rows are 1-D tensors: one list of 16 ints costs less than indexing
        # the tensor (a 0-d tensor per element, about 1.5 us on CPU).
        return int(got.tolist()[TAG_COLUMN])
    return int(got[TAG_COLUMN])


# --------------------------------------------------------------------- the feature


def wrap_metadata_init(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        inst.channel.allocate(self)  # startup: a non-CPU buffer is a ConfigError, on purpose

    return __init__


def wrap_buf_infos(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def get_buf_infos(self: Any) -> Any:
        return inst.channel.append_info(self, orig(self))

    return get_buf_infos


def wrap_set_buf(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def set_buf(self: Any, req: Any) -> Any:
        out = orig(self, req)
        try:
            inst.channel.write(self, req)
        except Exception as exc:
            inst.events.failed("set_buf", exc, "an unwritten row (the decode answers one-hot)")
        return out

    return set_buf


def wrap_clear_slot(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def clear_slot(self: Any, idx: int) -> Any:
        out = orig(self, idx)
        try:
            inst.channel.clear(self, idx)
        except Exception as exc:
            inst.events.failed("clear_slot", exc, "the row as it was (its room no longer matches)")
        return out

    return clear_slot


def wrap_commit(orig: Callable[..., Any], inst: Any) -> Callable[..., Any]:
    def _commit_transfer_to_req(self: Any, decode_req: Any) -> Any:
        out = orig(self, decode_req)
        # Every rank, for every committed request: the source's X agreement is a collective,
        # so it never returns early (``gloo_group``: SGLang's attention-TP CPU group, the one
        # its metadata gate uses).
        inst.source.on_commit(self, decode_req, getattr(self, "gloo_group", None))
        return out

    return _commit_transfer_to_req


#: SGLang's check that a request's transfer was a warmup's fake one (read at commit).
IS_FAKE_TRANSFER = f"{UTILS_MODULE}._is_fake_transfer"

register_feature(
    Feature(
        "metadata",
        (
            Target(UTILS_MODULE, "MetadataBuffers.__init__", None, Hook.AROUND, wrap_metadata_init),
            Target(UTILS_MODULE, "MetadataBuffers.get_buf_infos", ("self",), Hook.AROUND, wrap_buf_infos),
            Target(UTILS_MODULE, "MetadataBuffers.set_buf", ("self", "req"), Hook.AROUND, wrap_set_buf),
            # The slot reset: SGLang's own from 0.5.23, inline before (metadata_inline).
            Target(
                UTILS_MODULE,
                "MetadataBuffers.clear_slot",
                ("self", "idx"),
                Hook.AROUND,
                wrap_clear_slot,
                since="0.5.23",
            ),
            Target(
                DECODE_QUEUE_MODULE, "DecodeTransferQueue.__init__", None, Hook.AROUND, wrap_queue_init, until="0.5.22"
            ),
            Target(
                UTILS_MODULE,
                "ReqToMetadataIdxAllocator.free",
                ("self", "free_index"),
                Hook.AROUND,
                wrap_free,
                until="0.5.22",
            ),
            read(UTILS_MODULE, "_is_fake_transfer", ("req",), since="0.5.19"),
            read(UTILS_MODULE, "_is_fake_transfer", ("req", "server_args"), until="0.5.18", adapt=host_only),
            Target(
                DECODE_QUEUE_MODULE,
                "DecodeTransferQueue._commit_transfer_to_req",
                ("self", "decode_req"),
                Hook.AROUND,
                wrap_commit,
            ),
            # The registration's layout frame: SGLang's builder from 0.5.23, inline before.
            Target(
                MOONCAKE_MODULE,
                "MooncakeKVManager.build_receiver_registration_message",
                ("self",),
                Hook.AROUND,
                wrap_registration,
                since="0.5.23",
            ),
            Target(
                MOONCAKE_MODULE,
                "MooncakeKVReceiver._register_kv_args",
                ("self",),
                Hook.AROUND,
                wrap_register_kv_args,
                until="0.5.22",
            ),
            Target(MOONCAKE_MODULE, "KVArgsRegisterInfo.from_zmq", ("cls", "msg"), Hook.AROUND, wrap_from_zmq),
        ),
        lambda plan: "metadata" in plan.features,
        summary='the in-band row in SGLang\'s PD metadata buffers ([sglang].channel = "metadata")',
    )
)
