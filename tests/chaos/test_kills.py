"""Workers killed and frozen mid-run: nothing lost, nothing over-run, no zombie writes."""

from __future__ import annotations

import asyncio
import random
import signal
from typing import Any

import pytest
from harness import Cluster, until_finished, wait_for
from invariants import check
from pymongo import MongoClient
from sizes import Size

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(1800)]

LEASE = {"worker_timeout_ms": 1500, "ping_interval_ms": 300}


def work_items(n: int, seed: int, **options: Any) -> list[dict[str, Any]]:
    """A mix: mostly concurrency 1, every tenth task concurrency 2, every seventh fails once."""
    rng = random.Random(seed)
    return [
        {
            "name": "work",
            "key": f"k{i:05d}",
            "params": {"ms": rng.randint(50, 600), "fail_attempts": 1 if i % 7 == 0 else 0},
            "options": {
                "concurrency": 2 if i % 10 == 0 else 1,
                "max_retries": 10,
                "retry_delay_ms": 50,
                **options,
            },
        }
        for i in range(n)
    ]


def assert_invariants(mongo: MongoClient[dict[str, Any]], db: str, keys: set[str]) -> Any:
    report = check(mongo[db], keys)
    assert not report.problems, "\n".join(report.problems)
    return report


async def test_workers_killed_at_random_and_restarted(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str, size: Size
) -> None:
    rng = random.Random(7)
    items = work_items(size.tasks, seed=1, **LEASE)
    names = [f"w{i}" for i in range(3)]
    for name in names:
        cluster.spawn(name, "--concurrency", "8", "--sweep-interval", "2")
    client.publish_many(items)
    for generation in range(size.kill_rounds):
        await asyncio.sleep(rng.uniform(0.3, 1.2))
        victim = rng.choice(names)
        cluster.signal(victim, signal.SIGKILL)
        names.remove(victim)
        names.append(f"w{generation + 3}")
        cluster.spawn(names[-1], "--concurrency", "8", "--sweep-interval", "2")
    await until_finished(
        client, len(items), timeout=60 + size.tasks / 5, explain=cluster.explainer(client)
    )
    report = assert_invariants(mongo, db_name, {i["key"] for i in items})
    assert cluster.kills == size.kill_rounds
    assert report.by_status["succeeded"] == len(items)  # the retry budget covers every kill
    print(
        f"kills={cluster.kills} tasks={report.tasks} runs={report.runs} "
        f"timeouts={report.timeouts} unrecorded={report.unrecorded_ends}"
    )


async def test_frozen_worker_is_preempted_and_writes_nothing(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    """SIGSTOP past the lease, a second worker takes over and finishes, SIGCONT: the zombie
    stops its runs at once (by its own clock) and records nothing."""
    keys = [f"z{i}" for i in range(4)]
    options = {"worker_timeout_ms": 1000, "ping_interval_ms": 200, "max_retries": 3}
    zombie = cluster.spawn("zombie", "--concurrency", "4")
    client.publish_many(
        # the zombie's runs would sleep far past the freeze, so that only its lease deadline
        # can end them (a handler waking in the same loop turn as the deadline would race it)
        [
            {
                "name": "work",
                "key": k,
                "params": {"ms": 300, "ms_by_worker": {"zombie": 600_000}},
                "options": options,
            }
            for k in keys
        ]
    )
    log = mongo[db_name]["execlog"]
    await wait_for(lambda: log.count_documents({"worker_id": "zombie", "event": "start"}) == 4)
    zombie.send_signal(signal.SIGSTOP)
    try:
        cluster.spawn("rescuer", "--concurrency", "4")
        await until_finished(client, len(keys), timeout=60, explain=cluster.explainer(client))
    finally:
        zombie.send_signal(signal.SIGCONT)
    try:
        await wait_for(
            lambda: log.count_documents({"worker_id": "zombie", "event": "cancelled"}) == 4
        )
    except TimeoutError:
        entries = list(log.find({"worker_id": "zombie"}, {"_id": 0, "key": 1, "event": 1}))
        raise AssertionError(
            f"the zombie logged {entries}; its log:\n{cluster.log_of('zombie')}"
        ) from None
    report = assert_invariants(mongo, db_name, set(keys))
    assert report.by_status["succeeded"] == 4
    for task in client.list():
        states = [(r.worker_id, r.state) for r in task.runs]
        assert states == [("zombie", "TIMEOUT"), ("rescuer", "SUCCESS")], states
    assert log.count_documents({"worker_id": "zombie", "event": {"$in": ["finish", "fail"]}}) == 0
    cluster.signal("zombie", signal.SIGTERM)
    assert await asyncio.to_thread(zombie.wait, 30) == 0
    assert "lease of" in cluster.log_of("zombie")  # it said why it stopped the runs
