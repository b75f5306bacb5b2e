"""Supersede: of the tasks of a name and group published with a policy, one open
task at a time, decided by the unique ``supersede`` index. 20 publishers racing on one group end
with exactly one open task by the stated rule, for each policy (``cancel_queued`` also while an
older task runs: it runs on); a running older one is cancelled, told, and its fenced SUCCESS
never lands (a real worker process); ``cancel_queued`` leaves it running."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from harness import run_cli
from prometheus_client import REGISTRY
from pymongo import MongoClient
from test_snooze_worker import flow_worker, polled

from mtask import TaskClient
from mtask.errors import InvalidTask
from mtask.models import PublishResult
from mtask.vocabulary import RunState

RACERS = 20


def race(
    client: TaskClient,
    policy: str,
    group: str,
    options: dict[str, Any] | None = None,
    delay: float | None = None,
) -> list[PublishResult]:
    """``RACERS`` publishers of ``group-0`` … at once; ``options`` beyond the group."""
    start = threading.Barrier(RACERS)

    def one(n: int) -> PublishResult:
        start.wait()
        return client.publish(
            "hold",
            f"{group}-{n}",
            {"n": n},
            options={**(options or {}), "group": group},
            delay=delay,
            supersede=policy,
        )

    with ThreadPoolExecutor(RACERS) as pool:
        return list(pool.map(one, range(RACERS)))


def superseded(how: str) -> float:
    """``mtask_tasks_superseded_total`` of the name ``hold``, ``how``, in this process."""
    labels = {"name": "hold", "how": how}
    return REGISTRY.get_sample_value("mtask_tasks_superseded_total", labels) or 0.0


def one_newest(client: TaskClient, results: list[PublishResult], group: str) -> str:
    """The racers of ``group`` left exactly one open task, the newest: every other was created
    and then cancelled by exactly one newer publish, which it names, and following those names
    from any of them ends at the survivor. Returns the survivor's key."""
    keys = {f"{group}-{n}" for n in range(RACERS)}
    tasks = {k: client.get(k) for k in keys}
    assert all(t is not None for t in tasks.values())
    open_ = [k for k, t in tasks.items() if t is not None and t.status in ("pending", "running")]
    assert len(open_) == 1
    (survivor,) = open_
    assert all(r.created and not r.dropped for r in results)
    cancelled = {k for k, t in tasks.items() if t is not None and t.status == "cancelled"}
    assert cancelled == keys - {survivor}
    # each older one was cancelled by exactly one newer publish, which it names
    named = [k for r in results for k in r.superseded]
    assert sorted(named) == sorted(cancelled)
    for r in results:
        for k in r.superseded:
            assert tasks[k].superseded_by == r.task.key  # type: ignore[union-attr]
    assert tasks[survivor].superseded_by is None  # type: ignore[union-attr]
    for key in cancelled:  # the names lead from any of them to the survivor, no cycle
        seen = {key}
        while key != survivor:
            key = tasks[key].superseded_by  # type: ignore[union-attr,assignment]
            assert key not in seen
            seen.add(key)
    said = client.explain(tasks[next(iter(cancelled))])  # type: ignore[arg-type]
    assert "superseded by `" in said.reason
    return survivor


@pytest.mark.parametrize("policy", ["cancel_running", "cancel_queued"])
def test_racing_publishers_leave_exactly_one_newest(client: TaskClient, policy: str) -> None:
    before = superseded("cancelled")
    results = race(client, policy, f"acme-{policy}")
    one_newest(client, results, f"acme-{policy}")
    assert superseded("cancelled") - before == RACERS - 1  # the publishers' own counts


def test_racing_cancel_queued_publishers_leave_the_running_one_and_one_queued(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """20 ``cancel_queued`` publishers racing while an older task of the group runs: it runs
    on, out of the index, no racer names it; of the racers exactly one stays queued."""
    fast = {"ping_interval_ms": 100}
    with flow_worker(mongo_uri, db_name):
        options = {**fast, "group": "busy"}
        client.publish("hold", "busy-run", options=options, supersede="cancel_queued")
        polled(lambda: client.get("busy-run"), lambda t: t is not None and t.status == "running")
        before = superseded("cancelled")
        results = race(client, "cancel_queued", "busy", fast, delay=3600)  # left queued
        survivor = one_newest(client, results, "busy")
        assert superseded("cancelled") - before == RACERS - 1
        still = client.get("busy-run")
        assert still is not None and still.status == "running"
        assert still.supersede is None and still.superseded_by is None
        assert all("busy-run" not in r.superseded for r in results)
        queued = client.get(survivor)
        assert queued is not None and queued.status == "pending" and queued.supersede
        for key in ("busy-run", survivor):
            client.cancel(key)


def test_racing_publishers_drop_the_newer_ones(client: TaskClient) -> None:
    before = superseded("dropped")
    results = race(client, "drop_newer", "beta")
    created = [r for r in results if r.created]
    assert len(created) == 1 and not created[0].dropped
    winner = created[0].task.key
    dropped = [r for r in results if not r.created]
    assert len(dropped) == RACERS - 1
    assert all(r.dropped and r.task.key == winner for r in dropped)
    assert superseded("dropped") - before == RACERS - 1
    stored = [client.get(f"beta-{n}") for n in range(RACERS)]
    assert [t.key for t in stored if t is not None] == [winner]


def test_other_groups_names_and_tasks_without_a_policy_are_left_alone(
    client: TaskClient,
) -> None:
    client.publish("hold", "g1-a", options={"group": "g1"}, supersede="cancel_running")
    client.publish("hold", "g2-a", options={"group": "g2"}, supersede="cancel_running")
    client.publish("hold", "g1-plain", options={"group": "g1"})
    client.publish("hold", "nogroup-a", supersede="cancel_running")
    again = client.publish("hold", "g1-a", options={"group": "g1"}, supersede="cancel_running")
    assert not again.created and not again.superseded  # idempotent by key
    newer = client.publish("hold", "g1-b", options={"group": "g1"}, supersede="cancel_queued")
    assert newer.created and newer.superseded == ["g1-a"]
    statuses = {k: client.get(k).status for k in ("g1-a", "g2-a", "g1-plain", "nogroup-a")}  # type: ignore[union-attr]
    assert statuses == {
        "g1-a": "cancelled",
        "g2-a": "pending",
        "g1-plain": "pending",
        "nogroup-a": "pending",
    }


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"supersede": "newest"}, "supersede"),
        ({"supersede": "drop_newer", "on_conflict": "reset"}, "supersede"),
        ({"supersede": "drop_newer", "depends_on": ["x"]}, "supersede"),
    ],
)
def test_bad_input_is_refused(client: TaskClient, kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidTask) as caught:
        client.publish("hold", "bad", **kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert client.get("bad") is None


def test_a_running_older_run_is_cancelled_and_writes_nothing_after_its_fence(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    fast = {"ping_interval_ms": 100, "group": "live"}
    with flow_worker(mongo_uri, db_name):
        client.publish("hold", "old", options=fast, supersede="cancel_running")
        running = polled(
            lambda: client.get("old"), lambda t: t is not None and t.status == "running"
        )
        assert running is not None and running.status == "running"
        newer = client.publish("hold", "new", options=fast, supersede="cancel_running")
        assert newer.superseded == ["old"]
        old = polled(
            lambda: client.get("old"),
            lambda t: t is not None and bool(t.runs) and t.runs[-1].state != RunState.RUNNING,
        )
        assert old is not None and old.runs[-1].state == RunState.CANCELLED
        new = polled(lambda: client.get("new"), lambda t: t is not None and t.status == "running")
        assert new is not None and new.status == "running"
        client.cancel("new")
    assert old.status == "cancelled" and old.superseded_by == "new"
    assert old.result is None and old.successes == 0  # its handler's SUCCESS was fenced


def test_cancel_queued_leaves_the_running_one_and_keeps_one_queued(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    fast = {"ping_interval_ms": 100, "group": "q"}
    with flow_worker(mongo_uri, db_name):
        client.publish("hold", "q-run", options=fast, supersede="cancel_queued")
        polled(lambda: client.get("q-run"), lambda t: t is not None and t.status == "running")
        # queued: delayed, so the worker's free slots leave them pending
        first = client.publish("hold", "q-1", options=fast, delay=3600, supersede="cancel_queued")
        assert first.created and first.superseded == []
        second = client.publish("hold", "q-2", options=fast, delay=3600, supersede="cancel_queued")
        assert second.created and second.superseded == ["q-1"]
        still = client.get("q-run")
        assert still is not None and still.status == "running" and still.supersede is None
        for key in ("q-run", "q-2"):
            client.cancel(key)
    q1 = client.get("q-1")
    assert q1 is not None and q1.status == "cancelled" and q1.superseded_by == "q-2"


def test_the_cli_publishes_with_a_policy(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    code, _, _ = run_cli(
        "publish",
        "hold",
        "c-1",
        "--options",
        '{"group": "c"}',
        "--supersede",
        "cancel_queued",
        *common,
    )
    assert code == 0
    code, out, _ = run_cli(
        "publish",
        "hold",
        "c-2",
        "--options",
        '{"group": "c"}',
        "--supersede",
        "cancel_queued",
        *common,
    )
    assert code == 0 and "c-1" in out
    with pytest.raises(SystemExit) as refused:  # argparse's choices: exit 2
        run_cli("publish", "hold", "c-3", "--supersede", "newest", *common)
    assert refused.value.code == 2
    c1 = client.get("c-1")
    assert c1 is not None and c1.status == "cancelled" and c1.superseded_by == "c-2"


def test_the_api_publishes_with_a_policy_and_refuses_a_bad_one(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    from fastapi.testclient import TestClient

    from mtask.web import create_app

    auth = {"Authorization": "Bearer t"}
    with TestClient(create_app(mongo_uri, database=db_name, token="t")) as http:
        body = {"name": "hold", "options": {"group": "h"}, "supersede": "drop_newer"}
        first = http.post("/tasks", json={**body, "key": "h-1"}, headers=auth)
        second = http.post("/tasks", json={**body, "key": "h-2"}, headers=auth)
        bad = http.post("/tasks", json={**body, "key": "h-3", "supersede": "x"}, headers=auth)
    assert first.status_code == 201 and second.status_code == 200
    assert second.json()["dropped"] is True and second.json()["task"]["key"] == "h-1"
    assert bad.status_code == 422
    assert client.get("h-2") is None and client.get("h-3") is None


def test_a_superseded_task_retried_or_a_foreign_document_never_collides(
    mongo_uri: str, db_name: str, client: TaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    client.publish("hold", "r-1", options={"group": "r"}, delay=3600, supersede="cancel_queued")
    client.publish("hold", "r-2", options={"group": "r"}, delay=3600, supersede="cancel_queued")
    retried = client.retry("r-1")  # reopened beside r-2: outside the rule, not refused
    assert retried.status == "pending" and retried.supersede is None
    mongo[db_name]["tasks"].insert_one(
        {"_id": "r-foreign", "name": "hold", "options": {"group": "r", "ping_interval_ms": 100},
         "supersede": "drop_newer"}
    )  # fmt: skip
    with flow_worker(mongo_uri, db_name):  # it completes the minimal document, and runs it
        done = polled(
            lambda: client.get("r-foreign"), lambda t: t is not None and t.status == "running"
        )
        for key in ("r-foreign", "r-1"):  # "hold" runs until cancelled
            client.cancel(key)
    assert done is not None and done.status == "running" and done.supersede is None
    assert client.get("r-2").status == "pending"  # type: ignore[union-attr]
