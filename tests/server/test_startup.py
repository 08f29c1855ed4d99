"""Failure at start is loud: a server that cannot serve with the drop-in stops, saying why.

Each case starts one real PD decode with ``PD_MIDDLEWARE_CONFIG`` set and checks its exit
code and the message in its own log. The two start side by side.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from server import harness as h
from server.conftest import attach_logs

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]


def test_bad_config_and_topk_2_stop_the_decode_at_start(
    server_models: dict[str, Path], log_dir: Path, tmp_path: Path
) -> None:
    models = h.Models(server_models["target"], server_models["eagle3"])
    good = h.server_config(REPO / "configs" / "sglang.toml", tmp_path / "sglang.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text(good.read_text().replace("max_batch = 64", "max_batch = 64\nmax_bacth = 8"))
    cases = {
        "bad-config": (
            h.start_server("bad-config", models, log_dir, role="decode", config=bad, wait=False),
            "decode.max_bacth",
        ),
        "topk-2": (
            h.start_server("topk-2", models, log_dir, role="decode", config=good, topk=2, wait=False),
            # SGLang 0.5.23 refuses the flag itself, before the drop-in's own check
            # (startup.check: "--speculative-eagle-topk is 2; ...") is reached.
            "--speculative-use-rejection-sampling requires --speculative-eagle-topk=1",
        ),
    }
    attach_logs([s for s, _ in cases.values()])
    try:
        for name, (srv, message) in cases.items():
            rc = h.wait_exit(srv, timeout_s=h.START_TIMEOUT_S)
            log = srv.log(10**7)
            assert rc != 0, f"{name}: exit code {rc}"
            assert message in log, f"{name}: {message!r} not in the log:\n{log[-3000:]}"
    finally:
        for srv, _ in cases.values():
            h.stop(srv)
