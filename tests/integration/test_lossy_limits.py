"""Lossy limits on the real replica set with an in-process worker: a full limit with
``overflow="drop"`` cancels the tasks it refuses at once, one with ``overflow="fail"`` fails
them for good, each saying why; bad input is refused; ``mtask limits`` says so."""

from __future__ import annotations

from typing import Any

import pytest
import workerapp
from fastapi.testclient import TestClient
from harness import run_cli, running_worker, wait_for
from prometheus_client import REGISTRY
from pymongo import MongoClient

from mtask import TaskClient
from mtask.errors import InvalidTask
from mtask.web import create_app

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def finished(client: TaskClient, count: int) -> bool:
    return (
        sum(
            client.stats(exact=True).get("sleep", {}).get(s, 0)
            for s in ("succeeded", "cancelled", "failed")
        )
        == count
    )


async def test_a_full_lossy_limit_drops_or_fails_the_excess_at_once(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    client.set_limit("sleep", concurrency=1, overflow="drop")
    client.publish_many(
        [{"name": "sleep", "key": f"d{i}", "params": {"seconds": 0.5}} for i in range(6)]
    )
    async with running_worker(workerapp.registry, mongo_uri, db_name, concurrency=4):
        await wait_for(lambda: finished(client, 6), 30)
        assert client.stats(exact=True)["sleep"] == {"succeeded": 1, "cancelled": 5}
        dropped = [t for t in client.list(name="sleep", status="cancelled", limit=10)]
        assert {t.error for t in dropped} == {
            "dropped: the limit of `sleep` was full (overflow=drop)"
        }
        assert all(not t.runs for t in dropped)  # never ran

        client.set_limit("sleep", rate=1.0, burst=1, overflow="fail")  # 1 a second, no queue
        client.publish_many(
            [{"name": "sleep", "key": f"f{i}", "params": {"seconds": 0.01}} for i in range(4)]
        )
        await wait_for(lambda: finished(client, 10), 30)
    shed = REGISTRY.get_sample_value("mtask_limit_shed_total", {"limit": "sleep", "how": "drop"})
    assert shed is not None and shed >= 5  # the worker ran in this process
    failed = client.list(name="sleep", status="failed", limit=10)
    assert len(failed) >= 2  # one token: the rest of the burst failed at once
    assert all(t.error == "failed: the limit of `sleep` was full (overflow=fail)" for t in failed)
    assert all(t.failures == 0 and not t.runs for t in failed)  # failed for good, no run


def test_an_overflow_is_set_shown_and_checked(
    client: TaskClient, mongo_uri: str, db_name: str, mongo: MongoClient[Any]
) -> None:
    with pytest.raises(InvalidTask):
        client.set_limit("n", concurrency=2, overflow="spill")
    assert mongo[db_name].limits.count_documents({}) == 0
    where = ("--uri", mongo_uri, "--database", db_name)
    code, out, _ = run_cli(
        "limit", "n", "--concurrency", "2", "--overflow", "drop", *where, width=200
    )
    assert code == 0 and "the excess dropped at once" in out
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal: exit 2
        run_cli("limit", "n", "--concurrency", "2", "--overflow", "spill", *where)
    assert refused.value.code == 2
    code, out, _ = run_cli("limits", *where, width=200)
    assert "the excess dropped at once" in out
    assert client.set_limit("n", concurrency=2)["overflow"] is None  # set_limit sets it all
    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
        put = http.put("/limits/n", json={"concurrency": 2, "overflow": "fail"}, headers=AUTH)
        assert put.status_code == 200 and put.json()["overflow"] == "fail"
        bad = http.put("/limits/n", json={"concurrency": 2, "overflow": "x"}, headers=AUTH)
        assert bad.status_code == 422
        put = http.put("/resources/api", json={"rate": 5, "overflow": "drop"}, headers=AUTH)
        assert put.status_code == 200 and put.json()["overflow"] == "drop"
        page = http.get("/ui/limits", headers=AUTH).text  # the dashboard says it too
        assert "failed for good at once" in page and "cancelled at once" in page
