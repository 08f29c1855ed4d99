
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
