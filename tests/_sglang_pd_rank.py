"""The SGLang side of the PD harness: one engine rank, run inside a rank process.

Imported only by ``tests/_sglang_pd.py``'s child processes (it imports SGLang). Every
``cmd_*`` method is one command of the parent's protocol; results are plain Python
values (lists, ints, bytes) so they cross the pipe cheaply. See ``_sglang_pd.py`` for
what is real and what stands in.
"""

from __future__ import annotations

import datetime
import socket
import time
from types import SimpleNamespace
from typing import Any

import _sglang_pd
import msgspec
import numpy as np
import torch
import torch.distributed as dist
import zmq
from _sglang_pd import KV_DTYPE, Shape, kv_pattern

_sglang_pd.install_torchvision_stand_in()  # before the first SGLang import

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
from sglang.srt.disaggregation.mooncake.conn import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    poll_and_all_reduce,
)
from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
    maybe_init_shared_mooncake_transfer_engine,
)
from sglang.srt.environ import envs
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

POLL_S = 0.001  # between polls of a sender/receiver: SGLang's own loops poll per scheduler step


class Rank:
    """One prefill or decode attention-TP rank; configured per topology by ``cmd_configure``."""

    def __init__(self, role: str, name: str, gloo: tuple[int, int, int] | None):
        # The fork server imported SGLang, and with it CommonKVReceiver's class-level zmq
        # context; a zmq context belongs to the process that made it, so each rank takes
        # a fresh one, as its own import would have given it.
        CommonKVReceiver._ctx = zmq.Context()
        CommonKVReceiver._ctx.set(zmq.MAX_SOCKETS, envs.SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS.get())
        CommonKVReceiver._socket_cache, CommonKVReceiver._socket_locks = {}, {}
        self.role, self.name = role, name
        self.mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
        self.mgr: MooncakeKVManager | None = None
        self.retired: list = []  # managers and servers of earlier topologies (kept alive, see close)
        self.senders: dict[int, MooncakeKVSender] = {}
        self.pending: dict[int, DecodeRequest] = {}
        self.groups: dict[int, Any] = {}
        if gloo is not None:
            port, rank, world = gloo
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=60),
            )
            # One group per TP width of this role: {1: this rank alone, world: every rank}.
            singles = [dist.new_group([r], backend="gloo") for r in range(world)]
            self.groups = {1: singles[rank], world: dist.group.WORLD}
        # Hooks the drop-in installs (tests/_sglang_pd_dropin.py).
        self.make_req = make_req
        self.prepare_req = None  # prefill: (req, first) -> None, before set_buf
        self.fresh_engine = False  # the next configure allocates anew on a new engine
        self.committed: dict[int, Any] = {}  # decode: committed requests, by room, for cmd_build
        self.vocab = 0

    # ----------------------------------------------------------------- topology

    def cmd_configure(
        self,
        *,
        tp_size: int,
        tp_rank: int,
        bootstrap_port: int,
        shape: dict,
        serve_bootstrap: bool = False,
        server_args: dict | None = None,
    ) -> dict:
        """Build this rank for a topology: runtime context, engine, pools, metadata, manager."""
        shape = Shape(**shape)
        if self.mgr is not None:
            # Mooncake caches a peer's registered regions at first contact, so every
            # topology must register exactly the same memory: the pools and the metadata
            # buffers are allocated once per process, and the old manager gives its
            # registrations back before the new one takes them.
            self.mgr.deregister_buffer_to_engine()
            self.retired.append(self.mgr)
            assert msgspec.structs.replace(shape, mla=False) == msgspec.structs.replace(self.shape, mla=False), (
                "only Shape.mla may change between topologies"
            )
        self.senders.clear()
        self.pending.clear()
        self.shape = s = shape
        self.tp_size, self.tp_rank = tp_size, tp_rank
        sa = ServerArgs(
            model_path="dummy",
            device="cpu",
            tp_size=tp_size,
            disaggregation_mode=self.role,
            disaggregation_transfer_backend="mooncake",
            disaggregation_bootstrap_port=bootstrap_port,
            **(server_args or {}),
        )
        reset_context()
        publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank))
        # The prefill manager reads pp_group; only init_distributed_environment makes one.
        get_parallel().override_permanently(pp_group=None)
        if serve_bootstrap:
            self.retired.append(MooncakeKVBootstrapServer(host="127.0.0.1", port=bootstrap_port))
            _wait_listening(bootstrap_port, 10.0)  # its thread binds asynchronously
        self.bootstrap_addr = f"127.0.0.1:{bootstrap_port}"
        if self.fresh_engine:
            # The drop-in changes the aux list, so the memory changes: a new engine has a
            # new session name, which no peer has cached regions for.
            mte._mooncake_transfer_engine = None
            self.__dict__.pop("arena", None)
            self.fresh_engine = False
        if not hasattr(self, "arena"):
            # 2 x layers flat buffers, each big enough for every head (TP 1, MHA).
            self.arena = [
                torch.zeros(s.pages * s.page_size * s.heads * s.head_dim, dtype=KV_DTYPE) for _ in range(2 * s.layers)
            ]
            self.meta = self.make_metadata(s)
        maybe_init_shared_mooncake_transfer_engine(gpu_id=0)  # a no-op while one exists
        self.meta.bootstrap_room.zero_()
        heads = 1 if s.mla else s.heads // tp_size
        # K then V per layer (MHA), or one latent buffer per layer (MLA, which then has
        # 2 x layers layers, so both register the same regions); one item = one page.
        n_bufs = 2 * s.layers
        self.kv = [
            a[: s.pages * s.page_size * heads * s.head_dim].view(s.pages * s.page_size, heads, s.head_dim)
            for a in self.arena[:n_bufs]
        ]
        self.heads = heads
        self.meta_alloc = ReqToMetadataIdxAllocator(s.aux_rows)
        self.free_pages = list(range(1, s.pages))  # page 0 stays unused, like SGLang's padding slot
        args = KVArgs()
        args.engine_rank = tp_rank
        args.pp_rank = 0
        args.system_dp_rank = 0
        args.rust_http_port = None
        args.kv_cache_dtype_str = "float32"
        args.kv_layout = None
        args.prefill_start_layer = 0
        args.prefill_end_layer = n_bufs if s.mla else s.layers
        args.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        args.kv_data_lens = [a.nbytes for a in self.arena[:n_bufs]]  # the same regions in every topology
        args.kv_item_lens = [t[0].nbytes * s.page_size for t in self.kv]
        args.num_draft_entries = 0
        args.kv_layer_ids = []  # positional pairing, as for SGLang's plain MHA/MLA pools
        args.kv_head_num = heads
        args.total_kv_head_num = 1 if s.mla else s.heads
        args.page_size = s.page_size
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.aux_buf_infos()
        args.ib_device = None
        args.gpu_id = 0
        # What setup_state_kv_args sets for a pool without extra state.
        args.state_types, args.state_data_ptrs, args.state_data_lens, args.state_item_lens = [], [], [], []
        args.state_dim_per_tensor, args.state_slice_outer_counts, args.state_layer_ids = [], [], []
        args.state_conv_shard_groups = []
        args.is_hybrid_mla_backend = False
        args.swa_kv_cache_layout = None
        args.mla_compression_ratios = None
        self.mgr = MooncakeKVManager(args, self.mode, sa, is_mla_backend=s.mla)
        self.queue = self._transfer_queue()
        return {
            "rank_port": self.mgr.rank_port,
            "aux_item_lens": list(args.aux_item_lens),
            "session": self.mgr.get_session_id(),
        }

    def make_metadata(self, s: Shape) -> MetadataBuffers:
        """SGLang's real MetadataBuffers (patched by the drop-in when it is installed)."""
        return MetadataBuffers(s.aux_rows, s.hidden, torch.float32, 16)

    def aux_buf_infos(self) -> tuple[list, list, list]:
        """The aux list both nodes register (the drop-in appends its proposal buffer)."""
        return self.meta.get_buf_infos()

    def _transfer_queue(self) -> DecodeTransferQueue | None:
        """A real DecodeTransferQueue with only what ``_commit_transfer_to_req`` reads."""
        if self.role != "decode":
            return None
        q = DecodeTransferQueue.__new__(DecodeTransferQueue)
        q.metadata_buffers = self.meta
        q.req_to_metadata_buffer_idx_allocator = self.meta_alloc
        q.spec_algorithm = SpeculativeAlgorithm.EAGLE
        q.tp_rank = self.tp_rank
        q.gloo_group = self.groups.get(self.tp_size)
        q.scheduler = SimpleNamespace(
            kv_checksum_computer=None,
            batch_result_processor=SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, token: None),
        )
        return q

    # ----------------------------------------------------------------- prefill

    def cmd_open(self, *, room: int) -> str:
        """Prefill: a request arrives; SGLang's sender registers the room (Bootstrapping)."""
        self.senders[room] = MooncakeKVSender(self.mgr, self.bootstrap_addr, room)
        return _poll_name(self.senders[room].poll())

    def cmd_send(self, *, room: int, n_pages: int, first: dict, timeout: float = 20.0) -> dict:
        """Prefill: wait for the decode's metadata, write the aux row with ``set_buf``, send KV.

        ``first`` holds the first-token fields (``token``, ``topk_p``, ``topk_index``,
        ``hidden`` as lists). Returns the final status, the failure reason if any, the
        decode targets SGLang resolved for this room (endpoint, port, dummy, aux index)
        and the seconds spent waiting for the decode and transferring.
        """
        sender = self.senders.pop(room)
        t0 = time.perf_counter()
        status = _wait(sender.poll, (KVPoll.WaitingForInput, KVPoll.Failed), timeout)
        t1 = time.perf_counter()
        targets = [
            {
                "endpoint": f"{i.endpoint}:{i.dst_port}",
                "dummy": bool(i.is_dummy),
                "aux_index": None if i.is_dummy else int(i.dst_aux_index),
            }
            for i in self.mgr.transfer_infos.get(room, {}).values()
        ]
        if status != KVPoll.WaitingForInput:
            return {"status": _poll_name(status), "reason": self.mgr.failure_records.get(room), "targets": targets}
        idx = self.meta_alloc.alloc()
        pages = np.asarray(self._take_pages(n_pages), dtype=np.int32)
        try:
            self._fill_kv(room, pages)
            req = self.make_req(room=room, idx=idx, first=first, side="prefill")
            if self.prepare_req is not None:
                self.prepare_req(req, first)
            self.meta.set_buf(req)
            row = self.aux_row(idx)
            t2 = time.perf_counter()
            sender.init(len(pages), idx)
            sender.send(pages)
            status = _wait(sender.poll, (KVPoll.Success, KVPoll.Failed), timeout)
            t3 = time.perf_counter()
            return {
                "status": _poll_name(status),
                "reason": self.mgr.failure_records.get(room),
                "targets": targets,
                "wait_s": t1 - t0,
                "send_s": t3 - t1,  # fill the KV, write the row (set_buf), transfer
                "transfer_s": t3 - t2,  # SGLang's send() until the sender polls Success
                "row": row,
                "x": int(req.output_topk_index[0]),
            }
        finally:
            sender.clear()
            self.meta_alloc.free(idx)
            self.free_pages.extend(int(p) for p in pages)

    def cmd_drop(self, *, room: int) -> None:
        """Prefill: forget a request that will not be sent (a negative control)."""
        self.senders.pop(room).clear()

    def _take_pages(self, n: int) -> list[int]:
        assert len(self.free_pages) >= n, f"{self.name}: {n} pages asked, {len(self.free_pages)} free"
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    def _fill_kv(self, room: int, pages: np.ndarray) -> None:
        """Write the pattern of ``room`` (this rank's heads) into the source pages."""
        s = self.shape
        head0 = 0 if s.mla else self.tp_rank * self.heads
        for b, buf in enumerate(self.kv):
            want = kv_pattern(room, len(pages), b, head0, self.heads, s)
            view = buf.view(s.pages, s.page_size, self.heads, s.head_dim)
            view[torch.as_tensor(pages, dtype=torch.long)] = want

    # ----------------------------------------------------------------- decode

    def cmd_recv_open(self, *, room: int, n_pages: int, timeout: float = 20.0) -> dict:
        """Decode: learn the prefill's topology, open a receiver and send the destination."""
        deadline = time.monotonic() + timeout
        while not self.mgr.try_ensure_parallel_info(self.bootstrap_addr):
            assert time.monotonic() < deadline, f"{self.name}: the prefill never registered at {self.bootstrap_addr}"
            time.sleep(0.05)
        receiver = MooncakeKVReceiver(mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=room)
        req = self.make_req(room=room, idx=-1, first=None, side="decode")
        dreq = DecodeRequest(req=req, kv_receiver=receiver)
        receiver.init(0)
        pages = np.asarray(self._take_pages(n_pages), dtype=np.int32)
        dreq.metadata_buffer_index = self.meta_alloc.alloc()
        req.metadata_buffer_index = dreq.metadata_buffer_index
        dreq.pages = pages
        self.kv_zero(pages)
        receiver.send_metadata(pages, dreq.metadata_buffer_index, None)
        self.pending[room] = dreq
        return {
            "aux_index": dreq.metadata_buffer_index,
            "pages": pages.tolist(),
            "is_dummy": [bool(i["is_dummy"]) for i in receiver.bootstrap_infos or []],
        }

    def kv_zero(self, pages: np.ndarray) -> None:
        for buf in self.kv:
            buf.view(self.shape.pages, self.shape.page_size, self.heads, self.shape.head_dim)[
                torch.as_tensor(pages, dtype=torch.long)
            ] = 0

    def cmd_recv_wait(
        self, *, room: int, timeout: float = 20.0, before_commit: str | None = None, hook_kw: dict | None = None
    ) -> dict:
        """Decode: poll through SGLang's metadata gate (all-reduced over the decode TP group),
        then commit with the real ``_commit_transfer_to_req``. Returns what the request got."""
        dreq = self.pending.pop(room)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        polls = 0
        while True:
            # Every decode rank runs this loop the same number of times: the all-reduce
            # (MIN) hands all of them the same value, so none leaves early.
            expired = int(time.monotonic() > deadline)
            (poll,) = poll_and_all_reduce(
                [dreq.kv_receiver], self.queue.gloo_group, decode_reqs=[dreq], metadata_buffers=self.meta
            )
            polls += 1
            if poll in (KVPoll.Success, KVPoll.Failed) or _any_rank(expired, self.queue.gloo_group):
                break
            time.sleep(POLL_S)
        wait_s = time.perf_counter() - t0
        idx = dreq.metadata_buffer_index
        out: dict[str, Any] = {"status": _poll_name(poll), "polls": polls, "wait_s": wait_s, "aux_index": idx}
        out["reason"] = self.mgr.failure_records.get(room)
        out["row"] = self.aux_row(idx)
        out["row_room"] = int(self.meta.bootstrap_room[idx, 0])
        out["kv"] = self.read_kv(dreq.pages)
        try:
            if poll == KVPoll.Success:
                if before_commit:
                    getattr(self, before_commit)(room=room, idx=idx, dreq=dreq, **(hook_kw or {}))
                self.queue._commit_transfer_to_req(dreq)
                out["req"] = self.req_view(dreq.req)
                self.committed[room] = dreq.req
            else:
                dreq.kv_receiver.clear()
        finally:
            self.meta.clear_slot(idx)
            self.meta_alloc.free(idx)
            self.free_pages.extend(int(p) for p in dreq.pages)
        return out

    def aux_row(self, idx: int) -> list[bytes]:
        """Row ``idx`` of every registered aux buffer, as raw bytes."""
        ptrs, _, item_lens = self.aux_buf_infos()
        import ctypes

        return [ctypes.string_at(p + n * idx, n) for p, n in zip(ptrs, item_lens)]

    def read_kv(self, pages: np.ndarray) -> list:
        s = self.shape
        return [
            buf.view(s.pages, s.page_size, self.heads, s.head_dim)[torch.as_tensor(pages, dtype=torch.long)].clone()
            for buf in self.kv
        ]

    def req_view(self, req) -> dict:
        """What the commit handed the request (the fields SGLang's draft builder reads)."""
        return {
            "output_ids": list(req.output_ids),
            "output_topk_p": req.output_topk_p.clone(),
            "output_topk_index": req.output_topk_index.clone(),
            "hidden_states_tensor": req.hidden_states_tensor.clone(),
            "aborted": repr(getattr(req, "finished_reason", None))
            if getattr(req, "finished_reason", None) is not None
            else None,
            "attached": getattr(getattr(req, "pd_middleware", None), "reason", None),
        }

    def cmd_install(self, *, config: dict | None, vocab: int) -> dict:
        """Install the pd-middleware drop-in for ``config`` (None: uninstall); see _sglang_pd_dropin."""
        import _sglang_pd_dropin

        return _sglang_pd_dropin.install(self, config, vocab)

    def cmd_build(self, *, rooms: list[int]) -> dict:
        """Decode: SGLang's draft-input builder over committed requests (drop-in active)."""
        import _sglang_pd_dropin

        return _sglang_pd_dropin.build(self, rooms)

    def cmd_fault(self, *, kind: str) -> None:
        """Inject a drop-in fault in this rank (see _sglang_pd_dropin.fault)."""
        import _sglang_pd_dropin

        _sglang_pd_dropin.fault(self, kind)

    def cmd_counters(self) -> dict:
        """The drop-in's counters in this rank ({} without it)."""
        import _sglang_pd_dropin

        return _sglang_pd_dropin.counters()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def make_req(*, room: int, idx: int, first: dict | None, side: str) -> SimpleNamespace:
    """The fields of SGLang's ``Req`` that ``set_buf`` (prefill) and the commit (decode) read."""
    req = SimpleNamespace(
        rid=f"req-{room}",
        bootstrap_room=room,
        bootstrap_host="127.0.0.1",
        metadata_buffer_index=idx,
        origin_input_ids=[1, 2, 3],  # with output_ids: the draw's position (prefill.draw_position)
        output_ids=[],
        cached_tokens=0,
        cached_tokens_device=0,
        cached_tokens_host=0,
        cached_tokens_storage=0,
        return_logprob=False,
        return_sampling_mask=False,
        hidden_states_tensor=None,
        output_topk_p=None,
        output_topk_index=None,
        output_dsa_topk_indices=None,
        pd_rebootstrap_forced_output_id=None,
        time_stats=SimpleNamespace(set_wait_queue_entry_time=lambda: None),
        get_mm_token_counts=lambda: (0, 0, 0),
    )
    if first is not None:
        req.output_ids = [first["token"]]
        req.cached_tokens = first.get("cached", 0)
        req.output_topk_p = torch.tensor(first.get("topk_p", [0.0]), dtype=torch.float32)
        req.output_topk_index = torch.tensor(first.get("topk_index", [0]), dtype=torch.int64)
        req.hidden_states_tensor = torch.tensor(first["hidden"], dtype=torch.float32)
    return req


_POLL_NAMES = {v: k for k, v in vars(KVPoll).items() if isinstance(v, int)}


def _poll_name(status) -> str:
    """KVPoll's name for a status (KVPoll is a class of ints, not an enum)."""
    return _POLL_NAMES.get(int(status), str(status))


def _wait(poll, done: tuple, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        status = poll()
        if status in done or time.monotonic() > deadline:
            return status
        time.sleep(POLL_S)


def _wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on 127.0.0.1:{port} after {timeout} s"
            time.sleep(0.02)


def _any_rank(flag: int, group) -> bool:
    if group is None or dist.get_world_size(group) == 1:
        return bool(flag)
    t = torch.tensor([flag], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
