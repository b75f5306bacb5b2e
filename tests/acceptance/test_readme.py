"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

README = Path(__file__).parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(
    index: int, mongo_uri: str, mongo: MongoClient[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTASK_MONGODB_URI", mongo_uri)
    mongo.drop_database("mtask")
    try:
        exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), {})
    finally:
        mongo.drop_database("mtask")


def test_the_two_set_up_commands() -> None:
    """The set-up section holds exactly the two commands a new user copies: the demo on the
    embedded MongoDB and the test suite (an edit once pasted CLI lines into the first)."""
    section = README.read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    blocks = [b.strip() for b in re.findall(r"```sh\n(.*?)```", section, flags=re.S)]
    venv = "python3 -m venv .venv && .venv/bin/pip install -e "
    assert blocks == [
        f"{venv}'.[embedded]' && .venv/bin/mtask demo",
        f"{venv}'.[dev]' && .venv/bin/python -m pytest",
    ]
