"""Harness: SGLang 0.5.23's own PD transfer, unpatched, between processes on this CPU machine.

Not a test module: ``tests/test_sglang_pd.py`` drives it. Each :class:`RankProcess` is one
OS process that holds ONE engine rank (one prefill or decode attention-TP rank), as a
real deployment does, because SGLang's runtime context (parallel ranks, config) is
process-global. Rank processes fork from multiprocessing's fork server, which imports
SGLang once (about 8 s of CPU); a rank can be re-configured for another topology
(:meth:`Deployment.configure`), so a test module pays that import once. The SGLang side
of a rank is ``_sglang_pd_rank.py``; the pd-middleware drop-in inside a rank,
``_sglang_pd_dropin.py``.

What is real: SGLang's ``ServerArgs``, runtime-context ``publish``, the shared Mooncake
``TransferEngine`` (TCP, loopback), ``MooncakeKVBootstrapServer``, ``MooncakeKVManager``
(PREFILL/DECODE), ``MooncakeKVSender``/``MooncakeKVReceiver``, ``MetadataBuffers`` with
``set_buf``/``get_buf``/``clear_slot``, the decode's ``poll_and_all_reduce`` metadata gate
(a real gloo all-reduce across the decode ranks) and ``DecodeTransferQueue.
_commit_transfer_to_req``.

Stand-ins, because the real thing needs a GPU or a model: the KV pool is plain CPU
tensors laid out like SGLang's MHA pool (K then V buffer per layer, one page per item)
or MLA pool (one buffer per layer); the request is a namespace with the fields
``set_buf`` and ``_commit_transfer_to_req`` read; the scheduler is a namespace with the
three attributes the commit reads. ``pp_group`` is overridden to None (the prefill
manager reads a pp group handle that only ``init_distributed_environment`` creates).
torchvision is answered by an import stand-in (see :func:`install_torchvision_stand_in`).

The protocol with a rank process: ``call(cmd, **kw)`` sends ``(cmd, kw)`` over a pipe
and waits, bounded, for ``("ok", result)`` or ``("err", traceback)``; ``submit`` and
``result`` split the two so several ranks can work at once (the decode ranks' gloo
all-reduce needs both of them polling).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
import types
from typing import Any

import msgspec
import torch

#: The setup DESIGN §8 measured: Mooncake over TCP on loopback, quiet logs.
ENV = {
    "MC_FORCE_TCP": "1",
    "MOONCAKE_PROTOCOL": "tcp",
    "SGLANG_HOST_IP": "127.0.0.1",
    "MC_LOG_LEVEL": "WARNING",
    # The decode ranks' gloo group (the metadata gate's all-reduce) on loopback only.
    "GLOO_SOCKET_IFNAME": "lo",
    # A lost peer fails a request in seconds, not SGLang's default minutes.
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20",
}

#: The longest any single command may take before the parent gives up on the child.
CALL_TIMEOUT_S = 60.0
#: A child with no command for this long exits on its own (its parent is gone).
IDLE_EXIT_S = 600.0


#: The KV pool's dtype: float32, so every transferred value compares exactly.
KV_DTYPE = torch.float32


class Shape(msgspec.Struct, frozen=True):
    """The stand-in pools of one topology (the same on every rank of both roles)."""

    mla: bool = False  # one latent buffer per layer, replicated over TP (else K and V per layer, heads split over TP)
    layers: int = 2  # MHA layers (2 buffers each); an MLA pool has 2 x layers latent layers
    heads: int = 4  # total KV heads (MHA); MLA has one latent "head"
    head_dim: int = 8  # elements per head per token
    page_size: int = 4  # tokens per page (one transfer item)
    pages: int = 24  # pages per pool, page 0 unused
    aux_rows: int = 8  # metadata rows (requests in flight)
    hidden: int = 16  # hidden size of the first-token hidden state row


def kv_pattern(room: int, n_pages: int, buf: int, head0: int, heads: int, shape: Shape) -> torch.Tensor:
    """The KV values request ``room`` carries in pool buffer ``buf``: ``(n_pages, page_size, heads, head_dim)``
    for global heads ``head0 .. head0+heads``. The same on every process (seeded by room and buffer)."""
    total = 1 if shape.mla else shape.heads
    g = torch.Generator().manual_seed(room * 1009 + buf)
    full = torch.randn((n_pages, shape.page_size, total, shape.head_dim), generator=g, dtype=KV_DTYPE)
    return full[:, :, head0 : head0 + heads]


def draft_q(seed: int, vocab: int) -> torch.Tensor:
    """The stand-in draft model's distribution of a prefill rank, float32 (1, V): peaked
    enough for sparse rows (``first["q_seed"]``; the same on every process)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3.0 * torch.randn((1, vocab), generator=g), dim=-1)


def unavailable() -> str | None:
    """Why the harness cannot run here (SGLang or Mooncake missing), or None."""
    for mod, hint in (("sglang", "make setup-sglang"), ("mooncake", "make setup (the Mooncake wheel)")):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed; run `{hint}`"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago (held together
    while picked, so two calls cannot hand out the same port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def install_torchvision_stand_in() -> None:
    """Answer ``import torchvision`` with empty modules when the real one is absent.

    Why: SGLang's model-config package imports torchvision at module level, and every
    reachable torchvision wheel links to CUDA and fails on CPU torch. Nothing on the PD
    transfer path calls it; the stand-in only answers imports (attribute reads return
    inert classes).
    """
    if "torchvision" in sys.modules:
        return
    if importlib.util.find_spec("torchvision") is not None:
        # The server tier's torchvision (requirements-server.txt) does not load its
        # CUDA-linked ops on CPU torch: the harness's override of that gap serves here too.
        from _sglang_import import install_torchvision_stand_in as skip_meta_registrations

        skip_meta_registrations()
        return

    def inert(name: str) -> type:
        return _Inert(name, (), {"__init__": lambda self, *a, **k: None, "__call__": _inert_call})

    class _Inert(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return inert(name)

        def __or__(cls, other):
            return cls

        __ror__ = __or__

        def __getitem__(cls, item):
            return cls

    def _inert_call(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else self

    class _Module(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            obj = inert(name)
            setattr(self, name, obj)
            return obj

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] == "torchvision":
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            return _Module(spec.name)

        def exec_module(self, module):
            module.__path__ = []
            module.__version__ = "0.0.0+stand-in"

    sys.meta_path.insert(0, _Finder())


# ------------------------------------------------------------------------- parent side


class RankError(RuntimeError):
    """A rank process failed a command; ``.remote`` holds the child's traceback."""

    def __init__(self, name: str, cmd: str, remote: str):
        super().__init__(f"{name}: {cmd} failed in the rank process:\n{remote}")
        self.name, self.cmd, self.remote = name, cmd, remote


class RankProcess:
    """One spawned process holding one SGLang engine rank; see the module docstring.

    ``role`` is ``"prefill"`` or ``"decode"``. ``gloo`` is ``(port, rank, world)`` for
    decode ranks that share a real gloo group (the metadata gate's all-reduce).
    """

    def __init__(self, name: str, role: str, *, gloo: tuple[int, int, int] | None = None):
        ctx = mp.get_context("forkserver")
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, args=(child, role, name, gloo, dict(ENV)), name=name, daemon=True)
        self._proc.start()
        child.close()
        self._pending: str | None = None
        self._broken: str | None = None

    def submit(self, cmd: str, **kw: Any) -> None:
        """Send one command without waiting for its result."""
        if self._broken is not None:
            # A late answer may still be in the pipe: nothing this process says can be trusted.
            raise RankError(self.name, cmd, f"not sent: the process is out of step since {self._broken}")
        assert self._pending is None, f"{self.name}: {self._pending} still pending"
        self._conn.send((cmd, kw))
        self._pending = cmd

    def result(self, timeout: float = CALL_TIMEOUT_S) -> Any:
        """The pending command's result; raises :class:`RankError` or TimeoutError."""
        cmd, self._pending = self._pending, None
        if not self._conn.poll(timeout):
            self._broken = f"{cmd} timed out"
            raise TimeoutError(
                f"{self.name}: {cmd} gave no answer within {timeout} s (exit code {self._proc.exitcode})"
            )
        try:
            status, value = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RankError(self.name, str(cmd), f"the process died (exit code {self._proc.exitcode})") from None
        if status != "ok":
            raise RankError(self.name, str(cmd), value)
        return value

    def call(self, cmd: str, ipc_timeout: float = CALL_TIMEOUT_S, **kw: Any) -> Any:
        """Run one command in the rank process and return its result (bounded by ``ipc_timeout``)."""
        self.submit(cmd, **kw)
        return self.result(ipc_timeout)

    def close(self) -> None:
        """Ask the process to exit; kill it if it does not within 5 s."""
        with contextlib.suppress(Exception):
            self._conn.send(None)
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()


def gather(
    ranks: list[RankProcess],
    cmd: str,
    per_rank: list[dict] | None = None,
    ipc_timeout: float = CALL_TIMEOUT_S,
    **kw: Any,
) -> list:
    """Run ``cmd`` on all ``ranks`` at once (``per_rank[i]`` adds rank i's own arguments).

    Every rank's answer is collected (within one shared deadline) before the first error
    is raised, so no rank is left with an unread answer.
    """
    for i, r in enumerate(ranks):
        r.submit(cmd, **kw, **(per_rank[i] if per_rank else {}))
    deadline = time.monotonic() + ipc_timeout
    results: list = []
    errors: list[Exception] = []
    for r in ranks:
        try:
            results.append(r.result(max(0.1, deadline - time.monotonic())))
        except (RankError, TimeoutError) as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return results


# -------------------------------------------------------------------------- child side


def _child_main(conn, role: str, name: str, gloo, env: dict) -> None:
    # The drop-in activates from PD_MIDDLEWARE_CONFIG; a rank starts without it
    # (Deployment.install activates it explicitly).
    for key in [k for k in os.environ if k.startswith("PD_MIDDLEWARE_")]:
        del os.environ[key]
    os.environ.update(env)
    install_torchvision_stand_in()
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(name)s: %(message)s")
    state = None
    try:
        from _sglang_pd_rank import Rank  # the SGLang-side code, imported only here

        state = Rank(role, name, gloo)
        conn.send(("ok", "ready"))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while conn.poll(IDLE_EXIT_S):
        msg = conn.recv()
        if msg is None:
            break
        cmd, kw = msg
        try:
            conn.send(("ok", getattr(state, "cmd_" + cmd)(**kw)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
    state.close()


def start(specs: list[tuple[str, str, tuple | None]], timeout: float = 120.0) -> list[RankProcess]:
    """Start rank processes ``(name, role, gloo)`` together and wait until all imported SGLang.

    They fork from multiprocessing's fork server, which imports SGLang once (preload), so
    N ranks cost one SGLang import, not N. No rank thread or engine exists before the fork.
    """
    mp.get_context("forkserver").set_forkserver_preload(["_sglang_pd_rank", "_sglang_pd_dropin"])
    procs = [RankProcess(n, r, gloo=g) for n, r, g in specs]
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p._pending = "start"
            p.result(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for p in procs:
            p.close()
        raise
    return procs


# ------------------------------------------------------------------------- deployments


class Deployment:
    """Up to two prefill ranks (P0, P1) and two decode ranks (D0, D1), one process each,
    reused across topologies: :meth:`configure` rebuilds every rank for a new one.

    The decode ranks share a real gloo group (SGLang's metadata gate all-reduces its
    polls over the decode attention-TP group), and so do the prefill ranks (the drop-in's
    per-batch agreement runs over the prefill's attention-TP CPU group). P0 hosts the
    bootstrap server, as the prefill node's launcher does.
    """

    def __init__(self, start_timeout: float = 300.0):
        gp, gd = free_ports(2)  # the prefill's and the decode's gloo stores
        self.ranks = start(
            [
                ("P0", "prefill", (gp, 0, 2)),
                ("P1", "prefill", (gp, 1, 2)),
                ("D0", "decode", (gd, 0, 2)),
                ("D1", "decode", (gd, 1, 2)),
            ],
            timeout=start_timeout,
        )
        self.P, self.D = self.ranks[:2], self.ranks[2:]
        self.prefill: list[RankProcess] = []
        self.decode: list[RankProcess] = []
        self._installed: tuple = (msgspec.json.encode(None), msgspec.json.encode(None), 0)

    def install(self, prefill: dict | None, decode: dict | None, vocab: int = 0) -> list[dict]:
        """Install the pd-middleware drop-in with config ``prefill`` on the prefill ranks and
        ``decode`` on the decode ranks (None: without it); effective from the next
        :meth:`configure`. A no-op when that is already installed."""
        key = (msgspec.json.encode(prefill, order="sorted"), msgspec.json.encode(decode, order="sorted"), vocab)
        if key == self._installed:
            return []
        out = gather(self.P, "install", config=prefill, vocab=vocab) + gather(
            self.D, "install", config=decode, vocab=vocab
        )
        self._installed = key
        return out

    def configure(
        self,
        prefill_tp: int,
        decode_tp: int,
        shape: Shape | None = None,
        *,
        prefill_args: dict | None = None,
        decode_args: dict | None = None,
    ) -> dict:
        """Rebuild the ranks as prefill TP ``prefill_tp`` -> decode TP ``decode_tp`` (1 or 2)."""
        self.shape = shape or Shape()
        self.prefill, self.decode = self.P[:prefill_tp], self.D[:decode_tp]
        port = free_port()
        common = dict(bootstrap_port=port, shape=msgspec.structs.asdict(self.shape))
        info = {
            "P0": self.P[0].call(
                "configure", tp_size=prefill_tp, tp_rank=0, serve_bootstrap=True, server_args=prefill_args, **common
            )
        }
        for r, p in enumerate(self.prefill[1:], 1):
            info[p.name] = p.call("configure", tp_size=prefill_tp, tp_rank=r, server_args=prefill_args, **common)
        per = [{"tp_rank": r} for r in range(decode_tp)]
        for p, got in zip(
            self.decode, gather(self.decode, "configure", per, tp_size=decode_tp, server_args=decode_args, **common)
        ):
            info[p.name] = got
        return info

    def transfer(
        self,
        room: int,
        *,
        n_pages: int = 3,
        first: dict | list[dict],
        send_kw: dict | None = None,
        wait_kw: dict | None = None,
    ) -> dict:
        """One request through SGLang's PD path: open on the prefill ranks, receivers and
        destinations from the decode ranks, ``set_buf`` and KV send on the prefill ranks,
        then the gated poll and commit on the decode ranks.

        ``first`` is the first-token row (one dict, or one per prefill rank). Returns
        ``{"prefill": [...], "decode": [...], "opened": [...], "seconds": ...}``.
        """
        firsts = first if isinstance(first, list) else [first] * len(self.prefill)
        t0 = time.perf_counter()
        gather(self.prefill, "open", room=room)
        opened = gather(self.decode, "recv_open", room=room, n_pages=n_pages)
        sent = gather(
            self.prefill, "send", [{"first": f} for f in firsts], room=room, n_pages=n_pages, **(send_kw or {})
        )
        got = gather(self.decode, "recv_wait", room=room, **(wait_kw or {}))
        return {"prefill": sent, "decode": got, "opened": opened, "seconds": time.perf_counter() - t0}

    def expected_kv(self, room: int, n_pages: int, decode_rank: int) -> list[torch.Tensor]:
        """The KV a decode rank must hold after ``room`` (its own heads of every buffer)."""
        s = self.shape
        heads = 1 if s.mla else s.heads // len(self.decode)
        head0 = 0 if s.mla else decode_rank * heads
        return [kv_pattern(room, n_pages, b, head0, heads, s) for b in range(2 * s.layers)]

    def fault(self, ranks: list[RankProcess], kind: str) -> None:
        """Inject a drop-in fault in ``ranks`` (``_sglang_pd_dropin.fault``); ``reset`` everywhere undoes all."""
        for r in ranks:
            r.call("fault", kind=kind)

    def close(self) -> None:
        """Stop every rank process (each is killed if it does not exit within 5 s)."""
        for r in self.ranks:
            r.close()
