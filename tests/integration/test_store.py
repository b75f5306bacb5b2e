"""The worker's store operations on the real server, with an injected clock (no sleeping).

Driver conformance (River's driver test suite): every test that runs operations through
``tc._run`` runs twice, once through ``SyncDriver`` and once through ``AsyncDriver``, so the two
drivers' special cases (``find``/``aggregate`` to lists, errors thrown into the operation) are
held to the same results.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from harness import T0
from pymongo import AsyncMongoClient

from mtask import TaskClient, store
from mtask.clock import FixedClock
from mtask.driver import AsyncDriver, Call, Op, T, collections, gather
from mtask.errors import StorageError
from mtask.store import Outcome, RunState, claim, extend_lease, finish, finish_many, scan
from mtask.store.outcomes import _groups
from mtask.vocabulary import MAX_RUNS_KEPT
from mtask.worker.finding.stream import stream_pipeline


@pytest.fixture(params=["sync", "async"])
def tc(
    request: pytest.FixtureRequest, mongo_uri: str, db_name: str, clock: FixedClock
) -> Iterator[TaskClient]:
    """A client whose clock is ``clock``; with ``async``, its ``_run`` goes through an
    ``AsyncDriver`` (on an event loop of its own thread, as these tests are sync)."""
    with TaskClient(mongo_uri, database=db_name, clock=clock) as client:
        if request.param == "sync":
            yield client
            return
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="async-driver", daemon=True)
        thread.start()

        async def connect() -> AsyncMongoClient[dict[str, Any]]:
            return AsyncMongoClient(mongo_uri, tz_aware=True)

        amongo = asyncio.run_coroutine_threadsafe(connect(), loop).result()
        driver = AsyncDriver(collections(amongo[db_name]))

        def run(op: Op[T], session: Any = None) -> T:
            assert session is None  # a sync session cannot serve the async driver
            return asyncio.run_coroutine_threadsafe(driver.run(op), loop).result(timeout=30)

        client._run(store.ensure_indexes())  # as the sync client's first call does
        client._run = run  # type: ignore[method-assign]
        try:
            yield client
        finally:
            asyncio.run_coroutine_threadsafe(amongo.close(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()


def one(
    tc: TaskClient, key: str, worker: str, clock: FixedClock, names: tuple[str, ...] = ("n",)
) -> dict[str, Any] | None:
    docs = tc._run(claim([key], list(names), worker, clock.now()))
    return docs[0] if docs else None


def test_claim_respects_next_claim_at_and_names(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k", delay=60)
    assert one(tc, "k", "w1", clock) is None
    clock.advance(seconds=60)
    assert one(tc, "k", "w1", clock, names=("other",)) is None
    doc = one(tc, "k", "w1", clock)
    assert doc is not None and doc["status"] == "running" and doc["attempts"] == 1
    run = doc["runs"][0]
    assert run["worker_id"] == "w1" and run["lease_expires_at"] == clock.now() + dt.timedelta(
        seconds=30
    )
    assert doc["next_claim_at"] == run["lease_expires_at"]
    assert one(tc, "k", "w2", clock) is None  # the slot is taken


def test_expired_lease_is_preempted_and_fenced(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k", options={"worker_timeout_ms": 2000})
    first = one(tc, "k", "w1", clock)
    assert first is not None
    clock.advance(milliseconds=1999)
    assert one(tc, "k", "w2", clock) is None
    clock.advance(milliseconds=1)
    second = one(tc, "k", "w2", clock)
    assert second is not None
    states = [(r["worker_id"], r["state"]) for r in second["runs"]]
    assert states == [("w1", "TIMEOUT"), ("w2", "RUNNING")]
    assert second["failures"] == 1 and second["attempts"] == 2
    # the zombie can neither ping nor record an outcome
    old = first["claim_run_id"]
    assert tc._run(extend_lease("k", old, "w1", clock.now())) is None
    assert tc._run(finish(Outcome("k", old, RunState.SUCCESS), clock.now())) is None
    done = tc._run(
        finish(Outcome("k", second["claim_run_id"], RunState.SUCCESS, result=1), clock.now())
    )
    assert done is not None and done["status"] == "succeeded" and done["result"] == 1


def test_ping_extends_lease_and_next_claim_at(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k", options={"worker_timeout_ms": 2000})
    doc = one(tc, "k", "w1", clock)
    assert doc is not None
    clock.advance(milliseconds=1500)
    pinged = tc._run(extend_lease("k", doc["claim_run_id"], "w1", clock.now()))
    assert pinged is not None and pinged["options"]["worker_timeout_ms"] == 2000
    clock.advance(milliseconds=1500)  # past the first lease, within the extended one
    assert one(tc, "k", "w2", clock) is None
    stored = tc.collection.find_one({"_id": "k"})
    assert stored is not None and stored["next_claim_at"] == T0 + dt.timedelta(milliseconds=3500)


def test_expiries_exhaust_retries(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k", options={"worker_timeout_ms": 1000, "max_retries": 1})
    assert one(tc, "k", "w1", clock) is not None
    clock.advance(seconds=1)
    assert one(tc, "k", "w2", clock) is not None  # failure 1 of 1 allowed
    clock.advance(seconds=1)
    assert one(tc, "k", "w3", clock) is None  # failure 2 > max_retries: no new run
    stored = tc.collection.find_one({"_id": "k"})
    assert stored is not None and stored["status"] == "failed" and stored["failures"] == 2
    assert stored["next_claim_at"] is None and stored["attempts"] == 2


def test_specific_workers_checked_inside_claim_and_ping(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k", options={"specific_worker_ids": ["w2"]})
    assert one(tc, "k", "w1", clock) is None
    doc = one(tc, "k", "w2", clock)
    assert doc is not None
    tc.collection.update_one({"_id": "k"}, {"$set": {"options.specific_worker_ids": ["w3"]}})
    assert tc._run(extend_lease("k", doc["claim_run_id"], "w2", clock.now())) is None


def test_concurrency_needs_distinct_workers(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k", options={"concurrency": 2})
    a = one(tc, "k", "w1", clock)
    assert a is not None and a["next_claim_at"] == clock.now()  # a slot is still free
    assert one(tc, "k", "w1", clock) is None  # same worker twice: no
    b = one(tc, "k", "w2", clock)
    assert b is not None and one(tc, "k", "w3", clock) is None  # both slots taken
    tc._run(finish(Outcome("k", a["claim_run_id"], RunState.SUCCESS), clock.now()))
    assert one(tc, "k", "w1", clock) is None  # w1 already succeeded
    done = tc._run(finish(Outcome("k", b["claim_run_id"], RunState.SUCCESS), clock.now()))
    assert done is not None and done["status"] == "succeeded" and done["successes"] == 2


def test_failure_backoff_and_permanent_fail(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k", options={"retry_delay_ms": 1000, "retry_backoff": 3.0})
    for failures, delay_ms in ((1, 1000), (2, 3000), (3, 9000)):
        doc = one(tc, "k", "w1", clock)
        assert doc is not None
        after = tc._run(
            finish(
                Outcome("k", doc["claim_run_id"], RunState.FAIL, error="x", jitter=1.0), clock.now()
            )
        )
        assert after is not None and after["failures"] == failures
        assert after["next_claim_at"] == clock.now() + dt.timedelta(milliseconds=delay_ms)
        clock.advance(milliseconds=delay_ms)
    doc = one(tc, "k", "w1", clock)
    assert doc is not None
    after = tc._run(
        finish(
            Outcome("k", doc["claim_run_id"], RunState.FAIL, error="bad input", permanent=True),
            clock.now(),
        )
    )
    assert after is not None and after["status"] == "failed" and after["error"] == "bad input"


def test_release_does_not_spend_retries(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k", options={"max_retries": 0})
    doc = one(tc, "k", "w1", clock)
    assert doc is not None
    after = tc._run(finish(Outcome("k", doc["claim_run_id"], RunState.RELEASED), clock.now()))
    assert after is not None and after["status"] == "pending" and after["failures"] == 0
    assert after["next_claim_at"] == clock.now()
    assert one(tc, "k", "w2", clock) is not None


def test_runs_array_stays_bounded(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k", options={"max_retries": 100, "retry_delay_ms": 0})
    total = MAX_RUNS_KEPT + 7
    for _ in range(total):
        doc = one(tc, "k", "w1", clock)
        assert doc is not None
        tc._run(finish(Outcome("k", doc["claim_run_id"], RunState.FAIL, error="e"), clock.now()))
    stored = tc.collection.find_one({"_id": "k"})
    assert stored is not None
    assert len(stored["runs"]) == MAX_RUNS_KEPT and stored["runs_folded"] == 7
    assert stored["attempts"] == total == stored["failures"]


def test_user_data_is_literal_in_pipelines(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish("n", "k")
    doc = one(tc, "k", "$worker", clock)
    assert doc is not None and doc["runs"][0]["worker_id"] == "$worker"
    result = {"$set": "$name", "s": "$$NOW"}
    after = tc._run(
        finish(Outcome("k", doc["claim_run_id"], RunState.SUCCESS, result=result), clock.now())
    )
    assert after is not None and after["result"] == result


def test_batch_claim_and_bulk_finish(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish_many([{"name": "n", "key": f"k{i}"} for i in range(10)])
    tc.collection.update_one({"_id": "k3"}, {"$set": {"status": "cancelled"}})
    docs = tc._run(claim([f"k{i}" for i in range(10)], ["n"], "w1", clock.now()))
    assert sorted(d["_id"] for d in docs) == sorted(f"k{i}" for i in range(10) if i != 3)
    assert len({d["claim_run_id"] for d in docs}) == 9  # one batch, a distinct run per task
    for doc in docs:
        assert [r["run_id"] for r in doc["runs"]] == [doc["claim_run_id"]]
    outcomes = [Outcome(d["_id"], d["claim_run_id"], RunState.SUCCESS) for d in docs]
    stale = Outcome("k0", "not-a-run", RunState.SUCCESS)
    assert tc._run(finish_many([*outcomes, stale], clock.now())) == 9
    assert tc.stats() == {"n": {"succeeded": 9, "cancelled": 1}}


def test_scan_pages_through_everything(tc: TaskClient, clock: FixedClock) -> None:
    tc.publish_many([{"name": "n", "key": f"k{i:03}", "delay": i} for i in range(25)])
    tc.publish("n", "not-mine", options={"specific_worker_ids": ["w9"]})
    seen: list[str] = []
    after = None
    while True:
        page = tc._run(scan(["n"], "w1", 10, after))
        if not page:
            break
        seen += [d["_id"] for d in page]
        after = (page[-1]["next_claim_at"], page[-1]["_id"])
    assert seen == [f"k{i:03}" for i in range(25)]


def same_but_run_ids(tc: TaskClient, one: str, other: str) -> dict[str, Any]:
    """Tasks ``one`` and ``other`` are the same document but for ``_id`` and their runs'
    ``run_id``s; returns ``one``'s (without them)."""
    docs = [tc.collection.find_one({"_id": key}, {"_id": 0}) for key in (one, other)]
    for doc in docs:
        assert doc is not None, (one, other)
        for run in doc["runs"]:
            run.pop("run_id")
    assert docs[0] == docs[1], (one, other)
    return docs[0]  # type: ignore[return-value]


def test_transient_errors_are_told_apart() -> None:
    from pymongo.errors import (
        AutoReconnect,
        OperationFailure,
        ServerSelectionTimeoutError,
        WriteError,
    )

    from mtask.driver import storage_error

    assert storage_error(AutoReconnect("connection reset")).transient
    assert storage_error(ServerSelectionTimeoutError("no primary")).transient
    assert storage_error(OperationFailure("stepped down", code=189)).transient
    assert not storage_error(OperationFailure("conflict", code=40)).transient
    assert not storage_error(OperationFailure("auth failed", code=18)).transient
    # a write error blames one document, unless it is the server shutting down mid-write
    # (a worker once marked 30 good tasks as ignored during a MongoDB restart)
    too_big = storage_error(WriteError("Resulting document after update is larger", 17419))
    assert too_big.document and not too_big.transient
    shutdown = storage_error(WriteError("interrupted at shutdown", 11600))
    assert shutdown.transient and not shutdown.document
    assert not storage_error(OperationFailure("auth failed", code=18)).document


def test_success_shortcut_matches_the_pipeline(tc: TaskClient, clock: FixedClock) -> None:
    result = {"$set": "$name", "n": [1, {"$$NOW": 2}]}
    for prefix in ("fast", "slow"):
        tc.publish("n", f"{prefix}-plain")
        tc.publish("n", f"{prefix}-multi", options={"concurrency": 2})
        tc.publish("n", f"{prefix}-cancelled")
    docs = {
        d["_id"]: d
        for d in tc._run(
            claim(
                [f"{p}-{k}" for p in ("fast", "slow") for k in ("plain", "multi", "cancelled")],
                ["n"],
                "w1",
                clock.now(),
            )
        )
    }
    tc.cancel("fast-cancelled")
    tc.cancel("slow-cancelled")
    clock.advance(seconds=1)
    outcomes = [
        Outcome(k, d["claim_run_id"], RunState.SUCCESS, result=result) for k, d in docs.items()
    ]
    assert tc._run(finish_many([o for o in outcomes if o.key.startswith("fast")], clock.now())) == 3
    for o in outcomes:
        if o.key.startswith("slow"):
            assert tc._run(finish(o, clock.now())) is not None
    for kind in ("plain", "multi", "cancelled"):
        fast = same_but_run_ids(tc, f"fast-{kind}", f"slow-{kind}")
        assert fast["runs"][0]["result"] == result
    statuses = {k: tc.get(f"fast-{k}").status for k in ("plain", "multi", "cancelled")}  # type: ignore[union-attr]
    assert statuses == {"plain": "succeeded", "multi": "pending", "cancelled": "cancelled"}


@pytest.mark.parametrize("with_results", [False, True])
def test_grouped_successes_match_the_pipeline(
    tc: TaskClient, clock: FixedClock, with_results: bool
) -> None:
    """A worker's SUCCESSes are written in one update_many (``success_group_update``: a plain
    update without results, a pipeline with them); each task ends exactly as the general
    pipeline leaves it, with its own result, and the fence holds per task."""
    kinds = ("plain1", "plain2", "plain3", "multi", "cancelled", "taken")
    for prefix in ("group", "single"):
        for kind in kinds:
            options = {"concurrency": 2} if kind == "multi" else {"worker_timeout_ms": 1000}
            tc.publish("n", f"{prefix}-{kind}", options=options)
    keys = [f"{p}-{k}" for p in ("group", "single") for k in kinds]
    docs = {d["_id"]: d for d in tc._run(claim(keys, ["n"], "w1", clock.now()))}
    clock.advance(seconds=2)  # the "taken" tasks' leases run out and w2 takes them over
    assert len(tc._run(claim(["group-taken", "single-taken"], ["n"], "w2", clock.now()))) == 2
    for prefix in ("group", "single"):
        tc.cancel(f"{prefix}-cancelled")
    clock.advance(seconds=1)

    def result(key: str) -> Any:
        if not with_results or key.endswith("plain2"):  # a None among the results, too
            return None
        return {"$set": "$name", "key": key.split("-")[1], "n": [1, {"$$NOW": 2}]}

    outcomes = [
        Outcome(k, d["claim_run_id"], RunState.SUCCESS, result=result(k), worker_id="w1")
        for k, d in docs.items()
    ]
    grouped = [o for o in outcomes if o.key.startswith("group")]
    groups, rest = _groups(grouped)
    assert [len(g) for g in groups] == [6] and rest == []
    # recorded: the plain ones by the group update; "multi" and "cancelled" (whose run still
    # runs) by the pipeline after it; "taken" not at all (fenced out)
    assert tc._run(finish_many(grouped, clock.now())) == 5
    for outcome in outcomes:
        if outcome.key.startswith("single"):
            tc._run(finish(outcome, clock.now()))
    for kind in kinds:
        same_but_run_ids(tc, f"group-{kind}", f"single-{kind}")
    statuses = {k: tc.get(f"group-{k}").status for k in kinds}  # type: ignore[union-attr]
    assert statuses == {
        **{f"plain{i}": "succeeded" for i in (1, 2, 3)},
        "multi": "pending",
        "cancelled": "cancelled",
        "taken": "running",
    }
    plain = tc.collection.find_one({"_id": "group-plain1"})
    assert plain is not None and plain["last_write"] == "success:w1"
    assert plain["result"] == result("group-plain1") == plain["runs"][0]["result"]


def test_grouped_successes_are_split_by_result_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from mtask.store import outcomes as module

    monkeypatch.setattr(module, "GROUP_RESULT_BYTES", 100)
    small = {"s": "x" * 20}  # 46 bytes as {"result": ...}: two fit in 100
    outcomes = [
        Outcome(f"k{i}", f"r{i}", RunState.SUCCESS, result=small, worker_id="w1") for i in range(5)
    ]
    big = Outcome("big", "rb", RunState.SUCCESS, result={"s": "x" * 200}, worker_id="w1")
    other = Outcome("o1", "ro", RunState.SUCCESS, worker_id="w2")
    failed = Outcome("f1", "rf", RunState.FAIL, error="e", worker_id="w1")
    again = Outcome("k0", "r0-again", RunState.SUCCESS, worker_id="w1")  # a key once per group
    groups, rest = _groups([*outcomes, big, other, failed, again])
    assert [[o.key for o in g] for g in groups] == [["k0", "k1"], ["k2", "k3"]]
    assert [o.run_id for o in rest] == ["rb", "rf", "r0-again", "r4", "ro"]


def test_claim_shortcut_matches_the_pipeline(tc: TaskClient, clock: FixedClock) -> None:
    for key in ("fast", "slow"):
        tc.publish("n", key, {"p": 1}, options={"worker_timeout_ms": 1234})
    fast = tc._run(claim(["fast"], ["n"], "w1", clock.now(), timeouts={"fast": 1234}))
    slow = tc._run(claim(["slow"], ["n"], "w1", clock.now()))
    assert len(fast) == len(slow) == 1
    docs = []
    for key in ("fast", "slow"):
        doc = tc.collection.find_one({"_id": key}, {"_id": 0})
        assert doc is not None
        doc["runs"][0].pop("run_id")
        docs.append(doc)
    assert docs[0] == docs[1]
    # a wrong hint, or a task the shortcut does not cover, falls back to the pipeline
    tc.publish("n", "hint", options={"worker_timeout_ms": 5000})
    tc.publish("n", "multi", options={"concurrency": 2, "worker_timeout_ms": 1234})
    assert tc._run(claim(["hint"], ["n"], "w1", clock.now(), timeouts={"hint": 1234}))
    assert tc._run(claim(["multi"], ["n"], "w1", clock.now(), timeouts={"multi": 1234}))
    stored = tc.collection.find_one({"_id": "hint"})
    assert stored is not None
    assert stored["runs"][0]["lease_expires_at"] == clock.now() + dt.timedelta(seconds=5)
    # and it never claims what the filter forbids
    assert tc._run(claim(["fast"], ["n"], "w2", clock.now(), timeouts={"fast": 1234})) == []
    # a batch: the shortcut for the keys it covers, the pipeline for the rest, one run each
    tc.publish_many(
        [{"name": "n", "key": f"m{i}", "options": {"worker_timeout_ms": 1234}} for i in range(6)]
    )
    tc.publish("n", "m-multi", options={"concurrency": 2, "worker_timeout_ms": 1234})
    keys = [f"m{i}" for i in range(6)] + ["m-multi"]
    hints = {k: 1234 for k in keys[:4]} | {"m4": 999, "m-multi": 1234}
    got = tc._run(claim(keys, ["n"], "w1", clock.now(), timeouts=hints))
    assert sorted(d["_id"] for d in got) == sorted(keys)
    for d in got:
        assert [r["run_id"] for r in d["runs"]] == [d["claim_run_id"]]
        assert d["runs"][0]["lease_expires_at"] == clock.now() + dt.timedelta(milliseconds=1234)


def test_lean_batch_claim_matches_the_pipeline(tc: TaskClient, clock: FixedClock) -> None:
    from mtask.store import claim_filter, claim_pipeline

    for key in ("a", "b", "p"):
        tc.publish("n", key, {"p": 1}, options={"worker_timeout_ms": 1234, "max_retries": 2})
    tc.publish("n", "c2", options={"concurrency": 2})
    now = clock.now()
    got = tc._run(claim(["a", "b", "c2"], ["n"], "w1", now, batch="B"))
    assert sorted(d["_id"] for d in got) == ["a", "b", "c2"]  # lean for a, b; pipeline for c2
    tc.collection.update_many(claim_filter(["p"], ["n"], "w1", now), claim_pipeline("B", "w1", now))
    lean, full = (tc.collection.find_one({"_id": k}, {"_id": 0}) for k in ("a", "p"))
    assert lean is not None and full is not None
    assert (lean["runs"][0].pop("run_id"), full["runs"][0].pop("run_id")) == ("B-a", "B-p")
    assert lean == full
    # a key that is not a string (inserted by hand) is never matched: run ids are built from it
    numeric = {**tc.collection.find_one({"_id": "b"}, {"_id": 0}), "_id": 7, "status": "pending"}
    numeric.update(runs=[], next_claim_at=now, attempts=0)
    tc.collection.insert_one(numeric)
    assert tc._run(claim([7, "x"], ["n"], "w1", now, batch="C")) == []  # type: ignore[list-item]


def test_a_workers_stream_skips_its_own_claims_and_successes(
    tc: TaskClient, clock: FixedClock
) -> None:
    """Every claim path and the success shortcut tag the task with ``last_write``; worker A's
    stream (the server filters the oplog) then carries B's claim and success, A's failure (A
    must learn the retry time from it) and A's ping, but not A's own claims and successes."""
    with tc.collection.database.watch(stream_pipeline(tc.collection.name, "A")) as stream:
        for key in ("lean1", "lean2", "single", "b", "fails"):
            tc.publish("n", key, options={"max_retries": 1, "retry_delay_ms": 1000})
        # A: a batch (the lean stage), one key without a timeout hint (the full pipeline), one
        # key with it (the find-and-update shortcut); B: one key
        batch = tc._run(claim(["lean1", "lean2"], ["n"], "A", clock.now()))
        single = tc._run(claim(["single"], ["n"], "A", clock.now()))
        fails = tc._run(claim(["fails"], ["n"], "A", clock.now(), timeouts={"fails": 30000}))
        by_b = tc._run(claim(["b"], ["n"], "B", clock.now()))
        assert len(batch) == 2 and single and fails and by_b
        assert tc.collection.find_one({"_id": "lean1"})["last_write"] == "claim:A"
        run_of = {d["_id"]: d["claim_run_id"] for d in [*batch, *single, *fails, *by_b]}
        clock.advance(seconds=1)  # so that the ping moves the lease (and next_claim_at)
        assert tc._run(extend_lease("single", run_of["single"], "A", clock.now()))
        outcomes = [
            Outcome(k, run_of[k], RunState.SUCCESS, worker_id=w)
            for k, w in (("lean1", "A"), ("lean2", "A"), ("single", "A"), ("b", "B"))
        ]
        fail = Outcome("fails", run_of["fails"], RunState.FAIL, error="x", worker_id="A")
        assert tc._run(finish_many([*outcomes, fail], clock.now())) == 5
        assert tc.collection.find_one({"_id": "b"})["last_write"] == "success:B"
        tc.publish("n", "end")
        updates: list[str] = []
        for change in stream:
            if change["operationType"] == "update":
                updates.append(change["documentKey"]["_id"])
            if change["documentKey"]["_id"] == "end":
                break
    # B's claim and success; A's ping (single) and failure (fails)
    assert sorted(updates) == ["b", "b", "fails", "single"]


def test_gathered_calls_answer_in_order_and_an_error_reaches_the_operation(
    tc: TaskClient,
) -> None:
    """``driver.gather``: independent calls sent at once, their results in order; one that
    fails is thrown into the operation like a single call's error."""
    tc.publish_many([{"name": "n", "key": f"k{i}"} for i in range(3)])

    def both() -> Op[tuple[Any, Any]]:
        found = yield gather(
            Call("find_one", ({"_id": "k2"},)),
            Call("count", ({"name": "n"},)),
            Call("find_one", ({"_id": "k0"},)),
        )
        return found[0]["_id"], found[1:]

    key, rest = tc._run(both())
    assert key == "k2" and rest[0] == 3 and rest[1]["_id"] == "k0"

    def failing() -> Op[str]:
        try:
            yield gather(Call("find_one", ({"_id": "k1"},)), Call("count", ({},), {"hint": "no"}))
        except Exception as exc:  # noqa: BLE001 - the driver's error, thrown into the op
            return type(exc).__name__
        return "no error"

    assert tc._run(failing()) == "OperationFailure"
    with pytest.raises(StorageError):
        tc._run(gather_only())


def gather_only() -> Op[Any]:
    return (yield gather(Call("count", ({},), {"hint": "no such index"})))


def _last_update(tc: TaskClient, key: str) -> dict[str, Any]:
    ns = f"{tc.db.name}.{tc.collection.name}"
    entry = tc.mongo.local["oplog.rs"].find_one(
        {"ns": ns, "op": "u", "o2._id": key}, sort=[("$natural", -1)]
    )
    assert entry is not None, key
    return entry


def test_a_claim_of_one_key_a_ping_and_one_outcome_are_not_retryable_writes(
    tc: TaskClient, clock: FixedClock
) -> None:
    """A single-key claim (both its forms) and a ping are plain ``findAndModify`` commands, and
    one outcome alone an ``update_many`` of its key: no transaction number, so the server
    writes no retry image and no session record for them; the same update through the
    collection's method is a retryable write."""
    for key in ("fast", "slow", "control"):
        tc.publish("n", key, options={"worker_timeout_ms": 1234})
    assert tc._run(claim(["fast"], ["n"], "w1", clock.now(), timeouts={"fast": 1234}))
    [slow] = tc._run(claim(["slow"], ["n"], "w1", clock.now()))
    assert "txnNumber" not in _last_update(tc, "fast")
    assert "txnNumber" not in _last_update(tc, "slow")
    clock.advance(seconds=1)
    assert tc._run(extend_lease("slow", slow["claim_run_id"], "w1", clock.now())) is not None
    pinged = _last_update(tc, "slow")
    assert "txnNumber" not in pinged and "lease_expires_at" in str(pinged["o"])
    done = Outcome("slow", slow["claim_run_id"], RunState.SUCCESS, worker_id="w1")
    assert tc._run(finish_many([done], clock.now())) == 1
    recorded = _last_update(tc, "slow")
    assert "txnNumber" not in recorded and "SUCCESS" in str(recorded["o"])
    tc.collection.find_one_and_update({"_id": "control"}, {"$inc": {"runs_folded": 1}})
    assert "txnNumber" in _last_update(tc, "control")  # what the test tells apart


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_write_concern_failure_of_a_plain_find_and_modify_is_raised(
    kind: str, mongo_uri: str, db_name: str, mongo: Any
) -> None:
    """The plain command answers ``ok`` with a ``writeConcernError`` beside the document: the
    drivers raise it, as the collection's own methods do (a claim the majority may not hold
    must not start its run)."""
    from pymongo.write_concern import WriteConcern

    from mtask.driver import MODIFY_ONCE, SyncDriver

    mongo[db_name]["tasks"].insert_one({"_id": "k", "n": 0})
    unsatisfiable = WriteConcern(w=5, wtimeout=200)  # more members than the set has

    def modify() -> Op[Any]:
        found = yield Call(MODIFY_ONCE, ({"_id": "k"}, {"$inc": {"n": 1}}), {"new": True})
        return found

    if kind == "sync":
        tasks = mongo[db_name].get_collection("tasks", write_concern=unsatisfiable)
        with pytest.raises(StorageError, match="WriteConcernError"):
            SyncDriver({"tasks": tasks}).run(modify())
        ok = SyncDriver({"tasks": mongo[db_name]["tasks"]}).run(modify())
        assert ok == {"_id": "k", "n": 2}
        return

    async def run() -> None:
        amongo: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
        try:
            tasks = amongo[db_name].get_collection("tasks", write_concern=unsatisfiable)
            with pytest.raises(StorageError, match="WriteConcernError"):
                await AsyncDriver({"tasks": tasks}).run(modify())
        finally:
            await amongo.close()

    asyncio.run(run())
