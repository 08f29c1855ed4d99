"""A drop-in on one side only: a prefill with it in front of a decode without it.

The operator's case is a rolling upgrade, where some nodes have the drop-in and others
don't yet. The prefill serves that decode's session with SGLang's own metadata buffers
(the shorter list; SGLang pairs them by position and ours is last). The decode then
verifies with SGLang's own exact one-hot at the prefill's X. Nothing fails, and the
prefill says why in its own log and in its ``/metrics``. The reverse case, a decode with
the drop-in behind a prefill without it, is test_recompute.py: the decode-only default.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server import harness as h
from server import workload as w
from server.conftest import Shared, attach_logs

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pair(
    shared: Shared, server_models: dict[str, Path], log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[h.Pair]:
    cfg = h.server_config(REPO / "configs" / "sparse_floor.toml", tmp_path_factory.mktemp("cfg") / "sparse_floor.toml")
    models = h.Models(server_models["target"], server_models["eagle3"])
    pd = h.start_pair(models, log_dir / "one-sided", prefill_config=cfg, extra_args=["--enable-metrics"])
    attach_logs(pd.servers)
    try:
        yield pd
    finally:
        pd.stop()


def test_a_prefill_with_the_drop_in_serves_a_decode_without_it_and_says_so(shared: Shared, pair: h.Pair) -> None:
    texts = w.prompts(8, offset=4)
    sampled = w.generate(pair.router.url, texts, temperature=1.0, max_new_tokens=4)  # type: ignore[union-attr]
    greedy = w.generate(pair.router.url, texts, temperature=0.0, max_new_tokens=8)  # type: ignore[union-attr]
    agg = w.generate(shared.agg.url, texts, temperature=0.0, max_new_tokens=8)  # type: ignore[attr-defined]
    assert [r.status for r in sampled + greedy] == [200] * 16, [r.error for r in sampled + greedy]
    assert [r.output_ids for r in greedy] == [r.output_ids for r in agg]
    log = pair.prefill.log(10**7)
    assert "registered no proposal row (it runs without the drop-in)" in log
    text = h.get_text(pair.prefill.url + "/metrics")
    seen = h.metric_values(text, "pd_middleware_integration_events_total")
    print(f"prefill events: {seen}")
    assert sum(v for k, v in seen.items() if 'event="inband:peer_without_dropin"' in k) >= 1
