"""Every relative link between the README and the docs reaches a page that exists, and an
anchor that is one of its headings (GitHub's slugs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
LINK = re.compile(r"\]\(([^)\s]+\.md)(#[^)\s]+)?\)")


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return "#" + text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.MULTILINE)
    return {slug(h) for h in heads}


def test_links_between_the_docs_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # the journal too
    broken = []
    for page in pages:
        for target, anchor in LINK.findall(page.read_text()):
            if target.startswith("http"):
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and anchor not in anchors(path):
                broken.append(f"{page.name}: {target}{anchor}")
    assert not broken, broken


def test_every_page_is_linked_from_the_design_index() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name not in ("design.md", "performance.md"):
            assert f"({page.name})" in design, f"{page.name} is not in design.md's index"
