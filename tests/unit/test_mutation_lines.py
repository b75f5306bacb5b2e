"""Every mutation of the curated check (tests/mutations/check.py) still finds its one line, and
names tests that exist: a refactor that moves the line fails here, in seconds, rather than in
CI's mutation step after the suite."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _check() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "mutation_check", ROOT / "tests/mutations/check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutation_check", module)
    spec.loader.exec_module(module)
    return module


CHECK = _check()


@pytest.mark.parametrize("mutation", CHECK.MUTATIONS, ids=lambda m: m.name)
def test_the_mutation_finds_its_one_line(mutation: object) -> None:
    lines = (ROOT / mutation.path).read_text().splitlines(keepends=True)  # type: ignore[attr-defined]
    at = CHECK.locate(mutation, lines)
    assert lines[at].strip() == mutation.line  # type: ignore[attr-defined]
    assert mutation.replacement.strip() != mutation.line  # type: ignore[attr-defined]


@pytest.mark.parametrize("mutation", CHECK.MUTATIONS, ids=lambda m: m.name)
def test_the_mutations_tests_exist(mutation: object) -> None:
    for test in mutation.tests:  # type: ignore[attr-defined]
        path, _, name = test.partition("::")
        source = (ROOT / path).read_text()  # a whole file is a target too
        assert not name or f"def {name.split('[')[0]}(" in source, f"{test} is not in {path}"


def test_the_suites_report_stands_for_the_unmutated_run_only_where_every_case_passed(
    tmp_path: Path,
) -> None:
    report = tmp_path / "suite.xml"
    report.write_text(
        "<testsuites><testsuite>"
        '<testcase classname="tests.integration.test_a" name="test_one"/>'
        '<testcase classname="tests.integration.test_a" name="test_two[x]"/>'
        '<testcase classname="tests.integration.test_a" name="test_two[y]"><failure/></testcase>'
        '<testcase classname="tests.integration.test_b" name="test_skipped"><skipped/></testcase>'
        '<testcase classname="tests.integration.test_c" name="test_c"/>'
        "</testsuite></testsuites>"
    )
    asked = (
        "tests/integration/test_a.py::test_one",
        "tests/integration/test_a.py::test_two",  # one of its cases failed
        "tests/integration/test_a.py::test_two[x]",
        "tests/integration/test_a.py",  # the whole file: test_two[y] failed
        "tests/integration/test_b.py::test_skipped",
        "tests/integration/test_c.py",
        "tests/integration/test_d.py::test_absent",
    )
    assert CHECK.passed_in(report, asked) == (
        "tests/integration/test_a.py::test_one",
        "tests/integration/test_a.py::test_two[x]",
        "tests/integration/test_c.py",
    )
