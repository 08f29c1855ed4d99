"""SGLang's runtime at TP 1 in this process, for tests marked ``sglang`` that build SGLang's models.

SGLang's model classes read their parallel groups from its runtime context, so a test that
builds one needs a published context and a model-parallel group: here a one-rank gloo
group on 127.0.0.1, built by SGLang's own ``init_distributed_environment`` and
``initialize_model_parallel``.
"""

from __future__ import annotations

import socket

from _sglang_import import import_sglang


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for the gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_tp1() -> None:
    """Publish SGLang's runtime context (a CPU ``ServerArgs`` at TP 1, world rank 0) and
    build the one-rank gloo model-parallel group.

    Each test module calls it once. Groups an earlier module built were dropped from the
    context when it was reset, so they are built again (the gloo world is reused). The
    rotary embedding's constructor picks a vLLM kernel unless SGLang's CPU engine flag is
    set, and the CPU engine itself needs sgl-kernel's CPU build (not installable here): the
    flag of that one module is set, for the native rotary path.
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
