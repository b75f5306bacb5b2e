"""Fixtures of the chaos suite: its size, a worker cluster, a client on the test database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Cluster
from sizes import LONG, MODERATE, Size


@pytest.fixture
def size(request: pytest.FixtureRequest) -> Size:
    return LONG if request.config.getoption("--chaos-long") else MODERATE


@pytest.fixture
def cluster(mongo_uri: str, db_name: str, tmp_path: Path) -> Iterator[Cluster]:
    workers = Cluster(mongo_uri, db_name, tmp_path)
    try:
        yield workers
    finally:
        workers.close()
