"""Rendering of an A/B report: a text table and an acceptance-vs-bytes plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _fmt_bytes(n: float) -> str:
    if n != n:  # NaN
        return "-"
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000 or unit == "MB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000.0
    return f"{n:.1f}MB"


def format_table(report: dict[str, Any]) -> str:
    """A fixed-width table, one row per arm, plus the effect-size lines."""
    arms = report["arms"]
    wl = report["workload"]
    head = (
        f"workload {wl.get('name')}  seed {report['seed']}  requests/arm {report['requests_per_arm']}  "
        f"V {report['model']['vocab_size']}  num_steps {report['model']['num_steps']}  wall {report['wall_s']:.1f}s"
    )
    cols = [
        ("arm", 14),
        ("encoding", 9),
        ("synth", 17),
        ("accept", 7),
        ("E[acc]", 7),
        ("95% CI", 15),
        ("acc.len", 7),
        ("TV/bound", 15),
        ("exact", 5),
        ("ctrl B/req", 10),
        ("bulk B/req", 10),
        ("p50 ms", 7),
        ("p99 ms", 7),
        ("req/s", 7),
        ("sent/dlv/fail", 16),
    ]
    lines = [head, "  ".join(f"{n:<{w}}" for n, w in cols)]
    for a in arms:
        acc = a["acceptance"]
        ex = a["exact"]
        bp = a["bytes_per_request"]
        pl = a["payloads"]
        cells = [
            a["name"],
            a["encoding"],
            a["synthesizer"],
            f"{acc['mean']:.4f}",
            f"{acc['exact_expected']:.4f}",
            f"[{acc['ci95'][0]:.3f},{acc['ci95'][1]:.3f}]",
            f"{a['accepted_length']:.3f}",
            f"{ex['tv']:.4f}/{ex['bound']:.4f}",
            "PASS" if ex["pass"] else "FAIL",
            _fmt_bytes(bp["control"]),
            _fmt_bytes(bp["bulk"]),
            f"{a['latency_ms']['p50']:.2f}",
            f"{a['latency_ms']['p99']:.2f}",
            f"{a['throughput_per_s']:.0f}",
            f"{pl['sent']}/{pl['delivered']}/{pl['failed']}",
        ]
        lines.append("  ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, cols)))
    full = arms[0]["full_distribution_bound"] if arms else float("nan")
    lines.append("")
    lines.append(
        "accept: observed first-verify acceptance (95% Wilson CI); E[acc]: its exact expectation given "
        "the workload rows (sum min(p,q') if X ~ q', sum q.p if X ~ q with one-hot q'), paired across arms"
    )
    lines.append(f"full-distribution bound (mean Σ min(p, q) at the first position): {full:.4f}")
    for a in arms:
        vf = a.get("vs_full")
        if vf:
            lines.append(
                f"  {a['name']:<14} vs full_fp32: acceptance {vf['acceptance_ratio']:.3f}x (paired E[acc]), "
                f"total bytes {vf['bytes_ratio'] * 100:.2f}%, proposal bytes {vf['proposal_bytes_ratio'] * 100:.2f}%"
            )
    ab = report["ab"]
    lines.append(
        f"effect over a {ab['response_tokens']}-token response (later verifies: acceptance "
        f"{ab['later_acceptance']}, {report['model']['num_steps']} step(s), same for every arm):"
    )
    for a in arms:
        e = a["effect"]
        rel = next((v for k, v in e.items() if k.startswith("verifies_vs_")), 1.0)
        lines.append(
            f"  {a['name']:<14} first verify commits {e['first_verify_tokens']:.3f} tokens; "
            f"{e['verifies_per_response']:.2f} verifies/response ({(rel - 1) * 100:+.2f}% vs baseline)"
        )
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: Path) -> None:
    """Acceptance vs bytes per request (log x), one point per arm, full bound marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = report["arms"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for i, a in enumerate(arms):
        x = max(1.0, a["bytes_per_request"]["total"])
        y = a["acceptance"]["mean"]
        lo, hi = a["acceptance"]["ci95"]
        line = ax.errorbar(
            [x], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=4,
            label=f"{a['name']} ({a['encoding']}→{a['synthesizer']})",
        )
        exp = a["acceptance"].get("exact_expected")
        if exp is not None and not math.isnan(exp):
            ax.plot([x], [exp], marker="x", markersize=9, color=line[0].get_color(), linestyle="none")
        # Alternate label offsets so neighbouring arms stay readable.
        ax.annotate(a["name"], (x, y), textcoords="offset points", xytext=(7, -14 if i % 2 else 8), fontsize=8)
    ax.plot([], [], marker="x", color="black", linestyle="none", label="× exact expectation (paired)")
    full = arms[0]["full_distribution_bound"] if arms else float("nan")
    if not math.isnan(full):
        ax.axhline(full, color="gray", linestyle="--", linewidth=1)
        ax.text(0.01, full, " full-distribution bound Σ min(p,q)", va="bottom", fontsize=8, color="gray",
                transform=ax.get_yaxis_transform())
    ax.set_xscale("log")
    ax.set_xlabel("bytes on the wire per request (control + bulk, log scale)")
    ax.set_ylabel("first-verify acceptance")
    wl = report["workload"]
    ax.set_title(
        f"pd-middleware ab: {wl.get('name')} workload, V={report['model']['vocab_size']}, "
        f"S={report['model']['num_steps']}, {report['requests_per_arm']} req/arm",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
