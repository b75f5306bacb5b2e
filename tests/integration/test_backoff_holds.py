"""``BackOff`` on the real replica set: a hold refuses the slot's take on the server
(its name, one group of it, or a resource) until it ends; a worker's handler that raises it is
released without spending a retry and its task held; shown by ``mtask limits``, the dashboard
and the task's "why"."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from fastapi.testclient import TestClient
from harness import run_cli, running_worker, wait_for
from prometheus_client import REGISTRY
from pymongo import MongoClient

from mtask import BackOff, TaskClient
from mtask.driver import SyncDriver
from mtask.explain.states import State
from mtask.limits import rules as limits
from mtask.limits import slots
from mtask.registry import Registry, TaskContext
from mtask.store import slots as store_slots
from mtask.store.holds import hold
from mtask.web import create_app
from mtask.worker.claiming.limited import plan
from mtask.worker.finding.placement import TaskMeta

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
T0 = dt.datetime(2099, 1, 1, 9, tzinfo=dt.UTC)

registry = Registry()


@registry.task("polite")
async def polite(params: dict[str, Any], ctx: TaskContext) -> int:
    if params.get("back_off") and ctx.attempt == 1:
        raise BackOff(
            params["back_off"],
            name=params.get("whole", False),
            group=not params.get("whole", False),
        )
    return ctx.attempt


@registry.task("holder")
async def holder(params: dict[str, Any], ctx: TaskContext) -> int:
    """Backs off its whole name, or the resource ``crm`` its name does not take, once."""
    if params.get("hold") and ctx.attempt == 1:
        by_name = params["hold"] == "name"
        raise BackOff(params["seconds"], name=by_name, resource=None if by_name else "crm")
    return ctx.attempt


@registry.task("crm_user", uses=["crm"])
async def crm_user(params: dict[str, Any], ctx: TaskContext) -> int:
    return ctx.attempt


def take(driver: SyncDriver, slot: str, group: str | None, at: dt.datetime, run: str) -> bool:
    request = slots.Request(slot, run, f"k-{run}", 60_000, group=group)
    (taken,) = driver.run(store_slots.take([request], "w", at))
    return taken.taken


def test_a_hold_refuses_the_take_on_the_server_until_it_ends(
    mongo: MongoClient[Any], db_name: str
) -> None:
    driver = SyncDriver(mongo[db_name])
    driver.run(hold("n", "acme", T0 + dt.timedelta(seconds=30), T0))  # one group of n
    assert not take(driver, "n", "acme", T0 + dt.timedelta(seconds=29), "r1")
    assert take(driver, "n", "beta", T0 + dt.timedelta(seconds=1), "r2")  # another group
    assert take(driver, "n", "acme", T0 + dt.timedelta(seconds=30), "r3")  # it ended
    # a second back-off during one ends at the later of the two; ended holds are dropped
    driver.run(hold("n", "acme", T0 + dt.timedelta(seconds=40), T0 + dt.timedelta(seconds=31)))
    driver.run(hold("n", "acme", T0 + dt.timedelta(seconds=35), T0 + dt.timedelta(seconds=32)))
    driver.run(hold("n", "beta", T0 + dt.timedelta(seconds=50), T0 + dt.timedelta(seconds=33)))
    doc = mongo[db_name].limits.find_one({"_id": "n"})
    assert {h["group"]: h["until"] for h in doc["group_holds"]} == {
        "acme": T0 + dt.timedelta(seconds=40),
        "beta": T0 + dt.timedelta(seconds=50),
    }
    driver.run(hold("n", None, T0 + dt.timedelta(seconds=60), T0 + dt.timedelta(seconds=34)))
    assert not take(driver, "n", None, T0 + dt.timedelta(seconds=59), "r4")  # the whole name
    api = limits.resource_slot("api")
    driver.run(hold(api, None, T0 + dt.timedelta(seconds=10), T0))
    assert mongo[db_name].limits.find_one({"_id": api})["resource"] == "api"
    assert not take(driver, api, None, T0 + dt.timedelta(seconds=9), "r5")
    assert take(driver, api, None, T0 + dt.timedelta(seconds=10), "r6")
    # a group's name is data, never an expression
    driver.run(hold("m", "$acme", T0 + dt.timedelta(seconds=30), T0))
    assert not take(driver, "m", "$acme", T0 + dt.timedelta(seconds=1), "r7")
    assert take(driver, "m", "acme", T0 + dt.timedelta(seconds=1), "r8")


def test_a_group_held_since_the_worker_read_its_limit_is_refused_by_the_take(
    mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """A limited name: the worker's view of its limit (read before the back-off) holds no
    hold, and its batch's take of the name's slot for a task of the held group is refused all
    the same: the take carries the task's group whatever the view says (the hold is exact at
    once, not once the worker hears of it); another group's is taken."""
    driver = SyncDriver(mongo[db_name])
    client.set_limit("n", concurrency=100)
    view = {"n": mongo[db_name].limits.find_one({"_id": "n"})}  # read before the hold
    driver.run(hold("n", "acme", T0 + dt.timedelta(seconds=30), T0))
    known = {g: TaskMeta("n", 0, frozenset(), 1000, group=("n", g)) for g in ("acme", "beta")}
    out = plan(list(known), known, view, {}, T0, lambda k: f"run-{k}", 30_000)
    requests = [r for _, rs in out.claims for r in rs]
    assert [(r.slot, r.group) for r in requests] == [("n", "acme"), ("n", "beta")]
    taken = driver.run(store_slots.take(requests, "w", T0 + dt.timedelta(seconds=1)))
    assert [t.taken for t in taken] == [False, True]


async def test_a_handler_backs_off_its_group_without_spending_a_retry(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """An unlimited name: the handler's BackOff(group=True, 6 s) holds its group; its task is
    RELEASED (no failure counted) and runs again once the hold ended; a task of another group
    runs meanwhile; ``mtask limits``, the dashboard and the task's "why" say so. A group
    back-off from a task with no group fails it (it holds nothing)."""
    async with running_worker(registry, mongo_uri, db_name, concurrency=2) as _:
        client.publish(
            "polite", "acme-1", {"back_off": 6}, options={"group": "acme"}
        )  # room: a loaded host
        await wait_for(
            lambda: (
                client.get("acme-1").runs[:1]
                and client.get("acme-1").runs[0].state.value == "RELEASED"
            ),
            20,
        )
        client.publish("polite", "acme-2", options={"group": "acme"})
        client.publish("polite", "beta-1", options={"group": "beta"})
        await wait_for(lambda: client.get("beta-1").status.value == "succeeded", 20)
        explained = client.explain(client.get("acme-2"))
        assert explained.state is State.BLOCKED and explained.why == "backoff", explained
        assert "group `acme` of `polite` backs off" in explained.reason
        where = ("--uri", mongo_uri, "--database", db_name)
        code, out, _ = run_cli("limits", *where, width=200)
        assert code == 0 and "backing off: group acme" in out, out
        with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as http:
            assert "groups backing off" in http.get("/ui/limits", headers=AUTH).text
        await wait_for(lambda: client.get("acme-2").status.value == "succeeded", 20)
        await wait_for(lambda: client.get("acme-1").status.value == "succeeded", 20)
        task = client.get("acme-1")
        assert [r.state.value for r in task.runs] == ["RELEASED", "SUCCESS"]
        labels = {"name": "polite", "held": "tenant"}
        assert (REGISTRY.get_sample_value("mtask_backoffs_total", labels) or 0) >= 1
        assert task.failures == 0 and task.result == 2
        hold_doc = mongo[db_name].limits.find_one({"_id": "polite"})
        (until,) = [h["until"] for h in hold_doc["group_holds"]]
        later = [r.claimed_at for t in ("acme-1", "acme-2") for r in client.get(t).runs[-1:]]
        assert all(at >= until for at in later)  # the take compared its own time with it

        client.publish("polite", "lonely", {"back_off": 1.0})
        await wait_for(lambda: client.get("lonely").status.value == "failed", 20)
        assert "back-off refused" in (client.get("lonely").error or "")


@pytest.mark.parametrize("held", ["name", "resource"])
async def test_a_handler_backs_off_its_name_or_a_resource_and_its_own_task_waits_for_it(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient, held: str
) -> None:
    """``BackOff(name=True)`` on a name with no limit, or ``BackOff(resource="crm")`` from a
    handler whose name does not take ``crm``: what is held (the name's next task, a task of a
    name that uses ``crm``) is claimed only once the hold ended, on the server's clock, and so
    is the task that backed off (its own name took no slot of what it held), with no failure
    counted."""
    async with running_worker(registry, mongo_uri, db_name, concurrency=2) as (_, events):
        client.publish("holder", "h1", {"hold": held, "seconds": 3})
        await events.wait("released", key="h1")
        other = ("holder", "h2") if held == "name" else ("crm_user", "c1")
        client.publish(*other)
        for key in ("h1", other[1]):
            await wait_for(lambda key=key: client.get(key).status.value == "succeeded", 30)
    slot = "holder" if held == "name" else limits.resource_slot("crm")
    until = mongo[db_name].limits.find_one({"_id": slot})[limits.HELD_UNTIL]
    first = client.get("h1")
    assert [r.state.value for r in first.runs] == ["RELEASED", "SUCCESS"]
    assert first.failures == 0 and first.result == 2
    assert first.runs[-1].claimed_at >= until
    assert client.get(other[1]).runs[0].claimed_at >= until
    kind = "name" if held == "name" else "resource"
    labels = {"name": "holder", "held": kind}
    assert (REGISTRY.get_sample_value("mtask_backoffs_total", labels) or 0) >= 1


async def test_a_back_off_within_a_longer_hold_releases_its_task_until_the_longer_one_ends(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """A hold only moves later: a 3 s back-off of ``crm`` while a handler's earlier one holds
    it for an hour releases its task (whose name does not take ``crm``) due in an hour."""
    slot = limits.resource_slot("crm")
    now = client.now()
    SyncDriver(mongo[db_name]).run(hold(slot, None, now + dt.timedelta(hours=1), now))
    async with running_worker(registry, mongo_uri, db_name, concurrency=2) as (_, events):
        client.publish("holder", "h9", {"hold": "resource", "seconds": 3})
        await events.wait("recorded", key="h9", state="RELEASED")
    until = mongo[db_name].limits.find_one({"_id": slot})[limits.HELD_UNTIL]
    task = mongo[db_name].tasks.find_one({"_id": "h9"})
    assert task["status"] == "pending" and task["available_at"] >= until


@registry.task("always_429")
async def always_429(params: dict[str, Any], ctx: TaskContext) -> None:
    raise BackOff(params["seconds"], group=True, reason="429 from the provider")


async def test_the_task_that_backed_off_says_why_and_fails_past_max_backoffs(
    mongo_uri: str, mongo: MongoClient[Any], db_name: str, client: TaskClient
) -> None:
    """A handler that always answers 429: each run RELEASED says what it held until when, the
    task's own why says it was released by its handler's back-off (not a bare ``scheduled``),
    the held group's other task is ``blocked · backoff`` and counted blocked on the limits page
    as on its own; past ``max_backoffs`` the task fails for good, saying so."""
    async with running_worker(registry, mongo_uri, db_name, concurrency=2) as (_, events):
        client.publish(
            "always_429", "mail-429", {"seconds": 30},
            options={"group": "globex", "max_backoffs": 1},
        )  # fmt: skip
        await events.wait("recorded", key="mail-429", state="RELEASED")
        client.publish("always_429", "mail-2", {"seconds": 30}, options={"group": "globex"})
        task = client.get("mail-429")
        assert task is not None and task.backoffs == 1 and task.failures == 0
        assert task.runs[0].error is not None
        assert task.runs[0].error.startswith("backed off group `globex` of `always_429` until ")
        assert task.runs[0].error.endswith(", by its handler: 429 from the provider")
        said = client.explain(task)
        assert (said.state, said.why) == (State.SCHEDULED, "backoff"), said
        assert said.reason.startswith("released: backed off group `globex` of `always_429`")
        assert "1 back-off of at most 1 (max_backoffs), no retry spent" in said.reason
        other = client.explain(client.get("mail-2"))  # type: ignore[arg-type]
        assert (other.state, other.why) == (State.BLOCKED, "backoff"), other
        [use] = [u for u in client.limit_use() if u.name == "always_429"]
        blocked = client.search_state("blocked", name="always_429").tasks
        assert use.blocked == len(blocked) == 1, (use, blocked)
        [group] = [g for g in use.groups if g.group == "globex"]
        assert group.blocked == 1
        code, out, _ = run_cli("get", "mail-2", "--uri", mongo_uri, "--database", db_name)
        assert code == 0 and "blocked · backoff" in out, out
        code, out, _ = run_cli("get", "mail-429", "--uri", mongo_uri, "--database", db_name)
        assert "scheduled · backoff" in out and "released: backed off" in " ".join(out.split())
        client.publish(
            "always_429", "mail-cap", {"seconds": 1},
            options={"group": "initech", "max_backoffs": 1},
        )  # fmt: skip
        await wait_for(lambda: client.get("mail-cap").status.value == "failed", 60)
    task = client.get("mail-cap")
    assert task is not None and task.failed_permanently and task.backoffs == 1
    assert [r.state.value for r in task.runs] == ["RELEASED", "FAIL"]
    assert task.error is not None and task.error.startswith(
        "BackOffExceeded: more back-offs than max_backoffs (1); the last: backed off group "
        "`initech`"
    )
