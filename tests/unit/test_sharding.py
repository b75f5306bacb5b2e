"""Sharding on paper, checked where it can be without a mongos (scale.md, "Sharding"): every
operation the section calls *targeted* with a hashed ``_id`` shard key is built through the
store seam (generators yielding ``Call``s, driven here with canned replies: no I/O) and every
call it makes on the tasks collection must hold the shard key: ``_id`` equality or ``$in``."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from harness import T0
from pymongo import UpdateOne

from mtask import store
from mtask.driver import MODIFY_ONCE, Call, Op
from mtask.limits import rules as limits
from mtask.models import NewTask
from mtask.store import Outcome
from mtask.store import flows as store_flows
from mtask.store import limits as store_limits
from mtask.store import schedules as store_schedules
from mtask.store.retention import purge, purge_filter
from mtask.vocabulary import RunState

Doc = dict[str, Any]
KEYS = ["k1", "k2", "k3"]


def _reply(call: Call, found: Doc | None, modified: int) -> Any:
    """What the server would answer, enough for the operation to carry on."""
    if call.method == "gather":
        return [_reply(c, found, modified) for c in call.args]
    if call.method in ("find_one_and_update", "find_one", MODIFY_ONCE):
        return found
    if call.method in ("find", "distinct", "aggregate"):
        return ["n"] if call.method == "distinct" else []
    if call.method in ("count_documents", "count", "estimated_document_count"):
        return 0
    if call.method == "bulk_write":
        return SimpleNamespace(modified_count=modified, upserted_count=0, upserted_ids={})
    return SimpleNamespace(modified_count=modified, deleted_count=0, matched_count=modified)


def calls_of(op: Op[Any], found: Doc | None = None, modified: int = 0) -> list[Call]:
    made: list[Call] = []
    try:
        call = next(op)
        while True:
            made += call.args if call.method == "gather" else [call]
            call = op.send(_reply(call, found, modified))
    except StopIteration:
        return made


SINGLE = {"find_one_and_update", "find_one", "update_one", "delete_one", MODIFY_ONCE}
"""Single-document calls: before MongoDB 7.1 their filter must hold the shard key by equality."""


def filters(call: Call) -> list[tuple[Doc, bool]]:
    """Each filter of ``call``, and whether it belongs to a single-document write."""
    if call.method == "bulk_write":
        return [(r._filter, True) for r in call.args[0] if isinstance(r, UpdateOne)]
    return [(call.args[0], call.method in SINGLE)]


def holds_id(filt: Doc, single: bool = False) -> bool:
    """``_id`` by equality; for a multi-document call also ``$in`` (the shards owning those
    keys), with at most a ``$type`` check beside it."""
    value = filt.get("_id")
    if isinstance(value, str):
        return True
    return (
        not single
        and isinstance(value, dict)
        and "$in" in value
        and set(value) <= {"$in", "$type"}
        and bool(value["$in"])
    )


def task(key: str = "k1") -> NewTask:
    return NewTask.build(
        "n",
        key,
        {"x": 1},
        {"keep_succeeded_ms": 1000, "keep_failed_ms": 1000, "keep_cancelled_ms": 1000},
    )


def success(key: str, steps: tuple[Doc, ...] = ()) -> Outcome:
    return Outcome(key, f"b-{key}", RunState.SUCCESS, worker_id="w", steps=steps)


STEP = {"name": "m", "key": "k1/m", "params": {}, "options": {}, "depends_on": []}

TARGETED: dict[str, Callable[[], list[Call]]] = {
    "publish": lambda: calls_of(store.publish(task(), T0)),
    "publish in a session (an upsert)": lambda: calls_of(store.publish(task(), T0, upsert=True)),
    "publish, update_params": lambda: calls_of(
        store.publish(task(), T0, "update_params", upsert=True), found={"_id": "k1"}
    ),
    "publish, reset": lambda: calls_of(
        store.publish(task(), T0, "reset", upsert=True), found={"_id": "k1"}
    ),
    "publish_many": lambda: calls_of(store.publish_many([task(k) for k in KEYS], T0)),
    "get": lambda: calls_of(store.get("k1")),
    "get_status": lambda: calls_of(store.get_status("k1")),
    "claim by key": lambda: calls_of(store.claim(["k1"], ["n"], "w", T0)),
    "claim by key, plain-update shortcut": lambda: calls_of(
        store.claim(["k1"], ["n"], "w", T0, timeouts={"k1": 30_000})
    ),
    "batch claim": lambda: calls_of(store.claim(KEYS, ["n"], "w", T0), modified=1),
    "placements": lambda: calls_of(store.placements(KEYS)),
    "quarantine": lambda: calls_of(store.quarantine(KEYS, T0)),
    "ping (extend_lease)": lambda: calls_of(store.extend_lease("k1", "r", "w", T0)),
    "outcome, one": lambda: calls_of(store.finish(Outcome("k1", "r", RunState.FAIL), T0)),
    "outcomes, grouped SUCCESS": lambda: calls_of(
        store.finish_many([success(k) for k in KEYS], T0), modified=1
    ),
    "outcomes, bulk (with next steps)": lambda: calls_of(
        store.finish_many([success("k1", (STEP,)), Outcome("k2", "r", RunState.FAIL)], T0)
    ),
    "cancel": lambda: calls_of(store.cancel("k1", T0), found={"_id": "k1"}),
    "retry": lambda: calls_of(store.retry("k1", T0), found={"_id": "k1"}),
    "flow outbox of known parents": lambda: calls_of(store_flows.flush_outboxes(["k1"], T0)),
    "purge by keys": lambda: calls_of(purge(purge_filter(T0, keys=KEYS))),
}


@pytest.mark.parametrize("operation", list(TARGETED))
def test_targeted_operations_hold_the_shard_key(operation: str) -> None:
    calls = [c for c in TARGETED[operation]() if c.collection == "tasks"]
    assert calls, operation
    for call in calls:
        for filt, single in filters(call):
            assert holds_id(filt, single), (operation, call.method, filt)


def test_the_limits_and_schedules_documents_are_addressed_by_id() -> None:
    """Small collections (one document per limited name / schedule): unsharded, or sharded on
    ``_id``; their writes name the ``_id``."""
    calls = calls_of(
        store_limits.set_limit("n", limits.Limit(2), limits.Limit(), T0), found={"_id": "n"}
    )
    calls += calls_of(store_schedules.remove("s"))
    assert calls and all(holds_id(c.args[0], True) for c in calls if c.method != "find")


def test_scatter_gather_operations_say_so() -> None:
    """The section's scatter-gather list is honest: these filters do not hold the shard key."""
    for op in (
        store.scan(["n"], "w", 10),
        store.stats(),
        store.list_tasks(),
        store_flows.flush_outboxes(None, T0, older_than=T0),
        purge(purge_filter(T0)),
    ):
        calls = [c for c in calls_of(op) if c.collection == "tasks" and c.args]
        assert calls and not any(isinstance(c.args[0], dict) and holds_id(c.args[0]) for c in calls)


def test_a_publish_names_the_shard_key_once_per_task() -> None:
    """With ``name`` + ``_id`` as the shard key, a publish's insert holds both, but the upsert
    of a publish in a session lacks ``name`` in its filter: the section says it would need it
    added (and loses key uniqueness across names)."""
    [insert] = calls_of(store.publish(task(), T0))  # retention options set: no defaults read
    assert insert.method == "insert_one"
    assert insert.args[0]["_id"] == "k1" and "name" in insert.args[0]
    [upsert] = calls_of(store.publish(task(), T0, upsert=True))
    assert upsert.args[0] == {"_id": "k1"} and "name" not in upsert.args[0]
