"""The A/B job end to end on a tiny configuration, through real ZMQ + Mooncake."""

from __future__ import annotations

import json
import math

import pytest

from pd_middleware.ab.effect import later_tokens_per_verify, response_effect
from pd_middleware.cli import main
from pd_middleware.config import load_config, parse_config

REQUIRED_ARM_KEYS = {
    "name", "synthesizer", "encoding", "acceptance", "accepted_length", "exact", "bytes_per_request",
    "latency_ms", "payloads",
}


def _check_report(report: dict, n_req: int, arms: list[str]) -> None:
    assert {"seed", "workload", "arms"} <= set(report)
    assert [a["name"] for a in report["arms"]] == arms
    for a in report["arms"]:
        assert REQUIRED_ARM_KEYS <= set(a), a.keys()
        assert set(a["acceptance"]) >= {"mean", "ci95"} and len(a["acceptance"]["ci95"]) == 2
        lo, hi = a["acceptance"]["ci95"]
        assert 0.0 <= lo <= a["acceptance"]["mean"] <= hi <= 1.0
        assert set(a["exact"]) >= {"tv", "bound", "pass"}
        assert a["exact"]["pass"], f"{a['name']}: TV {a['exact']['tv']} over bound {a['exact']['bound']}"
        assert set(a["latency_ms"]) == {"p50", "p99"} and a["latency_ms"]["p50"] <= a["latency_ms"]["p99"]
        pl = a["payloads"]
        assert pl["sent"] == n_req and pl["delivered"] + pl["failed"] == pl["sent"]
        assert pl["failed"] == 0
        assert a["bytes_per_request"]["control"] > 0


def test_ab_cli_tiny_single_layer(tmp_path):
    out = tmp_path / "ab"
    rc = main(["ab", "configs/ab_tiny.toml", "--requests", "96", "--seed", "3", "--out", str(out), "--no-progress"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    _check_report(report, 96, ["one_hot", "full_fp32", "sparse"])
    assert report["seed"] == 3
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    arms = {a["name"]: a for a in report["arms"]}
    # Bytes: one-hot ships no proposal, full ships V x 4.
    assert arms["one_hot"]["bytes_per_request"]["proposal"] == 0
    assert arms["full_fp32"]["bytes_per_request"]["proposal"] == pytest.approx(1024 * 4, rel=0.01)
    # A shipped distribution accepts more than one-hot on this workload (expected values).
    assert arms["full_fp32"]["acceptance"]["expected"] > arms["one_hot"]["acceptance"]["expected"] + 0.3
    # The paired exact expectation of the full arm is the full-distribution bound itself.
    full = arms["full_fp32"]
    assert full["acceptance"]["exact_expected"] == pytest.approx(full["full_distribution_bound"], abs=1e-4)
    assert full["vs_full"]["acceptance_ratio"] == pytest.approx(1.0)
    # Truncation can only lose acceptance against the full row (sum min(p, q_k) <= sum min(p, q) + rounding).
    assert arms["sparse"]["acceptance"]["exact_expected"] <= full["acceptance"]["exact_expected"] + 1e-4


def test_ab_multi_layer(tmp_path):
    cfg = load_config("configs/ab_tiny.toml")
    data = json.loads(json.dumps(__import__("msgspec").to_builtins(cfg)))
    data["model"]["num_steps"] = 3
    from pd_middleware.ab.job import run_ab

    report = run_ab(parse_config(data), requests=48, seed=1, out_dir=tmp_path, progress=False)
    _check_report(report, 48, ["one_hot", "full_fp32", "sparse"])
    for a in report["arms"]:
        assert 0.0 <= a["accepted_length"] <= 3.0
        assert a["effect"]["first_verify_tokens"] == pytest.approx(a["accepted_length"] + 1.0, abs=1e-4)


def test_ab_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nvocab_size = 1000\n[ab]\nworkload = { name = "ngram" }\n[[arms]]\nname = "a"\nsynthesizer = { name = "one_hot" }\n')
    rc = main(["ab", str(bad), "--requests", "4", "--out", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "at model.vocab_size" in err and "has V=8192" in err
    noarms = tmp_path / "noarms.toml"
    noarms.write_text("[model]\nvocab_size = 100\n")
    assert main(["ab", str(noarms)]) == 2
    assert "needs at least one [[arms]] entry" in capsys.readouterr().err


def test_effect_size_formulas():
    assert later_tokens_per_verify(0.0, 3) == 1.0
    assert later_tokens_per_verify(0.5, 1) == pytest.approx(1.5)
    assert later_tokens_per_verify(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    e1 = response_effect(1.2, response_tokens=256, later_acceptance=0.7, num_steps=1)
    e2 = response_effect(1.8, response_tokens=256, later_acceptance=0.7, num_steps=1)
    assert e1.verifies_per_response == pytest.approx(1 + (256 - 1.2) / 1.7)
    # 0.6 more tokens in the first verify saves 0.6 / 1.7 verifies out of ~150.
    assert e1.verifies_per_response - e2.verifies_per_response == pytest.approx(0.6 / 1.7)
    with pytest.raises(ValueError, match=r"acceptance must be in \[0, 1\)"):
        later_tokens_per_verify(1.0, 1)
    assert not math.isnan(e1.later_tokens_per_verify)
