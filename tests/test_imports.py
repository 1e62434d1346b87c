"""The package's import graph has no cycle and no module outgrows its room."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT

PACKAGES = ("testbed", "workers", "protocol", "control")
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


def _imports(path: Path, module: str, known: set[str], type_level: bool = False) -> set[str]:
    """Every in-package module ``module`` imports (at any depth of its code, except under
    ``if TYPE_CHECKING``), plus the packages those imports initialise first."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if _type_checking_only(node) and not type_level:
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


def _graph(type_level: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports; with ``type_level``, also those imported
    only for type checking (a cycle there still ties two modules together)."""
    mods = _modules()
    known = set(mods)
    graph = {m: _imports(p, m, known, type_level) for m, p in mods.items()}
    # A package's __init__ is initialised before any of its modules, so a module's imports
    # include its package; but the package's own imports of its modules are not a cycle.
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def test_no_import_cycle() -> None:
    graph = _graph()
    # The walk sees real edges: top-level, relative and function-level imports.
    assert "protocol.messages" in graph["workers.decode"] and "protocol.router_config" in graph["control.router"]
    assert "testbed.deploy.deployment" in graph["testbed.load.verify"]
    assert "workers.model" in graph["testbed.load.verify"]  # imported inside run_verify (torch)
    assert _cycles(graph) == []
    assert _cycles(_graph(type_level=True)) == []


def test_cycle_detection_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_shared_floor_leans_on_nothing_above_it() -> None:
    """``protocol/`` is what both sides of a process boundary import: it imports none of them
    (type-level imports included: a contract that names an orchestrator's type is no contract)."""
    graph = _graph(type_level=True)
    leaks = {m: sorted(d for d in deps if not d.startswith("protocol")) for m, deps in graph.items()
             if m.startswith("protocol")}
    assert not any(leaks.values()), leaks


def test_workers_never_import_the_orchestrator() -> None:
    graph = _graph()
    leaks = {m: sorted(d for d in deps if d.startswith("testbed")) for m, deps in graph.items()
             if m.startswith("workers")}
    assert not any(leaks.values()), leaks


def test_modules_stay_small() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert sizes["testbed.cli.main"] <= CLI_MAX_LINES, sizes["testbed.cli.main"]
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


HEAVY = ("torch", "transformers", "pandas", "matplotlib", "mininet", "scipy", "optuna")


def _top_level_imports(tree: ast.Module) -> set[str]:
    """Modules imported at the top (``from a import b`` counts as ``a`` and ``a.b``)."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out |= {node.module or ""} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def _heavy_modules() -> set[str]:
    """Project modules whose import pulls in a heavy library (torch, transformers, pandas,
    matplotlib, mininet), themselves or through the project modules they import at their
    top: the only ones a function may import late, so that a command that never needs them
    (``testbed clean``, ``net up``) does not pay seconds for them."""
    mods = _modules()
    tops = {m: _top_level_imports(ast.parse(p.read_text())) for m, p in mods.items()}
    heavy = {m for m, imps in tops.items() if any(i.split(".")[0] in HEAVY for i in imps)}
    grew = True
    while grew:
        new = {m for m, imps in tops.items() if m not in heavy
               and any(i in heavy or i.rpartition(".")[0] in heavy for i in imps)}
        heavy |= new
        grew = bool(new)
    return heavy


def _late_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every project import inside a function (``TYPE_CHECKING`` aside)."""
    tree = ast.parse(path.read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                base = node.module or ""
                names = [f"{base}.{a.name}" for a in node.names] + [base]
            for name in names:
                if name.split(".")[0] in PACKAGES:
                    found.append((node.lineno, name))
                    break
    return found


def test_project_modules_are_imported_at_the_top() -> None:
    """The dependency graph is in the module headers: a function imports a project module
    only when that module pulls in a heavy library itself."""
    mods = _modules()
    heavy = _heavy_modules()
    assert "workers.model" in heavy and "testbed.net.build" not in heavy
    late = {}
    for p in mods.values():
        for line, name in _late_imports(p):
            target = name if name in mods else name.rpartition(".")[0]
            if target not in heavy:
                late[f"{p.relative_to(ROOT)}:{line}"] = name
    assert late == {}


def test_a_late_import_of_a_light_module_is_found(tmp_path: Path) -> None:
    p = tmp_path / "m.py"
    p.write_text("import os\n\ndef f():\n    from testbed.errors import InputError\n    import json\n    return 1\n")
    assert _late_imports(p) == [(4, "testbed.errors.InputError")]


def test_the_cli_starts_without_heavy_libraries() -> None:
    """`testbed clean`, `net up` and every parse error answer in well under a second: the
    command line imports no torch, transformers, pandas, matplotlib, mininet, scipy or optuna until a
    command needs them."""
    code = f"import sys, testbed.cli.main; print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_simulator_runs_workers_without_transformers() -> None:
    """A simulated worker is modeled: it reads its model's shape from ``config.json``
    (``workers.model_config``), so the simulator's process never pays transformers' ~2.5 s
    and ~150 MB (a sweep starts one process per point)."""
    code = "import sys, testbed.sim.engine; print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
