"""The suite's own rules: one reading of ``CI`` (``tests/needs.py``) and no skip anywhere else;
worker subprocesses run the tree under test."""

from __future__ import annotations

import re
from pathlib import Path

import needs
import pytest

TESTS = Path(__file__).parents[1]
READS = re.compile(r"""environ(?:\.get\(|\[)\s*["']CI["']|getenv\(\s*["']CI["']""")
SKIPS = re.compile(r"pytest\.skip\(|importorskip\(|mark\.skip(?:if)?\b")


def test_ci_is_read_in_one_place_and_nothing_else_skips() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if "node_modules" in path.parts or path.name in ("needs.py", "test_needs.py"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if READS.search(line) or SKIPS.search(line):
                found.append(f"{path.relative_to(TESTS)}:{n}: {line.strip()}")
    assert not found, found


def test_a_missing_tool_fails_under_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(needs, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="no frobnicator"):
        needs.missing("no frobnicator")
    monkeypatch.setattr(needs, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match="no frobnicator"):
        needs.missing("no frobnicator")


def test_worker_subprocesses_run_the_tree_under_test() -> None:
    """A subprocess given ``PYTHONPATH`` gets this checkout's root on it (``harness.tree_env``),
    not the tests' folder alone (which runs whatever ``mtask`` is
    installed); only the install test runs the installed wheel, on purpose."""
    allowed = {"check.py", "test_install.py"}
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if "node_modules" in path.parts or path.name in allowed:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if '"PYTHONPATH":' in line and "MTASK_ROOT" not in line:
                found.append(f"{path.relative_to(TESTS)}:{n}: {line.strip()}")
    assert not found, found
