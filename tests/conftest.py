"""Fixtures: one real MongoDB replica set for the session, one database per test.

``MTASK_TEST_MONGODB_URI`` points the tests at an existing replica set; otherwise the embedded
mongod is started in a temporary directory. If no MongoDB can be had, the tests fail loudly
under CI (``CI=true``) and are skipped with the reason elsewhere.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import T0, drained, until_recorded
from hypothesis import settings
from needs import missing
from pymongo import MongoClient
from tiers import group_of, tier_lines, tier_times

from mtask import AsyncTaskClient, TaskClient
from mtask.clock import FixedClock
from mtask.driver import inbox_database
from mtask.errors import MtaskError


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-long",
        action="store_true",
        help="run the chaos suite (tests/chaos) at its long size instead of the moderate one",
    )


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How the suite is spread over its processes (``-n``): by ``tests/tiers.group_of``, a
    file's tests in one process, the chaos tier's in two lanes, one test at a time in each.
    xdist's own ``loadscope`` scheduler, given that scope (its documented hook)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """One line a tier: its tests and their setup, call and teardown time (``tests/tiers.py``)."""
    phases = [
        (report.nodeid, report.duration)
        for reports in terminalreporter.stats.values()
        for report in reports
        if isinstance(report, pytest.TestReport)
    ]
    lines = tier_lines(tier_times(phases))
    if lines:
        terminalreporter.section("time per tier")
        for line in lines:
            terminalreporter.write_line(line)


# Tests never assert wall-clock figures, and hypothesis's per-example deadline is one: on a
# loaded machine a pure example can take longer than 200 ms. Shrinking and health checks stay.
settings.register_profile("mtask", deadline=None)
settings.load_profile("mtask")

# The CLI prints rich's tables, which wrap at the terminal's width and cut a word longer than
# its column short: the tests that read them run at one known width, whatever terminal they are
# started from (CI's is 80 columns), and so do the CLI processes they start.
os.environ["COLUMNS"] = "160"


CREDENTIAL = re.compile(r"mongodb(?:\+srv)?://[^/\s:@]+:(?!\*\*\*@)[^@\s/]+@|mrt1\.[\w-]{8,}\.")
"""A MongoDB URI with its password, or a read token: never in a log line."""


@pytest.fixture(autouse=True)
def no_credential_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Every test's captured log lines are scanned for credentials."""
    yield
    found = CREDENTIAL.search(caplog.text)
    assert found is None, f"a credential in a log line: {found.group(0)[:24]}…"


@pytest.fixture(scope="session")
def mongo_uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = os.environ.get("MTASK_TEST_MONGODB_URI")
    if env:
        yield env
        return
    from mtask.embedded import EmbeddedMongo

    server = EmbeddedMongo(Path(tmp_path_factory.mktemp("mongodb")))
    try:
        uri = server.start()
    except MtaskError as exc:
        missing(f"no MongoDB for the tests: {exc}")
    try:
        yield uri
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mongo(mongo_uri: str) -> Iterator[MongoClient[dict[str, Any]]]:
    client: MongoClient[dict[str, Any]] = MongoClient(mongo_uri, tz_aware=True)
    yield client
    client.close()


@pytest.fixture
def db_name(mongo: MongoClient[dict[str, Any]]) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:16]}"
    yield name
    mongo.drop_database(name)
    mongo.drop_database(inbox_database(name))  # the shared stream's inboxes, if any


@pytest.fixture
def client(mongo_uri: str, db_name: str) -> Iterator[TaskClient]:
    with TaskClient(mongo_uri, database=db_name) as c:
        yield c


@pytest.fixture
async def aclient(mongo_uri: str, db_name: str) -> AsyncIterator[AsyncTaskClient]:
    async with AsyncTaskClient(mongo_uri, database=db_name) as c:
        yield c


@pytest.fixture
def drain(mongo_uri: str, db_name: str) -> Any:
    """``drain(registry, publish, key, state=None, **worker_options)``: ``harness.drained``
    on the test's database."""
    return functools.partial(drained, uri=mongo_uri, database=db_name)


@pytest.fixture
def worker_after(mongo_uri: str, db_name: str) -> Any:
    """``async with worker_after(registry, publish, key, state=None, **worker_options) as
    (worker, events)``: ``harness.until_recorded`` on the test's database."""
    return functools.partial(until_recorded, uri=mongo_uri, database=db_name)


@pytest.fixture
def pipe_ends() -> Iterator[tuple[Any, Any]]:
    """The two ends of a ``multiprocessing.Pipe`` (a worker's and its child's), closed after."""
    ours, theirs = multiprocessing.Pipe()
    yield ours, theirs
    ours.close()
    theirs.close()


@pytest.fixture
def clock() -> FixedClock:
    """An injected clock at ``T0`` (tests advance it instead of sleeping)."""
    return FixedClock(T0)


@pytest.fixture
def tc(mongo_uri: str, db_name: str, clock: FixedClock) -> Iterator[TaskClient]:
    """A client whose clock is ``clock``."""
    with TaskClient(mongo_uri, database=db_name, clock=clock) as c:
        yield c
