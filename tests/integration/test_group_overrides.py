"""Per-group overrides and weights on the real replica set: set and cleared from
Python, the CLI and HTTP, bad input refused everywhere with nothing written, shown by
``mtask limits`` and the task's "why is this not running", and obeyed by in-process workers."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import workerapp
from fastapi.testclient import TestClient
from harness import peak, run_cli, running_worker, wait_for
from pymongo import MongoClient

from mtask import TaskClient
from mtask.driver import SyncDriver
from mtask.errors import InvalidTask
from mtask.limits import slots
from mtask.limits.rules import Limit, group_limit_for, group_slot
from mtask.store import occupancy
from mtask.store import slots as store_slots
from mtask.web import create_app

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_an_override_is_set_replaced_and_cleared_in_the_names_document(
    client: TaskClient, mongo: MongoClient[Any], db_name: str
) -> None:
    client.set_limit("n", group_concurrency=2)
    doc = client.set_group_limit("n", "$pro.tier", concurrency=5, weight=3)  # data, not a path
    assert doc["group_overrides"] == [
        {"group": "$pro.tier", "concurrency": 5, "rate": None, "burst": None, "weight": 3.0}
    ]
    client.set_group_limit("n", "free", rate=2.0)
    doc = client.set_group_limit("n", "$pro.tier", weight=2)  # replaces the group's override
    assert [o["group"] for o in doc["group_overrides"]] == ["free", "$pro.tier"]
    assert doc["group_overrides"][0]["burst"] == 2  # a rate's bucket: a second's worth
    assert doc["group_overrides"][1] == {
        "group": "$pro.tier", "concurrency": None, "rate": None, "burst": None, "weight": 2.0
    }  # fmt: skip
    assert doc["group_concurrency"] == 2  # the name's limit untouched
    client.set_limit("n", group_concurrency=3)  # and the overrides untouched by it
    assert len(client.limits()[0]["group_overrides"]) == 2
    assert client.clear_group_limit("n", "free") is True
    assert client.clear_group_limit("n", "free") is False
    assert [o["group"] for o in client.limits()[0]["group_overrides"]] == ["$pro.tier"]
    # a name with no limit gets a document holding its overrides alone
    doc = client.set_group_limit("plain", "pro", weight=3)
    assert doc["concurrency"] is None if "concurrency" in doc else True
    assert mongo[db_name].limits.count_documents({}) == 2


def test_bad_overrides_are_refused_and_nothing_is_written(
    client: TaskClient, mongo: MongoClient[Any], db_name: str
) -> None:
    for bad in (
        {"group": "", "concurrency": 2},
        {"group": "p", "concurrency": 0},
        {"group": "p", "concurrency": 1},
        {"group": "p", "weight": -1},
        {"group": "p"},
    ):
        group = bad.pop("group")
        with pytest.raises(InvalidTask):
            client.set_group_limit("n", group, **bad)
    assert mongo[db_name].limits.count_documents({}) == 0
    client.set_limit("seq", group_concurrency=1)
    with pytest.raises(InvalidTask, match="sequences"):
        client.set_group_limit("seq", "p", concurrency=3)
    assert "group_overrides" not in client.limits()[0]
    client.set_group_limit("seq", "p", weight=2)  # a sequence's groups may have weights


def test_the_cli_and_http_set_show_and_clear_overrides(
    client: TaskClient, mongo_uri: str, db_name: str
) -> None:
    where = ("--uri", mongo_uri, "--database", db_name)
    code, out, _ = run_cli("limit", "n", "--group-concurrency", "2", *where)
    assert code == 0
    code, out, _ = run_cli(
        "limit", "n", "--group", "pro", "--concurrency", "6", "--weight", "3", *where, width=200
    )
    assert code == 0 and "group pro of n: at most 6 at once, weight 3" in out
    for bad in (
        ("--group", "pro", "--concurrency", "0"),
        ("--group", "pro", "--group-concurrency", "3"),
        ("--weight", "3"),
        ("--group", "pro", "--clear", "--weight", "2"),
        ("--group", "pro", "--weight", "nan"),
    ):
        code, _, err = run_cli("limit", "n", *bad, *where)
        assert code == 2, (bad, err)
    client.publish_many(
        [{"name": "n", "key": f"{g}/{i}", "options": {"group": g}} for g in ("pro", "free")
         for i in range(2)]
    )  # fmt: skip
    code, out, _ = run_cli("limits", *where, width=200)
    assert code == 0 and "1 group with an override" in out, out
    pro = next(line for line in out.splitlines() if line.startswith("│ pro "))
    assert "0 of 6 (own)" in pro and "│ 3 " in pro
    free = next(line for line in out.splitlines() if line.startswith("│ free "))
    assert "0 of 2" in free and "(own)" not in free
    code, out, _ = run_cli("limits", "--json", *where)
    groups = {g["group"]: g for g in __import__("json").loads(out)[0]["use"]["groups"]}
    assert groups["pro"]["limit"] == 6 and groups["pro"]["weight"] == 3.0
    assert groups["pro"]["overridden"] and not groups["free"]["overridden"]

    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
        put = http.put("/limits/n/groups/api", json={"rate": 2.5, "weight": 2}, headers=AUTH)
        assert put.status_code == 200, put.text
        assert {o["group"] for o in put.json()["group_overrides"]} == {"pro", "api"}
        for body in ({"concurrency": 0}, {"weight": 0}, {"colour": 1}, {}):
            answer = http.put("/limits/n/groups/api", json=body, headers=AUTH)
            assert answer.status_code == 422, (body, answer.text)
        assert http.put("/limits/n/groups/x", json={"concurrency": 2}).status_code == 401
        assert http.delete("/limits/n/groups/api", headers=AUTH).status_code == 204
        page = http.get("/ui/limits", headers=AUTH)
        assert page.status_code == 200 and 'data-group="pro"' in page.text
        row = page.text.split('data-group="pro"')[1].split("</tr>")[0]
        assert "6 of 6" not in row and "0 of 6" in row and ">own<" in row and "weight 3" in row
    code, _, _ = run_cli("limit", "n", "--group", "pro", "--clear", *where)
    assert code == 0 and "group_overrides" in client.limits()[0]
    assert client.limits()[0]["group_overrides"] == []


def overrides_without_open_tasks(client: TaskClient) -> None:
    """The audit's case: acme at most 5 at once with weight 3, beta 2/s, neither with an open
    task; gamma with one, and no override."""
    client.set_limit("n", group_concurrency=2)
    client.set_group_limit("n", "acme", concurrency=5, weight=3)
    client.set_group_limit("n", "beta", rate=2.0)
    client.publish("n", "g1", options={"group": "gamma"})


def test_mtask_limits_shows_every_override_whether_or_not_its_group_has_open_tasks(
    client: TaskClient, mongo_uri: str, db_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    where = ("--uri", mongo_uri, "--database", db_name)
    overrides_without_open_tasks(client)
    code, out, _ = run_cli("limits", *where)
    assert code == 0, out
    assert "  acme: at most 5 at once, weight 3\n" in out, out
    assert "  beta: at most 2 at once, 2/s (bursts of 2)\n" in out, out
    assert "gamma:" not in out and "more" not in out
    monkeypatch.setattr(occupancy, "SHOWN_OVERRIDES", 1)  # a name with thousands of them
    code, out, _ = run_cli("limits", *where)
    assert code == 0 and "  acme: " in out and "beta" not in out, out
    assert "  and 1 more " in out, out


def test_the_limits_page_shows_every_override_whether_or_not_its_group_has_open_tasks(
    client: TaskClient, mongo_uri: str, db_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides_without_open_tasks(client)
    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
        page = http.get("/ui/limits", headers=AUTH)
        assert page.status_code == 200
        said = {
            g: page.text.split(f'data-override="{g}">')[1].split("</li>")[0]
            for g in ("acme", "beta")
        }
        assert said["acme"].endswith(">acme</a>: at most 5 at once, weight 3"), said
        assert said["beta"].endswith(">beta</a>: at most 2 at once, 2 per second (bursts of 2)")
        assert 'data-override="gamma"' not in page.text and 'data-group="gamma"' in page.text
        monkeypatch.setattr(occupancy, "SHOWN_OVERRIDES", 1)
        page = http.get("/ui/limits", headers=AUTH)
        assert 'data-override="acme"' in page.text and 'data-override="beta"' not in page.text
        assert "and 1 more" in page.text


def test_why_a_task_is_not_running_names_its_groups_own_limit(
    client: TaskClient, mongo: MongoClient[Any], db_name: str
) -> None:
    client.set_limit("n", group_concurrency=3)
    client.set_group_limit("n", "pro", concurrency=2)
    client.publish("n", "waiting", options={"group": "pro"})
    now = client.now()
    driver = SyncDriver(mongo[db_name])
    requests = [
        slots.Request(group_slot("n", "pro"), f"r{i}", f"k{i}", 60_000, Limit(2)) for i in range(2)
    ]
    assert all(t.taken for t in driver.run(store_slots.take(requests, "w", now)))
    live = {"_id": "w", "last_seen": now, "names": ["n"], "host": "h", "pid": 1}
    mongo[db_name].workers.insert_one(live)  # a live worker of `n` (a heartbeat by hand)
    said = client.explain(client.get("waiting"))
    assert "waiting for group `pro` of `n`: 2 of 2 runs at once in use" in said.reason, said


def spans(db: Any, prefix: str) -> list[tuple[float, float]]:
    """Each handler run's (start, end) on this process's monotonic clock (``timed_sleep``)."""
    return [
        (d["result"][0], d["result"][1])
        for d in db.tasks.find({"_id": {"$regex": f"^{prefix}"}}, {"result": 1})
    ]


async def test_workers_hold_each_group_to_its_own_limit_and_hear_a_change(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    db = mongo[db_name]
    client.set_limit("timed_sleep", group_concurrency=2)
    client.set_group_limit("timed_sleep", "pro", concurrency=4)

    def publish(prefix: str, group: str, count: int) -> None:
        client.publish_many(
            [
                {
                    "name": "timed_sleep",
                    "key": f"{prefix}{i}",
                    "params": {"seconds": 0.15},
                    "options": {"group": group},
                }
                for i in range(count)
            ]
        )

    publish("pro/", "pro", 24)
    publish("free/", "free", 12)
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            (
                await stack.enter_async_context(
                    running_worker(workerapp.registry, mongo_uri, db_name, concurrency=8)
                )
            )[0]
            for _ in range(2)
        ]
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 36, 60)
        assert peak(spans(db, "free/")) <= 2
        assert 2 < peak(spans(db, "pro/")) <= 4  # its own limit, not the name's
        client.clear_group_limit("timed_sleep", "pro")  # the name's again, on its change event

        def heard() -> bool:
            return all(
                group_limit_for(w.parts.gate.limited.get("timed_sleep", {}), "pro") == Limit(2)
                for w in workers
            )

        await wait_for(heard, 10)
        publish("again/", "pro", 12)
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 48, 60)
    assert peak(spans(db, "again/")) <= 2
