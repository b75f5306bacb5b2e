"""Bench WF, the preflight of changed handlers: ``n`` parked tasks (100,000; 5,000
with ``--quick``) checked against the handlers of ``bench.app`` (``mtask.steps.preflight.check``:
read page by page, replayed dry in the sandbox process), timed, with the server's write
operations counted across the check (``opcounters`` insert, update, delete: none expected).

The parked tasks are written as a worker leaves them (a done step, a wait for a signal), of
two journal shapes: three in four replay cleanly, one in four mismatches at its second step.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import TYPE_CHECKING, Any

from pymongo import MongoClient

from bench.support import QUICK, Result
from mtask.client import TaskClient
from mtask.models import NewTask
from mtask.registry import Registry, TaskContext
from mtask.steps import NEVER
from mtask.steps.preflight import check
from mtask.store.schema import new_document

if TYPE_CHECKING:
    from bench.workloads import Bench


async def parked(params: dict[str, Any], ctx: TaskContext) -> str:
    await ctx.step("charge", lambda: params["i"])
    await ctx.wait_for("go")
    return "shipped"


def register(registry: Registry) -> None:
    registry.task("parked")(parked)


def _entry(name: str, kind: str, state: str, at: dt.datetime, **more: Any) -> dict[str, Any]:
    return {"name": name, "kind": kind, "state": state, "attempts": 1, "run_id": "r",
            "attempt": 1, "started_at": at, **more}  # fmt: skip


def _docs(start: int, count: int, now: dt.datetime) -> list[dict[str, Any]]:
    docs = []
    for i in range(start, start + count):
        first = "charge" if i % 4 else "label"  # one in four: a journal of an older handler
        steps = [
            _entry(first, "call", "done", now, result=i),
            _entry("wait:go", "signal", "waiting", now, signal="go", nth=0, until=NEVER),
        ]
        doc = new_document(NewTask.build("parked", f"p{i:06}", {"i": i}), now)
        waiting = {"until": NEVER, "index": 1, "step": "wait:go", "signal": "go", "nth": 0}
        doc.update(steps=steps, attempts=1, next_claim_at=NEVER, available_at=NEVER,
                   waiting=waiting)  # fmt: skip
        docs.append(doc)
    return docs


def _writes(mongo: MongoClient[dict[str, Any]]) -> int:
    counters = mongo.admin.command("serverStatus")["opcounters"]
    return sum(int(counters[k]) for k in ("insert", "update", "delete"))


def preflight_at_scale(bench: Bench) -> None:
    from bench.scale import _own_mongod

    n = 5_000 if bench.sizes is QUICK else 100_000
    with _own_mongod() as (uri, _pid, _port), TaskClient(uri, database="wf") as client:
        now = client.now()
        for start in range(0, n, 10_000):
            client.collection.insert_many(_docs(start, min(10_000, n - start), now))
        client.ensure_indexes()  # the client's own set-up on first use: not the check's
        before = _writes(client.mongo)
        began = time.monotonic()
        report = check(client, "bench.app:registry", ["parked"])
        seconds = time.monotonic() - began
        writes = _writes(client.mongo) - before
    counts = report.names["parked"].counts
    bench.record(
        Result(
            "WF preflight",
            f"{n} parked tasks checked in {seconds:.1f} s ({seconds / n * 1e6:.0f} µs a task): "
            f"{counts['clean']} clean, {counts['mismatch']} mismatched; {writes} writes",
            "within seconds, no write",
            writes == 0 and counts["clean"] + counts["mismatch"] == n,
            "read page by page (name_status_newest), replayed dry in the sandbox process; "
            "the server's insert+update+delete counters across the check",
            {"seconds": seconds, "tasks": float(n), "writes": float(writes)},
        )
    )
