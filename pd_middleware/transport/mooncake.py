"""Mooncake transfer engine adapter: the only module that touches ``mooncake.engine``.

The engine's Python binding returns integer codes and never raises, and a few calls
kill the process instead of failing (DESIGN.md §5): any method before ``initialize``,
and ``get_batch_transfer_status``/``transfer_check_status`` with a batch id of 0 or one
already reaped. This adapter is the boundary where that is made safe:

- every non-zero code becomes :class:`~pd_middleware.TransferError` with ``.op``,
  ``.code`` and ``.peer``; code above this module never sees a return code;
- the wrapped engine exists only once ``initialize`` succeeded, and every method checks
  that the adapter is open, so no call can reach an uninitialised or closed engine;
- batch ids are tracked: 0 is refused at submit, and only live ids reach the status
  call, once;
- synchronous writes (which spin a core while they wait) run on one dedicated thread
  owned by the adapter, never on the caller's event loop;
- contiguous ranges are merged into one transfer (each batch entry costs ~20-40 us);
- ``send_probe`` runs before the first transfer to each peer, so a frozen peer fails
  in seconds rather than after the 60 s first-contact timeout.

Logs are quiet by default: ``MC_LOG_LEVEL`` is set (if unset) before the first engine
starts. ``GLOG_minloglevel`` was tried and does not silence the engine's own logger;
one "Logging before InitGoogleLogging" line and a few ``E`` lines at startup remain.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Sequence

from .._errors import TransferError
from .config import MooncakeConfig

Range = tuple[int, int, int]
"""(local source address, remote destination address, length in bytes)."""


def buffer_address(buf: Any) -> int:
    """Address of a writable buffer (bytearray, mmap, writable memoryview)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def merge_ranges(ranges: Iterable[Range]) -> list[Range]:
    """Merge ranges contiguous in both source and destination into single transfers."""
    out: list[Range] = []
    for src, dst, n in sorted(ranges, key=lambda r: r[1]):
        if n <= 0:
            continue
        if out:
            ps, pd, pn = out[-1]
            if ps + pn == src and pd + pn == dst:
                out[-1] = (ps, pd, pn + n)
                continue
        out.append((src, dst, n))
    return out


class MooncakeEngine:
    """A started Mooncake ``TransferEngine`` behind a safe, typed interface.

    Build one with :meth:`open` (or :func:`open_engine` from config); the constructor
    only wraps an engine that is already initialised.
    """

    def __init__(self, engine: Any, peer_name: str) -> None:
        self._engine: Any = engine
        self.peer_name = peer_name
        self._regions: dict[int, tuple[int, Any]] = {}
        self._probed: set[str] = set()
        self._live_batches: set[int] = set()
        self._lock = threading.Lock()
        # max_workers=1: the one dedicated transfer thread (started lazily on first use).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake-xfer")

    @classmethod
    def open(
        cls,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_names: str = "",
        *,
        force_tcp: bool = True,
        log_level: str = "WARNING",
    ) -> "MooncakeEngine":
        """Start and initialise an engine with P2PHANDSHAKE (no metadata server).

        ``protocol`` ``"tcp"`` or ``"rdma"`` with ``device_names`` (``"mlx5_0,mlx5_1"``);
        ``force_tcp`` sets ``MC_FORCE_TCP=1`` (process-wide, before the engine starts).
        Raises :class:`TransferError` (op ``initialize``) on failure.
        """
        os.environ.setdefault("MC_LOG_LEVEL", log_level)
        if force_tcp:
            os.environ["MC_FORCE_TCP"] = "1"
        try:
            from mooncake.engine import TransferEngine  # lazy: optional dependency
        except ImportError as exc:
            raise TransferError(f"mooncake.engine is not importable: {exc}", op="import", peer=host) from None
        engine = TransferEngine()
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_names)
        if rc != 0:
            raise TransferError(f"engine initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed", op="initialize", code=rc, peer=host)
        return cls(engine, f"{host}:{engine.get_rpc_port()}")

    # -- guards -----------------------------------------------------------------

    def _live(self, op: str, peer: str | None = None) -> Any:
        engine = self._engine
        if engine is None:
            raise TransferError("engine is closed", op=op, peer=peer)
        return engine

    @property
    def closed(self) -> bool:
        return self._engine is None

    # -- memory -----------------------------------------------------------------

    def register(self, buf: Any) -> int:
        """Register a writable buffer; returns its address. Keeps ``buf`` alive until unregistered."""
        mv = memoryview(buf)
        if mv.readonly:
            raise TransferError("cannot register a read-only buffer", op="register_memory")
        return self.register_ptr(buffer_address(buf), mv.nbytes, keep=buf)

    def register_ptr(self, addr: int, nbytes: int, keep: Any = None) -> int:
        """Register ``nbytes`` at raw address ``addr`` (e.g. a device tensor's ``data_ptr()``)."""
        engine = self._live("register_memory")
        rc = engine.register_memory(addr, nbytes)
        if rc != 0:
            raise TransferError(f"could not register {nbytes} bytes at {addr:#x}", op="register_memory", code=rc)
        self._regions[addr] = (nbytes, keep)
        return addr

    def unregister(self, addr: int) -> None:
        """Unregister memory registered at ``addr``."""
        engine = self._live("unregister_memory")
        if addr not in self._regions:
            raise TransferError(f"address {addr:#x} is not registered", op="unregister_memory")
        rc = engine.unregister_memory(addr)
        del self._regions[addr]
        if rc != 0:
            raise TransferError(f"could not unregister {addr:#x}", op="unregister_memory", code=rc)

    # -- transfers --------------------------------------------------------------

    def probe(self, peer: str, *, force: bool = False) -> None:
        """``send_probe`` to ``peer`` (once per peer unless ``force``)."""
        if peer in self._probed and not force:
            return
        engine = self._live("send_probe", peer)
        rc = engine.send_probe(peer)
        if rc != 0:
            raise TransferError("peer did not answer the probe", op="send_probe", code=rc, peer=peer)
        self._probed.add(peer)

    def _write_now(self, peer: str, ranges: Sequence[Range]) -> None:
        engine = self._live("transfer_sync_write", peer)
        self.probe(peer)
        if len(ranges) == 1:
            src, dst, n = ranges[0]
            rc = engine.transfer_sync_write(peer, src, dst, n)
            op = "transfer_sync_write"
        else:
            rc = engine.batch_transfer_sync_write(
                peer, [r[0] for r in ranges], [r[1] for r in ranges], [r[2] for r in ranges]
            )
            op = "batch_transfer_sync_write"
        if rc != 0:
            total = sum(r[2] for r in ranges)
            # The peer may have restarted: probe again before the next write.
            self._probed.discard(peer)
            raise TransferError(f"write of {total} bytes in {len(ranges)} range(s) failed", op=op, code=rc, peer=peer)

    def submit(self, peer: str, ranges: Iterable[Range]) -> "Future[None]":
        """Merge ``ranges`` and write them to ``peer`` on the dedicated transfer thread."""
        self._live("transfer_sync_write", peer)
        merged = merge_ranges(ranges)
        return self._pool.submit(self._write_now, peer, merged)

    def write(self, peer: str, ranges: Iterable[Range], timeout: float | None = None) -> None:
        """Blocking :meth:`submit`: returns when the bytes landed, or raises TransferError."""
        fut = self.submit(peer, ranges)
        try:
            fut.result(timeout)
        except TimeoutError:
            raise TransferError(f"write did not finish within {timeout} s", op="transfer_sync_write", peer=peer) from None

    def write_async(self, peer: str, ranges: Iterable[Range]) -> int:
        """Start an async batch write; returns a batch id for :meth:`wait_batch`."""
        engine = self._live("batch_transfer_async_write", peer)
        self.probe(peer)
        merged = merge_ranges(ranges)
        bid = engine.batch_transfer_async_write(
            peer, [r[0] for r in merged], [r[1] for r in merged], [r[2] for r in merged]
        )
        if not bid:  # 0 means failure; passing it on would crash the process
            raise TransferError("async write was not submitted", op="batch_transfer_async_write", code=0, peer=peer)
        with self._lock:
            self._live_batches.add(bid)
        return bid

    def wait_batch(self, batch_id: int) -> None:
        """Wait for a batch from :meth:`write_async`, on the transfer thread.

        Only ids this adapter issued and has not reaped reach the engine (a 0 or stale
        id would segfault it); anything else raises :class:`TransferError`.
        """
        with self._lock:
            if batch_id not in self._live_batches:
                raise TransferError(f"batch id {batch_id} is not live (0, stale or foreign)", op="get_batch_transfer_status")
            self._live_batches.discard(batch_id)
        engine = self._live("get_batch_transfer_status")
        rc = self._pool.submit(engine.get_batch_transfer_status, [batch_id]).result()
        if rc != 0:
            raise TransferError(f"batch {batch_id} failed", op="get_batch_transfer_status", code=rc)

    def close(self) -> None:
        """Unregister every region and drop the engine; later calls raise TransferError."""
        if self._engine is None:
            return
        self._pool.shutdown(wait=True)
        for addr in list(self._regions):
            try:
                self.unregister(addr)
            except TransferError:
                pass  # best effort on shutdown: the engine goes away with the process
        self._engine = None


def open_engine(config: MooncakeConfig) -> MooncakeEngine:
    """Open an engine as ``transport.mooncake`` configures it."""
    return MooncakeEngine.open(
        config.host,
        config.protocol,
        config.device_names,
        force_tcp=config.force_tcp,
        log_level=config.log_level,
    )
