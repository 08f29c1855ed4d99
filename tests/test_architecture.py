"""docs/architecture.md matches the code: its diagram's edges are the real imports, every
module is named on the page, and no import cycle exists (tests/_imports.py reads the
imports with ``ast``)."""

from __future__ import annotations

import re

from _imports import ROOT, cycles, house_edges, mermaid_edges, module_edges, modules  # tests/ is on sys.path

DOC = ROOT / "docs" / "architecture.md"
EDGE = re.compile(r"^\s*(\w+) (-->|-\.->) (\w+)\s*$")


def documented_edges(text: str) -> set[str]:
    """The edge lines of the page's ```mermaid block, normalised to ``a --> b``."""
    (block,) = re.findall(r"```mermaid\n(.*?)```", text, re.S)
    return {f"{m[1]} {m[2]} {m[3]}" for line in block.splitlines() if (m := EDGE.match(line))}


def test_diagram_edges_are_the_imports() -> None:
    actual = set(mermaid_edges(house_edges()))
    documented = documented_edges(DOC.read_text(encoding="utf-8"))
    assert len(actual) > 50  # the reader found the graph (an empty read would pass trivially)
    missing, extra = sorted(actual - documented), sorted(documented - actual)
    assert not missing and not extra, (
        f"docs/architecture.md is out of date; regenerate with `python tests/_imports.py`.\n"
        f"imports not drawn: {missing}\ndrawn but not imported: {extra}"
    )


def _section(text: str, package: str) -> str:
    """The page's text about one package: from its "`pd_middleware/...`" line to the next."""
    start = text.index(f"\n`{package}/`", text.index("## Modules"))
    nxt = text.find("\n`pd_middleware/", start + 1)
    return text[start : nxt if nxt != -1 else len(text)]


def test_every_module_is_named_on_the_page() -> None:
    text = DOC.read_text(encoding="utf-8")
    unnamed = []
    for name, path in modules().items():
        parts = name.split(".")
        if parts[0] != "pd_middleware":
            continue
        # A module is described in its package's section; a package's __init__ in its own.
        package = "/".join(parts if path.name == "__init__.py" else parts[:-1])
        if f"`{path.name}`" not in _section(text, package):
            unnamed.append(name)
    assert not unnamed, f"docs/architecture.md does not say what these own: {unnamed}"


def test_no_import_cycle() -> None:
    edges = module_edges()
    assert cycles(edges) == [], "module-level import cycle"
    assert cycles(house_edges()) == [], "the one-way flow between the diagram's boxes is broken"


def test_cycle_check_can_fail() -> None:
    """Negative control: a planted cycle, eager on every edge, is found; deferred edges are not cycles."""
    planted = {("a", "b"): True, ("b", "c"): True, ("c", "a"): True, ("c", "d"): True}
    assert cycles(planted) == [["a", "b", "c"]]
    assert cycles({**planted, ("c", "a"): False}) == []


def test_reader_sees_deferred_and_relative_imports() -> None:
    """Negative control for the reader: the edges it reports for a module it knows."""
    edges = module_edges()
    # ab/runner.py builds its decode through the middleware, inside run_ab (deferred).
    assert edges[("pd_middleware.ab.runner", "pd_middleware.middleware")] is False
    # workloads/trace.py: `from . import WorkloadBatch` at module level (eager, relative).
    assert edges[("pd_middleware.workloads.trace", "pd_middleware.workloads")] is True
    # and a page that leaves one edge out is caught
    text = DOC.read_text(encoding="utf-8").replace("    ab --> _errors\n", "", 1)
    assert "ab --> _errors" in set(mermaid_edges(house_edges())) - documented_edges(text)
