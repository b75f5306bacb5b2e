"""Documents of any shape, ``_id`` of any BSON type, inserted while workers of both stream
modes run: no worker stops, each document is run or marked ``invalid`` with its reason, and
every reader shows it."""

from __future__ import annotations

import datetime as dt
import itertools
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from bson import Binary, Decimal128, Int64, MaxKey, MinKey, ObjectId, Timestamp
from fastapi.testclient import TestClient
from harness import Cluster, on_a_server
from hypothesis import given
from hypothesis import strategies as st
from pymongo import MongoClient
from pymongo.errors import DuplicateKeyError, WriteError

from mtask.vocabulary import TaskStatus
from mtask.web import create_app

pytestmark = pytest.mark.chaos

SWEEP = 3.0
TOKEN = "t"
ENDED = {TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.INVALID}
_serial = itertools.count()

# Every type MongoDB accepts as an _id (not an array, a regex or undefined), nested ones too.
scalar_ids = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.integers(-(2**63), 2**63 - 1).map(Int64),
    st.floats(allow_nan=False),
    st.decimals(allow_nan=False, allow_infinity=False, places=3).map(
        lambda d: Decimal128(Decimal(d))
    ),
    st.datetimes(min_value=dt.datetime(1970, 1, 1), max_value=dt.datetime(2100, 1, 1)),
    st.binary(max_size=8).map(Binary),
    st.booleans(),
    st.just(None).map(lambda _: ObjectId()),
    st.sampled_from([MinKey(), MaxKey()]),
    st.integers(1, 2**31).map(lambda t: Timestamp(t, 1)),
    st.text(max_size=6).map(lambda s: f"s{next(_serial)}{s}"),
)
json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=4)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=2), st.dictionaries(st.text("abc", max_size=2), inner, max_size=2)
    ),
    max_leaves=4,
)
ids = st.one_of(
    scalar_ids,
    st.dictionaries(
        st.sampled_from(["n", "k", "x"]), st.one_of(scalar_ids, json_like), min_size=1
    ).map(lambda d: {**d, "serial": next(_serial)}),
)
names = st.one_of(
    st.just("work"),
    st.sampled_from(["", "wo\x00rk", "w" * 201, "\x00"]),
    st.integers(-(2**31), 2**31 - 1),
    # a field name cannot hold NUL (BSON itself refuses it: the driver, not mtask)
    st.dictionaries(
        st.text(st.characters(blacklist_characters="\x00"), max_size=2),
        st.integers(-5, 5),
        max_size=2,
    ),
)
options = st.dictionaries(
    st.sampled_from(["priority", "max_retries", "concurrency", "specific_worker_ids", "bogus"]),
    json_like,
    max_size=3,
)
published = st.fixed_dictionaries(
    {"_id": ids, "name": names},
    optional={"params": st.one_of(st.just({"ms": 1}), json_like), "options": options},
)


def as_stored(doc: dict[str, Any]) -> dict[str, Any]:
    """The same, shaped as if mtask wrote it (a status and a claim time): the path of the
    scan and the claim, not completion's."""
    now = dt.datetime.now(dt.UTC)
    return {**doc, "status": "pending", "next_claim_at": now, "runs": [], "attempts": 0}


documents = st.one_of(published, published.map(as_stored))


@pytest.fixture
def workers(mongo_uri: str, db_name: str, tmp_path: Path) -> Iterator[Cluster]:
    """Three workers on one host: one with its own change stream, two sharing the host's (a
    relay and a subscriber)."""
    cluster = Cluster(mongo_uri, db_name, tmp_path)
    common = ("--concurrency", "4", "--sweep-interval", str(SWEEP))
    cluster.spawn("own", *common, "--stream", "own")
    cluster.spawn("shared-a", *common, "--stream", "shared")
    cluster.spawn("shared-b", *common, "--stream", "shared")
    try:
        yield cluster
    finally:
        cluster.close()


def all_alive(workers: Cluster) -> None:
    """Every worker runs, and none is stopping because a part of it died (a worker that
    stops drains first: its process is still there for a while)."""
    for worker_id, proc in workers.procs.items():
        log = workers.log_of(worker_id)
        assert proc.poll() is None and "died" not in log, (worker_id, log[-3000:])


def settled(db: Any, keys: list[Any], timeout: float) -> list[dict[str, Any]]:
    """The documents of ``keys`` once each has ended (run to an end, or invalid)."""
    deadline = time.monotonic() + timeout
    docs: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        docs = list(db.tasks.find({"_id": {"$in": keys}}))
        if len(docs) == len(keys) and all(d.get("status") in ENDED for d in docs):
            return docs
        time.sleep(0.2)
    stuck = [d for d in docs if d.get("status") not in ENDED]
    raise AssertionError(f"not ended after {timeout}s: {stuck!r}")


def readers_show(api: TestClient, uri: str, db_name: str, docs: list[dict[str, Any]]) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for path in ("/tasks?limit=200", "/tasks?status=invalid&limit=200", "/stats", "/names"):
        answer = api.get(path, headers=auth)
        assert answer.status_code == 200, (path, answer.text)
    for path in ("/ui/tasks", "/ui/tasks?status=invalid", "/"):
        answer = api.get(path, headers=auth, follow_redirects=False)
        assert answer.status_code == 200, (path, answer.text[:500])
    for doc in docs:
        key = doc["_id"]
        if not isinstance(key, str) or not key or "\x00" in key:
            continue  # no string addresses it; the lists above show it
        path = urllib.parse.quote(key, safe="")
        answer = api.get(f"/tasks/{path}", headers=auth)
        assert answer.status_code == 200, (key, answer.text)
        page = api.get(f"/ui/tasks/{path}", headers=auth, follow_redirects=False)
        assert page.status_code == 200, (key, page.text[:500])
    where = ("--uri", uri, "--database", db_name)
    commands = [["list", *where, "--limit", "200"]]
    commands += [
        ["get", doc["_id"], *where]
        for doc in docs
        if isinstance(doc["_id"], str) and doc["_id"] and "\x00" not in doc["_id"]
    ][:1]
    for command in commands:
        done = subprocess.run(
            [sys.executable, "-m", "mtask", *command], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)


@pytest.mark.timeout(900)
@on_a_server(max_examples=12)
@given(batch=st.lists(documents, min_size=1, max_size=8))
def test_any_document_is_run_or_marked_and_no_worker_stops(
    batch: list[dict[str, Any]],
    workers: Cluster,
    mongo: MongoClient[dict[str, Any]],
    mongo_uri: str,
    db_name: str,
) -> None:
    db = mongo[db_name]
    keys: list[Any] = []
    for doc in batch:
        try:
            db.tasks.insert_one(doc)
        except (DuplicateKeyError, WriteError):  # the server refuses it: nobody sees it
            continue
        keys.append(doc["_id"])
    docs = settled(db, keys, timeout=SWEEP * 4 + 20)
    for doc in docs:
        if doc["status"] == TaskStatus.INVALID:
            assert isinstance(doc.get("invalid_reason"), str) and doc["invalid_reason"], doc
        else:
            assert isinstance(doc["_id"], str) and doc.get("name") == "work", doc
    all_alive(workers)
    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as api:
        readers_show(api, mongo_uri, db_name, docs)


def test_an_object_id_key_is_marked_invalid_by_its_event(
    workers: Cluster, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    """The issue's document: an object ``_id`` killed every worker that saw its event."""
    db = mongo[db_name]
    db.tasks.insert_many([{"_id": {"n": i}, "name": "work", "params": {}} for i in range(4)])
    db.tasks.insert_one({"_id": "after", "name": "work", "params": {"ms": 1}})
    docs = {str(d["_id"]): d for d in settled(db, [*({"n": i} for i in range(4)), "after"], 60)}
    assert docs["after"]["status"] == TaskStatus.SUCCEEDED
    for i in range(4):
        doc = docs[str({"n": i})]
        assert doc["status"] == TaskStatus.INVALID
        assert "'_id' must be a string" in doc["invalid_reason"], doc
    all_alive(workers)
