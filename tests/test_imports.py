"""The package's import graph has no cycle and no module outgrows its room."""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import ROOT

PACKAGES = ("testbed", "workers")
MAX_LINES = 400
CLI_MAX_LINES = 250


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """Every in-package module ``module`` imports (at any depth of its code, except under
    ``if TYPE_CHECKING``), plus the packages those imports initialise first."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # a.b.c initialises a, a.b, then a.b.c
                prefix = ".".join(parts[:i])
                if prefix in known and prefix != module:
                    found.add(prefix)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {m: _imports(p, m, known) for m, p in mods.items()}
    # A package's __init__ is initialised before any of its modules, so a module's imports
    # include its package; but the package's own imports of its modules are not a cycle.
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def test_no_import_cycle() -> None:
    graph = _graph()
    # The walk sees real edges: top-level, relative and function-level imports.
    assert "protocol.messages" in graph["workers.decode"] and "protocol.router_config" in graph["testbed.deploy.router"]
    assert "testbed.deploy.deployment" in graph["testbed.load.verify"]  # imported inside run_verify
    assert _cycles(graph) == []


def test_cycle_detection_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_workers_never_import_the_orchestrator() -> None:
    graph = _graph()
    leaks = {m: sorted(d for d in deps if d.startswith("testbed")) for m, deps in graph.items()
             if m.startswith("workers")}
    assert not any(leaks.values()), leaks


def test_modules_stay_small() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert sizes["testbed.cli.main"] <= CLI_MAX_LINES, sizes["testbed.cli.main"]
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}
