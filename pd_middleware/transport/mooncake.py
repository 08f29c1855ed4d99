"""Mooncake transfer engine adapter: the only module that touches ``mooncake.engine``.

The engine's Python binding returns integer codes and never raises, and a few calls
kill the process instead of failing (DESIGN.md §5): any method before ``initialize``,
and ``transfer_check_status``/``get_batch_transfer_status`` with a batch id of 0 or one
already reaped (this adapter only ever calls the first). This adapter is the boundary where that is made safe:

- every non-zero code becomes :class:`~pd_middleware.TransferError` with ``.op``,
  ``.code`` and ``.peer``; code above this module never sees a return code;
- the wrapped engine exists only once ``initialize`` succeeded, and every method checks
  that the adapter is open, so no call can reach an uninitialised or closed engine;
- batch ids are tracked: 0 is refused at submit, and only live ids reach the status
  call, once;
- no write spins a core: each range is submitted asynchronously and its status polled
  with short sleeps (a sync write spins a core while it waits, which on a busy host is
  taken from the threads the transfer itself needs); :meth:`MooncakeEngine.write` blocks
  its caller that way, and :meth:`MooncakeEngine.submit` runs the same on one dedicated
  transfer thread owned by the adapter, for callers that must never block (an event
  loop); batch ids are polled only while live, never after the engine freed them;
- contiguous ranges are merged into one transfer (each batch entry costs ~20-40 us);
- ``send_probe`` runs before the first transfer to each peer, so a frozen peer fails
  in seconds rather than after the 60 s first-contact timeout.

Logs are quiet by default: ``MC_LOG_LEVEL`` (the engine's own setting, read when
``mooncake.engine`` is imported) is set if unset, and while an engine starts glog's
``FLAGS_minloglevel`` in the engine library is raised to FATAL, which hides the start-up
lines that are not problems (``E... Local segment descriptor not found``, "Logging before
InitGoogleLogging"); errors after start-up still print. ``MC_LOG_LEVEL=INFO``
(``pd-middleware --log-level debug``) shows everything. ``GLOG_minloglevel`` has no
effect: the engine overrides it from ``MC_LOG_LEVEL``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..core._errors import TransferAbandoned, TransferError
from .backoff import Backoff
from .config import MooncakeConfig

Range = tuple[int, int, int]
"""(local source address, remote destination address, length in bytes)."""

# Batch ids are addresses; a failed submit returns 0 or -1 seen as an unsigned 64-bit id.
_ID_LIMIT = 1 << 63


# What the engine's ``transfer_check_status(batch_id)`` returns (its Python binding):
# still running, done, failed, or given up on by the engine's own timeout.
_STATUS_PENDING = 0
_STATUS_COMPLETED = 1
_STATUS_FAILED = -1
_STATUS_TIMEOUT = -2

_STARTUP_LOCK = threading.Lock()
_GLOG_FATAL = 3


@contextlib.contextmanager
def _quiet_startup(level: str) -> Iterator[None]:
    """Raise glog's minimum level to FATAL while an engine starts, unless ``level`` is INFO.

    The flag lives in ``mooncake/engine.so`` (glog linked in); if a build does not export
    it the start-up lines simply stay. The lock keeps concurrent starts from restoring
    each other's value.
    """
    flag = None
    if level.upper() != "INFO":
        try:
            from mooncake import engine as engine_mod

            flag = ctypes.c_int.in_dll(ctypes.CDLL(engine_mod.__file__), "_ZN3fLI17FLAGS_minloglevelE")
        except (OSError, ValueError, AttributeError, TypeError):
            flag = None
    if flag is None:
        yield
        return
    with _STARTUP_LOCK:
        old = flag.value
        flag.value = max(old, _GLOG_FATAL)
        try:
            yield
        finally:
            flag.value = old


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

    def __init__(self, engine: Any, peer_name: str, *, write_timeout_s: float = 30.0) -> None:
        self._engine: Any = engine
        self.peer_name = peer_name
        self.write_timeout_s = write_timeout_s
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
        write_timeout_s: float = 30.0,
    ) -> MooncakeEngine:
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
        with _quiet_startup(os.environ["MC_LOG_LEVEL"]):
            engine = TransferEngine()
            rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_names)
        if rc != 0:
            raise TransferError(
                f"engine initialize({host!r}, P2PHANDSHAKE, {protocol!r}) failed", op="initialize", code=rc, peer=host
            )
        return cls(engine, f"{host}:{engine.get_rpc_port()}", write_timeout_s=write_timeout_s)

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

    def start_write(self, peer: str, ranges: Iterable[Range]) -> list[int]:
        """Merge ``ranges`` and submit one asynchronous write per merged range; do not wait.

        Returns the live batch ids, to be passed to :meth:`poll_write` (or
        :meth:`finish_write`) until they are done. A submit that fails raises
        :class:`TransferError` (op ``transfer_submit_write``) after reaping the ranges
        already submitted, so no id is left behind.
        """
        engine = self._live("transfer_submit_write", peer)
        self.probe(peer)
        live: list[int] = []
        for src, dst, n in merge_ranges(ranges):
            bid = engine.transfer_submit_write(peer, src, dst, n)
            if not 0 < bid < _ID_LIMIT:  # 0 (or -1 as an unsigned id): not submitted
                with self._lock:
                    self._live_batches.update(live)
                try:
                    self.finish_write(peer, live)
                except TransferError:
                    pass  # the submit failure below is the error to report
                self._probed.discard(peer)  # the peer may have restarted: probe before the next write
                raise TransferError(
                    f"write of {n} bytes was not submitted", op="transfer_submit_write", code=-1, peer=peer
                )
            live.append(bid)
        with self._lock:
            self._live_batches.update(live)
        return live

    def poll_write(self, peer: str, batch_ids: list[int]) -> tuple[list[int], TransferError | None]:
        """One non-blocking status pass over ``batch_ids`` from :meth:`start_write`.

        Returns the ids still running and the first failure seen (or None). The engine
        frees a batch once it reports completed or failed, so such ids are dropped from
        the live set here and never polled again; ids this adapter did not issue, or has
        already reaped, raise :class:`TransferError` instead of reaching the engine.
        """
        engine = self._live("transfer_check_status", peer)
        pending: list[int] = []
        error: TransferError | None = None
        live = self._live_batches
        results = []
        with self._lock:  # check and free under one lock: two pollers never race on an id
            for bid in batch_ids:  # all first: a bad id must not cost the good ones' results
                if bid not in live:
                    raise TransferError(
                        f"batch id {bid} is not live (0, stale or foreign)", op="transfer_check_status", peer=peer
                    )
            for bid in batch_ids:
                st = engine.transfer_check_status(bid)
                if st == _STATUS_PENDING:
                    pending.append(bid)
                else:
                    live.discard(bid)
                    results.append(st)
        for st in results:
            if st != _STATUS_COMPLETED and error is None:
                if st == _STATUS_TIMEOUT:  # the write may still land (TransferAbandoned)
                    error = TransferAbandoned(
                        "transfer timed out in the engine", op="transfer_check_status", code=st, peer=peer
                    )
                else:  # _STATUS_FAILED, or a code this adapter does not know: a failure either way
                    error = TransferError("transfer failed", op="transfer_check_status", code=st, peer=peer)
        if error is not None:
            self._probed.discard(peer)
        return pending, error

    def abandon(self, batch_ids: Iterable[int]) -> None:
        """Stop tracking ids that will never be polled again (a write given up on).

        The engine keeps their bookkeeping; what matters is that no later call can pass
        them to it once it may have freed them.
        """
        with self._lock:
            self._live_batches.difference_update(batch_ids)

    def finish_write(self, peer: str, batch_ids: list[int]) -> None:
        """Wait for ``batch_ids`` from :meth:`start_write`; raise the first failure.

        Sleeps between status polls rather than spinning: 20 us (about 70 us with the
        kernel's timer slack) for the first 2 ms (:mod:`.backoff`), so a write is seen done soon
        after it lands, then doubling up to 1 ms. Past ``write_timeout_s`` the remaining
        ids are abandoned and :class:`TransferAbandoned` (op ``transfer_check_status``) raised:
        those writes may still land, so their slot must not be written again.
        """
        error: TransferError | None = None
        backoff = Backoff()
        start = time.monotonic()
        while batch_ids:
            batch_ids, failed = self.poll_write(peer, batch_ids)
            error = error or failed
            if not batch_ids:
                break
            now = time.monotonic()
            if now - start > self.write_timeout_s:
                self.abandon(batch_ids)
                self._probed.discard(peer)
                raise TransferAbandoned(
                    f"{len(batch_ids)} transfer(s) not done within write_timeout_s={self.write_timeout_s:g}",
                    op="transfer_check_status",
                    peer=peer,
                )
            backoff.sleep()
        if error is not None:
            raise error

    def write(self, peer: str, ranges: Iterable[Range]) -> None:
        """Write ``ranges`` to ``peer`` and return when the bytes landed.

        Blocks the calling thread for the transfer, sleeping between status polls rather
        than spinning, so no thread hop is needed: call it from a worker thread (the
        prefill sender), never from an event loop (use :meth:`submit` there). Raises
        :class:`TransferError` with the failing op, its code and the peer.
        """
        ranges = list(ranges)
        try:
            self.finish_write(peer, self.start_write(peer, ranges))
        except TransferError as exc:
            total = sum(r[2] for r in ranges)
            cls = (
                TransferAbandoned if isinstance(exc, TransferAbandoned) else TransferError
            )  # the caller retires on the first
            raise cls(
                f"write of {total} bytes in {len(ranges)} range(s) failed: {exc}", op=exc.op, code=exc.code, peer=peer
            ) from None

    def submit(self, peer: str, ranges: Iterable[Range]) -> Future[None]:
        """:meth:`write` on the dedicated transfer thread, for callers that must never block.

        The future's ``result()`` raises the write's TransferError.
        """
        self._live("transfer_submit_write", peer)
        ranges = list(ranges)
        return self._pool.submit(self.write, peer, ranges)

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
        write_timeout_s=config.write_timeout_s,
    )
