"""The import graph of the shipped packages, read from the source with ``ast``.

Used by tests/test_architecture.py (the documented diagram matches the code, and no
import cycle exists). Run it to print the edges in the mermaid form
docs/architecture.md uses::

    .venv/bin/python tests/_imports.py
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Package directories and the import name each one provides.
PACKAGES = {
    "pd_middleware": ROOT / "pd_middleware",
    "pd_middleware_plugins": ROOT / "plugins" / "pd_middleware_plugins",
    "pd_middleware_full": ROOT / "plugins" / "pd_middleware_full",
}
#: Subpackages drawn as one box each in the house diagram.
GROUPED = ("ab", "transport", "integrations", "workloads")


def modules() -> dict[str, Path]:
    """Every module of the shipped packages: dotted name -> file."""
    out: dict[str, Path] = {}
    for pkg, base in PACKAGES.items():
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement, with True when it runs at import time (module level, not
    under ``if TYPE_CHECKING``, not inside a function)."""

    def walk(nodes: list[ast.stmt], eager: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node, eager
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(node.body, False)
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body, eager)
            elif isinstance(node, ast.If):
                yield from walk(node.body, eager and not _is_type_checking(node.test))
                yield from walk(node.orelse, eager)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                    yield from walk(block, eager)
            elif isinstance(node, ast.With | ast.For | ast.While):
                yield from walk(node.body, eager)

    yield from walk(tree.body, True)


def module_edges() -> dict[tuple[str, str], bool]:
    """(importer, imported) -> eager, over the shipped modules only (third-party left out).

    ``eager`` is True when some import of that pair runs at import time; False when every
    one is deferred (inside a function or under ``TYPE_CHECKING``).
    """
    mods = modules()
    edges: dict[tuple[str, str], bool] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, eager in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".")
                    base = base if is_pkg else base[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # `from pkg import sub` names a submodule when one exists.
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                targets = subs if subs and len(subs) == len(node.names) else [mod, *subs]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[(name, t)] = edges.get((name, t), False) or eager
    return edges


def node(module: str) -> str:
    """The house diagram's box for a module: the subpackage for grouped ones."""
    parts = module.split(".")
    if parts[0] != "pd_middleware":
        return parts[0]
    if len(parts) == 1:
        return "api"
    return parts[1]


def house_edges() -> dict[tuple[str, str], bool]:
    """:func:`module_edges` collapsed onto the diagram's boxes (self-edges dropped)."""
    out: dict[tuple[str, str], bool] = {}
    for (a, b), eager in module_edges().items():
        na, nb = node(a), node(b)
        if na != nb:
            out[(na, nb)] = out.get((na, nb), False) or eager
    return out


def cycles(edges: dict[tuple[str, str], bool]) -> list[list[str]]:
    """Strongly connected components of more than one module, over eager edges only."""
    graph: dict[str, list[str]] = {}
    for (a, b), eager in edges.items():
        if eager:
            graph.setdefault(a, []).append(b)
            graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few dozen nodes
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def mermaid_edges(edges: dict[tuple[str, str], bool]) -> list[str]:
    """One mermaid line per edge, sorted: ``a --> b`` eager, ``a -.-> b`` deferred."""
    return [f"{a} {'-->' if eager else '-.->'} {b}" for (a, b), eager in sorted(edges.items())]


if __name__ == "__main__":
    for line in mermaid_edges(house_edges()):
        print(f"    {line}")
    print("cycles (eager, module level):", cycles(module_edges()) or "none", file=sys.stderr)
