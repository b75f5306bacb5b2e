"""docs/architecture.md's module map names every module of the package, and only those; its
table of packages names every package, and only those."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def mapped() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def package_rows() -> list[str]:
    """The rows of the packages' table (under "## Layers"), one package or a few a row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def test_the_packages_table_names_every_package() -> None:
    package = ROOT / "mtask"
    packages = {f"{p.parent.relative_to(package)}/" for p in package.rglob("__init__.py")} - {"./"}
    named = [n for row in package_rows() for n in re.findall(r"`([^`]+/)`", row.split("|")[1])]
    assert len(named) == len(set(named)), "a package is named twice"
    missing, stale = packages - set(named), set(named) - packages
    assert not missing and not stale, f"not in the table: {sorted(missing)}; gone: {sorted(stale)}"
    for row in package_rows():
        assert row.split("|")[2].strip(), f"no concept: {row!r}"


def test_the_module_map_names_every_module() -> None:
    package = ROOT / "mtask"
    modules = sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))
    listed = mapped()
    assert len(listed) == len(set(listed)), "a module is listed twice"
    missing, stale = set(modules) - set(listed), set(listed) - set(modules)
    assert not missing and not stale, f"not in the map: {sorted(missing)}; gone: {sorted(stale)}"


def test_the_map_is_short_and_described() -> None:
    """The prose is short: at most the 118 lines it had room for beside a map of 182 modules
    (300 in all). The map grows a line a module, and the packages' table a line a package (or a
    few), so splitting one costs no prose."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert len(text.splitlines()) - len(mapped()) - len(package_rows()) <= 300 - 182
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    for line in block.splitlines():
        if line.strip():
            assert re.match(r"^\S+\.py\s{2,}\S", line), f"no description: {line!r}"


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by their basename (the tiers are not packages): two of one
    name cannot be collected in one run."""
    names: dict[str, str] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if "node_modules" in path.parts:
            continue
        other = names.setdefault(path.name, str(path.relative_to(ROOT)))
        assert other == str(path.relative_to(ROOT)), f"{path.name}: {other} and {path}"
