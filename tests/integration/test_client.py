"""Publishing and reading through both clients, on the real server."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pymongo import MongoClient

from mtask import (
    AsyncTaskClient,
    InvalidTask,
    InvalidTransition,
    TaskClient,
    TaskNotFound,
    TaskStatus,
)
from mtask.clock import KEEP_BEST, ServerClock
from mtask.store import Outcome, RunState, bulk, claim, finish
from mtask.vocabulary import MAX_PARAMS_DEPTH


def test_publish_creates_a_pending_document(client: TaskClient) -> None:
    result = client.publish("resize", "img-1", {"w": 100}, options={"priority": 5})
    assert result.created and not result.updated
    task = result.task
    assert (task.key, task.name, task.params, task.status) == (
        "img-1",
        "resize",
        {"w": 100},
        "pending",
    )
    assert task.options.priority == 5
    assert task.next_claim_at == task.available_at == task.created_at
    stored = client.get("img-1")
    assert stored is not None and stored.model_dump() == task.model_dump()


def test_fifty_concurrent_publishers_make_one_document(client: TaskClient) -> None:
    def publish(i: int) -> bool:
        return client.publish("resize", "same", {"from": i}).created

    with ThreadPoolExecutor(50) as pool:
        created = list(pool.map(publish, range(50)))
    assert created.count(True) == 1
    assert client.collection.count_documents({}) == 1


async def test_fifty_concurrent_async_publishers(aclient: AsyncTaskClient) -> None:
    results = await asyncio.gather(*(aclient.publish("n", "k", {"i": i}) for i in range(50)))
    assert sum(r.created for r in results) == 1
    winner = next(r for r in results if r.created)
    assert all(r.task.params == winner.task.params for r in results)
    assert await aclient.collection.count_documents({}) == 1


def test_on_conflict_update_params(client: TaskClient) -> None:
    client.publish("n", "k", {"v": 1})
    result = client.publish(
        "n", "k", {"v": 2}, options={"priority": 9}, on_conflict="update_params"
    )
    assert (result.created, result.updated) == (False, True)
    assert result.task.params == {"v": 2} and result.task.options.priority == 9
    # a running task is not changed
    client._run(claim(["k"], ["n"], "w1", client.now()))
    result = client.publish("n", "k", {"v": 3}, on_conflict="update_params")
    assert (result.created, result.updated) == (False, False)
    assert result.task.params == {"v": 2} and result.task.status == "running"


def test_on_conflict_reset_reruns_a_finished_task(client: TaskClient) -> None:
    client.publish("n", "k", {"v": 1})
    [doc] = client._run(claim(["k"], ["n"], "w1", client.now()))
    client._run(finish(Outcome("k", doc["claim_run_id"], RunState.SUCCESS, result=7), client.now()))
    assert client.publish("n", "k", on_conflict="reset").task.status == "pending"
    # (the reset above used params None -> {}); a pending task is not reset again
    again = client.publish("n", "k", {"v": 5}, on_conflict="reset")
    assert (again.created, again.updated) == (False, False)
    task = client.get("k")
    assert task is not None and task.runs == [] and task.successes == 0 and task.attempts == 0


def test_publish_many_is_idempotent(client: TaskClient) -> None:
    items = [{"name": "n", "key": f"k{i}", "params": {"i": i}} for i in range(2500)]
    assert client.publish_many(items) == 2500
    assert client.publish_many([*items[:10], {"name": "n", "key": "new"}]) == 1
    assert client.collection.count_documents({}) == 2501


def test_bad_input_writes_nothing(client: TaskClient) -> None:
    with pytest.raises(InvalidTask, match="^params: not BSON-encodable"):
        client.publish("n", "k", {"x": {1, 2}})
    with pytest.raises(InvalidTask, match=r"^items\[1\]\.options\.max_retries"):
        client.publish_many(
            [{"name": "n", "key": "a"}, {"name": "n", "key": "b", "options": {"max_retries": -1}}]
        )
    with pytest.raises(InvalidTask, match="^on_conflict"):
        client.publish("n", "k", on_conflict="replace")  # type: ignore[arg-type]
    with pytest.raises(InvalidTask, match="^status"):
        client.list(status="done")
    assert client.collection.count_documents({}) == 0


PLUS_14 = dt.timezone(dt.timedelta(hours=14))


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"key": "\ud800"}, "key"),
        ({"name": "\ud800"}, "name"),
        ({"params": {"\udc80": 1}}, "params"),
        ({"depends_on": ["\ud800"]}, "depends_on[0]"),
        ({"options": {"specific_worker_ids": ["\ud800"]}}, "options.specific_worker_ids"),
        ({"options": {"run_at": dt.datetime(1, 1, 1, tzinfo=PLUS_14)}}, "options.run_at"),
        ({"delay": "abc"}, "delay"),
        ({"delay": 10**400}, "delay"),
    ],
)
def test_publish_many_writes_nothing_when_one_item_cannot_be_stored(
    client: TaskClient, bad: dict[str, Any], field: str
) -> None:
    """The bad item comes after a whole internal batch (1,000) of good ones: it is refused as
    InvalidTask before anything is written, not once the first batch is in."""
    items = [{"name": "n", "key": f"k{i}"} for i in range(1000)]
    with pytest.raises(InvalidTask, match=rf"^items\[1000\]\.{re.escape(field)}: "):
        client.publish_many([*items, {"name": "n", "key": "bad"} | bad])
    with pytest.raises(InvalidTask, match=rf"^{re.escape(field)}: "):
        client.publish(**({"name": "n", "key": "bad"} | bad))
    assert client.collection.count_documents({}) == 0


def test_a_signal_payload_nested_deeper_than_params_is_refused(client: TaskClient) -> None:
    client.publish("n", "sig")
    deep: list[Any] = []
    for _ in range(MAX_PARAMS_DEPTH):
        deep = [deep]
    with pytest.raises(InvalidTask, match="^payload: is nested more than 64 levels deep"):
        client.signal("sig", "s", deep)
    with pytest.raises(InvalidTask, match="^name: must be valid Unicode"):
        client.signal("sig", "\ud800", 1)
    client.signal("sig", "s", deep[0])  # 64 levels
    task = client.get("sig")
    assert task is not None and [s.name for s in task.signals] == ["s"]


def test_delay_uses_server_time(client: TaskClient) -> None:
    before = client.now()
    task = client.publish("n", "k", delay=dt.timedelta(minutes=5)).task
    after = client.now()
    assert task.next_claim_at is not None  # the server's now at the write, plus the delay
    assert before + dt.timedelta(minutes=5) <= task.next_claim_at <= after + dt.timedelta(minutes=5)


def test_list_pages_and_stats(client: TaskClient) -> None:
    for i in range(7):
        client.publish("a" if i % 2 else "b", f"k{i}")
    client.cancel("k0")
    page1 = client.list(limit=3)
    page2 = client.list(limit=3, after=page1[-1].key)
    page3 = client.list(limit=3, after=page2[-1].key)
    keys = [t.key for t in page1 + page2 + page3]
    assert keys == [f"k{i}" for i in range(6, -1, -1)]
    assert [t.key for t in client.list(name="a")] == ["k5", "k3", "k1"]
    assert [t.key for t in client.list(status="cancelled")] == ["k0"]
    soonest = client.list(order="next_claim_at", limit=2)
    assert [t.key for t in soonest] == ["k1", "k2"]
    assert client.stats() == {"a": {"pending": 3}, "b": {"pending": 3, "cancelled": 1}}
    with pytest.raises(TaskNotFound):
        client.list(after="missing")


def test_cancel_and_retry_transitions(client: TaskClient) -> None:
    client.publish("n", "k", options={"max_retries": 0})
    with pytest.raises(InvalidTransition, match="it is pending"):
        client.retry("k")
    cancelled = client.cancel("k")
    assert cancelled.status == "cancelled" and cancelled.next_claim_at is None
    assert cancelled.finished_at is not None
    with pytest.raises(InvalidTransition, match="it is cancelled"):
        client.cancel("k")
    again = client.retry("k")
    assert again.status == "pending" and again.next_claim_at is not None
    [doc] = client._run(claim(["k"], ["n"], "w1", client.now()))
    failed = client._run(
        finish(Outcome("k", doc["claim_run_id"], RunState.FAIL, error="boom"), client.now())
    )
    assert failed is not None and failed["status"] == "failed" and failed["error"] == "boom"
    assert client.retry("k").status == "pending"
    with pytest.raises(TaskNotFound):
        client.cancel("missing")


def test_cancel_running_task(client: TaskClient) -> None:
    client.publish("n", "k")
    [doc] = client._run(claim(["k"], ["n"], "w1", client.now()))
    run_id = doc["claim_run_id"]
    assert client.cancel("k").status == TaskStatus.CANCELLED
    assert client._run(claim(["k"], ["n"], "w2", client.now())) == []
    with pytest.raises(InvalidTransition, match="still stopping"):
        client.retry("k")
    # the worker notices at its next ping and marks its run CANCELLED
    stopped = client._run(
        finish(Outcome("k", run_id, RunState.CANCELLED, error="cancelled"), client.now())
    )
    assert stopped is not None and stopped["status"] == "cancelled"
    assert stopped["runs"][0]["state"] == "CANCELLED"
    assert client.retry("k").status == "pending"
    # a late SUCCESS of the stopped run is fenced out
    assert client._run(finish(Outcome("k", run_id, RunState.SUCCESS), client.now())) is None


def test_client_defaults_to_env_uri(
    mongo_uri: str, db_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTASK_MONGODB_URI", mongo_uri)
    with TaskClient(database=db_name) as c:
        assert c.publish("n", "k").created


def test_documents_are_readable_with_plain_pymongo(
    client: TaskClient, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    client.publish("n", "k", {"a": 1})
    doc = mongo[db_name]["tasks"].find_one({"_id": "k"})
    assert doc is not None and doc["status"] == "pending" and doc["params"] == {"a": 1}


def test_a_long_lived_client_calibrates_its_clock_again_every_keep_best_seconds(
    mongo_uri: str, db_name: str, mongo: MongoClient[Any]
) -> None:
    step = [0.0]
    clock = ServerClock(lambda: step[0] + time.monotonic())

    def off(key: str) -> float:
        """Seconds between the task's created_at (the client's clock) and the server's time."""
        created = mongo[db_name].tasks.find_one({"_id": key})["created_at"]
        server = mongo.admin.command("hello")["localTime"]
        return abs((server.replace(tzinfo=None) - created.replace(tzinfo=None)).total_seconds())

    with TaskClient(mongo_uri, database=db_name, clock=clock) as client:
        client.publish("n", "a", {})
        assert off("a") < 1
        step[0] = 30.0  # its clock runs 30 s ahead (as if the server's were stepped back)
        client.publish("n", "b", {})
        assert off("b") > 25  # within KEEP_BEST the calibration in use is kept
        step[0] = 30.0 + KEEP_BEST
        client.publish("n", "c", {})
        assert off("c") < 1  # KEEP_BEST later, the next call calibrates first


@pytest.mark.parametrize("key", [{"$gt": ""}, re.compile("^k"), 5, None])
def test_a_key_that_is_not_a_string_reads_and_changes_no_other_task(
    client: TaskClient, key: Any
) -> None:
    """A key is a string: a query operator, a regex or a number is refused, never matched
    against the keys (where ``{"$gt": ""}`` would cancel whichever open task came first)."""
    client.publish("n", "k1")
    for act in (
        lambda: client.get(key),
        lambda: client.cancel(key),
        lambda: client.retry(key),
        lambda: client.signal(key, "go"),
        lambda: client.wait(key, timeout=5),
    ):
        with pytest.raises(InvalidTask, match="^key: must be a string"):
            act()
    for page in (lambda: client.list(after=key), lambda: client.search(after=key)):
        if key is None:  # no cursor: the first page
            continue
        with pytest.raises(InvalidTask, match="^after: must be a string"):
            page()
    assert client.get("k1").status == TaskStatus.PENDING  # type: ignore[union-attr]


async def test_a_key_that_is_not_a_string_is_refused_by_the_async_client_too(
    aclient: AsyncTaskClient,
) -> None:
    await aclient.publish("n", "k1")
    with pytest.raises(InvalidTask, match="^key: must be a string"):
        await aclient.cancel({"$gt": ""})  # type: ignore[arg-type]
    with pytest.raises(InvalidTask, match="^key: must be a string"):
        await aclient.wait({"$gt": ""}, timeout=5)  # type: ignore[arg-type]
    assert (await aclient.get("k1")).status == TaskStatus.PENDING  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c: c.list(limit="5"), "limit"),
        (lambda c: c.list(limit=1.5), "limit"),
        (lambda c: c.list(limit=True), "limit"),
        (lambda c: c.list(status=["pending"]), "status"),
        (lambda c: c.list(order=["newest"]), "order"),
        (lambda c: c.search(limit="5"), "limit"),
        (lambda c: c.search(limit=2.5), "limit"),
        # a TypeError, an OverflowError, or a count of -5 sent to the server before
        (lambda c: c.workers("x"), "within_s"),
        (lambda c: c.workers(1e30), "within_s"),  # an OverflowError from its timedelta
        (lambda c: c.workers(float("nan")), "within_s"),
        (lambda c: c.throughput("x"), "minutes"),
        (lambda c: c.throughput(10**12), "minutes"),
        (lambda c: c.runs_by_worker(1.5), "minutes"),
        (lambda c: c.groups(top="x"), "top"),
        (lambda c: c.bulk_count("retry", bulk.Filter(), -5), "limit"),
        (lambda c: c.wait("k1", timeout="x"), "timeout"),
        (lambda c: c.wait("k1", timeout=-1), "timeout"),
    ],
)
def test_an_argument_of_the_wrong_type_or_range_is_invalid_task(
    client: TaskClient, call: Any, field: str
) -> None:
    client.publish("n", "k1")
    with pytest.raises(InvalidTask, match=f"^{field}:"):
        call(client)


async def test_the_async_clients_wait_checks_its_timeout(aclient: AsyncTaskClient) -> None:
    await aclient.publish("n", "k1")
    with pytest.raises(InvalidTask, match="^timeout:"):
        await aclient.wait("k1", timeout="soon")  # type: ignore[arg-type]
