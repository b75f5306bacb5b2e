"""docs/architecture.md's module map names every module of the package, and only those."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def mapped() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def test_the_module_map_names_every_module() -> None:
    package = ROOT / "mtask"
    modules = sorted(str(p.relative_to(package)) for p in package.rglob("*.py"))
    listed = mapped()
    assert len(listed) == len(set(listed)), "a module is listed twice"
    missing, stale = set(modules) - set(listed), set(listed) - set(modules)
    assert not missing and not stale, f"not in the map: {sorted(missing)}; gone: {sorted(stale)}"


def test_the_map_is_short_and_described() -> None:
    """The prose is short: at most the 118 lines it had room for beside a map of 182 modules
    (300 in all). The map grows a line a module, so splitting one (issue 60) costs no prose."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert len(text.splitlines()) - len(mapped()) <= 300 - 182
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
