"""Shared resources on the real replica set: a resource's limit set and cleared from
Python, the CLI and HTTP (bad input refused, nothing written), declared by handlers
(``uses=``), shown by ``mtask limits`` and the dashboard, and held by in-process workers for
two names at once, a change heard while they run."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from harness import peak, run_cli, running_worker, wait_for
from pymongo import MongoClient
from workerapp import timed_sleep

from mtask import TaskClient
from mtask.driver import SyncDriver
from mtask.errors import InvalidTask
from mtask.explain.states import State
from mtask.limits import rules as limits
from mtask.registry import Registry
from mtask.store.holds import hold
from mtask.web import create_app
from mtask.worker import Worker

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

registry = Registry()


# each sleeps, and returns its start and end on this process's clock (workerapp)
registry.task("summarize", uses=["openai"])(timed_sleep)
registry.task("embed", uses=["openai"])(timed_sleep)
registry.task("plain")(timed_sleep)


@contextlib.asynccontextmanager
async def two_workers(mongo_uri: str, db_name: str, **kwargs: Any) -> AsyncIterator[list[Worker]]:
    """Two in-process workers of ``registry``, concurrency 8 each."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            (
                await stack.enter_async_context(
                    running_worker(registry, mongo_uri, db_name, concurrency=8, **kwargs)
                )
            )[0]
            for _ in range(2)
        ]


def test_a_resources_limit_is_set_and_cleared_and_bad_input_writes_nothing(
    client: TaskClient, mongo: MongoClient[Any], db_name: str
) -> None:
    doc = client.set_limit(resource="$openai", concurrency=3, rate=10.0)
    assert doc["_id"] == limits.resource_slot("$openai") and doc["resource"] == "$openai"
    assert (doc["concurrency"], doc["rate"], doc["group_concurrency"]) == (3, 10.0, None)
    assert client.set_limit(resource="$openai", concurrency=2)["concurrency"] == 2
    assert client.clear_limit(resource="$openai") is True
    assert client.clear_limit(resource="$openai") is False
    for bad in (
        {"resource": "", "concurrency": 1},
        {"resource": "a\x00b", "concurrency": 1},
        {"resource": "r"},
        {"resource": "r", "concurrency": 0},
        {"resource": "r", "group_concurrency": 2},
        {"resource": "r", "name": "n", "concurrency": 1},
    ):
        with pytest.raises(InvalidTask):
            client.set_limit(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidTask):
        client.set_limit(concurrency=1)  # neither a name nor a resource
    assert mongo[db_name].limits.count_documents({}) == 0
    for uses in ("openai", [""], ["a\x00b"], None, 5):  # None, 5: a raw TypeError before
        with pytest.raises(InvalidTask):
            Registry().task("x", uses=uses)(timed_sleep)  # type: ignore[arg-type]
    assert registry.uses == {"summarize": ("openai",), "embed": ("openai",)}


def test_the_cli_and_http_set_show_and_clear_a_resources_limit(
    client: TaskClient, mongo_uri: str, db_name: str
) -> None:
    where = ("--uri", mongo_uri, "--database", db_name)
    code, out, _ = run_cli("limit", "--resource", "openai", "--concurrency", "3", *where, width=200)
    assert code == 0 and "resource openai: at most 3 at once" in out
    for bad in (
        ("--resource", "openai", "--group-concurrency", "2"),
        ("--resource", "openai", "--group", "g", "--concurrency", "2"),
        ("summarize", "--resource", "openai", "--concurrency", "2"),
        ("--concurrency", "2"),
        ("--resource", "", "--concurrency", "2"),
        ("--resource", "openai", "--clear", "--concurrency", "2"),
    ):
        code, _, err = run_cli("limit", *bad, *where)
        assert code == 2, (bad, err)
    code, out, _ = run_cli("limits", *where, width=200)
    assert code == 0 and "resource openai" in out and "0 of 3" in out
    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
        put = http.put("/resources/stripe", json={"rate": 25, "burst": 5}, headers=AUTH)
        assert put.status_code == 200, put.text
        assert put.json()["resource"] == "stripe" and put.json()["rate"] == 25
        for body in ({"concurrency": 0}, {"group_concurrency": 2}, {}):
            answer = http.put("/resources/stripe", json=body, headers=AUTH)
            assert answer.status_code == 422, (body, answer.text)
        assert http.put("/resources/x", json={"concurrency": 2}).status_code == 401
        page = http.get("/ui/limits", headers=AUTH).text
        assert 'data-resource="openai"' in page and 'data-resource="stripe"' in page
        used = http.get("/limits", params={"use": "true"}, headers=AUTH).json()
        assert {u["use"]["name"] for u in used if u["use"]["resource"]} == {"openai", "stripe"}
        assert http.delete("/resources/stripe", headers=AUTH).status_code == 204
    code, _, _ = run_cli("limit", "--resource", "openai", "--clear", *where)
    assert code == 0 and client.limits() == []


async def test_workers_share_a_resource_between_two_names_and_hear_a_change(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """Two names share ``openai`` (2 at once), a third name is unlimited: from the handlers'
    own times (one process, one monotonic clock) never more than 2 of the two names at once;
    raised to 4 while the workers run, the next runs use it."""
    db = mongo[db_name]
    client.set_limit(resource="openai", concurrency=2)

    def publish(prefix: str, count: int) -> None:
        client.publish_many(
            [
                {"name": name, "key": f"{prefix}{name}/{i}", "params": {"seconds": 0.1}}
                for i in range(count)
                for name in ("summarize", "embed", "plain")
            ]
        )

    def results(prefix: str, names: tuple[str, ...]) -> list[list[float]]:
        found = db.tasks.find({"_id": {"$regex": f"^{prefix}"}, "name": {"$in": list(names)}})
        return [d["result"] for d in found]

    publish("one-", 10)
    async with two_workers(mongo_uri, db_name) as workers:
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 30, 60)
        assert peak(results("one-", ("summarize", "embed"))) == 2
        assert peak(results("one-", ("plain",))) > 2  # a name that uses none: unlimited
        client.set_limit(resource="openai", concurrency=4)
        slot = limits.resource_slot("openai")

        def heard() -> bool:
            return all(
                limits.own_limit(w.parts.gate.limited.get(slot, {})).concurrency == 4
                for w in workers
            )

        await wait_for(heard, 10)
        publish("two-", 10)
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 60, 60)
    assert 2 < peak(results("two-", ("summarize", "embed"))) <= 4
    assert db.limits.find_one({"_id": slot})["holders"] == []


def test_a_resources_declared_names_are_set_from_python_the_cli_and_http(
    client: TaskClient, mongo_uri: str, db_name: str, mongo: MongoClient[Any]
) -> None:
    doc = client.set_limit(resource="crm", concurrency=2, names=["sync", "push", "sync"])
    assert doc["names"] == ["push", "sync"]
    assert client.set_limit(resource="crm", concurrency=3)["names"] == ["push", "sync"]  # kept
    for bad in ("sync", [""], ["a\x00b"], [3], ["x" * 201]):
        with pytest.raises(InvalidTask) as caught:
            client.set_limit(resource="crm", concurrency=1, names=bad)  # type: ignore[arg-type]
        assert caught.value.field == "names"
    with pytest.raises(InvalidTask):
        client.set_limit("sync", concurrency=1, names=["push"])  # a name's limit takes none
    assert mongo[db_name].limits.find_one({"_id": limits.resource_slot("crm")})["names"] == [
        "push",
        "sync",
    ]
    where = ("--uri", mongo_uri, "--database", db_name)
    args = ("limit", "--resource", "crm", "--concurrency", "2", "--names", "a,b", "--json")
    code, out, _ = run_cli(*args, *where, width=200)
    assert code == 0 and '"names"' in out and client.limits()[0]["names"] == ["a", "b"]
    code, _, err = run_cli("limit", "sync", "--concurrency", "2", "--names", "a", *where)
    assert code == 2 and "--resource" in err and "Traceback" not in err
    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
        put = http.put("/resources/crm", json={"concurrency": 2, "names": ["c"]}, headers=AUTH)
        assert put.status_code == 200 and put.json()["names"] == ["c"], put.text
        for body in ({"concurrency": 2, "names": "c"}, {"concurrency": 2, "names": ["a\x00"]}):
            answer = http.put("/resources/crm", json=body, headers=AUTH)
            assert 400 <= answer.status_code < 500, (body, answer.text)
    assert client.limits()[0]["names"] == ["c"]
    # a hand's names of any shape: read as the workers read them, never a 500
    odd = limits.resource_slot("odd")
    for names in ("translate", [1, None, "ok", ["x"]], {"a": 1}):
        mongo[db_name].limits.replace_one(
            {"_id": odd}, {"_id": odd, "resource": "odd", "names": names}, upsert=True
        )
        with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
            for path in ("/limits", "/limits?use=true"):
                answer = http.get(path, headers=AUTH)
                assert answer.status_code == 200, (names, answer.text)
                found = [d for d in answer.json() if d["_id"] == odd]
                assert found[0]["names"] == (["ok"] if isinstance(names, list) else [])


async def test_names_a_resource_lists_share_it_as_their_handlers_uses_do(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """``plain``'s handler declares no resource: listed in ``crm``'s document (set from
    Python), its runs take ``crm``'s slots (never more than 2 at once, from the handlers' own
    times); taken off the list by a service's own update of the document (a foreign one's,
    docs/scheduling.md), its next runs are not limited."""
    db = mongo[db_name]
    client.set_limit(resource="crm", concurrency=2, names=["plain"])
    slot = limits.resource_slot("crm")

    def publish(prefix: str) -> None:
        client.publish_many(
            [
                {"name": "plain", "key": f"{prefix}{i}", "params": {"seconds": 0.1}}
                for i in range(10)
            ]
        )

    def results(prefix: str) -> list[list[float]]:
        return [d["result"] for d in db.tasks.find({"_id": {"$regex": f"^{prefix}"}})]

    def heard(using: bool) -> bool:
        return all(("plain" in w.parts.gate.uses) is using for w in workers)

    publish("one-")
    # the documented updates are heard by the limit's event (the periodic read is an hour off)
    async with two_workers(mongo_uri, db_name, limits_refresh=3600) as workers:
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 10, 60)
        assert peak(results("one-")) == 2
        for update in ({"$pull": {"names": "plain"}}, {"$addToSet": {"names": "plain"}}):
            db.limits.update_one({"_id": slot}, update)
            await wait_for(lambda update=update: heard("$addToSet" in update), 10)
        db.limits.update_one({"_id": slot}, {"$set": {"names": ["other"]}})
        await wait_for(lambda: heard(False), 10)
        publish("two-")
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 20, 60)
    assert peak(results("two-")) > 2
    assert db.limits.find_one({"_id": slot})["holders"] == []


async def test_a_task_a_resource_holds_back_says_so(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """The "why" of a due task that a shared resource keeps: full (a name whose handler
    declares it, read from the workers' heartbeats; a name the resource lists), or backing
    off; ``mtask get`` says it too."""
    client.set_limit(resource="openai", concurrency=1, names=["plain"])
    async with running_worker(registry, mongo_uri, db_name, concurrency=4) as (_, events):
        client.publish("summarize", "s1", {"seconds": 30})
        await events.wait("claimed", key="s1")
        client.publish("summarize", "s2", {"seconds": 0})
        client.publish("plain", "p1", {"seconds": 0})
        for key, name in (("s2", "summarize"), ("p1", "plain")):
            explained = client.explain(client.get(key))
            assert explained.state is State.BLOCKED and explained.why == "limit", explained
            said = f"resource `openai`, which `{name}` uses, is full: 1 of 1 runs at once in use"
            assert explained.reason == said
        code, out, _ = run_cli("get", "s2", "--uri", mongo_uri, "--database", db_name, width=200)
        assert code == 0 and "resource `openai`, which `summarize` uses, is full" in out, out
        # who takes it: the live workers' handlers that declare it, and the names it lists
        taken = "taken by embed, plain, summarize"
        code, out, _ = run_cli("limits", "--uri", mongo_uri, "--database", db_name, width=250)
        assert code == 0 and taken in out, out
        (use,) = [u for u in client.limit_use() if u.resource]
        assert use.users == ("embed", "plain", "summarize")
        # its users' tasks: s1 runs, s2 and p1 are due and wait for its one slot
        assert (use.open, use.running, use.due, use.blocked, use.in_use) == (3, 1, 2, 2, 1)
        with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
            page = http.get("/ui/limits", headers=AUTH).text
            assert 'class="users"><a href="/ui/tasks?name=embed">embed</a>' in page, page
        now = client.now()
        until = now + dt.timedelta(seconds=60)
        SyncDriver(mongo[db_name]).run(hold(limits.resource_slot("openai"), None, until, now))
        explained = client.explain(client.get("p1"))
        assert explained.state is State.BLOCKED and explained.why == "backoff", explained
        assert "resource `openai`, which `plain` uses, backs off" in explained.reason
        client.cancel("s1")
