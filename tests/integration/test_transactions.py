"""Transactional publish: a task published in the caller's transaction exists if and only if it
commits (docs/transactions.md)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness import running_worker
from prometheus_client import REGISTRY
from pymongo import AsyncMongoClient, MongoClient
from pymongo.errors import OperationFailure, PyMongoError
from workerapp import registry

from mtask import AsyncTaskClient, TaskClient
from mtask.errors import InvalidTask


class Abort(Exception):
    """Raised by a test inside a transaction to roll it back."""


def published(name: str) -> float:
    """``mtask_tasks_published_total`` for ``name`` in this process."""
    value = REGISTRY.get_sample_value("mtask_tasks_published_total", {"name": name})
    return value or 0.0


def test_task_exists_iff_transaction_commits(mongo: MongoClient[Any], db_name: str) -> None:
    # the caller's own MongoClient: its sessions work with mtask's client
    client = TaskClient(mongo_client=mongo, database=db_name)
    client.ensure_indexes()  # not during a transaction (docs/transactions.md)
    orders = mongo[db_name].create_collection("orders")
    with pytest.raises(Abort), mongo.start_session() as s, s.start_transaction():
        orders.insert_one({"_id": "o1"}, session=s)
        client.publish("echo", "ship-o1", {"order": "o1"}, session=s)
        raise Abort
    assert client.get("ship-o1") is None and orders.count_documents({}) == 0

    with mongo.start_session() as s, s.start_transaction():
        orders.insert_one({"_id": "o2"}, session=s)
        result = client.publish("echo", "ship-o2", {"order": "o2"}, session=s)
        assert result.created
        assert client.get("ship-o2") is None  # not visible outside before the commit
    task = client.get("ship-o2")
    assert task is not None and task.status == "pending" and task.params == {"order": "o2"}
    assert orders.count_documents({}) == 1


def test_a_callers_plain_client_reads_timezone_aware_dates(mongo_uri: str, db_name: str) -> None:
    # a caller's MongoClient as frameworks make it (Django's, MongoEngine's): tz_aware=False
    with MongoClient(mongo_uri) as plain, TaskClient(mongo_client=plain, database=db_name) as c:
        c.publish("echo", "aware", {})
        task = c.get("aware")
        assert task is not None and task.created_at is not None
        assert task.created_at.utcoffset() is not None  # was naive: a wrong time in any zone


async def test_a_callers_plain_async_client_reads_timezone_aware_dates(
    mongo_uri: str, db_name: str
) -> None:
    plain: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
    try:
        c = AsyncTaskClient(mongo_client=plain, database=db_name)
        await c.publish("echo", "aware", {})
        task = await c.get("aware")
        assert task is not None and task.created_at is not None
        assert task.created_at.utcoffset() is not None
    finally:
        await plain.close()


@pytest.fixture
def client(client: TaskClient) -> TaskClient:
    client.ensure_indexes()
    client.db.create_collection("orders")
    return client


def test_idempotency_by_key_inside_a_transaction(client: TaskClient) -> None:
    client.publish("echo", "k", {"v": 1})
    with client.mongo.start_session() as s, s.start_transaction():
        again = client.publish("echo", "k", {"v": 2}, session=s)
        updated = client.publish("echo", "k", {"v": 3}, on_conflict="update_params", session=s)
    assert not again.created and again.task.params == {"v": 1}
    assert updated.updated and updated.task.params == {"v": 3}
    task = client.get("k")
    assert task is not None and task.params == {"v": 3}


def test_session_of_another_client_is_refused(client: TaskClient, mongo: MongoClient[Any]) -> None:
    with mongo.start_session() as s, s.start_transaction():
        with pytest.raises(InvalidTask, match="session: .*another MongoClient"):
            client.publish("echo", "k", session=s)
        with pytest.raises(InvalidTask, match="session: .*another MongoClient"):
            client.publish_many([{"name": "echo", "key": "k"}], session=s)
    assert client.get("k") is None


def test_dependency_bookkeeping_joins_the_transaction(client: TaskClient) -> None:
    client.publish("echo", "first")
    with pytest.raises(Abort), client.mongo.start_session() as s, s.start_transaction():
        client.publish("echo", "second", depends_on=["first"], session=s)
        raise Abort
    assert client.get("second") is None
    assert "has_dependents" not in client.collection.find_one({"_id": "first"}, {"runs": 0})

    with client.mongo.start_session() as s, s.start_transaction():
        client.publish("echo", "second", depends_on=["first"], session=s)
    assert client.collection.find_one({"_id": "first"})["has_dependents"] is True  # type: ignore[index]
    second = client.get("second")
    assert second is not None and second.status == "pending"


def test_concurrent_transactions_publishing_one_key(client: TaskClient) -> None:
    """The second writer's conflict reaches ``with_transaction`` as pymongo's
    TransientTransactionError (not mtask's StorageError); it retries after the first commits,
    then finds the task: exactly one task, both orders."""
    first_wrote = threading.Event()
    second_conflicted = threading.Event()
    errors: list[BaseException] = []
    results: dict[str, list[bool]] = {"first": [], "second": []}
    orders = client.db["orders"]

    def first(s: Any) -> None:
        orders.insert_one({"_id": "first"}, session=s)
        results["first"].append(client.publish("echo", "one", {"by": "first"}, session=s).created)
        first_wrote.set()
        assert second_conflicted.wait(30)

    def second(s: Any) -> None:
        assert first_wrote.wait(30)
        orders.insert_one({"_id": "second"}, session=s)
        try:
            results["second"].append(
                client.publish("echo", "one", {"by": "second"}, session=s).created
            )
        except PyMongoError as exc:
            errors.append(exc)
            second_conflicted.set()
            raise

    def run(callback: Any) -> None:
        with client.mongo.start_session() as s:
            s.with_transaction(callback)

    before = published("echo")
    threads = [threading.Thread(target=run, args=(f,)) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors and all(e.has_error_label("TransientTransactionError") for e in errors)  # type: ignore[attr-defined]
    assert published("echo") - before == 1  # the conflicting second run created nothing
    assert results["first"] == [True] and results["second"] == [False]
    assert client.collection.count_documents({}) == 1
    task = client.get("one")
    assert task is not None and task.params == {"by": "first"}
    assert orders.count_documents({}) == 2


@pytest.fixture
async def one_client(
    mongo_uri: str, db_name: str
) -> AsyncIterator[tuple[AsyncMongoClient[dict[str, Any]], AsyncTaskClient]]:
    """An ``AsyncTaskClient`` on a ``MongoClient`` of the test's (its sessions are the
    test's), the task collection's indexes made."""
    mongo: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    client = AsyncTaskClient(mongo_client=mongo, database=db_name)
    try:
        await client.ensure_indexes()
        yield mongo, client
    finally:
        await client.close()
        await mongo.close()


async def publish_then_abort(
    mongo: AsyncMongoClient[dict[str, Any]], client: AsyncTaskClient, items: list[dict[str, Any]]
) -> None:
    """``publish_many(items)`` in a transaction (each of the three new in it), aborted."""
    with pytest.raises(Abort):
        async with mongo.start_session() as s, await s.start_transaction():
            assert await client.publish_many(items, session=s) == 3
            raise Abort


async def test_async_publish_many_in_a_transaction(
    one_client: tuple[AsyncMongoClient[dict[str, Any]], AsyncTaskClient],
) -> None:
    mongo, client = one_client
    items = [{"name": "echo", "key": f"k{i}"} for i in range(3)]
    await publish_then_abort(mongo, client, items)
    assert await client.list() == []
    async with mongo.start_session() as s, await s.start_transaction():
        assert await client.publish_many(items, session=s) == 3
        assert (await client.publish("echo", "k0", session=s)).created is False
    assert sorted(t.key for t in await client.list()) == ["k0", "k1", "k2"]


async def test_worker_never_runs_an_aborted_publish_and_runs_a_committed_one_once(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        with pytest.raises(Abort), client.mongo.start_session() as s, s.start_transaction():
            client.publish("echo", "aborted", session=s)
            raise Abort
        with client.mongo.start_session() as s, s.start_transaction():
            client.publish("echo", "committed", session=s)
        await events.wait("recorded", key="committed")
        client.publish("echo", "after")  # published after both: once it ran, both were seen
        await events.wait("recorded", key="after")
    assert client.get("aborted") is None
    assert not [d for _, d in events.items if d.get("key") == "aborted"]
    task = client.get("committed")
    assert task is not None and task.status == "succeeded" and len(task.runs) == 1
    assert len(events.matching("recorded", key="committed")) == 1


def test_published_metric_counts_a_transactional_publish_after_commit(client: TaskClient) -> None:
    name = f"m{uuid.uuid4().hex[:8]}"
    with pytest.raises(Abort), client.mongo.start_session() as s, s.start_transaction():
        assert client.publish(name, "aborted", session=s).created
        assert client.publish_many([{"name": name, "key": "aborted-2"}], session=s) == 1
        assert published(name) == 0  # not before the commit
        raise Abort
    assert published(name) == 0  # an aborted publish created nothing

    with client.mongo.start_session() as s, s.start_transaction():
        client.publish(name, "committed", session=s)
        client.publish_many([{"name": name, "key": f"c{i}"} for i in range(2)], session=s)
        assert published(name) == 0
    assert published(name) == 3

    attempts = []

    def body(s: Any) -> None:  # with_transaction: a body run again counts once, after commit
        client.publish(name, f"retried-{len(attempts)}", session=s)
        attempts.append(1)
        if len(attempts) == 1:  # as a write conflict would: with_transaction runs it again
            raise OperationFailure("conflict", 112, {"errorLabels": ["TransientTransactionError"]})

    with client.mongo.start_session() as s:
        s.with_transaction(body)
    assert len(attempts) == 2 and published(name) == 4

    client.publish(name, "plain")  # no session: counted at once
    assert published(name) == 5


async def test_published_metric_after_commit_async(
    one_client: tuple[AsyncMongoClient[dict[str, Any]], AsyncTaskClient],
) -> None:
    mongo, client = one_client
    name = f"m{uuid.uuid4().hex[:8]}"
    items = [{"name": name, "key": f"k{i}"} for i in range(3)]
    await publish_then_abort(mongo, client, items)
    assert published(name) == 0
    async with mongo.start_session() as s:

        async def body(s: Any) -> None:
            await client.publish_many(items, session=s)
            assert published(name) == 0

        await s.with_transaction(body)
    assert published(name) == 3
