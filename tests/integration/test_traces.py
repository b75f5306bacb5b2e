"""One trace per task, with every step in it: a workflow (three steps, a sleep, two parallel
branches, three children) run by real worker processes that export their spans
(``tests/tracedapp.py``), its first worker killed with SIGKILL mid-run and the task taken over
by another. Every run of the parent is in one trace; each step is in it once as run (and as
replayed by each later run); its sleep, gather, branches and spawn are spans; each child's
runs join that trace, linked to the step span that spawned them."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_for
from harness.processes import TESTS
from pymongo import MongoClient

from mtask import TaskClient

pytestmark = pytest.mark.timeout(60)
LONG_AGO = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


@contextlib.contextmanager
def workers(uri: str, database: str, logs: Path) -> Iterator[Cluster]:
    found = Cluster(uri, database, logs, app="tracedapp:registry", home=TESTS)
    try:
        yield found
    finally:
        found.close()


def spans_in(folder: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(folder.glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def _of(spans: list[dict[str, Any]], key: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        s
        for s in spans
        if s["attributes"].get("mtask.key") == key and (name is None or s["name"] == name)
    ]


async def test_a_workflow_taken_over_after_a_kill_is_one_trace_with_every_step(
    mongo_uri: str, db_name: str, tmp_path: Path
) -> None:
    folder = tmp_path / "spans"
    folder.mkdir()
    env = {"MTASK_SPANS_DIR": str(folder)}
    args = ("--sweep-interval", "1")
    with (
        MongoClient(mongo_uri, tz_aware=True) as mongo,
        TaskClient(mongo_uri, database=db_name) as client,
        workers(mongo_uri, db_name, tmp_path) as cluster,
    ):
        tasks = mongo[db_name]["tasks"]
        cluster.spawn("w1", *args, env=env)
        # published without a tracer here: the first run begins the task's trace
        client.publish("traced_parent", "wf", {}, options={"worker_timeout_ms": 3000})

        def a_recorded_b_running() -> bool:
            doc = tasks.find_one({"_id": "wf"}, {"steps": 1}) or {}
            done = [s["name"] for s in doc.get("steps", []) if s.get("state") == "done"]
            return done == ["a"] and mongo[db_name]["calls"].count_documents({"key": "wf"}) == 1

        await wait_for(a_recorded_b_running, timeout=30)
        await asyncio.to_thread(cluster.signal, "w1", signal.SIGKILL)  # mid-run, in step b
        tasks.update_one(
            {"_id": "wf"},
            {"$set": {"runs.0.lease_expires_at": LONG_AGO, "next_claim_at": LONG_AGO}},
        )  # its lease over: another worker takes it over at once
        mongo[db_name]["release"].insert_one({"_id": "wf"})
        cluster.spawn("w2", *args, env=env)

        def finished() -> bool:
            task = client.get("wf")
            return task is not None and task.status is not None and task.status.finished

        await wait_for(finished, timeout=40, every=0.1)
        task = client.get("wf")
        assert task is not None and task.status is not None
        assert task.status.value == "succeeded", task.error
        assert task.result == [1, 2, "P1", "P2", 0, 10, 20, 3]
        run_ids = [r.run_id for r in task.runs]
        kids = sorted(tasks.find({"parent": "wf"}, {"trace": 1}), key=lambda d: d["_id"])
        stored = tasks.find_one({"_id": "wf"}, {"trace": 1}) or {}

    spans = spans_in(folder)
    mine = _of(spans, "wf")
    # one trace holds every run of the parent, the killed one's steps included
    traces = {s["trace_id"] for s in mine}
    assert len(traces) == 1, traces
    (trace_id,) = traces
    assert stored["trace"]["traceparent"].split("-")[1] == trace_id  # the one its first run kept
    assert len(run_ids) >= 4  # killed, taken over (ends in the sleep), the spawn, the last
    assert {s["attributes"].get("mtask.run_id") for s in mine} >= set(run_ids)
    (root,) = _of(spans, "wf", "mtask.task")
    runs = _of(spans, "wf", "mtask.run")
    assert len(runs) == len(run_ids) - 1  # the killed run's span never ended
    assert {r["parent_id"] for r in runs} == {root["span_id"]}
    assert {r["attributes"]["mtask.run_id"] for r in runs} == set(run_ids[1:])
    assert all(r["attributes"]["mtask.name"] == "traced_parent" for r in runs)

    # each step once as run, and as replayed by each later run that passed it
    steps = [s for s in mine if s["name"] == "mtask.step"]
    for name in ("a", "b", "c", "p1", "p2"):
        ran = [s for s in steps if s["attributes"]["mtask.step"] == name]
        fresh = [s for s in ran if not s["attributes"]["mtask.replayed"]]
        assert len(fresh) == 1, (name, ran)
        replayed = [s for s in ran if s["attributes"]["mtask.replayed"]]
        later = run_ids[run_ids.index(fresh[0]["attributes"]["mtask.run_id"]) + 1 :]
        assert sorted(s["attributes"]["mtask.run_id"] for s in replayed) == sorted(later), name
        assert all(s["attributes"]["mtask.outcome"] == "done" for s in ran)
    a_fresh = next(s for s in steps if s["attributes"]["mtask.step"] == "a")
    assert a_fresh["attributes"]["mtask.run_id"] == run_ids[0]  # the killed run's, exported
    b_fresh = [s for s in steps if s["attributes"]["mtask.step"] == "b"]
    assert run_ids[0] not in {s["attributes"]["mtask.run_id"] for s in b_fresh}  # killed in it

    # the sleep: ended waiting by one run, over in the next
    naps = _of(spans, "wf", "mtask.sleep")
    assert [s["attributes"]["mtask.outcome"] for s in naps][:2] == ["waiting", "done"]
    assert all(s["attributes"]["mtask.step"] == "nap" for s in naps)
    # the gather and its two branches, each branch's step under its branch
    p1 = next(
        p
        for p in steps
        if p["attributes"]["mtask.step"] == "p1" and not p["attributes"]["mtask.replayed"]
    )
    ran = p1["attributes"]["mtask.run_id"]
    (gather,) = [
        s for s in _of(spans, "wf", "mtask.gather") if s["attributes"]["mtask.run_id"] == ran
    ]
    branches = [s for s in _of(spans, "wf", "mtask.branch") if s["parent_id"] == gather["span_id"]]
    assert sorted(b["attributes"]["mtask.branch"] for b in branches) == [0, 1]
    for name in ("p1", "p2"):
        (run,) = [s for s in steps if s["attributes"]["mtask.step"] == name
                  and s["parent_id"] in {b["span_id"] for b in branches}]  # fmt: skip
        assert run["attributes"]["mtask.gather"] == "gather#1"
    # the spawn: its step span ends waiting; the children join the trace, linked to it
    (spawned,) = [s for s in _of(spans, "wf", "mtask.children")
                  if s["attributes"]["mtask.outcome"] == "waiting"]  # fmt: skip
    awaited = [s for s in _of(spans, "wf", "mtask.children") if s is not spawned]
    assert awaited and not awaited[0]["attributes"]["mtask.replayed"]  # the results read once
    assert len(kids) == 3
    for kid in kids:
        assert kid["trace"]["traceparent"].split("-")[1:3] == [trace_id, spawned["span_id"]]
        child_runs = _of(spans, kid["_id"], "mtask.run")
        assert child_runs, kid["_id"]
        for run in child_runs:
            assert run["trace_id"] == trace_id
            assert run["parent_id"] == spawned["span_id"]
            assert [(lk["trace_id"], lk["span_id"]) for lk in run["links"]] == [
                (trace_id, spawned["span_id"])
            ]
        (work,) = _of(spans, kid["_id"], "mtask.step")
        assert work["parent_id"] == child_runs[-1]["span_id"]
    # what a backend filters on
    assert {"mtask.key", "mtask.name", "mtask.attempt", "mtask.run_id", "mtask.step",
            "mtask.replayed"} <= set(a_fresh["attributes"])  # fmt: skip


async def test_an_isolated_handlers_steps_are_spans_under_its_run(
    mongo_uri: str, db_name: str, tmp_path: Path
) -> None:
    folder = tmp_path / "spans"
    folder.mkdir()
    with (
        TaskClient(mongo_uri, database=db_name) as client,
        workers(mongo_uri, db_name, tmp_path) as cluster,
    ):
        cluster.spawn("w1", env={"MTASK_SPANS_DIR": str(folder)})
        client.publish("traced_isolated", "iso")
        done = await asyncio.to_thread(client.wait, "iso", 30)
        assert done.result == 3
    spans = spans_in(folder)
    (run,) = _of(spans, "iso", "mtask.run")
    steps = _of(spans, "iso", "mtask.step")
    assert sorted(s["attributes"]["mtask.step"] for s in steps) == ["one", "two"]
    for step in steps:  # made in the child process, under the worker's run span
        assert (step["trace_id"], step["parent_id"]) == (run["trace_id"], run["span_id"])
        assert step["attributes"]["mtask.run_id"] == run["attributes"]["mtask.run_id"]
