"""The README tells the truth: its Python block runs, its CLI block is complete, the quick
start is the two commands the Makefile provides."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from pd_middleware.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_python_usage_block_runs(tmp_path):
    (code,) = _blocks(_section("Using it from Python"), "python")
    script = tmp_path / "readme_snippet.py"
    script.write_text(code)
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "delivered 1" in p.stdout and "failed    0" in p.stdout
    q = float(re.search(r"q'\(X\) = ([0-9.e-]+)", p.stdout).group(1))
    assert 0.0 < q <= 1.0, "the assembled row must hold the sparse law's probability of X"


def test_quick_start_is_two_make_commands_the_makefile_has():
    (block,) = _blocks(_section("Quick start"), "sh")[:1]
    commands = [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: setup\n\t\$\(VENV\)/bin/pd-middleware ab ", makefile, flags=re.M)
    assert re.search(r"^test: setup\n\t\$\(PY\) -m pytest", makefile, flags=re.M)


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:  # argparse has no public walk over subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"{prefix}{name}"] = sub
                out.update(_subcommands(sub, f"{prefix}{name} "))
    return out


def test_cli_block_is_complete():
    (block,) = _blocks(_section("Command line"), "")[:1]
    parser = build_parser()
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt not in ("--help", "--version"):
                assert opt in block, f"global option {opt} missing from the README's CLI block"
    subs = _subcommands(parser)
    assert set(subs) >= {"plugins", "check-config", "config", "config list", "config show", "ab"}
    for name, sub in subs.items():
        assert re.search(rf"(^|\s){re.escape(name.split()[-1])}\b", block), f"subcommand {name!r} missing"
        for action in sub._actions:
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help":
                    assert opt in block, f"{name} {opt} missing from the README's CLI block"
    for code in ("`0`", "`1`", "`2`", "`130`"):
        assert code in _section("Command line"), f"exit code {code} undocumented"
