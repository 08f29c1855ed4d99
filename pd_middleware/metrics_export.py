"""Getting :class:`~pd_middleware.core.metrics.Metrics` out of the process: an HTTP endpoint and
a copy into ``prometheus_client``'s multiprocess files.

- :class:`MetricsServer`: ``GET /metrics`` in the Prometheus text format, on a thread of
  its own (``[metrics] port``). It renders a snapshot per scrape; nothing runs per payload.
- :class:`MultiprocessMirror`: for engines that serve ``/metrics`` from another process
  through ``prometheus_client.multiprocess.MultiProcessCollector`` (SGLang with
  ``--enable-metrics``: its HTTP server reads every ``*.db`` file under
  ``PROMETHEUS_MULTIPROC_DIR``, which its scheduler processes write). A thread copies the
  counters' increments into this process's files every ``interval_s`` (and once more on
  stop), through ``prometheus_client.values.ValueClass``: the value type its own
  ``Counter``/``Histogram`` write through, which in multiprocess mode is the per-process
  mmap file. A ``Histogram`` object would cost an mmap write per observation on the hot
  path, and has no way to add a whole bucket's count at once.

Both need the optional extra ``prometheus`` (``prometheus_client``).
"""

from __future__ import annotations

import http.server
import logging
import threading
from typing import Any

from .core._errors import ConfigError, PluginError
from .core.metrics import PREFIX, Metrics

logger = logging.getLogger("pd_middleware.metrics")


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError(
            "exporting metrics needs prometheus_client: pip install 'pd-middleware[prometheus]'", path="metrics"
        ) from None
    return prometheus_client


class MetricsServer:
    """``GET /metrics`` for one :class:`Metrics`, on ``host:port`` (port 0: any free port).

    :meth:`start` binds (ConfigError naming ``metrics.port`` when it cannot) and serves
    on a daemon thread; :meth:`stop` closes the socket and joins the thread.
    """

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 0, prefix: str = PREFIX) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self.prefix = prefix
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://host:port/metrics`` of the bound socket (after :meth:`start`)."""
        if self._httpd is None:
            raise RuntimeError("the metrics server is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/metrics"

    def start(self) -> MetricsServer:
        pc = _prometheus()
        registry = pc.CollectorRegistry(auto_describe=False)
        self.metrics.register_prometheus(registry, self.prefix)
        content_type = pc.CONTENT_TYPE_LATEST

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                body = pc.generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("metrics endpoint: " + format, *args)

        try:
            httpd = http.server.ThreadingHTTPServer((self.host, self.port), Handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {self.host}:{self.port}: {exc}", path="metrics.port") from None
        httpd.daemon_threads = True
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, name="pd-middleware-metrics", daemon=True)
        self._thread.start()
        logger.info("pd-middleware metrics on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)


def serve(metrics: Metrics, config: Any) -> MetricsServer | None:
    """Start the endpoint a :class:`~pd_middleware.config.MetricsConfig` asks for, or None (no port)."""
    if config.port is None:
        return None
    return MetricsServer(metrics, config.host, config.port).start()


class MultiprocessMirror:
    """Copies :class:`Metrics` (or any object with its ``families(prefix)``) into
    ``prometheus_client``'s multiprocess files of this process.

    Needs ``PROMETHEUS_MULTIPROC_DIR`` set before ``prometheus_client`` was first
    imported in this process (PluginError otherwise: the values would go nowhere).
    Counters and histogram buckets only grow, so each sync writes the increase since the
    last one; a metric family that does not change costs no write.
    """

    def __init__(self, metrics: Metrics | Any, interval_s: float = 1.0, prefix: str = PREFIX) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        pc = _prometheus()
        from prometheus_client import values

        if not getattr(values.ValueClass, "_multiprocess", False):
            raise PluginError(
                "prometheus_client is not in multiprocess mode in this process (PROMETHEUS_MULTIPROC_DIR "
                "was not set when it was imported); the engine's /metrics would not see these counters",
                plugin="prometheus_client",
            )
        self._pc = pc
        self._value_class = values.ValueClass
        self.metrics = metrics
        self.interval_s = interval_s
        self.prefix = prefix
        # (family, sample name, label items) -> [value object, value written so far]
        self._written: dict[tuple[str, str, tuple[tuple[str, str], ...]], list[Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.syncs = 0

    def sync(self) -> int:
        """Write every increase since the last sync; returns how many values changed."""
        changed = 0
        with self._lock:
            for fam in self.metrics.families(self.prefix):
                for name, labels, value in _per_file_samples(fam):
                    key = (fam.name, name, labels)
                    slot = self._written.get(key)
                    if slot is None:
                        names = tuple(k for k, _ in labels)
                        vals = tuple(v for _, v in labels)
                        slot = self._written[key] = [
                            self._value_class(fam.type, fam.name, name, names, vals, fam.documentation),
                            0.0,
                        ]
                    delta = value - slot[1]
                    if delta:
                        slot[0].inc(delta)
                        slot[1] = value
                        changed += 1
            self.syncs += 1
        return changed

    def start(self) -> MultiprocessMirror:
        self.sync()
        self._thread = threading.Thread(target=self._run, name="pd-middleware-metrics-mirror", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        failed = False
        while not self._stop.wait(self.interval_s):
            try:
                self.sync()
            except Exception as exc:  # a failed copy must not end the thread: retried next interval
                if not failed:
                    failed = True
                    logger.error("pd-middleware: copying counters into the multiprocess files failed: %r", exc)

    def stop(self) -> None:
        """Stop the thread after one last sync (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.sync()


def _per_file_samples(fam: Any) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """A family's samples as the multiprocess files hold them.

    Counters as they are. Histograms per bucket, not cumulative (MultiProcessCollector
    adds the buckets up across processes and derives ``_count``), and no ``_count``.
    """
    out = []
    if fam.type != "histogram":
        for s in fam.samples:
            out.append((s.name, tuple(sorted(s.labels.items())), float(s.value)))
        return out
    last: dict[tuple[tuple[str, str], ...], float] = {}
    for s in fam.samples:  # buckets come in increasing le order per label set
        if s.name.endswith("_bucket"):
            base = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            prev = last.get(base, 0.0)
            last[base] = float(s.value)
            out.append((s.name, tuple(sorted(s.labels.items())), float(s.value) - prev))
        elif s.name.endswith("_sum"):
            out.append((s.name, tuple(sorted(s.labels.items())), float(s.value)))
    return out
