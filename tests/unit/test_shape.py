"""The package's shape: a worker of few top-level modules beside its wings, whose parts each wing
builds (``assembly.build`` stays short), no class over 300 lines, no function over ruff's
complexity limit without a reason beside it, at most two functions graded D or worse by radon,
and one file name for one thing."""

from __future__ import annotations

import ast
import re
import tomllib
from collections import Counter
from pathlib import Path

import radon.complexity as radon

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "mtask"
SOURCES = sorted(p for d in ("mtask", "tests", "bench") for p in (ROOT / d).rglob("*.py")
                 if "node_modules" not in p.parts)  # fmt: skip


def test_the_worker_has_at_most_15_top_level_modules() -> None:
    modules = [p.name for p in (PACKAGE / "worker").glob("*.py") if p.name != "__init__.py"]
    assert len(modules) <= 15, sorted(modules)


def test_no_class_is_over_300_lines() -> None:
    big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > 300:
                    big.append(f"{path.relative_to(ROOT)}:{node.name} ({size} lines)")
    assert not big, big


def test_ruffs_complexity_limit_is_10_and_every_exception_says_why() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert config["mccabe"]["max-complexity"] == 10
    assert "C90" in config["select"]
    bare = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in SOURCES
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "noqa: C901" in line and not re.search(r"noqa: C901 - \S.{8,}", line)
    ]
    assert not bare, f"a C901 exception without a one-line reason: {bare}"


def test_at_most_two_functions_are_graded_d_or_worse() -> None:
    worse = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for block in radon.cc_visit(path.read_text()):
            for item in [block, *getattr(block, "methods", [])]:
                if item.complexity > 20:  # radon's D starts at 21
                    worse.append(
                        f"{path.relative_to(ROOT)}:{item.lineno} {item.name} ({item.complexity})"
                    )
    assert len(set(worse)) <= 2, sorted(set(worse))


def test_the_workers_assembly_is_at_most_150_lines() -> None:
    """Each wing builds its own parts (``finding.build``, ``claiming.gate``/``build``,
    ``running.build``, ``maintenance.build``, ``reacting.build``): ``assembly.build`` only
    passes each what it needs of the others."""
    tree = ast.parse((PACKAGE / "worker" / "assembly.py").read_text())
    (build,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build"]
    assert build.end_lineno is not None
    assert build.end_lineno - build.lineno + 1 <= 150


NAMESAKES = {
    "__init__.py": "a package's surface",
    "__main__.py": "python -m: mtask/ and cli/",
    "api.py": "the API of its layer: client/ (every operation), web/ (REST)",
    "audit.py": "serve's audit: store/ (the collection), web/ (the middleware)",
    "batches.py": "batch handlers: limits/ (the declaration), worker/running/ (the runs)",
    "bulk.py": "operations on many tasks: store/, cli/",
    "children.py": "spawned child tasks: steps/ (the protocol), store/ (the writes)",
    "errors.py": "the errors of its layer: mtask/, worker/running/pool/",
    "events.py": "a task's change events: follow/ (the reopen loop), web/ (SSE)",
    "flows.py": "flows: mtask/ (the rules), store/ (the outboxes and dependents written)",
    "holds.py": "back-off holds: limits/ (the rule), store/ (the write)",
    "outcomes.py": "a run's outcome: worker/running/ (made), store/ (written)",
    "output.py": "a run's output: follow/, store/, web/",
    "protocols.py": "a wing's seams: finding/, running/, reacting/",
    "retention.py": "how long tasks are kept: store/, cli/",
    "roles.py": "MongoDB roles: security/ (the definition), store/ (created in MongoDB)",
    "rules.py": "the pure rules of its concept package: limits/, steps/",
    "schedules.py": "repeatable tasks: mtask/ (the rules), store/ (the schedules written and read)",
    "slots.py": "limit slots: limits/ (the requests), store/ (the atomic takes)",
    "streams.py": "following a task's output: follow/ (the stream), store/ (its reads)",
    "tasks.py": "tasks published and read: store/, cli/, contrib/django/",
    "transactional.py": "a transactional run: worker/running/, store/",
    "triggers.py": "triggers: mtask/ (pure), store/, cli/, web/",
    "worker.py": "running a worker: cli/, contrib/django/",
}
"""File names the package holds more than once, each for one concept in several layers (a
namesake per layer). Any other name appears once: ``slots.py`` is a limit's slots and
``handler_slots.py`` a worker's handler slots, not two ``slots.py``."""


def test_one_file_name_means_one_thing() -> None:
    names = Counter(p.name for p in PACKAGE.rglob("*.py"))
    twice = sorted(name for name, n in names.items() if n > 1 and name not in NAMESAKES)
    assert not twice, f"a file name used twice: {twice}; rename one, or add a namesake"


def test_the_top_level_holds_at_most_19_files() -> None:
    """The ground floor, the handler-facing API and one-module concepts; everything else lives
    in a package named for its concept."""
    files = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(files) <= 19, files


def driver_names(tree: ast.AST) -> set[str]:
    """How ``tree`` may spell the driver's ``Call``: the names it imports it as (``from
    mtask.driver import Call [as C]``) and ``<module>.Call`` for each name it gives the driver
    module (``from mtask import driver [as d]``, ``import mtask.driver [as d]``, ``import
    mtask``)."""
    spelled: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                if (node.module, alias.name) == ("mtask.driver", "Call"):
                    spelled.add(alias.asname or "Call")
                elif (node.module, alias.name) == ("mtask", "driver"):
                    spelled.add(f"{alias.asname or 'driver'}.Call")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("mtask", "mtask.driver"):
                    module = alias.asname if alias.name == "mtask.driver" else None
                    spelled.add(f"{module or 'mtask.driver'}.Call")
    return spelled


def driver_calls(tree: ast.AST) -> list[int]:
    """The lines of ``tree`` that make a ``driver.Call``, however the module imported it."""
    spelled = driver_names(tree)
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name | ast.Attribute)
        and ast.unparse(node.func) in spelled
    ]


def test_every_mongodb_call_is_made_in_the_store() -> None:
    """All database interaction in one room (Oban's engine): no ``driver.Call`` is made outside
    ``mtask/store/`` and ``mtask/driver.py``. The pool's pipe message named ``Call`` is its own
    (``pipe.Call``), and the step engine's ``Invoke`` a plan's request: neither is the driver's."""
    outside = [
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "store" and path != PACKAGE / "driver.py"
        for line in driver_calls(ast.parse(path.read_text()))
    ]
    assert outside == []


def test_the_driver_call_is_found_however_it_is_imported() -> None:
    spellings = {
        "from mtask.driver import Call\nCall('find_one', ({},))": [2],
        "from mtask.driver import Call as C\nC('find_one', ({},))": [2],
        "from mtask import driver as d\nd.Call('find_one', ({},))": [2],
        "import mtask.driver\nmtask.driver.Call('find_one', ({},))": [2],
        "import mtask.driver as d\nd.Call('find_one', ({},))": [2],
        "from mtask.worker.running.pool import pipe\npipe.Call(f, {}, None)": [],
        "class Call: ...\nCall()": [],
    }
    for code, lines in spellings.items():
        assert driver_calls(ast.parse(code)) == lines, code


ISSUE = re.compile(r"\bissues? \d+", re.IGNORECASE)
"""A reference to a numbered issue: history, which belongs in CHANGELOG.md and the journal."""


def test_history_stays_out_of_the_code_and_the_headings() -> None:
    """At most 10 "issue N" in mtask/ (code, comments, docstrings, schemas, templates), and none
    in a heading of the docs (the journal and CHANGELOG.md are history)."""
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in sorted(PACKAGE.rglob("*"))
        if p.is_file() and p.suffix in {".py", ".json", ".html", ".css", ".js"}
        for m in ISSUE.finditer(p.read_text())
    ]
    assert len(found) <= 10, found
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    headings = [
        f"{page.relative_to(ROOT)}: {line}"
        for page in pages
        for line in page.read_text().splitlines()
        if line.startswith("#") and ISSUE.search(line)
    ]
    assert headings == []
