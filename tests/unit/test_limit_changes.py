"""A changed limit without MongoDB: which events say a limit changed, what a run in flight
must hold under a new limit, the gate's reads on an event, and the recount of the runs in
flight (scripted drivers; what the server decides is tested on it: tests/chaos and
tests/integration/test_limits.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pymongo import UpdateMany, UpdateOne
from pymongo.results import UpdateResult
from scripted import AsyncScriptedDriver, ScriptedDriver, Step
from test_limited import limit_docs

from mtask import store
from mtask.clock import FixedClock
from mtask.driver import AsyncDriver
from mtask.limits import rules as limits
from mtask.limits import slots
from mtask.limits.rules import Limit
from mtask.store import slots as store_slots
from mtask.worker.claiming.gate import LimitGate
from mtask.worker.claiming.limited import counted, plan
from mtask.worker.claiming.recount import Recount
from mtask.worker.finding.changes import limit_set
from mtask.worker.finding.placement import TaskMeta
from mtask.worker.finding.stream import stream_pipeline
from mtask.worker.inflight import ActiveRun, InFlight
from mtask.worker.wiring import Signal
from mtask.worker.worker_events import Emitter

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


def event(op: str, key: Any, **fields: Any) -> dict[str, Any]:
    change: dict[str, Any] = {
        "operationType": op,
        "ns": {"coll": "limits"},
        "documentKey": {"_id": key},
    }
    if op == "update":
        change["updateDescription"] = {"updatedFields": fields}
    return change


def test_only_a_change_of_a_names_limit_fields_is_a_limit_set() -> None:
    assert limit_set(event("insert", "n")) == "n"  # the first set_limit (an upsert)
    assert limit_set(event("delete", "n")) == "n"  # clear_limit
    assert limit_set(event("replace", "n")) == "n"  # by hand
    assert limit_set(event("update", "n", group_concurrency=1)) == "n"
    assert limit_set(event("update", "n", rate=None)) == "n"  # a field cleared by set_limit
    # a slot given back or pinged: nothing said of the limit
    assert limit_set(event("update", "n", **{"holders.0.expires": NOW})) is None
    assert limit_set(event("update", "n")) is None
    # a group's slot document is state, not a limit; a key of another type names no limit
    assert limit_set(event("insert", limits.group_slot("n", "g"))) is None
    assert limit_set(event("update", limits.group_slot("n", "g"), concurrency=2)) is None
    assert limit_set(event("delete", 7)) is None


@given(st.recursive(st.none() | st.integers() | st.text(), lambda c: st.dictionaries(st.text(), c)))
def test_an_event_of_any_shape_is_read_without_an_error(change: Any) -> None:
    if isinstance(change, dict):
        assert limit_set(change) is None or isinstance(limit_set(change), str)


def test_the_streams_carry_a_names_limit_fields_and_nothing_more_of_a_task() -> None:
    """The fields a limit's event needs are projected (for both streams: the relay's pipeline
    is this one); a task has no field of that name, so its events carry no byte more."""
    projection = stream_pipeline("tasks", "w1")[-1]["$project"]
    for field in limits.LIMIT_FIELDS:
        assert projection[f"updateDescription.updatedFields.{field}"] == 1
        assert field not in store.PLACEMENT_FIELDS and field not in store.CLAIMED_FIELDS


names = st.sampled_from(["n", "m"])


@given(
    names, st.sampled_from([None, "g"]), st.sets(st.sampled_from(["n", "lock", "slot"])), limit_docs
)
def test_a_run_in_flight_counts_in_every_slot_its_new_limit_counts(
    name: str, group: str | None, holds: set[str], doc: dict[str, Any]
) -> None:
    held = [
        {
            "n": name,
            "lock": limits.claim_lock(name, group or "g"),
            "slot": limits.group_slot(name, group or "g"),
        }[h]
        for h in holds
    ]
    asked = dict(counted(name, group, held, doc))
    own, each = limits.own_limit(doc), limits.group_limit(doc)
    # the name's slot, if it limits runs at once (a rate alone counts claims, not runs)
    assert (name in asked) == (own.concurrency is not None)
    assert asked.get(name) is None  # a name's slot holds its own limit
    gslot = None if group is None else limits.group_slot(name, group)
    in_group = gslot is not None and each.concurrency is not None
    if in_group and limits.is_sequence(each) and limits.claim_lock(name, group or "") in held:
        in_group = False  # its sequence's lock counts it already
    assert (gslot in asked) == in_group
    if in_group:
        assert asked[gslot] == each  # a group's slot takes its limit from the name's document
    assert set(asked) <= {name, gslot}


def test_a_sequence_waits_while_its_groups_slot_holds_a_run_without_its_lock() -> None:
    """After a group limit of 3 is lowered to 1, the runs its slot still holds run on: the
    sequence's head (even due) waits for the slot, whose release wakes it."""
    known = {"k": TaskMeta("a", 0, frozenset(), 1000, group=("a", "g"))}
    heads = {("a", "g"): {"_id": "k", "next_claim_at": NOW, "slot_held": True}}
    out = plan(["k"], known, {"a": {"group_concurrency": 1}}, heads, NOW, str, 30_000)
    assert out.claims == [] and [(w.key, w.slot) for w in out.waits] == [
        ("k", limits.group_slot("a", "g"))
    ]
    heads[("a", "g")]["slot_held"] = False
    out = plan(["k"], known, {"a": {"group_concurrency": 1}}, heads, NOW, str, 30_000)
    assert [k for k, _ in out.claims] == ["k"] and out.locked == {"k": limits.claim_lock("a", "g")}


def test_heads_and_slots_reads_the_groups_slots_with_the_heads_in_one_round_trip() -> None:
    pairs = [("a", "g"), ("a", "h")]
    first = {
        "_id": {"name": "a", "group": "g"},
        "key": "k",
        "status": "pending",
        "next_claim_at": NOW,
        "timeout": 500,
    }
    other = {**first, "_id": {"name": "a", "group": "h"}, "key": "j"}
    driver = ScriptedDriver(
        Step("gather", reply=[[first, other], [], [{"_id": limits.group_slot("a", "h")}]])
    )
    heads = driver.run(store.heads_and_slots(pairs, pairs, NOW))
    assert driver.done and heads[("a", "g")]["_id"] == "k" and "slot_held" not in heads[("a", "g")]
    assert heads[("a", "h")]["slot_held"] is True
    _, _, live = driver.calls[0].args
    assert live.collection == "limits" and live.method == "find"
    assert live.args[0] == {
        "_id": {"$in": [limits.group_slot("a", "g"), limits.group_slot("a", "h")]},
        "holders": {"$elemMatch": {"expires": {"$gt": NOW}}},
    }


def test_a_join_makes_a_groups_document_once_and_adds_only_a_run_that_is_no_holder() -> None:
    gslot = limits.group_slot("n", "g")
    requests = [
        slots.Request("n", "r1", "k1", 2000),
        slots.Request(gslot, "r1", "k1", 2000, Limit(2)),
        slots.Request(gslot, "r2", "k2", 1000, Limit(2)),
    ]
    known: set[str] = set()
    driver = ScriptedDriver(Step("bulk_write", collection="limits"))
    driver.run(store_slots.join(requests, "w1", NOW, known))
    assert driver.done and known == {gslot}
    (ops,) = driver.calls[0].args
    assert driver.calls[0].kwargs == {"ordered": True}
    assert ops[0] == UpdateOne(
        {"_id": gslot}, {"$setOnInsert": store_slots._new_group(gslot, NOW)}, upsert=True
    )
    # a limit written by hand with no array of holders gets an empty one to be joined
    assert ops[1] == UpdateMany(
        {"_id": {"$in": sorted({"n", gslot})}, "holders": {"$not": {"$type": "array"}}},
        {"$set": {"holders": []}},
    )
    join = ops[3]
    assert join._filter == {
        "_id": gslot,
        "holders": {"$type": "array"},
        "holders.run_id": {"$ne": "r1"},
    }
    holder = join._doc["$push"]["holders"]
    assert holder["$sort"] == {"expires": 1} and holder["$each"][0][
        "expires"
    ] == NOW + dt.timedelta(seconds=2)
    assert join._doc["$set"] == {slots.TAKEN_AT: NOW}  # the streams leave it out: it frees nothing
    assert not join._upsert and len(ops) == 5  # a name's document is never made by a join
    again = ScriptedDriver(Step("bulk_write", collection="limits"))
    again.run(store_slots.join(requests[1:], "w1", NOW, known))
    assert len(again.calls[0].args[0]) == 3  # its document seen: not made again


class Sink:
    """A ``QueueSink`` that notes what is put back in the queue."""

    def __init__(self) -> None:
        self.requeued: list[str] = []

    def requeue_at(self, key: str, when: dt.datetime) -> None:
        self.requeued.append(key)

    def known(self, key: str) -> None:
        return None


def gate_with(
    driver: AsyncScriptedDriver, applied: list[str], uses: dict[str, list[str]] | None = None
) -> tuple[LimitGate, Sink]:
    sink = Sink()
    changes: Signal[[str]] = Signal()
    gate = LimitGate(
        cast(AsyncDriver, driver),
        "w1",
        FixedClock(NOW),
        cast(Any, sink),
        interval=3600,
        limit_set=changes,
        applied=applied.append,
        uses=uses,
    )
    return gate, sink


async def test_the_gate_reads_a_changed_name_at_once_and_only_a_change_is_applied() -> None:
    applied: list[str] = []
    group3 = {"_id": "n", "group_concurrency": 3, "holders": []}
    driver = AsyncScriptedDriver(
        Step("find", reply=[group3], collection="limits"),  # the first read: all of them
        Step("find", reply=[{**group3, "group_concurrency": 1}], collection="limits"),
        Step(
            "find",
            reply=[{**group3, "group_concurrency": 1, "holders": [{"run_id": "x"}]}],
            collection="limits",
        ),
        Step("find", reply=[], collection="limits"),  # cleared
    )
    gate, sink = gate_with(driver, applied)
    await gate.run_once()
    assert applied == ["n"] and gate.refreshed.is_set()
    for key in ("k1", "k2", "k3"):
        gate.block(limits.group_slot("n", "g"), key, None, NOW)
    gate.block("other", "k4", None, NOW)
    sink.requeued.clear()

    gate.limit_set("n")  # its event: read now, by _id
    await asyncio.wait_for(gate.wait(), 1)
    await gate.run_once()
    assert driver.calls[1].args[0] == {"_id": {"$in": ["n"]}, **limits.NAME_LIMITS}
    assert applied == ["n", "n"] and gate.limited["n"]["group_concurrency"] == 1
    assert sink.requeued == ["k1"]  # the group's keys tried again, as many as it allows now

    gate.limit_set("n")  # an event that changed no limit field (by hand): nothing applied
    await gate.run_once()
    assert applied == ["n", "n"]

    gate.limit_set("n")
    await gate.run_once()  # cleared: every key of it tried again, its claims plain
    assert applied == ["n", "n", "n"] and "n" not in gate.limited
    assert sink.requeued == ["k1", "k2", "k3"] and driver.done


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"concurrency": "5"}, ["concurrency '5' is no number: it limits nothing"]),
        ({"concurrency": 0}, ["concurrency 0 admits no run: the tasks wait until it changes"]),
        ({"rate": float("nan")}, ["rate nan admits no run: the tasks wait until it changes"]),
        ({"rate": 2, "burst": 0.5}, ["burst 0.5 admits no run: the tasks wait until it changes"]),
        ({"group_rate": True}, ["group_rate True is no number: it limits nothing"]),
        (
            {"concurrency": 2, "holders": {}},
            ["holders {} is no array: read as no run holding a slot"],
        ),
    ],
)
async def test_a_hand_written_limit_the_take_cannot_apply_as_written_is_logged(
    fields: dict[str, Any], said: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A limit document written by hand whose fields are not of the documented shape is read
    as the take reads it, and the worker says so, once per change of it (it went unsaid: a
    claim refused for good, or a limit not applied, silently)."""
    doc = {"_id": "n", **fields}
    assert limits.problems(doc) == said
    driver = AsyncScriptedDriver(
        Step("find", reply=[doc], collection="limits"),
        Step("find", reply=[doc], collection="limits"),
    )
    gate, _ = gate_with(driver, [])
    with caplog.at_level("WARNING", logger="mtask.worker.claiming.gate"):
        await gate.run_once()
        gate.read_all()
        await gate.run_once()  # the same document: not said again
    assert [r.getMessage() for r in caplog.records] == [
        f"the limit document 'n', written by hand: {said[0]}"
    ]


@given(
    concurrency=st.none() | st.integers(1, limits.MAX_LIMIT_CONCURRENCY),
    rate=st.none() | st.floats(0.001, limits.MAX_RATE),
    group=st.none() | st.integers(1, limits.MAX_LIMIT_CONCURRENCY),
)
def test_no_limit_set_limit_writes_is_said_to_be_malformed(
    concurrency: int | None, rate: float | None, group: int | None
) -> None:
    own = Limit(concurrency, rate)
    written = {
        "concurrency": concurrency,
        "rate": rate,
        "burst": None if rate is None else own.full(),
        "group_concurrency": group,
        "holders": [],
        "tokens": own.full(),
    }
    assert limits.problems(written) == []


async def test_a_slots_event_reads_nothing() -> None:
    """A slot given back (the name known as limited) wakes its keys: no read."""
    driver = AsyncScriptedDriver(
        Step("find", reply=[{"_id": "n", "concurrency": 1}], collection="limits")
    )
    gate, _ = gate_with(driver, [])
    await gate.run_once()
    gate.on_change("n")
    gate.on_change(limits.group_slot("n", "g"))
    assert not gate.stale and driver.done


def active(
    name: str, run_id: str, group: str | None, slots_held: tuple[str, ...] = ()
) -> ActiveRun:
    return ActiveRun(
        key=f"k-{run_id}",
        name=name,
        run_id=run_id,
        ctx=cast(Any, None),
        slots=slots_held,
        group=group,
        lease_ms=1000,
    )


class Runs:
    """The run side as the recount sees it: which runs hold what, and what was given back."""

    def __init__(self, inflight: InFlight) -> None:
        self.inflight = inflight
        self.given_back: list[tuple[str, str]] = []

    def hold(self, run_id: str, slot: str) -> bool:
        run = self.inflight.get(run_id)
        if run is None:
            return False
        run.slots = (*run.slots, slot)
        return True

    def give_back(self, slot: str, run_id: str) -> None:
        self.given_back.append((slot, run_id))


async def test_the_runs_in_flight_count_towards_a_changed_limit_then_the_worker_says_so() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    inflight = InFlight()
    lock = limits.claim_lock("n", "g")
    for run in (
        active("n", "r1", "g"),  # started with no limit
        active("n", "r2", "g", (lock,)),  # a sequence's run: its lock counts it
        active("m", "r3", "g"),  # another name
    ):
        inflight.started(run)
    gate, _ = gate_with(AsyncScriptedDriver(), [])
    gate.limited = {
        "n": {"_id": "n", "group_concurrency": 1},
        "m": {"_id": "m", "group_concurrency": 2},
    }
    driver = AsyncScriptedDriver(Step("bulk_write", collection="limits"))
    changed: Signal[[str]] = Signal()
    runs = Runs(inflight)
    recount = Recount(
        cast(AsyncDriver, driver),
        FixedClock(NOW),
        "w1",
        gate=gate,
        inflight=inflight,
        runs=cast(Any, runs),
        emit=Emitter(lambda e, **d: events.append((e, d))),
        changed=changed,
    )
    with inflight.claiming(["planned-before"]):
        changed("n")  # a claim planned under the old limit is on its way
        applying = asyncio.create_task(recount.apply_changes())
        await asyncio.sleep(0.01)
        assert not applying.done() and not events  # the worker waits for it
    await asyncio.wait_for(applying, 1)
    assert driver.done
    (ops,) = driver.calls[0].args
    gslot = limits.group_slot("n", "g")
    assert [
        op._filter["holders.run_id"]["$ne"] for op in ops if "holders.run_id" in op._filter
    ] == ["r1"]
    assert inflight.get("r1").slots == (gslot,) and inflight.get("r3").slots == ()  # type: ignore[union-attr]
    assert events == [("limits_applied", {"name": "n"})]

    inflight.started(active("n", "r4", None))
    inflight.started(active("n", "r5", None))
    gate.limited["n"] = {"_id": "n", "concurrency": 1}
    again = AsyncScriptedDriver(Step("bulk_write", collection="limits"))
    recount.driver = cast(AsyncDriver, again)
    changed("n")

    def ended(*args: Any, **kwargs: Any) -> None:  # r5 ends while its place is taken
        inflight.ended(inflight.get("r5"))  # type: ignore[arg-type]

    again.steps[0].check = ended
    await recount.apply_changes()
    assert runs.given_back == [("n", "r5")]  # taken for a run that had ended: given back
    assert "n" in inflight.get("r4").slots  # type: ignore[union-attr]
    assert events[-1] == ("limits_applied", {"name": "n"})


def test_a_worker_refuses_a_periodic_read_of_the_limits_out_of_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mtask.cli.worker import main
    from mtask.errors import ConfigError
    from mtask.registry import Registry
    from mtask.worker.config import WorkerConfig

    registry = Registry()

    @registry.task("t")
    async def t(params: dict[str, object]) -> None:
        return None

    for bad in (0.0, -5.0, 100_000.0):
        with pytest.raises(ConfigError) as caught:
            WorkerConfig(limits_refresh=bad).chosen_names(registry)
        assert caught.value.field == "limits_refresh"
    assert WorkerConfig(limits_refresh=3600).chosen_names(registry) == ["t"]
    # on the command line: exit 2, the option named, no traceback
    assert main(["workerapp:registry", "--limits-refresh", "0"]) == 2
    err = capsys.readouterr().err
    assert "limits_refresh" in err and "Traceback" not in err


async def test_the_periodic_read_settles_a_sequence_made_a_while_ago() -> None:
    """A name whose groups became sequences more than ``SETTLE_AFTER`` ago: its groups' slots
    are looked at, and the note cleared if none holds a run. A recent one is left alone."""
    old = NOW - limits.SETTLE_AFTER
    recent = NOW - dt.timedelta(seconds=5)
    docs = [
        {"_id": "a", "group_concurrency": 1, limits.SLOT_RUNS: old},
        {"_id": "b", "group_concurrency": 1, limits.SLOT_RUNS: recent},
        {"_id": "c", "group_concurrency": 1, limits.SLOT_RUNS: None},
    ]
    driver = AsyncScriptedDriver(
        Step("find", reply=docs, collection="limits"),
        Step("find_one", reply=None, collection="limits"),  # no slot of a's groups holds a run
        Step(
            "update_one",
            reply=UpdateResult({"n": 1, "nModified": 1}, acknowledged=True),
            collection="limits",
            check=lambda c: c.args[0] == {"_id": "a", limits.SLOT_RUNS: old},
        ),
    )
    gate, _ = gate_with(driver, [])
    await gate.run_once()
    assert driver.done


async def test_a_resources_document_declares_names_that_take_its_slot() -> None:
    """``limits.RESOURCE_USERS``: the names a resource's document lists take its slot as if
    their handler declared it (beside the handlers' own ``uses``), from the read that shows
    them; a name it no longer lists is claimed plainly again, unless limited itself."""
    crm, api = limits.resource_slot("crm"), limits.resource_slot("api")
    crm_doc = {"_id": crm, "resource": "crm", "concurrency": 3, "names": ["sync", "push"]}
    own = {"_id": "push", "concurrency": 9}
    driver = AsyncScriptedDriver(
        Step("find", reply=[crm_doc, own], collection="limits"),
        Step("find", reply=[{**crm_doc, "names": ["sync", 7]}], collection="limits"),
    )
    gate, _ = gate_with(driver, [], uses={"mail": ["api"]})
    await gate.run_once()
    assert gate.uses == {"mail": (api,), "sync": (crm,), "push": (crm,)}
    assert {"sync", "push"} <= gate.restricting and "mail" not in gate.restricting  # api: none

    gate.limit_set(crm)  # push left its list (and 7 is no name): push keeps its own limit
    await gate.run_once()
    assert gate.uses == {"mail": (api,), "sync": (crm,)}
    assert {"sync", "push"} <= gate.restricting and driver.done


async def test_a_name_a_resource_no_longer_lists_is_claimed_plainly_again() -> None:
    crm = limits.resource_slot("crm")
    crm_doc = {"_id": crm, "resource": "crm", "concurrency": 3, "names": ["sync"]}
    driver = AsyncScriptedDriver(
        Step("find", reply=[crm_doc], collection="limits"),
        Step("find", reply=[{**crm_doc, "names": []}], collection="limits"),
    )
    gate, _ = gate_with(driver, [])
    await gate.run_once()
    assert gate.is_limited("sync")
    gate.limit_set(crm)
    await gate.run_once()
    assert not gate.is_limited("sync") and gate.uses == {} and driver.done


def test_the_groups_slots_whose_names_were_sequences_a_moment_ago_count_their_locks_in() -> None:
    """``lock_runs_of``: a group's slot that limits runs at once, of a name whose document says
    its groups were sequences less than ``SETTLE_AFTER`` ago; no name's slot, no slot of a
    rate alone, none once that has passed."""
    group = limits.group_slot("n", "g")
    recent = {"n": {limits.LOCK_RUNS: NOW - dt.timedelta(seconds=5)}, "m": {}}
    requests = [
        slots.Request(group, "r1", "k1", 1000, Limit(concurrency=3)),
        slots.Request(group, "r2", "k2", 1000, Limit(concurrency=3)),
        slots.Request("n", "r1", "k1", 1000),
        slots.Request(limits.group_slot("n", "h"), "r3", "k3", 1000, Limit(rate=2.0)),
        slots.Request(limits.group_slot("m", "g"), "r4", "k4", 1000, Limit(concurrency=3)),
    ]
    assert slots.lock_runs_of(requests, recent, NOW) == [group]
    assert slots.lock_runs_of(requests, recent, NOW + limits.SETTLE_AFTER) == []
    assert slots.lock_runs_of(requests, {"n": {limits.LOCK_RUNS: None}}, NOW) == []
