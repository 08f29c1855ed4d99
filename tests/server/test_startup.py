"""Failure at start is loud: a server that cannot serve with the drop-in stops, saying why.

Each case starts one real PD decode with ``PD_MIDDLEWARE_CONFIG`` set and checks its exit
code and the message in its own log. They start side by side:

- a misspelt config key;
- ``--speculative-eagle-topk 2`` (SGLang itself refuses it under rejection sampling);
- the default recompute with an EAGLE-1 draft (``LlamaForCausalLMEagle``) and a
  non-identity, full-size ``--speculative-token-map`` (the tier's distilled
  ``trained_eagle1_token_map``, a fixed-seed permutation of the 1024 ids): SGLang 0.5.23
  maps draft tokens but not draft probabilities through such a map, so rejection
  sampling would verify against a proposal in the wrong order; the drop-in refuses it at
  scheduler start, before any X' is drawn, naming the flag. It needs the tier's built
  models (not ``PDM_SERVER_MODELS``): without them the test reports itself skipped for
  that case after the other two pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from server import harness as h
from server.conftest import attach_logs

pytestmark = pytest.mark.server
REPO = Path(__file__).resolve().parents[2]


def test_a_bad_config_topk_2_and_a_token_map_stop_the_decode_at_start(
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
    if "trained_eagle1_token_map" in server_models:  # built by the tier (not in PDM_SERVER_MODELS)
        from server.models.build import token_map_path

        eagle1 = h.Models(server_models["target"], server_models["trained_eagle1_token_map"], algorithm="EAGLE")
        cases["token-map"] = (
            h.start_server(
                "token-map",
                eagle1,
                log_dir,
                role="decode",
                config=good,
                extra_args=["--speculative-token-map", str(token_map_path(server_models))],
                wait=False,
            ),
            "not the identity (--speculative-token-map",
        )
    attach_logs([s for s, _ in cases.values()])
    try:
        for name, (srv, message) in cases.items():
            rc = h.wait_exit(srv, timeout_s=h.START_TIMEOUT_S)
            log = srv.log(10**7)
            assert rc != 0, f"{name}: exit code {rc}"
            assert message in log, f"{name}: {message!r} not in the log:\n{log[-3000:]}"
    finally:
        h.stop_all([srv for srv, _ in cases.values()])
    if "token-map" not in cases:
        pytest.skip("the token-map case needs the tier's built models (trained_eagle1_token_map); the others passed")
