"""A real SGLang PD pair on this CPU machine: start, wait, talk to, stop.

:func:`start_pair` starts a prefill, a decode and ``sglang-router`` (PD mode) as
subprocesses on free loopback ports, each in its own process group, each writing one log
file; waits on ``/health`` with a deadline; and returns a :class:`Pair`.
:meth:`Pair.stop` (and :func:`stop`) always ends them by process group id.
:func:`start_server` starts one server (aggregated or one PD role) the same way.

What makes SGLang 0.5.23 run on a CPU without a GPU (docs/server.md):

- ``tests/server/site/`` goes first on ``PYTHONPATH`` of every server: its
  ``common_ops.py`` stands in for sgl-kernel's CPU ops (:mod:`sgl_cpu_ops`) and its
  ``sitecustomize.py`` overrides SGLang's CPU gaps at run time (:mod:`cpu_gaps`);
- ``SGLANG_USE_CPU_ENGINE=1``, ``TRITON_INTERPRET=1`` (rejection sampling runs on Triton's
  interpreter), ``MOONCAKE_PROTOCOL=tcp``;
- ``--device cpu --disable-cuda-graph --attention-backend intel_amx`` and a
  ``--max-total-tokens`` cap (the default KV pool takes 72% of RAM); on the prefill
  ``--disable-overlap-schedule``, on the decode ``--disaggregation-decode-retraction-backup
  cpu_tensor`` (the defaults call CUDA).

Beyond TP 1 (``tp=``, ``dp=`` on :func:`start_server` and :func:`start_pair`): ``--tp-size``
(and ``--dp-size``) with ``SGLANG_CPU_OMP_THREADS_BIND`` set to one core per rank, wrapping
round this machine's cores (``"0|1"`` for TP 2 on 2 cores; SGLang asserts when it is unset
and the ranks outnumber the NUMA nodes). Without sgl-kernel's AMX ops the binding is only
checked, never applied, and the all-reduce falls back to gloo (``parallel_state.py``
around 696). ``sleep_on_idle=True`` passes ``--sleep-on-idle``: an idle scheduler then
blocks on its sockets instead of polling.

Older SGLang releases (``release=`` on :func:`start_server` and :func:`start_pair`): the
release's folder (:func:`release_dir`, ``make setup-releases``) goes on ``PYTHONPATH``
right after ``tests/server/site``, ahead of the venv's SGLang 0.5.23, and
``PDM_TEST_SGLANG_RELEASE`` names it: the server's own processes check that the SGLang
they import is that release (:mod:`cpu_gaps`, which also picks the release's overrides)
and say so in the log, which :func:`wait_healthy` reads.

Every wait is bounded; every port is on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SITE = Path(__file__).resolve().parent / "site"
REPO = SITE.parents[2]
HOST = "127.0.0.1"
#: The folder holding one folder per older SGLang release (``make setup-releases``).
ENV_RELEASES = "PDM_SGLANG_RELEASES"
#: Seconds a server may take to answer /health (about 30 s each on 2 idle cores).
START_TIMEOUT_S = float(os.environ.get("PDM_SERVER_START_TIMEOUT_S", "300"))


#: SGLang's two PD transfer timeouts in the tier's servers, seconds (SGLang's default: 300).
TRANSFER_TIMEOUT_S = "60"

#: (server name, its log folder, seconds from its start to its first healthy answer), in
#: the order they became healthy: the tier's start-time table (conftest's terminal summary).
STARTS: list[tuple[str, str, float]] = []
#: (server name, its log folder, seconds from the stop's SIGTERM to its process group's end).
STOPS: list[tuple[str, str, float]] = []


class ServerFailed(RuntimeError):
    """A server exited or did not become healthy in time; ``.log`` holds its log's tail."""

    def __init__(self, message: str, *, name: str, log: str, returncode: int | None) -> None:
        super().__init__(f"{message}\n--- {name} log (tail) ---\n{log}")
        self.name = name
        self.log = log
        self.returncode = returncode


def _ephemeral_low() -> int:
    """The low end of the kernel's ephemeral port range (32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS = random.Random()


#: Where SGLang 0.5.23 picks the ports it binds later itself (``utils/network.py``
#: ``get_free_port_below_ephemeral``: nccl / dist-init ports, one more per TP server), and
#: the window above it that DP attention derives from a server's port (port + 233 + 0..7,
#: ``server_args.py`` ``ZMQ_TCP_PORT_DELTA``). The harness keeps out of it: a decode once
#: lost its HTTP port to another server's socket in that range ("address already in use").
SGLANG_PORT_RANGE = (22000, 29999 + 241)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range and outside
    the range where SGLang picks its own ports (:data:`SGLANG_PORT_RANGE`).

    A server binds its port tens of seconds after the harness chose it. A port from the
    ephemeral range can be handed, meanwhile, to any other socket the servers open (ZMQ,
    Mooncake, HTTP clients), and the server then fails with "address already in use"
    (seen in the tier). Ports below that range are given out only to explicit binds.
    Falls back to the kernel's choice after 64 busy tries.
    """
    low = _ephemeral_low()
    lo, hi = max(1024, low - 12000), low
    ranges = [(a, b) for a, b in ((lo, min(hi, SGLANG_PORT_RANGE[0])), (max(lo, SGLANG_PORT_RANGE[1]), hi)) if a < b]
    if not ranges:
        ranges = [(lo, hi)]
    sizes = [b - a for a, b in ranges]
    for _ in range(64):
        i = _PORTS.randrange(sum(sizes))
        for (a, _b), n in zip(ranges, sizes):
            if i < n:
                port = a + i
                break
            i -= n
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class Models:
    """The model directories a server loads (HF format): the target and one EAGLE draft."""

    target: Path
    draft: Path | None = None
    algorithm: str = "EAGLE3"


@dataclass
class Server:
    """One started process: ``name``, its URL, its ``Popen``, its log file."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int
    bootstrap_port: int | None = None
    #: ``time.monotonic()`` when the process was started, and seconds until it answered
    #: its health check (None until :func:`wait_healthy` saw it healthy).
    started_at: float = 0.0
    healthy_after_s: float | None = None
    #: The older SGLang release it runs (None: the venv's).
    release: str | None = None

    def log(self, tail: int = 20000) -> str:
        """The last ``tail`` characters of the log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return text[-tail:]

    def alive(self) -> bool:
        return self.proc.poll() is None


def releases_root() -> Path:
    """Where the older releases' folders are: ``PDM_SGLANG_RELEASES`` (relative to the repo
    root unless absolute), by default ``.venv-releases`` in the repo root."""
    root = Path(os.environ.get(ENV_RELEASES) or ".venv-releases")
    return root if root.is_absolute() else REPO / root


def release_dir(release: str) -> Path:
    """SGLang ``release``'s folder (``pip install --no-deps --target``; make setup-releases)."""
    return releases_root() / release


def server_env(
    config: str | os.PathLike[str] | None, extra: Mapping[str, str] | None = None, *, release: str | None = None
) -> dict[str, str]:
    """The environment of a test server: the CPU stand-ins, the drop-in when ``config`` is
    given, and SGLang ``release``'s folder ahead of the venv's SGLang when ``release`` is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PD_MIDDLEWARE_", "PDM_TEST_"))}
    first = [str(SITE)]
    if release is not None:
        folder = release_dir(release)
        if not (folder / "sglang").is_dir():
            raise FileNotFoundError(f"SGLang {release}: no release folder at {folder} (make setup-releases)")
        first.append(str(folder))
        env["PDM_TEST_SGLANG_RELEASE"] = release
    env["PYTHONPATH"] = os.pathsep.join([*first, str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        TRITON_INTERPRET="1",
        MOONCAKE_PROTOCOL="tcp",
        MC_FORCE_TCP="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        # A crashing SGLang server waits this long for CUDA coredumps before it exits
        # (tokenizer_manager.py, 60 s by default): there is no GPU here, nothing to dump.
        SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS="0",
        # ... and, with either dump on (both are, by default), first sleeps 5 s "to let GPU
        # activity settle": every stopped server (a SIGTERM ends its scheduler, which the
        # tokenizer manager takes for a crash) and every seed-crashed decode paid it.
        SGLANG_PYSPY_DUMP_BEFORE_CRASH="0",
        SGLANG_CUDA_COREDUMP_BEFORE_CRASH="0",
    )
    # A lost KV transfer fails its request with SGLang's own error in a minute, not after
    # SGLang's default 300 s (disaggregation/common/conn.py: _check_waiting_timeout on the
    # decode, _check_bootstrap_timeout; counted in sglang:num_transfer_failed_reqs_total).
    # A request of the tier waits seconds for its transfer; benchmarks/pd_stall.py measures
    # how often one is lost, with and without the drop-in.
    for key in ("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"):
        env.setdefault(key, TRANSFER_TIMEOUT_S)
    if config is not None:
        env["PD_MIDDLEWARE_CONFIG"] = str(config)
    if extra:
        env.update(extra)
    return env


def omp_threads_bind(ranks: int, cpus: Sequence[int] | None = None) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks: one core each, wrapping round ``cpus``
    (this process's affinity by default): ``"0|1"`` for 2 ranks on cores 0 and 1."""
    if cpus is None:
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = list(range(os.cpu_count() or 1))
    cpus = list(cpus) or [0]
    return "|".join(str(cpus[i % len(cpus)]) for i in range(ranks))


def parallel_args(tp: int = 1, dp: int = 1) -> tuple[list[str], dict[str, str]]:
    """The flags and environment of a server with ``tp`` TP ranks and ``dp`` DP replicas."""
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    args: list[str] = []
    env: dict[str, str] = {}
    if tp > 1:
        args += ["--tp-size", str(tp)]
    if dp > 1:
        args += ["--dp-size", str(dp)]
    if tp * dp > 1:
        # SGLang sizes the bind list by dp * tp * pp (its numa_index is the rank's gpu_id).
        env["SGLANG_CPU_OMP_THREADS_BIND"] = omp_threads_bind(tp * dp)
    return args, env


def spec_args(models: Models, *, rejection_sampling: bool = True, topk: int = 1) -> list[str]:
    """The speculative flags of a test server (EAGLE chain of 3 steps, top-k 1)."""
    if models.draft is None:
        return []
    args = [
        "--speculative-algorithm",
        models.algorithm,
        "--speculative-draft-model-path",
        str(models.draft),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-steps",
        "3",
        "--speculative-num-draft-tokens",
        "4",
    ]
    if rejection_sampling:
        args.append("--speculative-use-rejection-sampling")
    return args


def start_server(
    name: str,
    models: Models,
    log_dir: Path,
    *,
    role: str = "null",
    config: str | os.PathLike[str] | None = None,
    extra_args: Sequence[str] = (),
    env_extra: Mapping[str, str] | None = None,
    rejection_sampling: bool = True,
    topk: int = 1,
    max_total_tokens: int = 8192,
    wait: bool = True,
    tp: int = 1,
    dp: int = 1,
    sleep_on_idle: bool = False,
    port: int | None = None,
    bootstrap_port: int | None = None,
    release: str | None = None,
) -> Server:
    """Start one SGLang server (``role``: ``null`` aggregated, ``prefill`` or ``decode``).

    ``release``: an older SGLang release's folder ahead of the venv's SGLang (:func:`server_env`).

    ``port``/``bootstrap_port``: bind these (a restart in place of a stopped server) instead
    of free ones.

    ``tp``/``dp``: ``--tp-size``/``--dp-size`` with one core per rank
    (``SGLANG_CPU_OMP_THREADS_BIND``; a value in ``env_extra`` wins). ``sleep_on_idle``:
    ``--sleep-on-idle``.

    Raises :class:`ServerFailed` (with its log) when it exits or is not healthy within
    ``START_TIMEOUT_S``; the process is stopped first.
    """
    par_args, par_env = parallel_args(tp, dp)
    port = free_port() if port is None else port
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(models.target),
        "--device",
        "cpu",
        "--host",
        HOST,
        "--port",
        str(port),
        "--disable-cuda-graph",
        "--attention-backend",
        "intel_amx",
        "--max-total-tokens",
        str(max_total_tokens),
        "--max-running-requests",
        "8",
        "--skip-server-warmup",
        *spec_args(models, rejection_sampling=rejection_sampling, topk=topk),
        *par_args,
    ]
    if sleep_on_idle:
        cmd.append("--sleep-on-idle")
    if release is not None:
        # Up to 0.5.22 SGLang takes its torch.distributed port from the kernel's ephemeral
        # range at start and binds it tens of seconds later; another server's ZMQ or
        # Mooncake socket took it once (EADDRINUSE at init_process_group, a 0.5.21 decode
        # of six started together). One from free_port(), below that range, instead.
        cmd += ["--nccl-port", str(free_port())]
    boot = None
    if role != "null":
        cmd += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "mooncake"]
    if role == "prefill":
        boot = free_port() if bootstrap_port is None else bootstrap_port
        cmd += ["--disaggregation-bootstrap-port", str(boot), "--disable-overlap-schedule"]
    elif role == "decode":
        cmd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    cmd += list(extra_args)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        started_at = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=server_env(config, {**par_env, **(env_extra or {})}, release=release),
            start_new_session=True,
        )
    srv = Server(name, f"http://{HOST}:{port}", proc, log_path, port, boot, started_at, release=release)
    if wait:
        wait_healthy(srv)
    return srv


def start_router(pair_prefill: Server, pair_decode: Server, log_dir: Path, *, wait: bool = True) -> Server:
    """Start ``sglang-router`` in PD mode in front of one prefill and one decode."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--prefill",
        pair_prefill.url,
        str(pair_prefill.bootstrap_port),
        "--decode",
        pair_decode.url,
        "--host",
        HOST,
        "--port",
        str(port),
        # Its Prometheus exporter binds a fixed port by default: two routers would collide.
        "--prometheus-host",
        HOST,
        "--prometheus-port",
        str(free_port()),
    ]
    log_path = log_dir / "router.log"
    with open(log_path, "wb") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        started_at = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(None), start_new_session=True)
    srv = Server("router", f"http://{HOST}:{port}", proc, log_path, port, started_at=started_at)
    if wait:
        wait_healthy(srv, path="/readiness")
    return srv


def wait_healthy(srv: Server, timeout_s: float = START_TIMEOUT_S, path: str = "/health") -> None:
    """Poll ``GET <path>`` every 0.5 s until 200, the process exits, or ``timeout_s`` passes.

    The router answers ``/health`` at once but serves only once it registered its workers
    (about 15 s): it is waited on at ``/readiness``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not srv.alive():
            rc = srv.proc.returncode
            raise ServerFailed(
                f"{srv.name} exited with code {rc} before it was healthy", name=srv.name, log=srv.log(), returncode=rc
            )
        try:
            with urllib.request.urlopen(srv.url + path, timeout=5) as r:
                if r.status == 200:
                    if srv.release is not None and f"[cpu-gaps] SGLang {srv.release}" not in srv.log(10**8):
                        stop(srv)
                        raise ServerFailed(
                            f"{srv.name} is healthy but never said it runs SGLang {srv.release}",
                            name=srv.name,
                            log=srv.log(),
                            returncode=None,
                        )
                    if srv.healthy_after_s is None and srv.started_at:
                        srv.healthy_after_s = time.monotonic() - srv.started_at
                        STARTS.append((srv.name, str(srv.log_path.parent.name), srv.healthy_after_s))
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    stop(srv)
    raise ServerFailed(
        f"{srv.name} not healthy within {timeout_s:.0f} s", name=srv.name, log=srv.log(), returncode=None
    )


def wait_exit(srv: Server, timeout_s: float = START_TIMEOUT_S) -> int:
    """Wait (bounded) for a server that must stop by itself; returns its exit code."""
    try:
        return srv.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(srv)
        raise ServerFailed(
            f"{srv.name} still running after {timeout_s:.0f} s", name=srv.name, log=srv.log(), returncode=None
        ) from None


@contextlib.contextmanager
def interpreters(
    script: str, envs: Mapping[str, Mapping[str, str]], args: Sequence[str] = ()
) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """``python -c script *args`` in one fresh interpreter per key of ``envs`` (its
    environment, e.g. :func:`server_env` of a release), all started at once (each is an
    import of SGLang's modules: together they take the time of the slowest, not the sum);
    yields the processes by key (read them with ``communicate(timeout=...)``). Every one still
    running when the block ends is killed."""
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for key, env in envs.items():
            procs[key] = subprocess.Popen(
                [sys.executable, "-c", script, *args],
                env=dict(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def stop(srv: Server, grace_s: float = 15.0) -> None:
    """End the server's process group by id: SIGTERM, then SIGKILL after ``grace_s``."""
    stop_all([srv], grace_s)


def start_together(starts: Mapping[str, Callable[[], T]]) -> tuple[dict[str, T], BaseException | None]:
    """Run every start at once, one thread each (a set of servers starts in the time of its
    slowest, not the sum): what started, by key, and the first error (None: all started).
    The caller stops what started when there is an error."""
    out: dict[str, T] = {}
    errors: list[BaseException] = []

    def run(key: str) -> None:
        try:
            out[key] = starts[key]()
        except BaseException as exc:  # handed back; the caller stops the others
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in starts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, (errors[0] if errors else None)


def stop_all(servers: Sequence[Server], grace_s: float = 15.0) -> None:
    """End every server's process group at once: SIGTERM to all, then SIGKILL to those still
    alive ``grace_s`` later (a pair stops in the time of its slowest server, not the sum).
    Each stop's time goes to :data:`STOPS`."""
    t0 = time.monotonic()
    live = [s for s in servers if s.proc.poll() is None or _group_alive(s.proc.pid)]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for srv in live:
            try:
                os.killpg(srv.proc.pid, sig)
            except OSError:  # gone already, or not ours to signal: the wait below tells
                pass
        deadline = time.monotonic() + wait_s
        left = list(live)
        while left and time.monotonic() < deadline:
            for srv in list(left):
                if srv.proc.poll() is not None and not _group_alive(srv.proc.pid):
                    left.remove(srv)
                    STOPS.append((srv.name, str(srv.log_path.parent.name), time.monotonic() - t0))
            if left:
                time.sleep(0.2)
        live = left
        if not live:
            return
    for srv in live:  # still alive after SIGKILL: say so in the table and on stderr
        STOPS.append((f"{srv.name} (NOT stopped)", str(srv.log_path.parent.name), time.monotonic() - t0))
        print(f"harness: {srv.name} (process group {srv.proc.pid}) survived SIGKILL", file=sys.stderr)


def group_cpu_seconds(srv: Server) -> float:
    """CPU seconds (user + system, all threads) used so far by the live processes of the
    server's process group (its scheduler ranks, detokenizer, ...): sample it twice and
    divide the difference by the wall time for the group's CPU use in cores."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # Fields after "(comm)": state ppid pgrp session tty tpgid flags minflt cminflt
        # majflt cmajflt utime stime ...
        rest = stat.rpartition(")")[2].split()
        if len(rest) > 12 and int(rest[2]) == srv.proc.pid:
            total += int(rest[11]) + int(rest[12])
    return total / tick


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Pair:
    """A running PD pair behind a router. ``servers``: everything started, in start order."""

    prefill: Server
    decode: Server
    router: Server | None
    servers: list[Server] = field(default_factory=list)

    def stop(self) -> None:
        stop_all(list(reversed(self.servers)))

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ({s.log_path}) ---\n{s.log()}" for s in self.servers)


def start_pair(
    models: Models,
    log_dir: Path,
    *,
    prefill_config: str | os.PathLike[str] | None = None,
    decode_config: str | os.PathLike[str] | None = None,
    prefill_env: Mapping[str, str] | None = None,
    decode_env: Mapping[str, str] | None = None,
    router: bool = True,
    max_total_tokens: int = 8192,
    extra_args: Sequence[str] = (),
    tp: int = 1,
    prefill_tp: int | None = None,
    decode_tp: int | None = None,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    sleep_on_idle: bool = False,
    release: str | None = None,
) -> Pair:
    """Prefill, decode (started together) and, with ``router``, the router; all healthy, or ServerFailed.

    ``release``: both nodes run that older SGLang release (:func:`start_server`).

    ``tp`` is both nodes' TP size unless ``prefill_tp``/``decode_tp`` say otherwise;
    ``prefill_args``/``decode_args`` go to one node after ``extra_args``;
    ``sleep_on_idle`` passes ``--sleep-on-idle`` to both.

    On failure every process started so far is stopped before the error propagates.
    """
    started: list[Server] = []
    try:
        p = start_server(
            "prefill",
            models,
            log_dir,
            role="prefill",
            config=prefill_config,
            env_extra=prefill_env,
            max_total_tokens=max_total_tokens,
            extra_args=[*extra_args, *prefill_args],
            wait=False,
            tp=tp if prefill_tp is None else prefill_tp,
            sleep_on_idle=sleep_on_idle,
            release=release,
        )
        started.append(p)
        d = start_server(
            "decode",
            models,
            log_dir,
            role="decode",
            config=decode_config,
            env_extra=decode_env,
            max_total_tokens=max_total_tokens,
            extra_args=[*extra_args, *decode_args],
            wait=False,
            tp=tp if decode_tp is None else decode_tp,
            sleep_on_idle=sleep_on_idle,
            release=release,
        )
        started.append(d)
        wait_healthy(p)
        wait_healthy(d)
        r = None
        if router:
            r = start_router(p, d, log_dir, wait=False)
            started.append(r)
            wait_healthy(r, path="/readiness")
        return Pair(p, d, r, started)
    except BaseException:
        for s in reversed(started):
            stop(s)
        raise


# ---- requests ---------------------------------------------------------------------------


def post_json(url: str, body: Mapping[str, Any], timeout_s: float = 300.0) -> tuple[int, Any]:
    """POST JSON; returns (status, decoded body or text); status 0 when no HTTP answer came. Never raises."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        # No HTTP answer at all (the server died, the connection was reset, or the wait ran out).
        return 0, f"{type(exc).__name__}: {exc}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def post_pd(
    prefill: Server, decode: Server, body: Mapping[str, Any], room: int, timeout_s: float = 120.0
) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """One PD request without a router: ``body`` to the prefill and the decode at once, with
    the bootstrap fields the router would add (the prefill's host and bootstrap port, the
    ``room``); returns both answers (:func:`post_json`'s)."""
    full = {**body, "bootstrap_host": HOST, "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
    out: dict[str, tuple[int, Any]] = {}

    def send(name: str, srv: Server) -> None:
        out[name] = post_json(srv.url + "/generate", full, timeout_s=timeout_s)

    threads = [threading.Thread(target=send, args=(n, s), daemon=True) for n, s in (("p", prefill), ("d", decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    return out.get("p", (0, "no answer")), out.get("d", (0, "no answer"))


def overlapped(srv: Server) -> bool:
    """Whether ``srv`` runs SGLang's overlap scheduler: the ``disable_overlap_schedule`` of
    the ``server_args`` its log prints at start, the value SGLang resolved (on the CPU its
    own refusal sets it True for speculative decoding unless ``cpu_gaps``' ``overlap_spec_cpu``
    is on). Raises AssertionError when the log has no such line."""
    # A dict's repr from 0.5.19 on ('disable_overlap_schedule': False), ServerArgs' on 0.5.18
    # (disable_overlap_schedule=False).
    found = re.findall(r"\bdisable_overlap_schedule'?(?:: |=)(True|False)", srv.log(10**8))
    assert found, f"{srv.name}: no server_args line with disable_overlap_schedule in its log"
    return found[0] == "False"


def get_text(url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return str(r.read().decode())


def metric_values(text: str, name: str) -> dict[str, float]:
    """Samples of metric ``name`` in a Prometheus text exposition: ``{labels: value}`` (labels raw)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, labels = head.partition("{")
        if metric != name:
            continue
        out[labels.rstrip("}")] = out.get(labels.rstrip("}"), 0.0) + float(value)
    return out


def server_config(src: Path, dst: Path) -> Path:
    """A shipped config for these servers: its ``[model]`` shape table (``model:`` mapping in
    YAML) dropped (V and S come from the engine)."""
    if src.suffix in (".yaml", ".yml"):
        import yaml

        doc = yaml.safe_load(src.read_text())
        doc.pop("model", None)
        dst.write_text(yaml.safe_dump(doc, sort_keys=False))
        return dst
    kept: list[str] = []
    skipping = False
    for line in src.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = stripped == "[model]"
        if not skipping:
            kept.append(line)
    dst.write_text("\n".join(kept) + "\n")
    return dst
