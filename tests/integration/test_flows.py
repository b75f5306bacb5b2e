"""Flows: next steps published with the SUCCESS that returned them, fan-out and fan-in with
``depends_on``, the flow sweep after a crash, and the tree."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import pytest
from harness import T0, running_worker, wait_for

from mtask import Next, TaskClient, store
from mtask.cli.render import _flow_rows
from mtask.clock import FixedClock
from mtask.errors import InvalidTask
from mtask.flows import child_key
from mtask.registry import Fail, Registry
from mtask.store import CLAIMED_FIELDS, Outcome, RunState, claim, finish
from mtask.store.flows import awaited, flush_outboxes, resolve

registry = Registry()


@registry.task("order")
async def order(params: dict[str, Any]) -> list[Next]:
    parts = [Next("pack", {"item": item}) for item in params["items"]]
    return [*parts, Next("ship", {"to": params["to"]}, key=f"ship-{params['to']}")]


@registry.task("pack")
async def pack(params: dict[str, Any]) -> str:
    if params["item"] == "broken":
        raise Fail("cannot pack a broken item")
    return f"packed {params['item']}"


@registry.task("ship")
async def ship(params: dict[str, Any]) -> str:
    return f"shipped to {params['to']}"


@registry.task("split")
async def split(params: dict[str, Any]) -> list[Next]:
    parts = [Next("pack", {"item": f"p{i}"}, key=f"part-{i}") for i in range(params["n"])]
    return [*parts, Next("ship", {"to": "join"}, key="join", depends_on=[p.key for p in parts])]  # type: ignore[misc]


@registry.task("bad_step")
async def bad_step(params: dict[str, Any]) -> Next:
    return Next("pack", {"item": "x"}, options={"priority": "high"})


def test_child_keys_are_derived_from_parent_and_step() -> None:
    assert child_key("order-1", "pack", None) == "order-1/pack"
    assert child_key("order-1", "pack", 2) == "order-1/pack.2"
    long = child_key("o" * 510, "pack", None)
    assert len(long) <= 512 and long.startswith("o" * 64 + "/…")


async def test_next_steps_are_published_with_the_success(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=4) as (_, events):
        client.publish("order", "order-1", {"items": ["cup", "plate"], "to": "paris"})
        for key in ("order-1/pack.0", "order-1/pack.1", "ship-paris"):
            await events.wait("recorded", key=key)
    parent = client.get("order-1")
    assert parent is not None and parent.status == "succeeded"
    assert parent.children == ["order-1/pack.0", "order-1/pack.1", "ship-paris"]
    assert parent.result == parent.children
    assert client.collection.find_one({"_id": "order-1", "outbox": {"$exists": True}}) is None
    child = client.get("order-1/pack.1")
    assert child is not None and child.parent == "order-1" and child.result == "packed plate"
    tree = client.flow("order-1")
    assert tree is not None and tree["status"] == "succeeded"
    assert [(c["key"], c["status"]) for c in tree["children"]] == [
        ("order-1/pack.0", "succeeded"),
        ("order-1/pack.1", "succeeded"),
        ("ship-paris", "succeeded"),
    ]
    assert client.flow("nope") is None


async def test_fan_out_and_fan_in(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=8) as (_, events):
        client.publish("split", "s", {"n": 5})
        await events.wait("recorded", key="join")
    parts = [client.get(f"part-{i}") for i in range(5)]
    join = client.get("join")
    assert join is not None and join.status == "succeeded" and join.waiting_on == []
    assert join.depends_on == [f"part-{i}" for i in range(5)]
    last_part = max(p.finished_at for p in parts if p is not None and p.finished_at)
    assert join.runs[0].claimed_at >= last_part  # claimed only after every part succeeded


async def test_a_dependency_failing_for_good_fails_its_dependents(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as _:
        client.publish("pack", "good", {"item": "cup"})
        client.publish("pack", "broken", {"item": "broken"})
        client.publish("ship", "after", {"to": "x"}, depends_on=["good", "broken"])
        await wait_for(lambda: client.get("after").status == "failed")  # type: ignore[union-attr]
    after = client.get("after")
    assert after is not None and after.error == "dependency 'broken' is failed"
    assert after.attempts == 0 and after.waiting_on == ["broken"]  # "good" succeeded


async def test_depending_on_finished_tasks(client: TaskClient) -> None:
    clock_now = client.now()
    client.publish("n", "a")
    client.collection.update_one(
        {"_id": "a"}, {"$set": {"status": "succeeded", "next_claim_at": None}}
    )
    client.publish("n", "c")
    client.cancel("c")
    ready = client.publish("n", "b", depends_on=["a"]).task
    assert ready.waiting_on == [] and ready.next_claim_at is not None
    assert ready.next_claim_at >= clock_now
    failed = client.publish("n", "d", depends_on=["a", "c"]).task
    assert failed.status == "failed" and failed.error == "dependency 'c' is cancelled"
    waiting = client.publish("n", "e", depends_on=["later"]).task
    assert waiting.status == "pending" and waiting.next_claim_at is None


@pytest.mark.parametrize(
    ("depends_on", "message"),
    [
        ("a", "depends_on: must be a list of task keys"),
        (["a", 3], "depends_on[1]: must be a string, not int"),
        (["k"], "depends_on: a task cannot depend on itself"),
    ],
)
def test_bad_dependencies_are_refused(client: TaskClient, depends_on: Any, message: str) -> None:
    with pytest.raises(InvalidTask, match="^" + re.escape(message)):
        client.publish("n", "k", depends_on=depends_on)
    assert client.collection.count_documents({}) == 0


async def test_an_invalid_next_step_fails_the_task(client: TaskClient, drain: Any) -> None:
    await drain(registry, lambda: client.publish("bad_step", "b"), "b")
    task = client.get("b")
    assert task is not None and task.status == "failed"
    assert task.error is not None and "invalid next step: options.priority" in task.error
    assert client.collection.count_documents({}) == 1


def test_the_sweep_publishes_an_outbox_left_by_a_crash_once(mongo_uri: str, db_name: str) -> None:
    """The SUCCESS (with its outbox) was recorded, then the worker died before publishing."""
    clock = FixedClock(T0)
    with TaskClient(mongo_uri, database=db_name, clock=clock) as tc:
        tc.publish("n", "p")
        [doc] = tc._run(claim(["p"], ["n"], "w", T0, fields=CLAIMED_FIELDS))
        step = {"name": "m", "key": "p/m", "params": {"x": 1}, "options": {}, "depends_on": []}
        outcome = Outcome("p", doc["claim_run_id"], RunState.SUCCESS, result=["p/m"], steps=(step,))
        assert tc._run(finish(outcome, T0)) is not None
        assert tc.get("p/m") is None
        # a sweep only takes outboxes older than its interval
        assert tc._run(flush_outboxes(None, T0, older_than=T0)) == []
        later = T0 + dt.timedelta(seconds=10)
        [published] = tc._run(flush_outboxes(None, later, older_than=later))
        assert published.key == "p/m"
        assert tc._run(flush_outboxes(None, later, older_than=later)) == []
        child = tc.get("p/m")
        assert child is not None and child.parent == "p" and child.params == {"x": 1}
        assert tc.collection.count_documents({}) == 2


def test_a_malformed_outbox_neither_stops_the_sweep_nor_is_met_again(
    mongo_uri: str, db_name: str
) -> None:
    """An entry without a key (a hand edit, another version) raised KeyError out of the sweep,
    which stopped the worker, and every worker's sweep met the same document. Now the good
    entries are published and the bad ones kept aside with the reason."""
    clock = FixedClock(T0)
    good = {"name": "m", "key": "p/m", "params": {"x": 1}, "options": {}, "depends_on": []}
    outboxes: dict[Any, Any] = {
        "p": [good, {"name": "m"}, 5, {"name": "m", "key": "p/o", "options": {"priority": "x"}}],
        "q": "not a list",
        "r": {"$gt": 1},  # read back, it must be compared as a value, not as an operator
        7: [{"name": "m", "key": "seven/m"}],  # a key that is not a string: no parent key
    }
    with TaskClient(mongo_uri, database=db_name, clock=clock) as tc:
        for key, outbox in outboxes.items():
            tc.collection.insert_one(
                {"_id": key, "name": "n", "status": "succeeded", "updated_at": T0}
            )
            tc.collection.update_one({"_id": key}, [{"$set": {"outbox": {"$literal": outbox}}}])
        later = T0 + dt.timedelta(seconds=10)
        [published] = tc._run(flush_outboxes(None, later, older_than=later))
        assert published.key == "p/m" and tc.get("p/m").parent == "p"  # type: ignore[union-attr]
        assert tc._run(flush_outboxes(None, later, older_than=later)) == []  # not met again
        assert tc.collection.count_documents({"outbox": {"$exists": True}}) == 0
        kept = {
            d["_id"]: d["outbox_rejected"]
            for d in tc.collection.find({}, {"outbox_rejected": 1})
            if "outbox_rejected" in d
        }
        assert kept["p"] == [
            {"entry": {"name": "m"}, "reason": "outbox[1]: key: must be a string, not NoneType"},
            {"entry": 5, "reason": "outbox[2]: step: must be an object, not int"},
            {
                "entry": {"name": "m", "key": "p/o", "options": {"priority": "x"}},
                "reason": kept["p"][2]["reason"],
            },
        ]
        assert kept["p"][2]["reason"].startswith("outbox[3]: options.priority")
        assert kept["q"] == [
            {"entry": "not a list", "reason": "outbox: must be a list of steps, not str"}
        ]
        assert kept["r"] == [
            {"entry": {"$gt": 1}, "reason": "outbox: must be a list of steps, not dict"}
        ]
        assert kept[7] == [
            {"entry": outboxes[7][0], "reason": "outbox[0]: parent key: must be a string, not int"}
        ]
        parent = tc.get("p")
        assert parent is not None and parent.outbox_rejected == kept["p"]
        assert ("step not published", kept["p"][0]["reason"]) in _flow_rows(parent)  # mtask get
        assert tc.collection.count_documents({}) == 5  # only the good step was published


def test_a_malformed_dependent_does_not_strand_the_others_and_is_marked_invalid(
    mongo_uri: str, db_name: str
) -> None:
    """A string ``waiting_on`` equal to the key matched resolve's ``$in``: its ``$setDifference``
    failed and stopped the update_many before the well-formed dependents, on every retry; an
    invalid dependent was revived by the status rule; an int ``waiting_on`` crashed ``awaited``."""
    with TaskClient(mongo_uri, database=db_name, clock=FixedClock(T0)) as tc:
        tc.publish("n", "dep")
        for key in ("a_bad", "b_good", "c_invalid", "d_int"):
            tc.publish("n", key, depends_on=["dep"])
        tc.collection.update_one({"_id": "a_bad"}, {"$set": {"waiting_on": "dep"}})
        tc.collection.update_one({"_id": "d_int"}, {"$set": {"waiting_on": 5}})
        tc.collection.update_one({"_id": "c_invalid"}, {"$unset": {"options.concurrency": ""}})
        assert tc._run(store.quarantine(["c_invalid"], T0)) == 1
        assert tc._run(awaited()) == ["dep"]
        [doc] = tc._run(claim(["dep"], ["n"], "w", T0, fields=CLAIMED_FIELDS))
        tc._run(finish(Outcome("dep", doc["claim_run_id"], RunState.SUCCESS), T0))
        assert tc._run(resolve(["dep"], T0)) == 1
        good = tc.collection.find_one({"_id": "b_good"})
        assert good is not None and "waiting_on" not in good and good["next_claim_at"] == T0
        assert tc.collection.find_one({"_id": "c_invalid"})["status"] == "invalid"  # type: ignore[index]
        # the odd ones are not stranded in silence: the sweep's stranded search marks them
        odd = sorted(tc._run(store.stranded()))
        assert odd == ["a_bad", "d_int"]
        assert tc._run(store.quarantine(odd, T0)) == 2
        for key in odd:
            bad = tc.collection.find_one({"_id": key})
            assert bad is not None and bad["status"] == "invalid"
            assert "'next_claim_at' must be a date while the task is open" in bad["invalid_reason"]


def test_the_sweep_resolves_a_dependency_claimed_before_its_dependent_existed(
    mongo_uri: str, db_name: str
) -> None:
    clock = FixedClock(T0)
    with TaskClient(mongo_uri, database=db_name, clock=clock) as tc:
        tc.publish("n", "a")
        [doc] = tc._run(claim(["a"], ["n"], "w", T0, fields=CLAIMED_FIELDS))
        assert "has_dependents" not in doc  # so its worker will not resolve dependents
        tc.publish("n", "b", depends_on=["a"])
        tc._run(finish(Outcome("a", doc["claim_run_id"], RunState.SUCCESS), T0))
        assert tc.get("b").waiting_on == ["a"]  # type: ignore[union-attr]
        assert tc._run(awaited()) == ["a"]
        assert tc._run(resolve(tc._run(awaited()), T0)) == 1
        b = tc.get("b")
        assert b is not None and b.waiting_on == [] and b.next_claim_at == T0
        assert tc._run(claim(["b"], ["n"], "w", T0))  # claimable now
