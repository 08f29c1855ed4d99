"""Renders a :class:`~pd_middleware.ab.schema.Report` as a table, Markdown, CSV or JSON.

The table goes through ``rich`` and fits the given width (the terminal's by default);
at 120 columns nothing wraps. Every column header carries its unit and every term is
explained in the notes under the tables (docs/report.md has the long version).
"""

from __future__ import annotations

import csv
import io
import shutil
from typing import Literal

from .schema import ArmReport, Report

Format = Literal["table", "markdown", "json", "csv"]
FORMATS: tuple[str, ...] = ("table", "markdown", "json", "csv")


def fmt_bytes(n: float | None) -> str:
    """Decimal byte units: ``128 B``, ``4.2 KB``, ``1.5 MB``."""
    if n is None:
        return "-"
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _measured_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    head = [
        "arm",
        "accept [95% CI]",
        "exact (TV≤bound)",
        "proposal B/req",
        "wire B/req",
        "p50/p99 ms",
        "req/s",
        "sent/ok/fail",
    ]
    rows = []
    for a in report.arms:
        acc, ex, pl = a.acceptance, a.exact, a.payloads
        ci = f" [{acc.ci95[0]:.3f},{acc.ci95[1]:.3f}]" if acc.ci95 else ""
        verdict = "PASS" if ex.passed else "FAIL"
        rows.append(
            [
                a.name,
                f"{_f(acc.mean)}{ci}",
                f"{verdict} {_f(ex.tv)}≤{_f(ex.bound)}",
                fmt_bytes(a.bytes_per_request.proposal),
                fmt_bytes(a.bytes_per_request.total),
                f"{_f(a.latency_ms.p50, '.1f')}/{_f(a.latency_ms.p99, '.1f')}",
                _f(a.throughput_per_s, ".0f"),
                f"{pl.sent}/{pl.delivered}/{pl.failed}",
            ]
        )
    return head, rows


def _effect_rows(report: Report) -> tuple[list[str], list[list[str]]]:
    t = report.ab["response_tokens"]
    ref = report.reference
    head = ["arm", "role", "E[accept]"]
    if ref:
        head += ["accept ÷ ref", "proposal B ÷ ref", "wire B ÷ ref"]
    head += ["tokens 1st verify", "verifies per resp.", "saved vs baseline"]
    rows = []
    for a in report.arms:
        row = [a.name, a.role, _f(a.acceptance.exact_expected, ".4f")]
        if ref:
            vs = a.vs_reference
            row += (
                ["ref"] * 3
                if vs is None
                else [
                    f"{vs.acceptance_ratio:.3f}x" if vs.acceptance_ratio is not None else "-",
                    _pct(vs.proposal_bytes_ratio),
                    _pct(vs.bytes_ratio),
                ]
            )
        saved = "baseline" if a.role == "baseline" else _saved(a, t)
        row += [_f(a.effect.first_verify_tokens), _f(a.effect.verifies_per_response, ".2f"), saved]
        rows.append(row)
    return head, rows


def _saved(a: ArmReport, t: int) -> str:
    r = a.effect.verifies_vs_baseline
    return "-" if r is None else f"{(1 - r) * 100:+.2f}%"


def _title(report: Report) -> str:
    wl, m = report.workload, report.model
    part = "  PARTIAL (cancelled)" if report.partial else ""
    return (
        f"workload {wl.get('name')}, seed {report.seed}, {report.requests_per_arm} requests/arm, "
        f"V {m['vocab_size']}, {m['num_steps']} draft step(s), {report.wall_s:.1f} s{part}"
    )


def notes(report: Report) -> list[str]:
    """The lines under the tables that explain every column."""
    hidden = report.model["hidden_size"] * {"bf16": 2, "fp16": 2, "fp32": 4}[report.model["hidden_dtype"]]
    bound = next((a.full_distribution_bound for a in report.arms if a.full_distribution_bound is not None), None)
    s = report.model["num_steps"]
    lines = [
        "arms: " + "; ".join(f"{a.name} = {a.encoding} encoder → {a.synthesizer} synthesizer" for a in report.arms),
        (
            "accept: observed first-verify acceptance, 95% Wilson interval. E[accept]: its exact expectation given the "
            "workload rows, paired across arms (same contexts), so ratios between arms are precise."
        ),
        (
            "exact: total-variation distance (TV) of the committed tokens' probability bins from the target law; "
            "a correct verifier stays under the bound with probability ≥ 1 - 1e-6."
        ),
        (
            f"proposal B/req: bulk bytes beyond the {hidden} B hidden state; wire B/req: control + bulk; "
            "p50/p99 ms: latency from receive to batch assembled."
        ),
        (
            f"ref: the reference arm ({report.reference or 'none'}); baseline: {report.baseline}; verifies per resp.: "
            f"expected verify steps for a {report.ab['response_tokens']}-token response."
        ),
        f"full-distribution bound (Σ min(p, q) at the first position, the best any proposal can do): {_f(bound, '.4f')}",
        (
            f"tokens 1st verify: accepted drafts + 1 (of {s} drafted). Later verifies are drafted on the decode node, "
            f"the same for every arm (acceptance {report.ab['later_acceptance']}), so a proposal's effect is diluted "
            "over the response: see the plot's second panel."
        ),
    ]
    return lines


def failure_lines(report: Report) -> list[str]:
    """One line per failure kind of each arm and per failing hook, with the first error."""
    out = []
    for h in report.hook_failures:
        arms = ", ".join(f"{k} {v}" for k, v in h.by_arm.items())
        out.append(f"hook {h.hook}: {h.count} payload(s) failed ({arms}); first: {h.first_request}: {h.first_error}")
    for a in report.arms:
        for f in a.failures:
            if not f.kind.startswith("hook"):
                out.append(f"arm {a.name}: {f.count} x {f.kind}; first: {f.first_request}: {f.first_error}")
        if a.send_failures is not None:
            sf = a.send_failures
            out.append(
                f"arm {a.name}: {sf.count} send error(s) at the prefill; first: {sf.first_request}: {sf.first_error}"
            )
    return out


def render(report: Report, fmt: Format = "table", width: int | None = None) -> str:
    """The report as text in ``fmt``; ``width`` (table only) defaults to the terminal's, else 120."""
    if fmt == "json":
        return report.to_json().decode()
    if fmt == "csv":
        return _csv(report)
    if fmt == "markdown":
        return _markdown(report)
    if fmt == "table":
        return _table(report, width or shutil.get_terminal_size((120, 24)).columns)
    raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _table(report: Report, width: int) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=io.StringIO(), width=width, color_system=None, highlight=False, soft_wrap=False)
    console.print(Text(_title(report)))
    for head, rows in (_measured_rows(report), _effect_rows(report)):
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
        for i, h in enumerate(head):
            # Values never wrap (a header may, onto two lines), so numbers stay readable.
            widest = max((len(r[i]) for r in rows), default=1)
            table.add_column(Text(h), justify="left" if i == 0 or h == "role" else "right", min_width=widest)
        for r in rows:
            table.add_row(*(Text(c) for c in r))
        console.print(table)
    for line in notes(report) + failure_lines(report):
        console.print(Text(line))
    text = console.file.getvalue()  # type: ignore[attr-defined]  # a StringIO, set above
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines()) + "\n"


def _markdown(report: Report) -> str:
    def md(head: list[str], rows: list[list[str]]) -> list[str]:
        esc = [[c.replace("|", "\\|") for c in r] for r in [head, *rows]]
        return [
            "| " + " | ".join(esc[0]) + " |",
            "|" + "|".join("---" for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in esc[1:]),
        ]

    out = [f"**{_title(report)}**", "", *md(*_measured_rows(report)), "", *md(*_effect_rows(report)), ""]
    out += [f"- {line}" for line in notes(report) + failure_lines(report)]
    return "\n".join(out) + "\n"


def _csv(report: Report) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(
        [
            "arm",
            "role",
            "encoding",
            "synthesizer",
            "acceptance",
            "ci95_low",
            "ci95_high",
            "exact_expected",
            "exact_pass",
            "tv",
            "tv_bound",
            "proposal_bytes_per_req",
            "wire_bytes_per_req",
            "latency_p50_ms",
            "latency_p99_ms",
            "throughput_per_s",
            "sent",
            "delivered",
            "failed",
            "first_verify_tokens",
            "verifies_per_response",
            "verifies_vs_baseline",
        ]
    )
    for a in report.arms:
        acc, ci = a.acceptance, a.acceptance.ci95 or (None, None)
        w.writerow(
            [
                a.name,
                a.role,
                a.encoding,
                a.synthesizer,
                acc.mean,
                ci[0],
                ci[1],
                acc.exact_expected,
                a.exact.passed,
                a.exact.tv,
                a.exact.bound,
                a.bytes_per_request.proposal,
                a.bytes_per_request.total,
                a.latency_ms.p50,
                a.latency_ms.p99,
                a.throughput_per_s,
                a.payloads.sent,
                a.payloads.delivered,
                a.payloads.failed,
                a.effect.first_verify_tokens,
                a.effect.verifies_per_response,
                a.effect.verifies_vs_baseline,
            ]
        )
    return buf.getvalue()
