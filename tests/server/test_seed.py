"""The seed's failure, reproduced in a real PD decode: the negative control of test_pd_pair.py.

SGLang's own fix made inert (``PDM_TEST_SEED_BUILDER=1``: its builder leaves ``draft_probs``
unset, as SGLang did before 0.5.23) and no drop-in: the decode's first rejection-sampling
verify stacks the missing proposals and fails (``torch.stack`` ... ``NoneType``), or the
request fails. test_pd_pair.py runs the same decode with the drop-in on, and every
request is served.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from server import harness as h
from server import workload as w
from server.conftest import attach_logs

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def seed_pair(server_models: dict[str, Path], log_dir: Path) -> Iterator[h.Pair]:
    models = h.Models(server_models["target"], server_models["eagle3"])
    pair = h.start_pair(models, log_dir, decode_env={"PDM_TEST_SEED_BUILDER": "1"})
    attach_logs(pair.servers)
    try:
        yield pair
    finally:
        pair.stop()


def test_decode_without_the_drop_in_fails_at_the_first_verify(seed_pair: h.Pair) -> None:
    log = seed_pair.decode.log(10**7)
    assert "override seed_builder" in log, "the seed builder was not installed: the control would prove nothing"
    # One request: with the decode dead, a second one would wait on the prefill's bootstrap.
    # It is sent aside and not waited for once the decode's log shows the failure: the
    # router holds a request to a dead decode until its own timeout (120 s here).
    res: list[w.Result] = []
    sender = threading.Thread(
        target=lambda: res.extend(
            w.generate(seed_pair.router.url, w.prompts(1), temperature=1.0, max_new_tokens=4, timeout_s=120)  # type: ignore[union-attr]
        ),
        daemon=True,
    )
    sender.start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and "NoneType" not in seed_pair.decode.log(10**7) and sender.is_alive():
        time.sleep(1)
    log = seed_pair.decode.log(10**7)
    assert "torch.stack(draft_probs_list, dim=1)" in log, log[-3000:]
    assert "expected Tensor as element 0" in log and "NoneType" in log, log[-3000:]
    if not sender.is_alive():  # the request came back first: it must have failed
        assert any(r.status != 200 for r in res), [r.status for r in res]
