"""Triggers end to end on a real replica set with real (in-process) workers (docs/triggers.md):
a task for each matching change and none for the others, the updated-fields filter, a task per
document (joined while it has not started, reset once finished, a follow-up while it runs), a
debounce, a scan once at the start, pause, resume and reset, a standby taking over, lag, and a
document of any shape that never stops a trigger."""

from __future__ import annotations

import datetime as dt
from typing import Any

from bson import Decimal128
from harness import running_worker, wait_for
from pymongo import MongoClient

from mtask import AsyncTaskClient, TaskClient
from mtask.registry import Registry, TaskContext

Db = MongoClient[dict[str, Any]]


def orders_registry(**declaration: Any) -> Registry:
    registry = Registry()

    @registry.task("ship")
    async def ship(params: dict[str, Any]) -> Any:
        return params.get("total")

    @registry.task("idle")
    async def idle(params: dict[str, Any]) -> None:
        return None

    declaration.setdefault("match", {"status": "paid"})
    declaration.setdefault("on", ["insert", "update"])
    registry.trigger("orders", task="ship", params=["total"], **declaration)
    return registry


def handled(events: Any) -> int:
    """The changes the trigger has handled so far (its ``reacted`` events)."""
    return sum(e["changes"] for e in events.matching("reacted", follower="trigger:ship"))


def ship_tasks(db: Db, **more: Any) -> list[dict[str, Any]]:
    return list(db.tasks.find({"name": "ship", **more}).sort("created_at", 1))


async def test_each_matching_change_publishes_one_task_and_no_other_change_does(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    db = mongo[db_name]
    async with running_worker(orders_registry(), mongo_uri, db_name) as (_, events):
        await events.wait("following", follower="trigger:ship")
        db.orders.insert_many(
            [
                {"_id": "o1", "status": "paid", "total": 10},
                {"_id": "o2", "status": "new", "total": 20},
                {"_id": 3, "status": "paid", "total": 30},
            ]
        )
        db.orders.update_one({"_id": "o2"}, {"$set": {"status": "paid"}})
        db.orders.update_one({"_id": "o2"}, {"$set": {"note": "still paid"}})  # matches too
        db.orders.update_one({"_id": 3}, {"$set": {"status": "refunded"}})  # does not
        db.orders.replace_one({"_id": "o1"}, {"status": "paid", "total": 11})  # not in `on`
        db.orders.delete_one({"_id": "o1"})
        await wait_for(lambda: len(ship_tasks(db, status="succeeded")) == 4)
        db.orders.insert_one({"_id": "o9", "status": "paid", "total": 90})
        await wait_for(lambda: len(ship_tasks(db, status="succeeded")) == 5)
    tasks = ship_tasks(db)
    assert sorted((str(t["params"]["_id"]), t["params"]["change"]["op"]) for t in tasks) == [
        ("3", "insert"),
        ("o1", "insert"),
        ("o2", "update"),
        ("o2", "update"),
        ("o9", "insert"),
    ]
    assert {t["_id"].rsplit(":", 1)[0] for t in tasks} == {
        "ship:o1",
        "ship:~3",
        "ship:o2",
        "ship:o9",
    }
    assert all(t["result"] == t["params"]["total"] for t in tasks)
    assert all(isinstance(t["params"]["change"]["at"], dt.datetime) for t in tasks)


async def test_the_updated_fields_filter_passes_only_updates_that_touch_them(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    db = mongo[db_name]
    registry = orders_registry(match={"status": "paid"}, fields=["status", "lines.qty"])
    async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (_, events):
        await events.wait("following", follower="trigger:ship")
        db.orders.insert_one({"_id": "o1", "status": "paid", "lines": {"qty": 1}})  # insert
        db.orders.update_one({"_id": "o1"}, {"$set": {"note": "x"}})  # not a named field
        db.orders.update_one({"_id": "o1"}, {"$set": {"lines.qty": 2}})  # named
        db.orders.update_one({"_id": "o1"}, {"$set": {"lines": {"qty": 3}}})  # around it
        db.orders.update_one({"_id": "o1"}, {"$unset": {"note": ""}})  # not named
        # set to the value it holds: MongoDB records only what changed (x), so it does not pass
        db.orders.update_one({"_id": "o1"}, {"$set": {"status": "paid", "x": 1}})
        db.orders.insert_one({"_id": "end", "status": "paid"})
        await wait_for(lambda: db.tasks.find_one({"params._id": "end"}))
    ops = sorted((str(t["params"]["_id"]), t["params"]["change"]["op"]) for t in ship_tasks(db))
    assert ops == [("end", "insert"), ("o1", "insert"), ("o1", "update"), ("o1", "update")]


async def test_a_document_key_gives_one_waiting_task_however_often_the_document_changes(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    """Five updates while its task is pending give one task, with the newest params; once it
    finished a change runs it again; a change while it runs gets a follow-up task."""
    db = mongo[db_name]
    registry = orders_registry(key="document")
    async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (_, events):
        await events.wait("following", follower="trigger:ship")
        db.orders.insert_one({"_id": "o1", "status": "paid", "total": 0})
        for total in range(1, 6):
            db.orders.update_one({"_id": "o1"}, {"$set": {"total": total}})
        await wait_for(lambda: handled(events) == 6)
        [task] = ship_tasks(db)
        assert task["_id"] == "ship:o1" and task["params"]["total"] == 5
        # it finished: a change runs it again (reset), with that change's params
        db.tasks.update_one({"_id": "ship:o1"}, {"$set": {"status": "succeeded"}})
        db.orders.update_one({"_id": "o1"}, {"$set": {"total": 6}})
        await wait_for(lambda: handled(events) == 7)
        task = db.tasks.find_one({"_id": "ship:o1"})
        assert task["status"] == "pending" and task["params"]["total"] == 6
        # it runs: a change gets a follow-up keyed by that run; the next joins the follow-up
        db.tasks.update_one(
            {"_id": "ship:o1"},
            {"$set": {"status": "running", "attempts": 1, "runs": [{"run_id": "r-1"}]}},
        )
        db.orders.update_one({"_id": "o1"}, {"$set": {"total": 7}})
        db.orders.update_one({"_id": "o1"}, {"$set": {"total": 8}})
        await wait_for(lambda: handled(events) == 9)
    follow_up = ship_tasks(db, _id={"$ne": "ship:o1"})
    assert len(follow_up) == 1 and follow_up[0]["_id"].startswith("ship:o1:after-")
    assert follow_up[0]["params"]["total"] == 8  # joined by the second change


async def test_a_debounced_document_runs_its_debounce_after_its_latest_change(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    db = mongo[db_name]
    registry = orders_registry(debounce=3600)
    async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (_, events):
        await events.wait("following", follower="trigger:ship")
        db.orders.insert_one({"_id": "o1", "status": "paid", "total": 1})
        await wait_for(lambda: db.tasks.find_one({"_id": "ship:o1"}))
        first = db.tasks.find_one({"_id": "ship:o1"})["available_at"]
        db.orders.update_one({"_id": "o1"}, {"$set": {"total": 2}})
        await wait_for(lambda: db.tasks.find_one({"_id": "ship:o1"})["params"]["total"] == 2)
    task = db.tasks.find_one({"_id": "ship:o1"})
    at = task["params"]["change"]["at"]
    assert task["available_at"] >= first
    assert task["available_at"] == at + dt.timedelta(hours=1)
    assert task["next_claim_at"] == task["available_at"] and len(ship_tasks(db)) == 1


async def test_a_new_trigger_scans_the_matching_documents_once(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    db = mongo[db_name]
    db.orders.insert_many(
        [{"_id": i, "status": "paid" if i % 2 else "new", "total": i} for i in range(1, 1201)]
        + [{"_id": "text-id", "status": "paid"}]
    )
    registry = orders_registry(start="scan")
    async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (_, events):
        done = await events.wait("scanned", follower="trigger:ship", timeout=60)
        db.orders.insert_one({"_id": "after", "status": "paid"})
        await wait_for(lambda: db.tasks.find_one({"params._id": "after"}))
    assert done["published"] == 601
    scanned = ship_tasks(db, **{"params.change.op": "scan"})
    assert len(scanned) == 601 and all(t["_id"].endswith(":scan1") for t in scanned)
    assert {t["params"]["_id"] for t in scanned} == {*range(1, 1201, 2), "text-id"}
    async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (_, events):
        await events.wait("following", follower="trigger:ship")
        db.orders.insert_one({"_id": "later", "status": "paid"})
        await wait_for(lambda: db.tasks.find_one({"params._id": "later"}))
    assert not events.matching("scanned")  # once: a worker started again does not scan
    assert len(ship_tasks(db)) == 603


async def test_pause_resume_and_reset_from_the_client_and_the_lag_they_show(
    mongo_uri: str, db_name: str, mongo: Db, client: TaskClient
) -> None:
    db = mongo[db_name]
    async with running_worker(orders_registry(), mongo_uri, db_name, names=["idle"]) as (
        _,
        events,
    ):
        await events.wait("following", follower="trigger:ship")
        [view] = await wait_for(lambda: [v for v in client.triggers() if v.get("through")])
        assert view["held"] and view["spec"]["task"] == "ship" and view["lag_ms"] >= 0
        paused = client.pause_trigger("ship")
        assert paused["paused"]
        await events.wait("unfollowed", follower="trigger:ship", why="paused", timeout=30)
        db.orders.insert_one({"_id": "while-paused", "status": "paid"})
        assert not client.triggers()[0]["held"]
        client.resume_trigger("ship")
        await events.wait("following", follower="trigger:ship", count=2, timeout=30)
        # resumed from its position: the change made while paused is published
        await wait_for(lambda: db.tasks.find_one({"params._id": "while-paused"}))
        client.pause_trigger("ship")
        await events.wait("unfollowed", follower="trigger:ship", count=2, timeout=30)
        db.orders.insert_one({"_id": "forgotten", "status": "paid"})
        client.reset_trigger("ship")  # forgets the position: from now on
        client.resume_trigger("ship")
        await events.wait("following", follower="trigger:ship", count=3, timeout=30)
        await wait_for(lambda: client.triggers()[0].get("through"))  # its fresh position
        db.orders.insert_one({"_id": "after-reset", "status": "paid"})
        await wait_for(lambda: db.tasks.find_one({"params._id": "after-reset"}))
        # the counts are saved with the position, a moment after the task is published
        await wait_for(lambda: client.triggers()[0].get("changes", 0) >= 1)
    assert db.tasks.find_one({"params._id": "forgotten"}) is None
    [view] = client.triggers()
    assert view["generation"] == 1 and view["changes"] >= 1


async def test_a_standby_takes_the_trigger_when_its_holder_stops(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    db = mongo[db_name]
    registry = orders_registry()
    async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (first, one):
        await one.wait("following", follower="trigger:ship")
        async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (_, two):
            db.orders.insert_one({"_id": "a", "status": "paid"})
            await wait_for(lambda: db.tasks.find_one({"params._id": "a"}))
            assert not two.matching("following")  # one follower for the cluster
            first.stop(immediate=True)  # gives its lease back as it stops
            await two.wait("following", follower="trigger:ship", timeout=30)
            db.orders.insert_one({"_id": "b", "status": "paid"})
            await wait_for(lambda: db.tasks.find_one({"params._id": "b"}))
    assert len(ship_tasks(db)) == 2


async def test_a_document_of_any_shape_never_stops_a_trigger(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    db = mongo[db_name]
    registry = orders_registry(match={"kind": "x"})
    big = "x" * (1024 * 1024 + 10)
    async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (_, events):
        await events.wait("following", follower="trigger:ship")
        db.orders.insert_one({"_id": "big", "kind": "x", "total": big})
        db.orders.insert_one({"_id": {"a": {"b": 2}, "c": Decimal128("1.5")}, "kind": "x"})
        deep: Any = 1
        for _ in range(80):  # deeper than params may be (64), as deep as MongoDB takes
            deep = {"d": deep}
        oid = db.orders.insert_one({"kind": "x", "total": deep}).inserted_id
        db.orders.insert_one({"_id": "end", "kind": "x"})
        await wait_for(lambda: db.tasks.find_one({"params._id": "end"}))
    tasks = {str(t["params"]["_id"]): t for t in ship_tasks(db)}
    assert len(tasks) == 4
    for key in ("big", str(oid)):
        assert "total" not in tasks[key]["params"] and "omitted" in tasks[key]["params"]
    assert "bytes" in tasks["big"]["params"]["omitted"]


async def test_a_trigger_runs_from_a_worker_process_registry_and_its_task_runs(
    mongo_uri: str, db_name: str, mongo: Db, aclient: AsyncTaskClient
) -> None:
    """A trigger's task is any task: it runs, its result recorded, and `mtask triggers` counts."""
    db = mongo[db_name]
    registry = Registry()
    seen: list[Any] = []

    @registry.task("welcome")
    async def welcome(params: dict[str, Any], ctx: TaskContext) -> str:
        seen.append(params["email"])
        return f"sent to {params['email']}"

    registry.trigger("users", task="welcome", on=["insert"], params=["email"])
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("following", follower="trigger:welcome")
        db.users.insert_one({"_id": "u1", "email": "ann@example.com"})
        done = await events.wait("succeeded", timeout=30)
        await wait_for(lambda: (db.triggers.find_one() or {}).get("published") == 1, timeout=20)
    assert seen == ["ann@example.com"]
    task = await aclient.get(done["key"])
    assert task is not None and task.result == "sent to ann@example.com"


async def test_with_images_a_trigger_matches_the_document_as_its_change_left_it(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    """``images=True``: each update is matched against its own post-image, so an order paid
    then shipped at once gets its task (the lookup could read it shipped already). A change
    whose image is missing (images turned on after it) is a lost history: said, and scanned."""
    db = mongo[db_name]
    db.create_collection("orders")
    db.orders.insert_one({"_id": "early", "status": "new"})
    registry = orders_registry(images=True, on=["update"])
    async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (_, events):
        await events.wait("following", follower="trigger:ship")
        db.orders.update_one({"_id": "early", "status": "new"}, {"$set": {"status": "paid"}})
        await events.wait("history_lost", follower="trigger:ship", timeout=30)
        await events.wait("scanned", follower="trigger:ship", timeout=30)
        db.command("collMod", "orders", changeStreamPreAndPostImages={"enabled": True})
        db.orders.insert_many([{"_id": i, "status": "new"} for i in range(20)])
        for i in range(20):
            db.orders.update_one({"_id": i}, {"$set": {"status": "paid"}})
            db.orders.update_one({"_id": i}, {"$set": {"status": "shipped"}})
        await wait_for(lambda: handled(events) >= 20, timeout=30)
    updates = ship_tasks(db, **{"params.change.op": "update"})
    assert sorted(t["params"]["_id"] for t in updates) == list(range(20))
    assert [t["params"]["_id"] for t in ship_tasks(db, **{"params.change.op": "scan"})] == ["early"]


async def test_a_change_replayed_by_the_next_holder_publishes_no_second_task(
    mongo_uri: str, db_name: str, mongo: Db
) -> None:
    """A holder that published a change's task but whose position was not saved past it (it
    died in between) leaves the change to the next holder, which reads it again from the saved
    resume token: the change still has exactly one task, and the one that ran stays done."""
    db = mongo[db_name]
    registry = orders_registry()
    follower = {"_id": "tasks/trigger/ship"}
    async with running_worker(registry, mongo_uri, db_name) as (_, first):
        await first.wait("following", follower="trigger:ship")
        before = db.triggers.find_one(follower)["token"]  # saved before anything is handled
        db.orders.insert_one({"_id": "a", "status": "paid", "total": 5})
        await first.wait("reacted", follower="trigger:ship")
        await wait_for(lambda: ship_tasks(db, status="succeeded"))
    # the position goes back to before the change, as if the holder died before saving it
    assert db.triggers.find_one(follower)["token"] != before
    db.triggers.update_one(follower, {"$set": {"token": before}})
    async with running_worker(registry, mongo_uri, db_name, names=["idle"]) as (_, second):
        await second.wait("reacted", follower="trigger:ship", timeout=30)  # the same change
        db.orders.insert_one({"_id": "b", "status": "paid", "total": 6})
        await wait_for(lambda: handled(second) == 2)
    assert handled(second) == 2  # "a" was read again, then "b"
    tasks = {str(t["params"]["_id"]): t for t in ship_tasks(db)}
    assert sorted(tasks) == ["a", "b"]  # one task for "a", not two
    assert tasks["a"]["status"] == "succeeded" and tasks["a"]["attempts"] == 1
