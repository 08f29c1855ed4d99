"""The A/B job end to end on a tiny configuration, through real ZMQ + Mooncake."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pd_middleware.ab.effect import later_tokens_per_verify, response_effect
from pd_middleware.cli import main
from pd_middleware.config import load_config, parse_config

REQUIRED_ARM_KEYS = {
    "name",
    "role",
    "synthesizer",
    "encoding",
    "acceptance",
    "accepted_length",
    "exact",
    "bytes_per_request",
    "latency_ms",
    "payloads",
    "failures",
    "effect",
    "vs_reference",
}


def _check_report(report: dict, n_req: int, arms: list[str]) -> None:
    assert {
        "schema_version",
        "created_at",
        "partial",
        "seed",
        "workload",
        "config",
        "versions",
        "arms",
        "hook_failures",
    } <= set(report)
    assert report["versions"]["torch"] == torch.__version__ and report["hook_failures"] == []
    assert [a["name"] for a in report["arms"]] == arms
    for a in report["arms"]:
        assert set(a) >= REQUIRED_ARM_KEYS, a.keys()
        assert set(a["acceptance"]) >= {"mean", "ci95"} and len(a["acceptance"]["ci95"]) == 2
        lo, hi = a["acceptance"]["ci95"]
        assert 0.0 <= lo <= a["acceptance"]["mean"] <= hi <= 1.0
        assert set(a["exact"]) >= {"tv", "bound", "pass"}
        assert a["exact"]["pass"], f"{a['name']}: TV {a['exact']['tv']} over bound {a['exact']['bound']}"
        assert set(a["latency_ms"]) == {"p50", "p99"} and a["latency_ms"]["p50"] <= a["latency_ms"]["p99"]
        pl = a["payloads"]
        assert pl["sent"] == n_req and pl["delivered"] + pl["failed"] == pl["sent"]
        assert pl["failed"] == 0 and a["failures"] == []
        assert a["bytes_per_request"]["control"] > 0


def test_ab_cli_tiny_single_layer(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ab"
    monkeypatch.setenv("COLUMNS", "120")  # what `make demo` must fit
    rc = main(["ab", "configs/ab_tiny.toml", "--requests", "96", "--seed", "3", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert max(len(line) for line in printed.splitlines() if not line.startswith("wrote ")) <= 120  # a path may not
    assert printed.count("PASS") == 3 and "reference" in printed and "TV/bound" not in printed
    report = json.loads((out / "report.json").read_text())
    _check_report(report, 96, ["one_hot", "full_fp32", "sparse"])
    assert report["seed"] == 3
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    arms = {a["name"]: a for a in report["arms"]}
    assert report["schema_version"] == 2 and report["partial"] is False
    assert (report["baseline"], report["reference"]) == ("one_hot", "full_fp32")
    assert [a["role"] for a in report["arms"]] == ["baseline", "reference", "candidate"]
    # Bytes: one-hot ships no proposal, full ships V x 4.
    assert arms["one_hot"]["bytes_per_request"]["proposal"] == 0
    assert arms["full_fp32"]["bytes_per_request"]["proposal"] == pytest.approx(1024 * 4, rel=0.01)
    # The paired exact expectations, recomputed here from the workload rows the job
    # regenerated from the same seed: one-hot with X ~ q accepts sum q.p; the full row
    # accepts sum min(p, q), the full-distribution bound.
    p, q = _first_rows(report)
    one_hot_exact = float((p * q).sum(1).mean())
    bound = float(torch.minimum(p, q).sum(1).mean())
    assert arms["one_hot"]["acceptance"]["exact_expected"] == pytest.approx(one_hot_exact, abs=1e-6)
    full = arms["full_fp32"]
    assert full["full_distribution_bound"] == pytest.approx(bound, abs=1e-6)
    assert full["acceptance"]["exact_expected"] == pytest.approx(bound, abs=1e-4)
    # A shipped distribution accepts much more than one-hot on this workload.
    assert bound > one_hot_exact + 0.3
    # The reference is not compared with itself; the others are, as paired ratios.
    assert full["vs_reference"] is None
    for name in ("one_hot", "sparse"):
        vs = arms[name]["vs_reference"]
        assert vs["acceptance_ratio"] == pytest.approx(arms[name]["acceptance"]["exact_expected"] / bound, rel=1e-4)
        assert vs["bytes_ratio"] < 0.25  # both ship far fewer bytes than V x 4
    assert arms["one_hot"]["vs_reference"]["acceptance_ratio"] == pytest.approx(one_hot_exact / bound, rel=1e-4)
    # Truncation can only lose acceptance against the full row, and top-p 0.95 keeps most.
    assert 0.8 < arms["sparse"]["vs_reference"]["acceptance_ratio"] <= 1.0 + 1e-4
    # Effect: fewer verify steps than the baseline exactly when the first verify commits more.
    base_e1 = arms["one_hot"]["effect"]["first_verify_tokens"]
    for a in report["arms"]:
        e = a["effect"]
        assert [pt["response_tokens"] for pt in e["by_response_length"]] == [16, 32, 64, 128, 256, 512, 1024]
        saved = [pt["saved_vs_baseline"] for pt in e["by_response_length"]]
        if a["role"] == "baseline":
            assert saved == [0.0] * 7 and e["verifies_vs_baseline"] == 1.0
        else:
            # (E1 - E1_base) / later for every length beyond E1: a constant saving, diluted.
            assert saved == pytest.approx(
                [(e["first_verify_tokens"] - base_e1) / e["later_tokens_per_verify"]] * 7, abs=1e-4
            )
            pct = [pt["saved_pct_vs_baseline"] for pt in e["by_response_length"]]
            assert pct == sorted(pct, reverse=True) and pct[0] > 0


def _first_rows(report: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """First-position target and draft rows of every request, regenerated from the seed."""
    from pd_middleware.ab.config import workload_options
    from pd_middleware.workloads import make_workload

    cfg = parse_config(report["config"])
    wl = make_workload(cfg.ab.workload.name, **workload_options(cfg))
    batches = list(wl.batches(report["requests_per_arm"], cfg.ab.batch_size, report["seed"]))
    p = torch.cat([b.target_probs[:, 0] for b in batches]).double()
    q = torch.cat([b.draft_probs[:, 0] for b in batches]).double()
    return p, q


def test_ab_multi_layer(tmp_path):
    cfg = load_config("configs/ab_tiny.toml")
    data = json.loads(json.dumps(__import__("msgspec").to_builtins(cfg)))
    data["model"]["num_steps"] = 3
    from pd_middleware.ab.runner import run_ab

    run_ab(parse_config(data), requests=48, seed=1, out_dir=tmp_path, progress=False)
    report = json.loads((tmp_path / "report.json").read_text())
    _check_report(report, 48, ["one_hot", "full_fp32", "sparse"])
    for a in report["arms"]:
        assert 0.0 <= a["accepted_length"] <= 3.0
        assert a["effect"]["first_verify_tokens"] == pytest.approx(a["accepted_length"] + 1.0, abs=1e-4)


def test_ab_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[model]\nvocab_size = 1000\n[ab]\nworkload = { name = "ngram" }\n[[arms]]\nname = "a"\nsynthesizer = { name = "one_hot" }\n'
    )
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


@pytest.mark.parametrize("workload", ["synthetic", "ngram"])
def test_ab_recompute_arm_matches_full_at_zero_proposal_bytes(tmp_path, workload):
    """The recompute arm (workload draft head, X' redrawn on the decode) through the real
    loopback deployment: paired E[accept] equals full_fp32's within the workload's
    numerics (q' = softmax(log q)), no proposal bytes, exactness test passed."""
    cfg = load_config("configs/ab_tiny.toml")
    data = json.loads(json.dumps(__import__("msgspec").to_builtins(cfg)))
    data["arms"] = [
        {"name": "one_hot", "encoder": {"name": "softmax"}, "synthesizer": {"name": "one_hot"}},
        {
            "name": "full_fp32",
            "encoder": {"name": "full", "options": {"dtype": "fp32"}},
            "synthesizer": {"name": "full_distribution"},
        },
        {"name": "recompute", "encoder": {"name": "softmax"}, "synthesizer": {"name": "recompute"}},
    ]
    if workload == "ngram":
        from pd_middleware.workloads.ngram import NgramWorkload

        data["ab"]["workload"] = {"name": "ngram", "options": {}}
        data["model"]["vocab_size"] = NgramWorkload().vocab_size
    from pd_middleware.ab.runner import run_ab

    report = run_ab(parse_config(data), requests=64, seed=3, out_dir=tmp_path, progress=False)
    arms = {a.name: a for a in report.arms}
    rec, full = arms["recompute"], arms["full_fp32"]
    assert rec.payloads.delivered == 64 and not rec.failures
    assert rec.exact.passed
    assert rec.bytes_per_request.proposal == 0.0
    assert rec.acceptance.exact_expected == pytest.approx(full.acceptance.exact_expected, rel=1e-4)
    assert rec.acceptance.exact_expected > arms["one_hot"].acceptance.exact_expected
