"""A parent cancelled while its run publishes its children, on the real server, with the race
played step by step: the spawn's operation is run call by call and the cancel lands between
two of its calls (where a worker's spawn and an operator's cancel meet). No child is left
open, whichever call it lands before, nor when the spawning run dies between its write and its
look at its parent (the flow sweep's part), nor however many children there are."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Generator
from typing import Any

import pytest

from mtask import TaskClient, store
from mtask.driver import Call, Doc, Op
from mtask.errors import LeaseLost
from mtask.steps.children import build
from mtask.store import children as store_children
from mtask.store.children import PUBLISH_BATCH
from mtask.store.schema import OPEN_LIST

ONE = dt.timedelta(milliseconds=1)


def claimed_parent(client: TaskClient) -> tuple[str, dt.datetime]:
    """The parent ``p`` claimed: its run's id and the end of its lease."""
    client.publish("fanout", "p")
    doc = client._run(store.claim(["p"], ["fanout"], "w1", client.now()))[0]
    run = next(r for r in doc["runs"] if r["run_id"] == doc["claim_run_id"])
    return doc["claim_run_id"], run["lease_expires_at"]


def spawn(client: TaskClient, run_id: str, n: int) -> Op[int]:
    """The spawn's operation as the parent's run makes it (``StepStore.spawn``)."""
    specs = build("p", "squares", [("square", {"n": i}) for i in range(n)])
    entry = {"name": "squares", "kind": "children", "state": "waiting", "total": n}
    return store_children.spawn("p", run_id, 0, entry, specs, client.now())


def around_batches(
    op: Op[int], before: Callable[[int], None], dies_after: int | None = None
) -> Generator[Call, Any, int | None]:
    """``op``, with ``before(i)`` called just before its ``i``-th batch of children is written
    (``bulk_write``: the batches alone use it); ``dies_after``: the run dies once that many
    batches are written (nothing more of ``op`` runs)."""
    written = 0
    call = next(op)
    while True:
        if call.method == "bulk_write":
            before(written)
        result = yield call
        if call.method == "bulk_write":
            written += 1
            if written == dies_after:
                return None
        try:
            call = op.send(result)
        except StopIteration as stop:
            return int(stop.value)


def children(client: TaskClient) -> list[Doc]:
    return list(client.collection.find({"parent": "p"}, {"status": 1}))


def open_children(client: TaskClient) -> int:
    return sum(1 for c in children(client) if c["status"] in OPEN_LIST)


@pytest.mark.parametrize("batch", [0, 1, 2])
def test_a_cancel_during_the_spawn_leaves_no_child_open(client: TaskClient, batch: int) -> None:
    """The cancel lands after the spawn looked at its parent and before its batch's write: the
    batch is written all the same, and the spawn's next look cancels it and publishes no more
    (children published after the cancel stayed open and ran: up to 838 of 2,000 in 8 s)."""
    run_id, _ = claimed_parent(client)

    def cancel(at: int) -> None:
        if at == batch:
            client.cancel("p")

    op = around_batches(spawn(client, run_id, 3 * PUBLISH_BATCH), cancel)
    with pytest.raises(LeaseLost, match="cancelled while it spawned"):
        client._run(op)
    assert open_children(client) == 0
    assert len(children(client)) == (batch + 1) * PUBLISH_BATCH  # no batch after the cancel's


def test_children_a_dead_run_published_after_the_cancel_are_cancelled_by_the_sweep(
    client: TaskClient,
) -> None:
    """The spawning run died between its batch's write and its look at its parent: its
    parent, cancelled while it ran, is marked until that run's lease ends, then the flow
    sweep cancels the children it left open."""
    run_id, lease_end = claimed_parent(client)

    def cancel(at: int) -> None:
        if at == 1:
            client.cancel("p")

    client._run(around_batches(spawn(client, run_id, 3 * PUBLISH_BATCH), cancel, dies_after=2))
    assert open_children(client) == PUBLISH_BATCH  # the batch written after the cancel
    assert client._run(store_children.sweep_cancelled(lease_end - ONE)) == 0  # it may still run
    assert client._run(store_children.sweep_cancelled(lease_end)) == PUBLISH_BATCH
    assert open_children(client) == 0
    assert "cancel_children_at" not in (client.collection.find_one({"_id": "p"}) or {})


def test_a_cancel_reaches_every_child_however_many(client: TaskClient) -> None:
    """More children than any bound but the documented one (100,000 a spawn): a cancel
    reached 10,000 of them and left the rest pending."""
    run_id, _ = claimed_parent(client)
    n = 12_000
    assert client._run(spawn(client, run_id, n)) == n
    client.cancel("p")
    assert open_children(client) == 0 and len(children(client)) == n
