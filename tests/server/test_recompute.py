"""Decode-only recompute: the drop-in on the decode alone, behind a prefill with none.

The decode runs the shipped SGLang default, ``configs/sglang.toml`` (``synthesizer =
"recompute"``, ``channel = "none"``): it recomputes the first draft step's proposal from
the shipped hidden state with its own draft model. Its first-verify acceptance must match
aggregated serving within the band of test_pd_pair.py (two-sided alpha 1e-3) and beat
SGLang's one-hot (one-sided alpha 1e-2), on the trained models; the references are the
session's (``conftest.shared``).
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
N = 128
Z_SAME, Z_BETTER = 3.29, 2.33


@pytest.fixture(scope="module")
def pair(
    shared: Shared, server_models: dict[str, Path], log_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[h.Pair]:
    cfg = h.server_config(REPO / "configs" / "sglang.toml", tmp_path_factory.mktemp("cfg") / "sglang.toml")
    models = h.Models(server_models["target"], server_models["eagle3"])
    pd = h.start_pair(models, log_dir / "pd", decode_config=cfg)
    attach_logs(pd.servers)
    try:
        yield pd
    finally:
        pd.stop()


def test_decode_only_recompute_matches_aggregated_and_beats_one_hot(shared: Shared, pair: h.Pair) -> None:
    texts = w.prompts(N, offset=2)
    a = w.first_verify_rate(w.generate(shared.agg.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[attr-defined]
    r = w.first_verify_rate(w.generate(pair.router.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[union-attr]
    o = w.first_verify_rate(w.generate(shared.onehot.router.url, texts, temperature=1.0, max_new_tokens=2))  # type: ignore[attr-defined]
    print(f"first-verify acceptance: aggregated {a}, PD + decode-only recompute {r}, PD one-hot {o}")
    assert abs(w.z_diff(r, a)) <= Z_SAME
    assert w.z_diff(r, o) >= Z_BETTER
    log = pair.decode.log(10**7)
    assert "decode-only recompute" in log, "the decode's activation line is missing"
