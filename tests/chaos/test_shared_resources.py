"""A shared resource: one limit of runs at once taken by the runs of three task
names, held by three real worker processes through a SIGKILL and a SIGSTOP past the leases,
from the handlers' own start and end times (the execution log, the server's clock)."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Cluster, until_finished, wait_for
from test_cluster_limits import crowd, peak
from test_group_faults import FAST, effective_spans, ends_of_frozen, kill_a_and_freeze_b

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

NAMES = ("api_a", "api_b", "api_c")


async def test_a_concurrency_shared_by_three_names_holds_through_a_kill_and_a_freeze(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    """``set_limit(resource="api", concurrency=3)``, used by three names (one of them also
    uses a resource with no limit): 3 x 30 tasks on three workers of concurrency 8; one worker
    is killed with SIGKILL, one frozen past its leases. Never more than three runs of the three
    names at once (three reached), every task done once, and no slot left held."""
    client.set_limit(resource="api", concurrency=3)
    for worker in ("a", "b", "c"):
        cluster.spawn(worker, "--concurrency", "8")
    client.publish_many(
        [
            {
                "name": name,
                "key": f"{name}/{i:02d}",
                "params": {"ms": 120, "ms_by_worker": {"b": 20_000}},
                "options": FAST,
            }
            for i in range(30)
            for name in NAMES
        ]
    )
    tasks, log = mongo[db_name]["tasks"], mongo[db_name]["execlog"]
    await wait_for(lambda: tasks.count_documents({"status": "succeeded"}) >= 10, timeout=120)
    cuts, stopped, resumed = await kill_a_and_freeze_b(cluster, client, log)
    await until_finished(client, 90, timeout=300, explain=cluster.explainer(client))
    assert client.stats() == {name: {"succeeded": 30} for name in NAMES}
    frozen = ends_of_frozen(log, stopped)
    assert frozen and set(frozen.values()) == {"cancelled"}, frozen  # none went on working
    # a run frozen mid-run ran nothing from the freeze on: its handler's first step after it was
    # its cancellation (its log entry is written a moment later, while the runs that took its
    # place run); the other runs from their start to their end, or to their worker's kill
    spans = effective_spans(mongo, db_name, cuts, ("b", stopped, resumed))
    every = [
        (start, end)
        for name in NAMES
        for start, end in spans[name]
        if not (start == resumed and end > resumed)  # the frozen runs' stretch after it
    ]
    assert peak(every) == 3, ("three at once at most, and three reached", crowd(mongo, db_name))

    # none held: a worker gives a run's slot back once its outcome is written, a moment after
    # the last success shows (a rehearsal read one still held), well within its lease (30 s)
    def given_back() -> bool:
        now = client.now()
        (resource,) = list(mongo[db_name]["limits"].find({"resource": "api"}))
        return all(h["expires"] <= now for h in resource["holders"])

    await wait_for(given_back, timeout=10)
