"""The seed's failure, reproduced in a real PD decode: the negative control of test_pd_pair.py.

SGLang's own fix made inert (``PDM_TEST_SEED_BUILDER=1``: its builder leaves ``draft_probs``
unset, as SGLang did before 0.5.23) and no drop-in: the decode's first rejection-sampling
verify stacks the missing proposals and fails (``torch.stack`` ... ``NoneType``), or the
request fails. test_pd_pair.py runs the same decode with the drop-in on, and every
request is served. The control's prefill is the session's stock prefill (no drop-in):
only the decode is started here, and its one request goes to both nodes directly, with
the bootstrap fields a router adds.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from server import harness as h
from server import workload as w
from server.conftest import Shared, attach_logs

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def seed_decode(shared: Shared, server_models: dict[str, Path], log_dir: Path) -> Iterator[h.Server]:
    """The control's decode alone: its prefill is the session's stock one (no drop-in), and
    the request goes to both without a router (``h.post_pd``), as the router would send it."""
    models = h.Models(server_models["target"], server_models["eagle3"])
    srv = h.start_server("decode", models, log_dir, role="decode", env_extra={"PDM_TEST_SEED_BUILDER": "1"})
    attach_logs([srv])
    try:
        yield srv
    finally:
        h.stop(srv)


def test_decode_without_the_drop_in_fails_at_the_first_verify(shared: Shared, seed_decode: h.Server) -> None:
    log = seed_decode.log(10**7)
    assert "override seed_builder" in log, "the seed builder was not installed: the control would prove nothing"
    assert "pd-middleware active" not in log  # no drop-in on this decode
    prefill: h.Server = shared.onehot.prefill  # type: ignore[attr-defined]
    # One request, sent aside and not waited for once the decode's log shows the failure
    # (the prefill then waits for the dead decode until SGLang's transfer timeout).
    body = {"text": w.prompts(1)[0], "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}}
    res: list[tuple[tuple[int, object], tuple[int, object]]] = []
    sender = threading.Thread(
        target=lambda: res.append(h.post_pd(prefill, seed_decode, body, room=random.getrandbits(62))), daemon=True
    )
    sender.start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and "NoneType" not in seed_decode.log(10**7) and sender.is_alive():
        time.sleep(1)
    log = seed_decode.log(10**7)
    assert "torch.stack(draft_probs_list, dim=1)" in log, log[-3000:]
    assert "expected Tensor as element 0" in log and "NoneType" in log, log[-3000:]
    if not sender.is_alive():  # the answers came back first: the decode's must have failed
        assert res and res[0][1][0] != 200, res
