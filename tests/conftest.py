"""Shared fixtures for the whole suite (helpers that are not fixtures: tests/_helpers.py)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import zmq

# ---- the `wheel` tier ----


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``wheel`` (a fresh venv, pip and its index, minutes) run only when a
    ``-m`` expression names the marker (``make test-wheel``); the default suite skips them."""
    if "wheel" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="the wheel tier: run `make test-wheel` (pytest -m wheel)")
    for item in items:
        if "wheel" in item.keywords:
            item.add_marker(skip)


# ---- transport fixtures ----


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A fresh ZMQ context per test; destroyed with linger 0, which closes whatever a failed
    test left open, so a failure never hangs in ``term()``."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(scope="session")
def mooncake_pair() -> Iterator[tuple[object, object]]:
    """Two real Mooncake engines (TCP, loopback) shared by the session: (decode, prefill)."""
    os.environ.setdefault("MC_FORCE_TCP", "1")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from pd_middleware.transport import MooncakeEngine

    decode, prefill = MooncakeEngine.open(), MooncakeEngine.open()
    yield decode, prefill
    decode.close()
    prefill.close()


# ---- sglang fixtures ----


@pytest.fixture(scope="session")
def sglang_importable() -> bool:
    """Make SGLang's speculative and disaggregation modules importable on this CPU tier
    (tests/_sglang_import.py: the torchvision stand-in and why)."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed; run `make setup-sglang` (requirements-sglang.txt)")
    from _sglang_import import import_sglang  # tests/ is on sys.path (no __init__.py)

    for name in (
        "sglang.srt.speculative.eagle_disaggregation",
        "sglang.srt.disaggregation.utils",
        "sglang.srt.disaggregation.decode",
        "sglang.srt.disaggregation.mooncake.conn",
    ):
        import_sglang(name)
    return True


@pytest.fixture(scope="module")
def sglang_context(sglang_importable: bool) -> Iterator[None]:
    """SGLang's runtime context as SGLang starts (nothing published) for a module's span, and
    again after it: a module that overrides the context's server args or parallel sizes
    (``get_context().override_server_args``) starts from the same context whatever ran
    before it, and leaves none behind. Modules that build SGLang's models publish their own
    (``tests/_sglang_tp1.py: tp1``)."""
    from _sglang_import import import_sglang

    rc = import_sglang("sglang.srt.runtime_context")
    rc.reset_context()
    yield
    rc.reset_context()


@pytest.fixture
def sglang_uninstall() -> Iterator[None]:
    """Undo whatever SGLang installation a test made (tests of the drop-in use it for every test)."""
    yield
    from pd_middleware.integrations import sglang

    sglang.uninstall()
