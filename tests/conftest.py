
# ---- transport fixtures (owner: transport helper; append other sections, do not rewrite) ----
import os as _transport_os

import pytest as _transport_pytest


@_transport_pytest.fixture(scope="session")
def mooncake_pair():
    """Two real Mooncake engines (TCP, loopback) shared by the session: (decode, prefill)."""
    _transport_os.environ.setdefault("MC_FORCE_TCP", "1")
    _transport_os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from pd_middleware.transport import MooncakeEngine

    decode, prefill = MooncakeEngine.open(), MooncakeEngine.open()
    yield decode, prefill
    decode.close()
    prefill.close()


# ---- end transport fixtures ----


# ---- sglang fixtures (owner: sglang helper) ----
import importlib.util as _sg_importlib_util


@_transport_pytest.fixture(scope="session")
def sglang_importable():
    """Make SGLang's speculative and disaggregation modules importable on this CPU tier
    (tests/_sglang_import.py: the torchvision stand-in and why)."""
    if _sg_importlib_util.find_spec("sglang") is None:
        _transport_pytest.skip("SGLang is not installed; run `make setup-sglang` (requirements-sglang.txt)")
    from _sglang_import import import_sglang  # tests/ is on sys.path (no __init__.py)

    for name in (
        "sglang.srt.speculative.eagle_disaggregation",
        "sglang.srt.disaggregation.utils",
        "sglang.srt.disaggregation.decode",
        "sglang.srt.disaggregation.mooncake.conn",
    ):
        import_sglang(name)
    return True


# ---- end sglang fixtures ----
