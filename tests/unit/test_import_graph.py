"""The package's modules import each other without cycles: none at import time (module-level
imports), and none with every import counted (under ``TYPE_CHECKING``, inside a function; a
package's ``__init__`` naming its own modules excepted, the root's counted); and the worker's
wings form no loop at package level (every import counted, wherever it is)."""

from __future__ import annotations

import ast
from pathlib import Path

import mtask

ROOT = Path(mtask.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
    return {n for n in names if n in known}


def every_import(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules ``path`` names anywhere: at module level, under ``TYPE_CHECKING``, inside a
    function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
    return {n for n in names if n in known}


WINGS = ("finding", "claiming", "running", "reacting")
"""The worker's wings (``mtask/worker/<wing>/``); what they share sits below them in ``worker/``."""


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return (
        parts[2]
        if parts[:2] == ["mtask", "worker"] and parts[2:3] in ([w] for w in WINGS)
        else None
    )


def wing_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Which wing imports which, every import of any module of a wing counted."""
    graph: dict[str, set[str]] = {wing: set() for wing in WINGS}
    for name, path in known.items():
        if (wing := wing_of(name)) is not None:
            graph[wing] |= {
                w for m in every_import(path, known) if (w := wing_of(m)) not in (None, wing)
            }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:  # noqa: C901 - Tarjan's algorithm, as written
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    assert graph.get("mtask.worker.claiming.claimer")
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_worker_wings_form_no_loop() -> None:
    """Finding fills the claim queue (``worker/claim_queue.py``, below the wings) and claiming
    pops it; claiming sees the run side through ``running/protocols.py``; the run side knows
    neither (it tells what happened through ``wiring.Signal``s and narrow protocols)."""
    graph = wing_graph(modules())
    assert graph["claiming"] == {"finding", "running"}  # the intended direction, still seen
    assert cycles(graph) == [], graph
    assert not graph["running"] & {"finding", "claiming"}, graph["running"]


def own_module(importer: str, imported: str, known: dict[str, Path]) -> bool:
    """``importer`` is a package whose ``__init__`` names one of its own modules (its surface,
    lazily or not): not an edge of a cycle. The root's ``__init__`` (``mtask``, the public face)
    is no such package: it names modules all over the package, so were it excepted every edge
    out of it would be, and a module importing code defined in it would close a loop the graph
    could not see (hence ``lazy_exports``, which packages use, lives in ``_version.py``)."""
    return (
        known[importer].name == "__init__.py"
        and "." in importer
        and imported.startswith(importer + ".")
    )


def full_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """Every import, wherever it is (module level, ``TYPE_CHECKING``, inside a function), less a
    package's ``__init__`` naming its own modules."""
    return {
        name: {m for m in every_import(path, known) if m != name and not own_module(name, m, known)}
        for name, path in known.items()
    }


def test_no_import_cycles_counting_every_import() -> None:
    """No cycle even through type-only and function-local imports: a module never reaches back
    to one that imports it, whenever the import runs."""
    graph = full_graph(modules())
    assert "mtask.registry" in graph["mtask"]  # the root's type-only imports are counted
    assert cycles(graph) == []


def test_a_function_local_cycle_is_found() -> None:
    known = {"m.a": Path("a.py"), "m.b": Path("b.py"), "m": Path("__init__.py")}
    graph = {"m.a": {"m.b"}, "m.b": {"m.a"}, "m": set()}
    assert cycles(graph) == [["m.a", "m.b"]]
    assert own_module("m.p", "m.p.a", known | {"m.p": Path("__init__.py")})
    assert not own_module("m.a", "m.b", known)
    assert not own_module("m", "m.a", known)  # the root's __init__ is counted
