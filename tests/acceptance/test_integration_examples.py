"""docs/examples/: each integration example of docs/integrations.md runs as written, against
the test mongod, on a database of its own."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from harness.processes import MTASK_ROOT
from needs import missing
from pymongo import MongoClient

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))
NEEDS = {
    "beanie_transaction.py": "beanie",
    "fastapi_app.py": "fastapi",
    "mongoengine_transaction.py": "mongoengine",
    "pydantic_ai_agent.py": "pydantic_ai",
}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_example_runs(example: Path, mongo_uri: str, mongo: MongoClient[dict[str, object]],
                          db_name: str) -> None:  # fmt: skip
    package = NEEDS.get(example.name)
    if package and importlib.util.find_spec(package) is None:
        missing(f"{package} is not installed (the dev extra has it)")
    ran = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(MTASK_ROOT), "MTASK_MONGODB_URI": mongo_uri,
             "EXAMPLE_DATABASE": db_name},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr
    if example.name in ("beanie_transaction.py", "mongoengine_transaction.py"):
        assert ran.stdout.strip() == "aborted: neither; committed: both"
    if example.name == "fastapi_app.py":
        assert ran.stdout.split("\n")[1:4] == ["succeeded shipped o-17", "401", "200"]
    if example.name == "pydantic_ai_agent.py":
        assert ran.stdout.splitlines() == [
            "tool: lookup_order",
            "tool: refund",
            "asked: refund {'order': 'o-17'}",
            "answer: Done: refunded o-17. ",
        ]


def test_every_example_is_covered() -> None:
    assert {p.name for p in EXAMPLES} == set(NEEDS)
