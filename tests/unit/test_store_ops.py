"""Store operations without MongoDB: the exact ``Call`` sequence of the paths that only a race
or a failure reaches on a real server."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pymongo import UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError, WriteError
from pymongo.results import BulkWriteResult, UpdateResult
from scripted import ScriptedDriver, Step

from mtask import flows, store
from mtask.driver import Call
from mtask.errors import InvalidTask, StorageError, TaskNotFound
from mtask.models import NewTask
from mtask.store import claims
from mtask.store import flows as store_flows
from mtask.store import queries as store_queries
from mtask.store import usage as store_usage

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


def updated(n: int) -> UpdateResult:
    return UpdateResult({"n": n, "nModified": n, "ok": 1.0}, acknowledged=True)


def test_a_new_key_is_published_by_one_insert() -> None:
    driver = ScriptedDriver(
        Step("find", reply=[], collection="retention"),  # the name's retention defaults: none
        Step("insert_one", reply=None),
    )
    published = driver.run(store.publish(NewTask.build("add", "k", {"a": 1}), NOW))
    assert driver.done and published.created and not published.updated
    assert driver.calls[1].args[0] is published.document and published.document["_id"] == "k"


def test_a_known_key_costs_the_refused_insert_and_the_upsert() -> None:
    """The insert is refused on ``_id``; the upsert returns the document there, which is left
    alone (``ignore``). One removed in between is inserted by that upsert."""
    existing = {"_id": "k", "name": "add", "status": "pending"}
    driver = ScriptedDriver(
        Step("find", reply=[], collection="retention"),
        Step("insert_one", raises=DuplicateKeyError("E11000 duplicate key")),
        Step("find_one_and_update", reply=existing),
    )
    published = driver.run(store.publish(NewTask.build("add", "k", {"a": 1}), NOW))
    assert driver.done
    assert not published.created and not published.updated and published.document is existing
    upsert = driver.calls[2]
    assert upsert.args[0] == {"_id": "k"} and upsert.kwargs["upsert"] is True
    assert (
        upsert.args[1]["$setOnInsert"]["name"] == "add"
        and "_id" not in upsert.args[1]["$setOnInsert"]
    )

    removed_meanwhile = ScriptedDriver(
        Step("find", reply=[], collection="retention"),
        Step("insert_one", raises=DuplicateKeyError("E11000 duplicate key")),
        Step("find_one_and_update", reply=None),
    )
    published = removed_meanwhile.run(store.publish(NewTask.build("add", "k"), NOW))
    assert removed_meanwhile.done and published.created


def test_in_a_session_publish_upserts_and_retries_once_after_a_racing_insert() -> None:
    """In a caller's session a publish is one upsert (a refused insert would abort the
    caller's transaction). Two upserts of a new key race; the loser's DuplicateKeyError is
    retried and finds the winner's document, which it leaves alone (``ignore``)."""
    existing = {"_id": "k", "name": "add", "status": "pending"}
    driver = ScriptedDriver(
        Step("find", reply=[], collection="retention"),  # the name's retention defaults: none
        Step("find_one_and_update", raises=DuplicateKeyError("E11000 duplicate key")),
        Step("find_one_and_update", reply=existing),
    )
    task = NewTask.build("add", "k", {"a": 1})
    published = driver.run(store.publish(task, NOW, upsert=True))
    assert driver.done
    assert not published.created and not published.updated and published.document is existing
    # both attempts are the same upsert
    assert driver.calls[1] == driver.calls[2]
    assert driver.calls[1].kwargs["upsert"] is True


def test_in_a_session_publish_gives_up_after_a_second_duplicate_key_error() -> None:
    driver = ScriptedDriver(
        Step("find", reply=[], collection="retention"),
        Step("find_one_and_update", raises=DuplicateKeyError("E11000 duplicate key")),
        Step("find_one_and_update", raises=DuplicateKeyError("E11000 duplicate key")),
    )
    with pytest.raises(StorageError) as raised:
        driver.run(store.publish(NewTask.build("add", "k"), NOW, upsert=True))
    assert driver.done and raised.value.document and not raised.value.transient


def test_a_batch_claim_falls_back_to_the_full_pipeline_for_what_the_lean_one_left() -> None:
    keys = ["a", "b", "c"]
    claimed = [{"_id": "a"}, {"_id": "b"}, {"_id": "c"}]
    driver = ScriptedDriver(
        Step("update_many", reply=updated(2)),  # the lean stage: a running task it cannot take
        Step("update_many", reply=updated(1)),  # the full pipeline takes the third
        Step("find", reply=claimed),
    )
    docs = driver.run(store.claim(keys, ["add"], "w1", NOW, batch="b1"))
    assert driver.done and [d["_id"] for d in docs] == keys
    assert all(d["claim_run_id"] == store.run_id_for("b1", d["_id"]) for d in docs)
    lean, full = driver.calls[0].args, driver.calls[1].args
    assert lean[0]["status"] == "pending"  # the lean filter: only what is plainly claimable
    assert full[0]["status"] != "pending" and full[0]["_id"]["$in"] == keys


def test_a_batch_claim_the_lean_stage_completes_sends_two_calls() -> None:
    driver = ScriptedDriver(
        Step("update_many", reply=updated(2)),
        Step("find", reply=[{"_id": "a"}, {"_id": "b"}]),
    )
    assert len(driver.run(store.claim(["a", "b"], ["add"], "w1", NOW))) == 2
    assert driver.done


def test_a_batch_claim_that_takes_nothing_reads_nothing() -> None:
    driver = ScriptedDriver(Step("update_many", reply=updated(0)), Step("update_many", updated(0)))
    assert driver.run(store.claim(["a", "b"], ["add"], "w1", NOW)) == []
    assert driver.done


junk = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=4),
        st.just(NOW),
        st.binary(max_size=3),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)
entries = st.one_of(
    junk,
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.one_of(st.just("m"), junk),
            "key": st.one_of(st.just("p/m"), st.just("p"), junk),
            "params": st.one_of(st.just({"x": 1}), junk),
            "options": st.one_of(st.just({}), st.just({"priority": 3}), junk),
            "depends_on": st.one_of(st.just([]), st.just(["a"]), junk),
        },
    ),
)


@given(parent=st.one_of(st.just("p"), junk), outbox=st.one_of(st.lists(entries, max_size=4), junk))
def test_an_outbox_of_any_shape_is_read_into_steps_and_rejected_entries(
    parent: object, outbox: object
) -> None:
    """A malformed entry raised KeyError or InvalidTask out of the flow sweep, which stopped
    the worker (every worker's sweep met the same document)."""
    steps, rejected = flows.read_outbox(parent, outbox)
    assert all(isinstance(r["reason"], str) and r["reason"] for r in rejected)
    if outbox is None:
        assert steps == [] and rejected == []
    elif not isinstance(outbox, list):
        assert steps == [] and rejected == [{"entry": outbox, "reason": rejected[0]["reason"]}]
    else:
        assert len(steps) + len(rejected) == len(outbox)
        assert [r["entry"] for r in rejected] == [e for e in outbox if not _builds(parent, e)]
        assert all(step.parent == parent for step in steps)


def _builds(parent: object, entry: object) -> bool:
    try:
        flows.from_outbox(parent, entry)
    except InvalidTask:
        return False
    return True


def test_a_rejected_outbox_entry_is_moved_aside_with_its_reason() -> None:
    outbox = [{"name": "m", "key": "p/m"}, {"name": "m"}]
    driver = ScriptedDriver(
        Step("find", reply=[{"_id": "p", "outbox": outbox}, {"_id": "q", "outbox": {"$gt": 1}}]),
        Step("find", reply=[], collection="retention"),  # the steps' retention defaults
        Step("bulk_write", reply=SimpleNamespace(upserted_count=1)),  # the publish
        Step("bulk_write", reply=None),  # the clear
    )
    [step] = driver.run(store_flows.flush_outboxes(None, NOW, older_than=NOW))
    assert step.key == "p/m" and step.parent == "p"
    clear_p, clear_q = driver.calls[-1].args[0]
    # $eq: the outbox read is compared as a value (an object of operators is not a filter)
    assert clear_p._filter == {"_id": "p", "outbox": {"$eq": outbox}}
    assert clear_q._filter == {"_id": "q", "outbox": {"$eq": {"$gt": 1}}}
    rejected = [
        {"entry": {"name": "m"}, "reason": "outbox[1]: key: must be a string, not NoneType"}
    ]
    assert _literal(clear_p._doc) == rejected
    assert _literal(clear_q._doc) == [
        {"entry": {"$gt": 1}, "reason": "outbox: must be a list of steps, not dict"}
    ]


def _literal(pipeline: object) -> object:
    assert isinstance(pipeline, list)
    return pipeline[0]["$set"]["outbox_rejected"]["$concatArrays"][1]["$literal"]


def test_resolve_releases_dependents_of_successes_and_fails_those_of_failures() -> None:
    def released(call: Call) -> None:
        assert call.args[0] == {
            "waiting_on": {"$in": ["ok"]},
            # not an invalid dependent (the status rule would revive it), and only an array:
            # a string waiting_on equal to the key matches $in, and $setDifference fails on it
            "status": {"$in": ["pending", "failed", "cancelled"]},
            "$expr": {"$isArray": "$waiting_on"},
        }

    def failed(call: Call) -> None:
        assert call.args[0] == {
            "waiting_on": {"$in": ["bad"]},
            "status": {"$in": ["pending"]},
            "$expr": {"$isArray": "$waiting_on"},
        }
        assert "dependency 'bad' is failed" in str(call.args[1][0])

    driver = ScriptedDriver(
        Step(
            "find", reply=[{"_id": "ok", "status": "succeeded"}, {"_id": "bad", "status": "failed"}]
        ),
        Step("update_many", reply=updated(2), check=released),
        Step("update_many", reply=updated(1), check=failed),
    )
    assert driver.run(store_flows.resolve(["ok", "bad", "open"], NOW)) == 3
    assert driver.done
    assert driver.calls[0].args[0]["_id"] == {"$in": ["ok", "bad", "open"]}


def test_resolve_of_unfinished_keys_changes_nothing() -> None:
    driver = ScriptedDriver(Step("find", reply=[]))
    assert driver.run(store_flows.resolve(["open"], NOW)) == 0
    assert driver.done
    assert ScriptedDriver().run(store_flows.resolve([], NOW)) == 0  # no call at all


def test_a_signal_to_no_task_names_the_key_once() -> None:
    """The signal's ``TaskNotFound`` carries the key, so its message is "no task with key
    'nope'": it was built from the message, and the CLI said ``no task with key "no task with
    key 'nope'"``."""
    driver = ScriptedDriver(Step("find_one_and_update", None), Step("find_one", None))
    with pytest.raises(TaskNotFound) as info:
        driver.run(store.steps.signal("nope", "approved", {"by": "ann"}))
    assert info.value.key == "nope" and str(info.value) == "no task with key 'nope'"
    assert driver.done


# -- a sequence's claim (store.claim_locked): its exact calls, pinned -------------------------

LOCKED = {"a": ("n", "g1"), "b": ("n", "g2"), "c": ("n", "g3"), "d": ("n", "g4")}
GROUPED = {"options.group": {"$type": "string"}}


def lean_locked(keys: list[str]) -> Call:
    (stage,) = claims.claim_lean_pipeline("b1", "w1", NOW)
    lean = [{"$set": {**stage["$set"], "group_lock": True}}]
    return Call(
        "update_many",
        ({**claims.claim_lean_filter(keys, ["n"], "w1", NOW), **GROUPED}, lean),
        timeout=claims.CLAIM_TIMEOUT_S,
    )


def read_locked(keys: list[str]) -> Call:
    run_ids = [store.run_id_for("b1", k) for k in keys]
    return Call("find", ({"_id": {"$in": keys}, "runs.run_id": {"$in": run_ids}}, None))


def full_locked(keys: list[str]) -> Call:
    requests = [
        UpdateOne(
            {**claims.claim_filter([k], ["n"], "w1", NOW), **GROUPED},
            [*claims.claim_pipeline("b1", "w1", NOW), claims.lock_stage("b1")],
        )
        for k in keys
    ]
    return Call("bulk_write", (requests,), {"ordered": False}, timeout=claims.CLAIM_TIMEOUT_S)


def busy_group(group: str) -> WriteError:
    return WriteError("E11000", 11000, {"keyValue": {"name": "n", "options.group": group}})


def test_a_sequences_claim_retries_without_busy_groups_then_claims_the_rest_one_by_one() -> None:
    """The exact calls of ``claim_locked`` (a refactor must send the same): the lean batch sent
    again without the group its duplicate key names; one read; the full pipeline for what is
    left, in one unordered bulk, whose refusals name busy and broken keys."""
    refused = BulkWriteError(
        {
            "writeErrors": [{"index": 0, "code": 11000}, {"index": 1, "code": 2, "errmsg": "bad"}],
            "nModified": 0,
        }
    )
    driver = ScriptedDriver(
        Step("update_many", raises=busy_group("g2")),
        Step("update_many", reply=updated(1)),
        Step("find", reply=[{"_id": "a"}]),
        Step("bulk_write", raises=refused),
    )
    docs, busy, broken = driver.run(store.claim_locked(LOCKED, ["n"], "w1", NOW, batch="b1"))
    assert driver.done and [d["_id"] for d in docs] == ["a"]
    assert busy == {"b", "c"} and broken == {"d": "bad"}
    assert driver.calls == [
        lean_locked(["a", "b", "c", "d"]),
        lean_locked(["a", "c", "d"]),
        read_locked(["a", "b", "c", "d"]),
        full_locked(["c", "d"]),
    ]


def test_a_sequences_claim_reads_what_its_full_pipeline_took() -> None:
    """A write error that is no busy group goes straight to the bulk; what it took is read."""
    took = BulkWriteResult({"nModified": 1, "writeErrors": []}, acknowledged=True)
    driver = ScriptedDriver(
        Step("update_many", raises=WriteError("cannot apply $set", 2, {})),
        Step("find", reply=[]),
        Step("bulk_write", reply=took),
        Step("find", reply=[{"_id": "b"}]),
    )
    pairs = {k: LOCKED[k] for k in ("a", "b")}
    docs, busy, broken = driver.run(store.claim_locked(pairs, ["n"], "w1", NOW, batch="b1"))
    assert driver.done and [d["_id"] for d in docs] == ["b"] and not busy and not broken
    assert driver.calls == [
        lean_locked(["a", "b"]),
        read_locked(["a", "b"]),
        full_locked(["a", "b"]),
        read_locked(["a", "b"]),
    ]


def test_a_sequences_claim_gives_up_its_retries_after_four_busy_groups() -> None:
    took = BulkWriteResult({"nModified": 0, "writeErrors": []}, acknowledged=True)
    driver = ScriptedDriver(
        *(Step("update_many", raises=busy_group(g)) for g in ("g1", "g2", "g3", "g4")),
        Step("find", reply=[]),
        Step("bulk_write", reply=took),
    )
    many = {**LOCKED, "e": ("n", "g5")}
    docs, busy, broken = driver.run(store.claim_locked(many, ["n"], "w1", NOW, batch="b1"))
    assert driver.done and docs == [] and busy == {"a", "b", "c", "d"} and not broken
    assert driver.calls == [
        lean_locked(["a", "b", "c", "d", "e"]),
        lean_locked(["b", "c", "d", "e"]),
        lean_locked(["c", "d", "e"]),
        lean_locked(["d", "e"]),
        read_locked(["a", "b", "c", "d", "e"]),
        full_locked(["e"]),
    ]


def test_a_sequences_claim_of_nothing_sends_nothing() -> None:
    driver = ScriptedDriver()
    assert driver.run(store.claim_locked({}, ["n"], "w1", NOW)) == ([], set(), {})


def test_quiet_until_is_quiet_only_with_nothing_running_nor_due() -> None:
    """``quiet_until`` (the automatic skips of ``mtask.testing``): a RUNNING run, or a task or
    schedule due by ``now``, is something to do; else the soonest time something will be."""
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    later, latest = now + dt.timedelta(days=1), now + dt.timedelta(days=2)

    def script(running: Any, task_at: Any, tick_at: Any) -> tuple[bool, Any]:
        driver = ScriptedDriver(
            Step("find_one", running),
            Step("find_one", None if task_at is None else {"next_claim_at": task_at}),
            Step(
                "find_one",
                None if tick_at is None else {"next_tick_at": tick_at},
                collection="schedules",
            ),
        )
        answer = driver.run(store_queries.quiet_until(now))
        assert driver.done
        return answer

    assert script(None, later, latest) == (True, later)
    assert script(None, latest, later) == (True, later)
    assert script(None, None, None) == (True, None)
    assert script({"_id": "k"}, later, None) == (False, later)  # a run in a worker's hands
    assert script(None, None, now) == (False, now)  # a schedule's tick due now
    driver = ScriptedDriver(  # due now, not held back: nothing to skip to
        Step("find_one", None),
        Step("find_one", {"next_claim_at": now}),
        Step("find_one", None, collection="schedules"),
        Step("find", []),
    )
    assert driver.run(store_queries.quiet_until(now)) == (False, now)
    assert driver.done


def test_quiet_until_skips_to_the_soonest_end_of_what_holds_the_due_tasks() -> None:
    """A due task held back by its name's back-off, one by its name's full bucket (a claim an
    hour) and one by its resource's full token window: quiet until the soonest end among
    them, a later task's ``next_claim_at`` and a schedule's tick; not quiet once a due task is
    claimable (no hold), or held by what no time ends (no live worker for it)."""
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    hour = dt.timedelta(hours=1)

    def task(key: str, name: str) -> dict[str, Any]:
        return {"_id": key, "name": name, "status": "pending", "next_claim_at": now, "runs": []}

    held = {"_id": "held", "held_until": now + 3 * hour}
    slow = {"_id": "slow", "rate": 1 / 3600, "burst": 1, "tokens": 0.5, "refilled_at": now}
    window = {"_id": "\x00api", "names": ["spend"], "measured_limit": 10}
    window |= {"measured_window_ms": 7_200_000, "measured_at": now, "measured_used": 10}

    def script(due: list[Any], later: Any, tick: Any, names: list[str]) -> Any:
        steps = [
            Step("find_one", None),
            Step("find_one", {"next_claim_at": now}),
            Step(
                "find_one", None if tick is None else {"next_tick_at": tick}, collection="schedules"
            ),
            Step("find", due),
            Step("find", [], collection="controls"),
            Step("find", [{"_id": "w", "names": names}], collection="workers"),
            Step("find", [held, slow, window], collection="limits"),
        ]
        if later is not ...:
            steps.append(Step("find_one", None if later is None else {"next_claim_at": later}))
        driver = ScriptedDriver(*steps)
        answer = driver.run(store_queries.quiet_until(now))
        assert driver.done
        return answer

    everyone = ["held", "slow", "spend", "free"]
    assert script([task("a", "held")], None, None, everyone) == (True, now + 3 * hour)
    half = now + dt.timedelta(minutes=30)  # the bucket's next token
    both = [task("a", "held"), task("b", "slow")]
    assert script(both, None, None, everyone) == (True, half)
    assert script(both, now + dt.timedelta(minutes=10), None, everyone) == (
        True,
        now + dt.timedelta(minutes=10),
    )
    assert script(both, None, now + dt.timedelta(minutes=5), everyone) == (
        True,
        now + dt.timedelta(minutes=5),
    )
    spend = [task("c", "spend")]  # the window's end, two hours from its start
    assert script(spend, None, None, everyone) == (True, now + 2 * hour)
    free = [task("a", "held"), task("d", "free")]
    assert script(free, ..., None, everyone) == (False, now)
    assert script([task("a", "held")], ..., None, ["free"]) == (False, now)


def test_clearing_a_budget_is_one_update_whose_match_is_the_answer() -> None:
    """No document is sent back (an ``update_one``, not a ``findAndModify``): a match is a
    budget removed, counted by ``matched_count`` (a match that changed nothing still had one)."""
    scope = {"scope": "group", "id": "acme"}

    def fenced(call: Call) -> None:
        filt, update = call.args
        assert filt == {"_id": scope, "budget": {"$exists": True}}
        assert update == [{"$unset": ["budget", "window"]}]

    for reply, cleared in (
        (UpdateResult({"n": 1, "nModified": 1}, True), True),
        (UpdateResult({"n": 1, "nModified": 0}, True), True),
        (updated(0), False),
    ):
        driver = ScriptedDriver(Step("update_one", reply, collection="usage", check=fenced))
        assert driver.run(store_usage.clear_budget(scope)) is cleared and driver.done
