"""docs/performance.md stays a reference, not a diary: at most 400 lines, no dates
(those are the journal's, docs/journal/), one table row for every workload of the bench, in
``WORKLOADS``' order, whose figures are quoted from bench/results.md, and a cost table whose
figures are bench/budget.json's."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "bench" / "results.md"
PENDING = "*next full run*"
"""What the figure column says of a workload that bench/results.md holds no row for yet."""
QUOTE = re.compile(r"“([^”]+)”")
ALSO = {"W1": ("W7 ",)}
"""Rows of bench/results.md a workload records under another name (W1's worker's memory)."""
COSTS = {
    "worker CPU": ("worker µs", " µs"),
    "mongod CPU": ("mongod µs", " µs"),
    "index keys": ("index keys", ""),
    "bytes a finished document": ("bytes per document", ""),
}
"""The cost table's rows, with bench/budget.json's line for each and the unit it is shown in."""


def workloads() -> list[str]:
    """The keys of ``WORKLOADS`` in bench/__main__.py, read without importing the bench."""
    tree = ast.parse((ROOT / "bench" / "__main__.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "WORKLOADS" for t in node.targets
        ):
            assert isinstance(node.value, ast.Dict)
            return [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
    raise AssertionError("no WORKLOADS in bench/__main__.py")


def section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def rows(text: str) -> list[list[str]]:
    """The cells of every table row of a text, header and separator rows left out."""
    found = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            found.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return found[1:] if found else found


def workload_rows() -> dict[str, list[str]]:
    table = rows(section(PAGE.read_text(), "## The workloads"))
    return {cells[0]: cells for cells in table}


def recorded(key: str) -> list[str]:
    """bench/results.md's rows of a workload: those whose name begins with its key."""
    prefixes = (f"{key} ", *ALSO.get(key, ()))
    lines = RESULTS.read_text().splitlines()
    return [line for line in lines if line.startswith(tuple(f"| {p}" for p in prefixes))]


def test_the_reference_is_short() -> None:
    assert len(PAGE.read_text().splitlines()) <= 400


def test_the_reference_holds_no_dates() -> None:
    """A date belongs to the journal; a link to one of its entries may carry one."""
    text = re.sub(r"\]\(journal/[^)]*\)", "]()", PAGE.read_text())
    dated = re.findall(r".{0,30}\b(?:19|20)\d\d-\d\d.{0,30}|.{0,30}\d\d:\d\d UTC.{0,10}", text)
    assert not dated, dated


def test_every_workload_has_a_row_in_its_order() -> None:
    assert list(workload_rows()) == workloads()


def test_each_figure_is_quoted_from_the_latest_full_run() -> None:
    """A quote is in bench/results.md among its workload's rows; a workload that file has a
    row for is quoted, not left for the next full run. When a full run rewrites the file, this
    names each figure to quote again, beside what the file now holds."""
    stale = []
    for key, cells in workload_rows().items():
        figure, found = cells[-1], recorded(key)
        quotes = QUOTE.findall(figure)
        if not quotes:
            if figure != PENDING or found:
                stale.append(f"{key}: {figure!r} (bench/results.md: {found})")
            continue
        missing = [q for q in quotes if not any(q in line for line in found)]
        if missing:
            stale.append(f"{key}: {missing} not in bench/results.md's rows {found}")
    hint = "quote each figure from those rows in “quotes” (docs/performance.md, The workloads)"
    assert not stale, "\n".join([*stale, hint])


def test_the_cost_table_is_the_committed_budget() -> None:
    budget = json.loads((ROOT / "bench" / "budget.json").read_text())["full"]
    table = rows(section(PAGE.read_text(), "### A plain task"))
    shown = {cells[0]: cells[1:] for cells in table if cells[0] in COSTS}
    assert set(shown) == set(COSTS)
    for row, (line, unit) in COSTS.items():
        expected = [
            f"{round(budget[f'{shape}, as shipped: {line}']):,}{unit}"
            for shape in ("drain", "trickle")
        ]
        assert shown[row] == expected, (row, shown[row], expected)
