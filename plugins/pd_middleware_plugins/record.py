"""The ``record`` receive hook: appends every incoming payload to a trace file.

Decode side, after wire validation and before synthesis (``docs/workloads.md``). The
file is the ``pd-middleware-trace`` format of :mod:`pd_middleware.workloads.trace`, so
the ``trace`` workload can replay it offline. The file is opened on the first payload,
not when the hook is built (a config check must not create files), and closed by
:meth:`RecordHook.close`, which the pipeline calls at shutdown.

Cost per payload: one msgpack encode and one buffered write on the receiver thread.
The decode side has no target distribution, so records carry none.
"""

from __future__ import annotations

import threading
from typing import Literal

import msgspec

from pd_middleware import OptionValueError, Payload, PluginContext, PluginSpec, ReceiveContext
from pd_middleware.workloads.trace import TraceWriter


class RecordOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options of the ``record`` hook."""

    # Trace file to write (relative paths resolve against the working directory).
    path: str
    # Stop recording after this many payloads (0 = no limit); later payloads pass unrecorded.
    max_records: int = 0
    # "append" adds a segment to an existing file; "create" refuses an existing file.
    mode: Literal["append", "create"] = "append"

    def __post_init__(self) -> None:
        if not self.path:
            raise OptionValueError("path", "must name a trace file")
        if self.max_records < 0:
            raise OptionValueError("max_records", f"must be >= 0, got {self.max_records}")


class RecordHook:
    """Records payloads; never replaces them. ``recorded``/``skipped`` count what it did."""

    def __init__(self, options: RecordOptions, context: PluginContext) -> None:
        self.options = options
        self.meta = {
            "writer": "pd_middleware_plugins.record",
            "vocab_size": str(context.vocab_size),
            "num_steps": str(context.num_steps),
        }
        self._writer: TraceWriter | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.recorded = 0
        self.skipped = 0

    def on_receive(self, payload: Payload, context: ReceiveContext) -> None:
        limit = self.options.max_records
        # One lock around open and write, so a close() from another thread never races a write.
        with self._lock:
            if self._closed or (limit and self.recorded >= limit):
                self.skipped += 1
                return None
            if self._writer is None:
                self._writer = TraceWriter(self.options.path, meta=self.meta, mode=self.options.mode)
            self._writer.write(payload, arm=context.arm, peer=context.peer, received_at=context.received_at)
            self.recorded += 1
        return None

    def flush(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.flush()

    def close(self) -> None:
        """Finish the trace segment; later payloads are counted as skipped."""
        with self._lock:
            self._closed = True
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


PLUGIN = PluginSpec(
    name="record",
    kind="hook",
    factory=RecordHook,
    options=RecordOptions,
    summary="append every received payload to a pd-middleware-trace file (replay: workload 'trace')",
)
