"""The command line as a user meets it: real subprocesses, exit codes, stderr text.

Every run is bounded by a timeout, runs from a temporary working directory (so nothing
leaks into the repo) and must never print a Python traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "pd_middleware.cli"]


def run(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    p = subprocess.run(CLI + args, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_help_documents_exit_codes(tmp_path):
    p = run(["--help"], tmp_path)
    assert p.returncode == 0
    for line in (
        "0    success",
        "1    the job ran and its checks failed",
        "2    usage, config, plugin or run error",
        "130  interrupted",
    ):
        assert line in p.stdout
    for flag in ("--log-level", "--plugin-path", "check-config", "config", "plugins", "ab"):
        assert flag in p.stdout


def test_check_config_inline_json_reports_every_error_at_its_full_path(tmp_path):
    doc = '{"model": {"vocab_sise": 5, "num_steps": 0}, "decod": {}}'
    p = run(["check-config", doc], tmp_path)
    assert p.returncode == 2
    assert "config error (<inline JSON>): 3 problems:" in p.stderr
    assert "at model.vocab_sise: unknown field `vocab_sise`; did you mean `vocab_size`?" in p.stderr
    assert "at model.num_steps: must be in [1, 16], got 0" in p.stderr
    assert "at decod: unknown field `decod`; did you mean `decode`?" in p.stderr
    # The same through PD_MIDDLEWARE_CONFIG's loader: load_config takes the inline text too.
    opts = '{"encoder": {"name": "sparse", "options": {"top_k": 3}}}'
    p = run(["check-config", opts], tmp_path)
    assert (
        p.returncode == 2 and "config error at encoder.options.top_k (<inline JSON>): unknown field `top_k`" in p.stderr
    )


def test_schema_and_plugin_option_errors_are_reported_in_one_run(tmp_path):
    # A schema error stops the typed parse before plugins resolve; the plugin's options
    # are still checked from the raw document, so both come out at once.
    doc = '{"model": {"vocab_sise": 5}, "encoder": {"name": "sparse", "options": {"mode": "topk", "kk": 3}}}'
    p = run(["check-config", doc], tmp_path)
    assert p.returncode == 2
    assert "2 problems:" in p.stderr
    assert "at model.vocab_sise: unknown field `vocab_sise`; did you mean `vocab_size`?" in p.stderr
    assert "at encoder.options.kk: unknown field `kk`; did you mean `k`?" in p.stderr
    # Control: with the schema fixed, the plugin error alone remains.
    p = run(["check-config", doc.replace("vocab_sise", "vocab_size")], tmp_path)
    assert p.returncode == 2 and "problems" not in p.stderr and "encoder.options.kk" in p.stderr


def test_empty_config_says_which_defaults_apply_and_show_prints_them(tmp_path):
    (tmp_path / "empty.toml").write_text("")
    p = run(["check-config", "empty.toml", "--show"], tmp_path)
    assert p.returncode == 0, p.stderr
    shown = json.loads(p.stdout[: p.stdout.index("\nempty.toml: OK")])
    assert shown["decode"]["max_batch"] == 64 and shown["transport"]["slots"]["count"] == 256
    assert "note: the config is empty: every value below is a default" in p.stdout
    assert "note: model.vocab_size:" in p.stdout


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("deep.toml", "a = " + "[" * 3000 + "]" * 3000, "nesting deeper than 32 levels"),
        ("deep.yaml", "a: " + "[" * 3000 + "]" * 3000, "nesting deeper than 32 levels"),
        ("big.yaml", "model:\n  vocab_size: " + "9" * 5000 + "\n", "an integer has too many digits"),
    ],
)
def test_hostile_files_are_clean_errors(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    p = run(["check-config", name], tmp_path)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_ok_means_it_would_start(tmp_path):
    doc = json.dumps(
        {
            "transport": {
                "hmac_key_env": "PDM_TEST_UNSET_SECRET",
                "bind_host": "not a host!",
                "slots": {"count": 1 << 20, "size_bytes": 1 << 32},
            }
        }
    )
    env = {k: v for k, v in os.environ.items() if k != "PDM_TEST_UNSET_SECRET"}
    p = subprocess.run(
        [*CLI, "check-config", doc, "--no-probe"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "would not start (3 problems)" in p.stderr
    assert "transport.hmac_key_env: environment variable PDM_TEST_UNSET_SECRET is not set" in p.stderr
    assert "transport.bind_host: 'not a host!' is not an IP address" in p.stderr
    assert "transport.slots: needs 4.0 PiB" in p.stderr
    # Negative control: the same secret set, sane host and pool -> OK.
    good = json.dumps({"transport": {"hmac_key_env": "PDM_TEST_SET_SECRET"}})
    p = run(["check-config", good, "--no-probe"], tmp_path, env={"PDM_TEST_SET_SECRET": "x" * 32})
    assert p.returncode == 0 and "<inline JSON>: OK" in p.stdout


def test_pair_that_never_uses_its_proposal_is_a_warning(tmp_path):
    bad = '{"encoder": {"name": "greedy"}, "synthesizer": {"name": "full_distribution"}}'
    p = run(["check-config", bad], tmp_path)
    assert p.returncode == 0
    assert (
        "warning: synthesizer: encoder 'greedy' sends no usable proposal for synthesizer 'full_distribution'"
        in p.stdout
    )
    assert "falls back to one-hot (greedy)" in p.stdout
    p = run(["check-config", '{"encoder": {"name": "softmax"}, "synthesizer": {"name": "sparse"}}'], tmp_path)
    assert "every payload falls back to one-hot (no_proposal)" in p.stdout
    # Negative control: an exact pair that hands its proposal over draws no warning.
    p = run(["check-config", '{"encoder": {"name": "sparse"}, "synthesizer": {"name": "sparse"}}'], tmp_path)
    assert p.returncode == 0 and "warning" not in p.stdout


_PLUGIN = """\
import pathlib
pathlib.Path({marker!r}).write_text("imported")
from pd_middleware import PluginSpec
class Flaky:
    def __init__(self, options, context):
        self.n = 0
    def on_receive(self, payload, context):
        self.n += 1
        if self.n % 2 == 0:
            raise ValueError(f"flaky hook refuses payload number {{self.n}}")
SPEC = PluginSpec(name="flaky", kind="hook", factory=Flaky)
"""


def test_check_config_never_imports_from_the_working_directory(tmp_path):
    marker = tmp_path / "imported.txt"
    (tmp_path / "cwd_plugin.py").write_text(_PLUGIN.format(marker=str(marker)))
    (tmp_path / "c.toml").write_text('hooks = [{name = "cwd_plugin:SPEC"}]\n')
    for env in ({}, {"PYTHONPATH": "."}):
        p = run(["check-config", "c.toml", "--no-probe"], tmp_path, env=env)
        assert p.returncode == 2, (env, p.stdout)
        # check-config imports no module reference unless asked (issue 23): checked for form only.
        assert "'cwd_plugin:SPEC' is a module reference (form OK), not imported" in p.stderr, p.stderr
        assert "pass --import, or --plugin-path DIR" in p.stderr and not marker.exists()
        # Asked to import: -m drops the implicit cwd entry (not found); PYTHONPATH=. finds it and refuses it.
        p = run(["check-config", "--import", "c.toml", "--no-probe"], tmp_path, env=env)
        assert p.returncode == 2, (env, p.stdout)
        assert ("'cwd_plugin' in the working directory is not used" in p.stderr) != (
            "'cwd_plugin' would be imported from the working directory" in p.stderr
        ), p.stderr
        assert "pass --plugin-path DIR" in p.stderr and not marker.exists()
    p = run(["--plugin-path", ".", "check-config", "c.toml", "--no-probe"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "hooks: flaky" in p.stdout and marker.exists()


def test_a_broken_entry_point_breaks_only_its_users(tmp_path):
    site = tmp_path / "site"
    (site / "pdm_cli_broken").mkdir(parents=True)
    (site / "pdm_cli_broken" / "__init__.py").write_text("raise ImportError('this plugin is broken')\n")
    info = site / "pdm_cli_broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pdm-cli-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pd_middleware.plugins]\nhook.broken = pdm_cli_broken:NOPE\n")
    env = {"PYTHONPATH": str(site)}
    p = run(["plugins"], tmp_path, env=env)
    assert p.returncode == 0
    assert "synthesizer  one_hot" in p.stdout.replace("  ", "  ")
    assert "BROKEN (1)" in p.stdout and "hook.broken = pdm_cli_broken:NOPE" in p.stdout
    assert "ImportError: this plugin is broken" in p.stdout
    p = run(["check-config", "one_hot", "--no-probe"], tmp_path, env=env)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr
    p = run(["check-config", '{"hooks": [{"name": "broken"}]}', "--no-probe"], tmp_path, env=env)
    assert p.returncode == 2 and "(config key hooks[0].name)" in p.stderr and "this plugin is broken" in p.stderr


def test_shipped_configs_list_and_show(tmp_path):
    p = run(["config", "list"], tmp_path)
    assert p.returncode == 0 and "ab.toml" in p.stdout and "sparse_topk.toml" in p.stdout
    p = run(["config", "show", "ab"], tmp_path)
    assert p.returncode == 0 and p.stdout == (ROOT / "configs" / "ab.toml").read_text()
    p = run(["config", "show", "sprase_topk"], tmp_path)
    assert p.returncode == 2 and "did you mean `sparse_topk`?" in p.stderr


def test_bad_out_fails_before_the_run(tmp_path):
    (tmp_path / "taken").write_text("a file")
    p = run(["ab", "ab_tiny", "--out", "taken"], tmp_path)
    assert p.returncode == 2 and "--out 'taken' exists and is not a directory" in p.stderr
    # A run that starts prints progress lines ("ab: N/M payloads", as the Ctrl-C test
    # below waits for): none means --out was refused before the deployment started.
    progress = [line for line in p.stderr.splitlines() if line.startswith("ab: ")]
    assert not progress, f"the run started before --out was checked: {progress}"
    assert not (tmp_path / "taken").is_dir()


@pytest.mark.slow
def test_hook_failures_are_summarised_and_fail_on_loss(tmp_path):
    marker = tmp_path / "imported.txt"
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "flaky_hook.py").write_text(_PLUGIN.format(marker=str(marker)))
    cfg = 'hooks = [{name = "flaky_hook:SPEC"}]\n' + (ROOT / "configs" / "ab_tiny.toml").read_text()
    (tmp_path / "c.toml").write_text(cfg)
    p = run(
        ["--plugin-path", "plug", "ab", "c.toml", "--requests", "32", "--out", "o", "--no-progress", "--fail-on-loss"],
        tmp_path,
        timeout=300,
    )
    assert p.returncode == 1, p.stderr
    flat = " ".join(p.stdout.split())  # the table wraps long lines at the terminal width
    assert "hook flaky: 48 payload(s) failed (" in flat
    assert ": ValueError: flaky hook refuses payload number 2" in flat
    assert "48 payload(s) failed (--fail-on-loss)" in p.stderr
    # Quiet engine: none of Mooncake's start-up lines at the default log level.
    assert "transfer_engine" not in p.stderr and "Local segment descriptor" not in p.stderr


@pytest.mark.slow
def test_default_ab_is_quiet_and_debug_shows_engine_logs(tmp_path):
    p = run(
        ["--log-level", "debug", "ab", "ab_tiny", "--requests", "8", "--out", "o", "--no-progress"],
        tmp_path,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "Local segment descriptor not found" in p.stderr  # negative control of the quiet check above
    assert "hook " not in p.stdout and "payload(s) failed" not in p.stdout


@pytest.mark.slow
def test_ctrl_c_exits_130_with_a_partial_report(tmp_path):
    # How long Ctrl-C takes to exit (the help's "within 2 s") is measured by
    # benchmarks/cancel.py (``ctrl_c_exit_s``) and printed here (pytest -s or -rP); the
    # only bound is one that an ignored Ctrl-C crosses.
    hang_s = 60
    proc = subprocess.Popen(
        [*CLI, "ab", "ab_tiny", "--requests", "200000", "--out", "o"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Wait for the first progress line (the run is under way), at most 120 s.
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if line.startswith("ab: ") or not line:
                break
        assert line.startswith("ab: "), f"no progress line before the run ended or 120 s passed: {line!r}"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            _out, err = proc.communicate(timeout=hang_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pd-middleware ab still running {hang_s} s after Ctrl-C: the interrupt was not observed")
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    print(f"\nCtrl-C: exit {proc.returncode} after {took:.2f} s")
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    # The job must return within the CLI's grace (cli.interrupt_to_cancel, 1.8 s) or it
    # is aborted without a report: say which happened.
    assert "cancelled; the report is partial" in err, f"aborted, no partial report ({took:.2f} s): {err[-2000:]}"
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["partial"] is True
    assert 0 < sum(a["payloads"]["delivered"] for a in report["arms"]) < 3 * 200000
