"""Fixtures of the integration tier beyond tests/conftest.py's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from harness import gone, wait_for

from mtask.worker.running.pool.pool import ProcessPool


@pytest.fixture
async def pool() -> AsyncIterator[ProcessPool]:
    """A process pool (the worker's, for handlers in child processes); closed after the test,
    and every child it started gone."""
    p = ProcessPool(term_grace=0.5)
    yield p
    seen = list(p.pids)
    await p.close()
    await wait_for(lambda: all(gone(pid) for pid in seen), timeout=10)
