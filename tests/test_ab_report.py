"""The typed A/B report and its renderings, from hand-made statistics (no deployment)."""

from __future__ import annotations

import csv
import io
import json
import math

import msgspec
import pytest

from pd_middleware.ab.collector import ArmStats
from pd_middleware.ab.render import FORMATS, fmt_bytes, render
from pd_middleware.ab.report import RunFacts, build_report
from pd_middleware.ab.schema import Report
from pd_middleware.config import load_config
from pd_middleware.evaluation.stats import ExactnessAccumulator

CFG = load_config("configs/ab_tiny.toml")


def _stats(
    name: str, synth: str, enc: str, verified: int, accepted: int, exact_sum: float, failed: int = 0
) -> ArmStats:
    st = ArmStats(name=name, synthesizer=synth, encoder=enc, encoder_options={}, exactness=ExactnessAccumulator())
    st.verified = st.delivered = verified
    st.first_accepted = st.accepted_sum = accepted
    st.expected_first_sum = st.exact_first_sum = exact_sum
    st.full_bound_sum = 0.8 * verified
    for ms in (1.0, 2.0, 3.0, 4.0):
        st.latency_ms.add(ms)
    st.first_t, st.last_t = 0.0, 1.0
    return st


def _report(reference: str | None = "full_fp32", partial: bool = False) -> Report:
    stats = {
        "one_hot": _stats("one_hot", "one_hot", "softmax", 100, 20, 20.0),
        "full_fp32": _stats("full_fp32", "full_distribution", "full", 100, 80, 80.0),
        "sparse": _stats("sparse", "sparse", "sparse", 100, 76, 76.0),
    }
    hidden = CFG.model.hidden_size * 2
    prefill = {
        "sent": dict.fromkeys(stats, 100),
        "bytes": {
            "one_hot": {"control": 24_000, "bulk": 100 * hidden},
            "full_fp32": {"control": 33_000, "bulk": 100 * (hidden + 4096)},
            "sparse": {"control": 41_000, "bulk": 100 * (hidden + 300)},
        },
        "send_errors": {"sparse": ["sparse/7: TransferError: peer went away"]},
    }
    facts = RunFacts(
        config=CFG,
        workload={"name": "synthetic"},
        requests=100,
        seed=7,
        wall_s=1.5,
        partial=partial,
        baseline="one_hot",
        reference=reference,
        receiver={},
        prefill=prefill,
    )
    return build_report(stats, facts)


def test_roles_ratios_and_effect_by_role() -> None:
    r = _report()
    arms = {a.name: a for a in r.arms}
    assert [a.role for a in r.arms] == ["baseline", "reference", "candidate"]
    assert arms["full_fp32"].vs_reference is None  # never compared with itself
    assert arms["sparse"].vs_reference.acceptance_ratio == pytest.approx(0.76 / 0.80)
    assert arms["sparse"].vs_reference.proposal_bytes_ratio == pytest.approx(300 / 4096)
    assert arms["one_hot"].vs_reference.proposal_bytes_ratio == 0.0
    assert arms["one_hot"].effect.verifies_vs_baseline == 1.0
    # E1 = 1.8 against 1.2: 0.6 tokens / 1.7 per later verify = 0.353 verifies saved at every length.
    pts = arms["full_fp32"].effect.by_response_length
    assert [p.saved_vs_baseline for p in pts] == pytest.approx([0.6 / 1.7] * 7, abs=1e-4)
    assert pts[0].saved_pct_vs_baseline > pts[-1].saved_pct_vs_baseline > 0
    assert arms["sparse"].send_failures.first_error == "TransferError: peer went away"
    # Without a reference arm there are no ratios, and the table says so.
    r2 = _report(reference=None)
    assert all(a.vs_reference is None for a in r2.arms) and "ref" not in render(r2, "table", 120).split("\n")[3]


def test_json_round_trips_and_names_every_documented_field() -> None:
    r = _report()
    data = json.loads(render(r, "json"))
    assert msgspec.json.decode(r.to_json(), type=Report) == r
    assert data["schema_version"] == 2 and data["arms"][0]["exact"]["pass"] is False  # no tokens recorded
    assert data["arms"][0]["exact"]["tv"] is None  # null, never NaN
    with open("docs/report.md", encoding="utf-8") as f:
        doc = f.read()
    for name in _field_names(Report):
        assert f"`{name}`" in doc, f"docs/report.md does not document {name!r}"


def _field_names(typ: type) -> set[str]:
    """Every JSON field name in the Report tree."""
    out: set[str] = set()
    for f in msgspec.structs.fields(typ):
        out.add(f.encode_name)
        for t in _struct_types(f.type):
            out |= _field_names(t)
    return out


def _struct_types(t: object) -> list[type]:
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return [t]
    return [x for a in getattr(t, "__args__", ()) for x in _struct_types(a)]


@pytest.mark.parametrize("width", [120, 100])
def test_table_fits_the_width_without_jargon(width: int) -> None:
    text = render(_report(), "table", width)
    assert max(len(line) for line in text.splitlines()) <= width
    for gone in ("TV/bound", "acc.len", "1.000x", "full_fp32 vs full_fp32"):
        assert gone not in text
    assert "proposal B/req" in text and "p50/p99 ms" in text and "0.950x" in text


def test_partial_and_failures_are_rendered() -> None:
    text = render(_report(partial=True), "table", 120)
    assert "PARTIAL (cancelled)" in text
    assert "arm sparse: 1 send error(s) at the prefill; first: sparse/7: TransferError: peer went away" in text


def test_markdown_and_csv() -> None:
    r = _report()
    md = render(r, "markdown")
    assert "| arm | accept [95% CI] |" in md and "|---|" in md
    rows = list(csv.DictReader(io.StringIO(render(r, "csv"))))
    assert [row["arm"] for row in rows] == ["one_hot", "full_fp32", "sparse"]
    assert float(rows[2]["acceptance"]) == pytest.approx(0.76) and rows[0]["role"] == "baseline"
    assert set(FORMATS) == {"table", "markdown", "json", "csv"}
    with pytest.raises(ValueError, match="unknown format 'yaml'"):
        render(r, "yaml")  # type: ignore[arg-type]  # the error path under test


def test_fmt_bytes_units() -> None:
    assert [fmt_bytes(x) for x in (0, 999, 4096, 608_256, 2.5e6, None)] == [
        "0 B",
        "999 B",
        "4.1 KB",
        "608.3 KB",
        "2.5 MB",
        "-",
    ]
    assert not math.isnan(_report().arms[0].latency_ms.p50)


def test_progress_lines_off_a_terminal_and_a_bar_on_one() -> None:
    from pd_middleware.ab.progress import Progress

    plain = io.StringIO()
    bar = Progress(200, "ab", stream=plain)
    for done in range(0, 201, 10):
        bar.update(done)
    bar.close()
    lines = plain.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("ab: 200/200 payloads (100%)")

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = Progress(200, "ab", stream=tty)
    bar.update(100)
    bar.close()
    assert "100/200" in tty.getvalue() and "━" in tty.getvalue()  # rich drew its bar (transient)
    silent = io.StringIO()
    off = Progress(200, "ab", enabled=False, stream=silent)
    off.update(200)
    off.close()
    assert silent.getvalue() == ""
