"""The A/B runner end to end: what hooks see, failures in the report, cancellation,
the decode's credit pacing the prefill, a payload that never arrives.

Real ZMQ + Mooncake on 127.0.0.1 (the embedded deployment), tiny vocabulary. The
``arm_tally`` hook comes from the example plugin package (examples/, installed by
``make setup``), so these tests also prove a third-party hook runs inside ``ab``.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
from _ab_hooks import BatchSeen, SeeArm

from pd_middleware import ConfigError
from pd_middleware.ab import verifier as verifier_module
from pd_middleware.ab.render import failure_lines, render
from pd_middleware.ab.runner import run_ab
from pd_middleware.ab.schema import Report
from pd_middleware.config import load_config, parse_config

pytest.importorskip("pd_middleware_example", reason="make setup installs examples/pd-middleware-example-plugin")
from pd_middleware_example import ArmTally


def _tiny(**over: object) -> dict:
    data = msgspec.to_builtins(load_config("configs/ab_tiny.toml"))
    for key, value in over.items():
        data[key] = value
    return data


def test_hooks_see_each_payloads_arm_and_failures_reach_the_report() -> None:
    data = _tiny(hooks=[{"name": "arm_tally", "options": {"fail_every": 7}}])
    report = run_ab(parse_config(data), requests=32, seed=5, out_dir=None, progress=False)
    tally = ArmTally.latest
    assert tally is not None
    # The router runs before every configured hook: each arm's 32 payloads, no "default".
    assert dict(tally.counts) == {"one_hot": 32, "full_fp32": 32, "sparse": 32}
    assert len(report.hook_failures) == 1
    hf = report.hook_failures[0]
    assert hf.hook == "arm_tally" and hf.count == 96 // 7 == sum(hf.by_arm.values())
    assert "RuntimeError: arm_tally: failing payload #" in hf.first_error and "on purpose" in hf.first_error
    for a in report.arms:
        pl = a.payloads
        assert pl.sent == 32 and pl.delivered + pl.failed == 32
        assert pl.failed == hf.by_arm.get(a.name, 0) == pl.failed_by_reason.get("hook:arm_tally", 0)
        assert a.acceptance.n == pl.delivered  # only delivered rows are verified
        if pl.failed:
            (f,) = a.failures
            assert f.kind == "hook:arm_tally" and f.count == pl.failed and f.first_request.startswith(a.name + "/")
    assert not report.partial and report.lost == 0
    lines = failure_lines(report)
    assert lines[0].startswith(f"hook arm_tally: {hf.count} payload(s) failed") and "on purpose" in lines[0]
    assert "on purpose" in render(report, "table", 120)


#: Only a cancel that is never observed crosses this; how long a cancel takes is measured
#: by benchmarks/cancel.py (``ab_cancel_s``), and printed here (pytest -s or -rP).
HANG_S = 120.0


def test_cancel_returns_a_partial_report() -> None:
    cancel = threading.Event()
    box: dict[str, object] = {}
    SeeArm.latest = None
    # 20000 requests per arm take minutes: the run is surely not done when it is cancelled.
    data = _tiny(hooks=[{"name": "_ab_hooks:SEE_ARM"}])

    def run() -> None:
        try:
            box["report"] = run_ab(
                parse_config(data), requests=20_000, seed=1, out_dir=None, progress=False, cancel=cancel
            )
        except BaseException as exc:  # shown by the assertion below, not lost in the thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    # Cancel mid-run: once the decode has received its first payload (start-up is a few
    # seconds, more on a loaded machine), not after a fixed sleep.
    deadline = time.monotonic() + HANG_S
    while (SeeArm.latest is None or not SeeArm.latest.seen) and t.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert t.is_alive(), f"the run ended before it was cancelled: {box!r}"
    assert SeeArm.latest is not None and SeeArm.latest.seen, f"no payload reached the decode in {HANG_S:.0f} s"
    t_cancel = time.monotonic()
    cancel.set()
    t.join(timeout=HANG_S)
    took = time.monotonic() - t_cancel
    assert not t.is_alive(), f"run_ab still running {took:.0f} s after cancel was set: the cancel was not observed"
    print(f"\ncancel: run_ab returned {took:.2f} s after cancel was set")
    assert "error" not in box, f"the cancelled run raised: {box['error']!r}"
    report = box["report"]
    assert isinstance(report, Report) and report.partial, "a cancelled run must say so"
    verified = sum(a.acceptance.n for a in report.arms)
    assert verified < 3 * 20_000, "the run went to its end: the cancel was not observed"
    assert "PARTIAL" in render(report, "table", 120)


def test_roles_must_name_arms() -> None:
    data = _tiny()
    data["ab"] = {**data["ab"], "reference": "nope"}
    with pytest.raises(ConfigError, match=r"at ab\.reference.*'nope' is not an arm"):
        run_ab(parse_config(data), requests=4, out_dir=None, progress=False)


def _paced_run(monkeypatch: pytest.MonkeyPatch, window: int, hold_first: bool = False) -> list[tuple[int, int]]:
    """8 batches of 16 with a slow verifier (0.1 s a batch); (batch index, batches verified) per arrival.

    ``hold_first``: the first verify also waits (30 s at most) until the last batch has
    arrived, which only a prefill that is not paced can do.
    """
    real = verifier_module.verify_batch
    BatchSeen.verified[0] = 0

    def slow_verify(*args: object) -> None:
        real(*args)  # type: ignore[arg-type]  # the verifier's own arguments, passed through
        time.sleep(0.1)
        deadline = time.monotonic() + 30.0
        while hold_first and BatchSeen.verified[0] == 0 and time.monotonic() < deadline:
            seen = BatchSeen.latest.seen if BatchSeen.latest is not None else []
            if any(k == 7 for k, _ in seen):
                break
            time.sleep(0.05)
        BatchSeen.verified[0] += 1  # before the credit for this batch is granted

    monkeypatch.setattr(verifier_module, "verify_batch", slow_verify)
    data = _tiny(hooks=[{"name": "_ab_hooks:BATCH_SEEN"}])
    report = run_ab(parse_config(data), requests=128, out_dir=None, progress=False, in_flight_batches=window)
    assert report.lost == 0 and all(a.payloads.delivered == 128 for a in report.arms)
    assert report.pipeline is not None and report.pipeline.in_flight_batches == window
    assert BatchSeen.latest is not None
    return BatchSeen.latest.seen


@pytest.mark.parametrize("window", [1, 2])
def test_the_prefill_is_paced_by_the_decodes_credit(monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    # Batch k may be sent once batch k - window was verified: it never arrives earlier.
    seen = _paced_run(monkeypatch, window)
    early = [(k, v) for k, v in seen if v < k - window + 1]
    assert not early, f"window {window}: batches arrived before their credit (batch, verified): {early[:5]}"
    assert max(k for k, _ in seen) == 7


def test_pacing_negative_control_without_credit_the_prefill_runs_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    # A window as large as the run is no pacing at all: the check above then fails (the
    # last batch arrives while the first is still being verified).
    seen = _paced_run(monkeypatch, 1000, hold_first=True)
    assert [(k, v) for k, v in seen if v < k - 1], "the slow verifier should have let the prefill run ahead"


def test_a_payload_that_never_arrives_fails_mid_run_without_stalling_the_credit() -> None:
    # full_fp32's payloads need 4,224 bulk bytes, slots hold 2,048: every send of that arm
    # fails at the prefill, so its batches never complete and no credit comes back until
    # the prefill publishes what it sent (credit.py); the decode then fails the rest.
    data = _tiny()
    data["transport"] = {**data["transport"], "inline_threshold_bytes": 0, "slots": {"size_bytes": 2048}}
    t0 = time.monotonic()
    # A credit that waited for its timeout instead of the prefill's report would raise
    # (credit.take: "no credit from the decode ... in 120s") rather than return a report:
    # returning one, with every missing payload failed as never arrived, is the behaviour.
    report = run_ab(parse_config(data), requests=48, out_dir=None, progress=False, timeout_s=120)
    print(f"\nnever-arrives run: {time.monotonic() - t0:.1f} s (a figure, not a check)")
    arms = {a.name: a for a in report.arms}
    full = arms["full_fp32"]
    assert full.payloads.sent == 48 and full.payloads.delivered == 0 and full.payloads.failed == 48
    assert full.failures[0].first_error == "never arrived at the decode"
    assert full.send_failures is not None and full.send_failures.count == 48
    assert "needs 4224 bulk bytes, slots hold 2048" in full.send_failures.first_error
    assert arms["one_hot"].payloads.delivered == arms["sparse"].payloads.delivered == 48
    assert report.lost == 0 and report.pipeline is not None and report.pipeline.credit_wait_s > 0
