"""Groups on the real replica set with in-process workers: sequences in publish order, limits
per group, the slot documents."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
from typing import Any

import pytest
import workerapp
from fastapi.testclient import TestClient
from harness import in_groups, running_worker, wait_for
from pymongo import MongoClient

from mtask import TaskClient, store
from mtask.cli import main
from mtask.driver import SyncDriver, collections
from mtask.limits import slots
from mtask.limits.rules import Limit, group_slot
from mtask.registry import Registry, TaskContext
from mtask.store import Outcome, RunState
from mtask.store import slots as store_slots
from mtask.web import create_app
from mtask.worker.claiming import limited_claims

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def spans(db: Any, prefix: str) -> dict[str, list[tuple[dt.datetime, dt.datetime, str]]]:
    """Per task, (claimed, finished, state) of its runs that ended."""
    return {
        d["_id"]: [
            (r["claimed_at"], r["finished_at"], r["state"]) for r in d["runs"] if r["finished_at"]
        ]
        for d in db.tasks.find({"_id": {"$regex": f"^{prefix}"}}, {"runs": 1})
    }


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_sequence_runs_its_group_one_at_a_time_in_publish_order(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient, workers: int
) -> None:
    db = mongo[db_name]
    client.set_limit("timed_sleep", group_concurrency=1)
    client.publish_many(in_groups("timed_sleep", "s", groups=3, each=6, params={"seconds": 0.02}))
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(workers):  # in this process: one monotonic clock for their handlers
            await stack.enter_async_context(
                running_worker(workerapp.registry, mongo_uri, db_name, concurrency=4)
            )
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 18)
    runs = spans(db, "s")
    assert all(len(r) == 1 and r[0][2] == "SUCCESS" for r in runs.values()), runs
    handled = {d["_id"]: d["result"] for d in db.tasks.find({}, {"result": 1})}
    for g in range(3):
        ordered = [handled[f"s{g}/{i:02d}"] for i in range(6)]  # publish order
        for before, after in itertools.pairwise(ordered):
            assert before[1] <= after[0], f"s{g}: not one at a time, in order: {before}, {after}"


def test_a_groups_slot_document_is_made_by_its_first_request_and_holds_its_limit(
    client: TaskClient, mongo: MongoClient[Any], db_name: str
) -> None:
    driver = SyncDriver(mongo[db_name])
    limits = mongo[db_name].limits
    now = dt.datetime(2099, 1, 1, 9, tzinfo=dt.UTC)  # the take's clock is given: a fixed day
    slot = group_slot("n", "$tenant")  # a group's name is data, never an expression
    limit = Limit(concurrency=2)
    requests = [slots.Request(slot, f"r{i}", f"k{i}", 1000, limit) for i in range(3)]
    taken = driver.run(store_slots.take(requests, "w", now))
    assert [t.taken for t in taken] == [True, True, False]
    assert taken[2].retry_at == now + dt.timedelta(seconds=1.001)  # the first lease's end
    doc = limits.find_one({"_id": slot})
    assert doc["name"] == "n" and doc["group"] == "$tenant" and doc["concurrency"] == 2
    assert [h["run_id"] for h in doc["holders"]] == ["r0", "r1"]
    assert doc["expire_at"] == dt.datetime(2099, 1, 2, tzinfo=dt.UTC) + slots.GROUP_TTL
    # a full slot is not written (no change event wakes those who wait for it)
    assert not driver.run(
        store_slots.take([slots.Request(slot, "r9", "k9", 1000, limit)], "w", now)
    )[0].taken
    assert limits.find_one({"_id": slot}) == doc
    driver.run(store_slots.release({slot: ["r0"]}))
    later = now + dt.timedelta(hours=1)  # a take within a day leaves the removal time alone
    assert driver.run(store_slots.take([slots.Request(slot, "r3", "k3", 1000, limit)], "w", later))[
        0
    ].taken
    assert limits.find_one({"_id": slot})["expire_at"] == doc["expire_at"]
    # the name's own limits are not a group's: they are listed, the groups' documents are not
    client.set_limit("n", group_concurrency=2)
    assert [d["_id"] for d in client.limits()] == ["n"]


def test_a_groups_slot_is_exact_when_a_lease_ended_or_the_limit_was_lowered(
    mongo: MongoClient[Any], db_name: str
) -> None:
    """A lock's push drops a holder whose lease ended; holders beyond a lowered limit leave
    the decision to the exact path, which counts the live ones."""
    driver = SyncDriver(mongo[db_name])
    limits = mongo[db_name].limits
    now = dt.datetime(2099, 1, 1, 9, tzinfo=dt.UTC)
    slot = group_slot("n", "g")

    def take(run: str, at: dt.datetime, concurrency: int, lease_ms: int = 1000) -> bool:
        request = slots.Request(slot, run, f"k-{run}", lease_ms, Limit(concurrency=concurrency))
        return driver.run(store_slots.take([request], "w", at))[0].taken

    assert take("a", now, 2, lease_ms=500) and take("b", now, 2)
    assert not take("c", now, 2)
    after_a = now + dt.timedelta(milliseconds=600)  # a's lease ended (its worker died)
    assert take("c", after_a, 2)
    assert [h["run_id"] for h in limits.find_one({"_id": slot})["holders"]] == ["b", "c"]
    assert take("d", now, 4, lease_ms=5000) and take("e", now, 4, lease_ms=5000)
    assert len(limits.find_one({"_id": slot})["holders"]) == 4
    # lowered to 1 with four holders: refused while they are live ...
    assert not take("f", after_a, 1)
    # ... and taken by the exact path once two are given back and two leases ended
    driver.run(store_slots.release({slot: ["d", "e"]}))
    assert take("f", now + dt.timedelta(seconds=2), 1)
    doc = limits.find_one({"_id": slot})
    live = [h["run_id"] for h in doc["holders"] if h["expires"] > now + dt.timedelta(seconds=2)]
    assert live == ["f"] and doc["concurrency"] == 1


def test_a_sequence_is_held_by_the_claim_of_its_running_task(
    client: TaskClient, mongo: MongoClient[Any], db_name: str
) -> None:
    """A sequence's lock is taken by the claim itself (``group_lock``, one open holder per
    group): another task of the group is refused whatever a worker read, until the holder
    finishes; a task reopened by ``retry`` takes the lock anew."""
    driver = SyncDriver(collections(mongo[db_name]))
    client.publish_many(
        [{"name": "n", "key": f"k{i}", "options": {"group": "g"}} for i in range(3)]
        + [{"name": "n", "key": "other", "options": {"group": "h"}}]
    )

    def claim(*keys: str) -> tuple[list[str], set[str]]:
        pairs = {k: ("n", "h" if k == "other" else "g") for k in keys}
        docs, busy, broken = driver.run(store.claim_locked(pairs, ["n"], "w", client.now()))
        assert broken == {}
        runs[docs[0]["_id"] if docs else ""] = docs[0]["claim_run_id"] if docs else ""
        return sorted(d["_id"] for d in docs), busy

    def end(key: str, state: RunState, permanent: bool = False) -> None:
        outcome = Outcome(key=key, run_id=runs[key], state=state, permanent=permanent)
        assert driver.run(store.finish_many([outcome], client.now())) == 1

    runs: dict[str, str] = {}
    assert claim("k0") == (["k0"], set())
    assert claim("other") == (["other"], set())  # another group: not held
    assert claim("k1") == ([], {"k1"})  # k0 holds the group: refused, nothing written
    assert mongo[db_name].tasks.find_one({"_id": "k1"})["status"] == "pending"
    end("k0", RunState.SUCCESS)  # finishing gives the lock up
    assert claim("k1") == (["k1"], set())
    end("k1", RunState.FAIL, permanent=True)
    assert claim("k2") == (["k2"], set())
    client.retry("k1")  # reopened while k2 runs: it waits for k2, not the other way round
    assert claim("k1") == ([], {"k1"})
    end("k2", RunState.SUCCESS)
    assert claim("k1") == (["k1"], set())
    held = mongo[db_name].tasks.count_documents(
        {"group_lock": True, "status": {"$in": ["pending", "running"]}}
    )
    assert held == 2  # k1 and other


def test_groups_are_visible_to_operators(
    client: TaskClient, mongo_uri: str, db_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Open work per group and the largest groups: the client, the REST API (which filters by
    group), ``mtask stats`` and the dashboard; metrics carry no group label."""
    client.publish_many(
        [{"name": "n", "key": f"big/{i}", "options": {"group": "big"}} for i in range(5)]
        + [{"name": "n", "key": f"small/{i}", "options": {"group": "small"}} for i in range(2)]
        + [{"name": "m", "key": "plain"}]
    )
    client.cancel("big/0")  # finished: no longer open
    assert client.groups() == [
        {"name": "n", "group": "big", "open": 4, "running": 0},
        {"name": "n", "group": "small", "open": 2, "running": 0},
    ]
    assert client.groups("m") == [] and len(client.groups(top=1)) == 1
    assert {t.key for t in client.list(group="small")} == {"small/0", "small/1"}

    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
        page = http.get("/tasks", params={"group": "small"}, headers=AUTH).json()
        assert sorted(t["key"] for t in page["tasks"]) == ["small/0", "small/1"]
        assert http.get("/groups", params={"top": 1}, headers=AUTH).json() == [
            {"name": "n", "group": "big", "open": 4, "running": 0}
        ]
        assert http.get("/groups", params={"top": 0}, headers=AUTH).status_code == 422
        assert http.get("/tasks", params={"group": ""}, headers=AUTH).status_code == 422
        assert "group" not in http.get("/metrics", headers=AUTH).text
        overview = http.get("/", headers=AUTH).text
        assert 'data-group="big"' in overview and 'data-group="small"' in overview
        listed = http.get("/ui/tasks", params={"group": "big"}, headers=AUTH).text
        assert "big/1" in listed and "small/0" not in listed

    assert main(["stats", "--uri", mongo_uri, "--database", db_name]) == 0
    shown = capsys.readouterr().out
    assert "largest groups" in shown and "big" in shown and "small" in shown


async def test_a_run_whose_slot_another_run_took_is_stopped_and_given_back(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """A run frozen or cut off past its lease, whose task nobody took but whose slot another
    run did (the take drops a holder whose lease ended), must not run on beside that run: its
    next ping finds the slot gone, and the run stops and gives its task back (RELEASED, no
    retry spent). Here the other run's take is written by hand (the take itself:
    test_limits)."""
    db = mongo[db_name]
    client.set_limit("sleep", group_concurrency=2)
    options = {"group": "g", "ping_interval_ms": 100, "worker_timeout_ms": 30_000}
    client.publish("sleep", "a", {"seconds": 3600}, options=options)
    async with running_worker(workerapp.registry, mongo_uri, db_name, concurrency=2) as (
        worker,
        events,
    ):
        await events.wait("claimed", key="a")
        run_id = db.tasks.find_one({"_id": "a"})["runs"][0]["run_id"]
        slot = group_slot("sleep", "g")
        await wait_for(lambda: db.limits.find_one({"_id": slot, "holders.run_id": run_id}))
        taken = db.limits.update_one(
            {"_id": slot, "holders.run_id": run_id},
            {"$set": {"holders.$": {"run_id": "other", "key": "b", "worker_id": "w2",
                                    "expires": dt.datetime(2099, 1, 1, tzinfo=dt.UTC)}}},
        )  # fmt: skip
        assert taken.modified_count == 1
        released = await events.wait("released", key="a", timeout=30)
        assert released["reason"] == "slot_lost" and released["run_id"] == run_id
        assert worker.stats.slots_lost == 1 and worker.stats.lease_lost == 0
        await wait_for(lambda: len(db.tasks.find_one({"_id": "a"})["runs"]) == 2)
    doc = db.tasks.find_one({"_id": "a"})
    first = doc["runs"][0]
    assert first["run_id"] == run_id and first["state"] == "RELEASED"
    assert doc["failures"] == 0  # no retry spent
    # claimed again in the room left (the other run holds one place of two)
    assert doc["runs"][1]["state"] in ("RUNNING", "RELEASED")


@pytest.mark.parametrize("why", ["retried", "taken_over"])
async def test_a_sequence_runs_the_task_holding_its_lock_first_whatever_its_place(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient, why: str
) -> None:
    """A task keeps its group's lock while it is open, running or not (waiting for its retry,
    left by a worker that died), and a task with an earlier place can become open meanwhile:
    one reopened by ``retry`` or one whose publisher's clock put it first. The holder is the
    group's head: it runs first, then the other (claiming the earlier task first failed on
    the lock for ever, and nothing claimed the holder: neither ran again)."""
    db = mongo[db_name]
    driver = SyncDriver(collections(db))
    client.set_limit("sleep", group_concurrency=1)
    quick = {"seconds": 0.01}
    if why == "retried":  # k1 failed for good; k2 failed and waits for its retry, holding g
        client.publish("sleep", "k1", quick, options={"group": "g"})
        client.publish("sleep", "k2", quick, options={"group": "g", "retry_delay_ms": 0})
        for key, permanent in (("k1", True), ("k2", False)):
            docs, busy, _ = driver.run(
                store.claim_locked({key: ("sleep", "g")}, ["sleep"], "w", client.now())
            )
            assert [d["_id"] for d in docs] == [key] and not busy
            failed = Outcome(key, docs[0]["claim_run_id"], RunState.FAIL, permanent=permanent)
            assert driver.run(store.finish_many([failed], client.now())) == 1
        client.retry("k1")  # reopened by an operator: earlier in publish order than k2
        holder, other = "k2", "k1"
    else:  # the holder's worker died; a task published with an earlier place appears
        client.publish("sleep", "late", quick, options={"group": "g"})
        docs, _, _ = driver.run(
            store.claim_locked({"late": ("sleep", "g")}, ["sleep"], "dead", client.now())
        )
        assert [d["_id"] for d in docs] == ["late"]
        client.publish("sleep", "early", quick, options={"group": "g"})
        seq = db.tasks.find_one({"_id": "late"})["publish_seq"] - 500
        lease_end = client.now()
        db.tasks.update_one({"_id": "early"}, {"$set": {"publish_seq": seq}})
        db.tasks.update_one(
            {"_id": "late"},
            {"$set": {"runs.0.lease_expires_at": lease_end, "next_claim_at": lease_end}},
        )
        await wait_for(lambda: client.now() > lease_end + dt.timedelta(milliseconds=50))
        holder, other = "late", "early"
    assert db.tasks.find_one({"_id": holder})["group_lock"] is True
    heads = driver.run(store.heads([("sleep", "g")]))
    assert heads[("sleep", "g")]["_id"] == holder
    async with running_worker(workerapp.registry, mongo_uri, db_name, concurrency=2):
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 2)
    runs = {d["_id"]: d["runs"][-1] for d in db.tasks.find({}, {"runs": 1})}
    assert runs[holder]["finished_at"] <= runs[other]["claimed_at"]  # the holder went first


@pytest.mark.parametrize("odd", ["object_id", "options_array"])
async def test_an_odd_document_in_a_sequence_never_stops_the_worker(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient, odd: str
) -> None:
    """A document written by hand into a sequence's group, first in publish order (it has no
    ``publish_seq``): a key that is not a string, or ``options`` an array (whose group reads
    as an array). It is never a head (no claim could take it; the sweep marks it invalid),
    and reading the heads never stops the worker (it raised ``TypeError``: unhashable)."""
    db = mongo[db_name]
    client.set_limit("sleep", group_concurrency=1)
    client.publish("sleep", "k1", {"seconds": 0.01}, options={"group": "g"})
    doc = db.tasks.find_one({"_id": "k1"})
    doc.pop("publish_seq")
    if odd == "object_id":
        doc["_id"] = {"tenant": 7}
    else:
        doc["_id"], doc["options"] = "odd", [doc["options"]]
    db.tasks.insert_one(doc)
    heads = SyncDriver(collections(db)).run(store.heads([("sleep", "g")]))
    assert heads[("sleep", "g")]["_id"] == "k1"
    async with running_worker(workerapp.registry, mongo_uri, db_name, concurrency=2):
        await wait_for(lambda: db.tasks.find_one({"_id": "k1"})["status"] == "succeeded")
        await wait_for(lambda: db.tasks.find_one({"_id": doc["_id"]})["status"] == "invalid")


def test_a_task_moved_to_another_group_leaves_its_old_groups_lock(
    client: TaskClient, mongo: MongoClient[Any], db_name: str
) -> None:
    """``publish(on_conflict="update_params")`` moving a sequence's lock holder (retrying, so
    still pending) into a group whose lock is held works: the task waits in its new group
    behind that holder, and its old group's next task may take the lock (it was a
    ``StorageError`` the callers took for transient)."""
    driver = SyncDriver(collections(mongo[db_name]))
    client.publish_many(
        [{"name": "n", "key": f"g{i}", "options": {"group": "g"}} for i in range(2)]
        + [{"name": "n", "key": "h0", "options": {"group": "h"}}]
    )

    def claim(key: str, group: str) -> tuple[list[dict[str, Any]], set[str]]:
        docs, busy, broken = driver.run(
            store.claim_locked({key: ("n", group)}, ["n"], "w", client.now())
        )
        assert broken == {}
        return docs, busy

    [g0], _ = claim("g0", "g")
    assert claim("h0", "h")[0]  # h0 holds h's lock, running
    failed = Outcome(key="g0", run_id=g0["claim_run_id"], state=RunState.FAIL, retry_delay_ms=0)
    assert driver.run(store.finish_many([failed], client.now())) == 1  # retrying: still holds g
    assert claim("g1", "g") == ([], {"g1"})
    moved = client.publish("n", "g0", {"v": 2}, options={"group": "h"}, on_conflict="update_params")
    assert moved.updated and moved.task.options.group == "h"
    doc = mongo[db_name].tasks.find_one({"_id": "g0"})
    assert doc["status"] == "pending" and "group_lock" not in doc
    assert claim("g0", "h") == ([], {"g0"})  # behind h0 in its new group
    assert [d["_id"] for d in claim("g1", "g")[0]] == ["g1"]  # g's lock was given up
    kept = client.publish("n", "g1", {"v": 3}, options={"group": "g"}, on_conflict="update_params")
    assert not kept.updated  # running: update_params leaves a running task as it is


async def test_a_lowered_group_limit_never_stalls_its_group(
    mongo_uri: str, db_name: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three runs of a group hold its slot when its limit is lowered from 3 to 2, and two keys
    of the same worker wait for it. Each run's end keeps its place for a waiting key, whose
    take is refused (the slot holds more runs than it allows now): that place must go back
    with its run. It was kept again for the key the refusal had just blocked, whatever the
    interleaving allowed, so the ended runs held the slot until their leases ran out (30 s;
    an hour here, so that a stall is a hang)."""
    monkeypatch.setattr(limited_claims, "DEFAULT_SLOT_LEASE_MS", 3_600_000)
    registry = Registry()
    go = {f"k{i}": asyncio.Event() for i in range(5)}

    @registry.task("work")
    async def work(params: dict[str, Any], ctx: TaskContext) -> None:
        await go[ctx.key].wait()

    client.set_limit("work", group_concurrency=3)
    async with running_worker(registry, mongo_uri, db_name, concurrency=8) as (worker, events):
        await asyncio.wait_for(worker.parts.gate.refreshed.wait(), 10)
        client.publish_many(
            [{"name": "work", "key": f"k{i}", "options": {"group": "g"}} for i in range(5)]
        )
        await events.wait("claimed", count=3)
        client.set_limit("work", group_concurrency=2)
        await events.wait("limits_applied", name="work", count=2)  # the start's, the change's
        first = [e["key"] for e in events.matching("claimed")]
        for key in set(go) - set(first):
            go[key].set()  # the waiting ones end at once once they run
        gate, slot = worker.parts.gate, group_slot("work", "g")
        refused: list[str] = []  # the ended runs whose place a take was refused
        take = gate.take

        async def noted(requests: list[Any], now: dt.datetime) -> Any:
            got = await take(requests, now)
            for request, t in zip(requests, got or (), strict=False):
                if request.replaces is not None and not t.taken:
                    refused.append(request.replaces)
            return got

        gate.take = noted  # type: ignore[method-assign]

        def waiting() -> bool:  # every key not claimed yet waits for the slot
            claimed = {e["key"] for e in events.matching("claimed")}
            return set(gate.waiting_for_lock(slot, 5)) == set(go) - claimed

        for key in first:  # one at a time, each while the others wait for the slot
            await wait_for(waiting)
            go[key].set()
            await events.wait("recorded", key=key)
        await events.wait("recorded", count=5, timeout=20)
    holders = client.collection.database.limits.find_one({"_id": group_slot("work", "g")})
    assert holders is not None and holders["holders"] == []
    assert refused and max(refused.count(r) for r in refused) == 1  # then given back


async def test_a_sequence_raised_counts_its_running_task_before_its_worker_does(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """A group's sequence raised to 3 at once while its lock's task runs on another worker
    that has not counted that run in yet (its change event late, or the worker frozen): a
    worker that applies the raised limit first counts that run towards the 3 before it takes
    a place, so its own runs of the group are 2 at once at most while that run goes on. It
    took the 3 places itself: 4 runs of the group at once."""
    db = mongo[db_name]
    driver = SyncDriver(collections(db))
    client.set_limit("work", group_concurrency=1)
    client.publish("work", "held", options={"group": "g"})
    docs, _, _ = driver.run(
        store.claim_locked({"held": ("work", "g")}, ["work"], "elsewhere", client.now())
    )
    assert [d["_id"] for d in docs] == ["held"]  # its run goes on, on its live lease
    keys = [f"k{i}" for i in range(4)]
    client.publish_many([{"name": "work", "key": k, "options": {"group": "g"}} for k in keys])
    client.set_limit("work", group_concurrency=3)
    registry = Registry()
    go = asyncio.Event()
    running: list[str] = []
    most = 0

    @registry.task("work")
    async def work(params: dict[str, Any], ctx: TaskContext) -> None:
        nonlocal most
        running.append(ctx.key)
        most = max(most, len(running))
        await go.wait()
        running.remove(ctx.key)

    async with running_worker(registry, mongo_uri, db_name, concurrency=4) as (worker, events):
        slot = group_slot("work", "g")

        def decided() -> bool:  # every key runs, or waits for the group's slot
            claimed = {e["key"] for e in events.matching("claimed")}
            return len(claimed) >= 2 and claimed | set(
                worker.parts.gate.waiting_for_lock(slot, 4)
            ) == set(keys)

        await wait_for(decided)
        claimed = sorted(e["key"] for e in events.matching("claimed"))
        assert len(claimed) == 2, f"{claimed} ran beside `held`: more than 3 at once"
        go.set()
        await wait_for(lambda: db.tasks.count_documents({"status": "succeeded"}) == 4)
    assert most == 2  # the raised limit is used, `held` counted in all along
    assert db.tasks.find_one({"_id": "held"})["status"] == "running"


def test_a_sequence_raised_says_so_and_its_lock_holders_are_counted_in(
    mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """``set_limit`` notes when a name's groups stop being sequences (``LOCK_RUNS``), only
    then; ``count_lock_runs`` gives the live run of each group's lock holder a place in its
    slot, which a take counts, never shortens a place kept live, and counts no run that
    ended."""
    db = mongo[db_name]
    driver = SyncDriver(collections(db))

    def since() -> Any:
        return db.limits.find_one({"_id": "work"}).get("lock_runs_since")

    client.set_limit("work", group_concurrency=3)  # no sequence before
    assert since() is None
    client.set_limit("work", group_concurrency=1)
    assert since() is None
    client.set_limit("work", group_concurrency=3)
    raised = since()
    assert isinstance(raised, dt.datetime)
    client.set_limit("work", group_concurrency=4)  # still no sequence: kept
    assert since() == raised
    client.set_limit("work", group_concurrency=1)
    assert since() is None
    client.set_limit("work", group_rate=5.0)  # a rate alone counts no runs at once
    assert since() is None
    client.set_limit("work", group_concurrency=3)  # from a rate, not from a sequence
    assert since() is None
    client.set_limit("work", group_concurrency=1)
    client.set_limit("work", group_concurrency=1, group_rate=5.0)  # a slot of one, no lock
    assert isinstance(since(), dt.datetime)

    for key, group in (("held", "g"), ("other", "h")):
        client.publish("work", key, options={"group": group})
        docs, _, _ = driver.run(
            store.claim_locked({key: ("work", group)}, ["work"], "elsewhere", client.now())
        )
        assert [d["_id"] for d in docs] == [key]
    run_id = db.tasks.find_one({"_id": "held"})["runs"][0]["run_id"]
    slot, now, known = group_slot("work", "g"), client.now(), set[str]()
    assert driver.run(store_slots.count_lock_runs([slot], now, known)) == 1
    holders = db.limits.find_one({"_id": slot})["holders"]
    assert [(h["run_id"], h["key"], h["worker_id"]) for h in holders] == [
        (run_id, "held", "elsewhere")
    ]
    assert now < holders[0]["expires"] <= now + store_slots.COUNTED_FOR
    assert known == {slot}  # the group's document was made (the other group's was not)
    assert db.limits.find_one({"_id": group_slot("work", "h")}) is None
    limit = Limit(concurrency=2)
    requests = [slots.Request(slot, f"r{i}", f"k{i}", 1000, limit) for i in range(2)]
    assert [t.taken for t in driver.run(store_slots.take(requests, "w", now))] == [True, False]
    # its own worker counted it in since: a place kept live is left alone
    kept = now + dt.timedelta(minutes=5)
    db.limits.update_one(
        {"_id": slot, "holders.run_id": run_id}, {"$set": {"holders.$.expires": kept}}
    )
    driver.run(store_slots.count_lock_runs([slot], now, known))
    places = {h["run_id"]: h["expires"] for h in db.limits.find_one({"_id": slot})["holders"]}
    assert places[run_id] == kept
    # a run whose lease ended is counted in no more
    db.tasks.update_one({"_id": "held"}, {"$set": {"runs.0.lease_expires_at": now}})
    db.limits.update_one({"_id": slot}, {"$set": {"holders": []}})
    assert driver.run(store_slots.count_lock_runs([slot], client.now(), known)) == 0
    assert db.limits.find_one({"_id": slot})["holders"] == []
