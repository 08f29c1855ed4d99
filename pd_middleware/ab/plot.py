"""The A/B plot: acceptance against proposal bytes, and the effect against response length.

Left: first-verify acceptance (95% CI, and its paired exact expectation) against the
bytes the proposal itself adds per request (the hidden state every arm ships is left
out), on a symmetric-log axis so the zero-byte one-hot arm stays on the chart, with
decimal KB/MB ticks. Arms are told apart by marker and legend, never by text placed
next to the points, so labels cannot collide.

Right: verify steps each arm saves against the baseline arm, as a share of the
baseline's, for responses of 16 to 1024 tokens: the honest effect, since only the
first verify of a response uses the shipped proposal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .render import fmt_bytes
from .schema import ArmReport, Report

_MARKERS = "osD^vP*Xh<>p"


def _tick(v: float) -> str:
    """``0 B``, ``100 B``, ``10 KB``, ``1 MB``: byte ticks without a trailing ``.0``."""
    return fmt_bytes(v).replace(".0 ", " ")


def write_plot(report: Report, path: Path) -> None:
    """Write the two-panel PNG for ``report`` to ``path`` (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.9), dpi=110, gridspec_kw={"width_ratios": [1.15, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, a in enumerate(report.arms):
        _plot_arm(ax, ax2, a, colors[i % len(colors)], _MARKERS[i % len(_MARKERS)])
    _style_acceptance(ax, report)
    _style_effect(ax2, report)
    wl, m = report.workload, report.model
    part = " (PARTIAL)" if report.partial else ""
    fig.suptitle(
        f"pd-middleware ab: {wl.get('name')} workload, V={m['vocab_size']}, S={m['num_steps']}, "
        f"{report.requests_per_arm} requests/arm, seed {report.seed}{part}",
        fontsize=10.5,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_arm(ax: Any, ax2: Any, a: ArmReport, color: str, marker: str) -> None:
    """One arm's points: acceptance with its CI and exact expectation (left), and the
    effect over response lengths (right; not for the baseline)."""
    x = a.bytes_per_request.proposal
    label = f"{a.name} ({a.encoding} → {a.synthesizer}{', ' + a.role if a.role != 'candidate' else ''})"
    acc = a.acceptance
    if acc.mean is not None and acc.ci95 is not None:
        ax.errorbar(
            [x],
            [acc.mean],
            yerr=[[acc.mean - acc.ci95[0]], [acc.ci95[1] - acc.mean]],
            fmt=marker,
            color=color,
            capsize=4,
            markersize=7,
            label=label,
        )
    if acc.exact_expected is not None:
        ax.plot([x], [acc.exact_expected], marker="x", markersize=9, color=color, linestyle="none")
    pts = a.effect.by_response_length
    if a.role != "baseline" and pts:
        ax2.plot(
            [p.response_tokens for p in pts],
            [p.saved_pct_vs_baseline for p in pts],
            marker=marker,
            color=color,
            label=a.name,
        )


def _style_acceptance(ax: Any, report: Report) -> None:
    """The left panel's legend entries, bound line, axes and title."""
    from matplotlib.ticker import FuncFormatter

    most = max((a.bytes_per_request.proposal for a in report.arms), default=0.0)
    ax.plot([], [], marker="x", color="black", linestyle="none", label="exact expectation (paired)")
    bound = next((a.full_distribution_bound for a in report.arms if a.full_distribution_bound is not None), None)
    if bound is not None:
        ax.axhline(bound, color="gray", linestyle="--", linewidth=1, label=f"full-distribution bound {bound:.3f}")
    # symlog keeps 0 B (one-hot) on the axis; below 100 B the scale is linear.
    ax.set_xscale("symlog", linthresh=100)
    ax.set_xlim(-10, max(1000.0, most * 3))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _tick(v)))
    ax.set_xlabel("proposal bytes per request (beyond the hidden state; log above 100 B)")
    ax.set_ylabel("first-verify acceptance (95% CI)")
    ax.set_ylim(0, 1.05)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="lower right", framealpha=0.9)
    ax.set_title("acceptance against what the proposal costs", fontsize=10)


def _style_effect(ax2: Any, report: Report) -> None:
    """The right panel's axes, the constant saving per response, and its title."""
    ax2.axhline(0, color="gray", linewidth=1)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks([16, 32, 64, 128, 256, 512, 1024], ["16", "32", "64", "128", "256", "512", "1024"])
    ax2.set_xlabel("response length (tokens)")
    ax2.set_ylabel(f"verify steps saved vs {report.baseline} (%)")
    ax2.grid(True, which="both", alpha=0.3)
    if ax2.lines[1:]:
        ax2.legend(fontsize=7.5, loc="upper right", framealpha=0.9)
    # The saving is a constant number of verify steps (only the first verify differs),
    # diluted as responses grow: say the constant, the curve shows the dilution.
    steps = [
        f"{a.name}: {a.effect.by_response_length[-1].saved_vs_baseline:.2f}"
        for a in report.arms
        if a.role != "baseline" and a.effect.by_response_length
    ]
    if steps:
        ax2.text(
            0.40,
            0.42,
            "verify steps saved per response, any length:\n" + "\n".join(steps),
            transform=ax2.transAxes,
            fontsize=7.5,
            va="bottom",
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85, "edgecolor": "0.8"},
        )
    ax2.set_title(
        f"effect over a response (later verifies: acceptance {report.ab['later_acceptance']}, same for every arm)",
        fontsize=9,
    )
