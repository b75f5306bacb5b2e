"""Batch handlers, run by a real worker process: 200 tasks of a batch name are
handled in calls of many tasks each, every task keeps its own outcome (one failing entry fails
its task alone), its own attempt and run; bad declarations are refused at registration."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from harness import tree_env
from pymongo import MongoClient
from pymongo.collection import Collection
from test_snooze_worker import TESTS, polled

from mtask import Registry, TaskClient
from mtask.errors import InvalidTask
from mtask.testing import worker_argv

COUNT = 200


def drained(mongo_uri: str, db_name: str, name: str, concurrency: int) -> list[dict[str, Any]]:
    """The tasks of ``name``, once a worker process of ``concurrency`` has left none open."""
    proc = subprocess.Popen(
        worker_argv("flowpubapp:registry", mongo_uri, db_name, "--concurrency", str(concurrency)),
        cwd=TESTS,
        env=tree_env(),
    )
    tasks: Collection[dict[str, Any]] = MongoClient(mongo_uri)[db_name]["tasks"]
    still_open = {"name": name, "status": {"$in": ["pending", "running"]}}
    try:
        left = polled(
            lambda: tasks.count_documents(still_open),
            lambda left: left == 0,
            timeout=60,
        )
        assert left == 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        docs = list(tasks.find({"name": name}))
        tasks.database.client.close()
    return docs


def test_a_batch_handler_handles_many_tasks_per_call_each_with_its_own_outcome(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    client.publish_many(
        [
            {"name": "index", "key": f"i{n}", "params": {"fail": n == 7},
             "options": {"max_retries": 0}}
            for n in range(COUNT)
        ]
    )  # fmt: skip
    docs = drained(mongo_uri, db_name, "index", 64)
    failed = [d for d in docs if d["status"] == "failed"]
    assert [d["_id"] for d in failed] == ["i7"] and "bad i7" in failed[0]["error"]
    succeeded = [d for d in docs if d["status"] == "succeeded"]
    assert len(succeeded) == COUNT - 1
    assert all(d["attempts"] == 1 and len(d["runs"]) == 1 for d in docs)
    sizes = [d["result"]["size"] for d in succeeded]
    assert max(sizes) > 1 and sum(sizes) / len(sizes) > 2  # handled many at a time


def test_a_batch_larger_than_the_workers_slots_is_called_once_they_all_wait(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """``batch=100`` on a worker of concurrency 4: each call takes the 4 runs the worker can
    hold, at once, not after the hour of ``batch_timeout``."""
    client.publish_many([{"name": "wide", "key": f"w{n}"} for n in range(12)])
    docs = drained(mongo_uri, db_name, "wide", 4)
    assert [d["status"] for d in docs] == ["succeeded"] * 12
    sizes = [d["result"]["size"] for d in docs]
    assert max(sizes) <= 4 and sum(sizes) / len(sizes) > 1


@pytest.mark.parametrize(
    ("kwargs", "field", "says"),
    [
        ({"batch": 0}, "batch", "must be an integer from 1"),
        ({"batch": True}, "batch", "must be an integer from 1"),
        ({"batch": 10, "batch_timeout": 0}, "batch_timeout", "above 0"),
        ({"batch": 10, "batch_timeout": float("nan")}, "batch_timeout", "above 0"),
        ({"batch": 10, "isolation": "process"}, "batch", "cannot be transactional, isolated"),
        ({"batch": 10, "time_limit": 5}, "batch", "cannot be transactional, isolated"),
        # without batch=, a batch_timeout was accepted and ignored (1.0: the default's value)
        ({"batch_timeout": 2.0}, "batch_timeout", "only with batch="),
        ({"batch_timeout": 1.0}, "batch_timeout", "only with batch="),
        ({"uses": None}, "uses", "list of resource names ([] for none), not None"),  # TypeError
        ({"uses": 5}, "uses", "not int"),
        ({"uses": "api"}, "uses", "not a string"),
    ],
)
def test_bad_declarations_are_refused(kwargs: dict[str, Any], field: str, says: str) -> None:
    registry = Registry()
    with pytest.raises(InvalidTask) as caught:

        @registry.task("b", **kwargs)
        def b(items: list[Any]) -> list[Any]:
            return items

    assert caught.value.field == field and says in str(caught.value)


def test_a_batch_timeout_defaults_to_a_second_and_is_kept() -> None:
    registry = Registry()
    registry.task("b", batch=5)(lambda items: items)
    registry.task("c", batch=5, batch_timeout=0.5)(lambda items: items)
    assert (registry["b"].batch_timeout, registry["c"].batch_timeout) == (1.0, 0.5)


def test_a_batch_handler_takes_one_argument() -> None:
    with pytest.raises(InvalidTask) as caught:

        @Registry().task("b", batch=5)
        def b(items: list[Any], ctx: Any) -> list[Any]:
            return items

    assert caught.value.field == "batch"
