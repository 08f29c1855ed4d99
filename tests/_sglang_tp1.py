"""SGLang's runtime at TP 1 in this process, for tests marked ``sglang`` that build SGLang's models.

SGLang's model classes read their parallel groups from its runtime context, so a test that
builds one needs a published context and a model-parallel group: here a one-rank gloo
group on 127.0.0.1, built by SGLang's own ``init_distributed_environment`` and
``initialize_model_parallel``.

A module holds it for its own span only (:func:`tp1`, a module-scoped fixture's ``with``):
on the way out SGLang's groups, its gloo world and its published context are taken down,
so the next module (whatever its order) starts from SGLang's pristine context. A module
that runs after one and finds a TP 1 context published fails when it overrides the
parallel sizes ("parallel topology is inconsistent").
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from _sglang_import import import_sglang


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for the gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_tp1() -> None:
    """Publish SGLang's runtime context (a CPU ``ServerArgs`` at TP 1, world rank 0) and
    build the one-rank gloo model-parallel group.

    Use it through :func:`tp1`, which takes it down again. Groups left in place by a caller
    that did not are dropped first and built again. The rotary embedding's constructor picks
    a vLLM kernel unless SGLang's CPU engine flag is set, and the CPU engine itself needs
    sgl-kernel's CPU build (not installable here): the flag of that one module is set, for
    the native rotary path.
    """
    rc = import_sglang("sglang.srt.runtime_context")
    ps = import_sglang("sglang.srt.distributed.parallel_state")
    from sglang.srt.server_args import ServerArgs

    def publish() -> None:
        rc.reset_context()
        sa = ServerArgs(model_path="dummy", device="cpu", tp_size=1)
        if hasattr(rc, "SpawnRanks"):  # 0.5.21 on: the spawn's ranks are published with it
            rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=0))
        else:  # up to 0.5.20 (tests/test_sglang_releases.py): the ranks come with the groups
            rc.publish(sa, role="scheduler")

    publish()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()  # drops the published ranks too
        publish()
    ps.init_distributed_environment(  # makes the gloo world once a process; publishes it to the context
        world_size=1,
        rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        local_rank=0,
        backend="gloo",
    )
    ps.initialize_model_parallel()
    rb = import_sglang("sglang.srt.layers.rotary_embedding.base")
    rb._is_cpu = True


def release_tp1() -> None:
    """Take down what :func:`init_tp1` built: the model-parallel groups, the one-rank gloo
    world, and SGLang's published runtime context (back to SGLang's pristine one)."""
    rc = import_sglang("sglang.srt.runtime_context")
    ps = import_sglang("sglang.srt.distributed.parallel_state")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.destroy_distributed_environment()  # one rank: nothing to wait for
    rc.reset_context()


@contextlib.contextmanager
def tp1() -> Iterator[None]:
    """:func:`init_tp1` for the span of the ``with``; afterwards :func:`release_tp1`, and the
    rotary module's CPU flag as it was."""
    rb = import_sglang("sglang.srt.layers.rotary_embedding.base")
    was_cpu = rb._is_cpu
    init_tp1()
    try:
        yield
    finally:
        release_tp1()
        rb._is_cpu = was_cpu
