"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pymongo import MongoClient

README = Path(__file__).parent.parent / "README.md"
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
