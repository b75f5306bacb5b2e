"""A lossy limit held by three real worker processes: ``overflow="drop"`` runs at
most its limit at once (the handlers' own start and end times) and cancels the rest at once,
every task ending once: run, or dropped without a run."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Cluster, until_finished
from test_cluster_limits import crowd, peak, spans

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


async def test_a_lossy_limit_runs_its_limit_and_drops_the_rest(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    client.set_limit("work", concurrency=2, overflow="drop")
    for worker in ("a", "b", "c"):
        cluster.spawn(worker, "--concurrency", "8")
    keys = {f"l{i:02d}" for i in range(60)}
    client.publish_many([{"name": "work", "key": k, "params": {"ms": 150}} for k in keys])
    await until_finished(client, 60, timeout=240, explain=cluster.explainer(client))
    counts = client.stats(exact=True)["work"]
    assert set(counts) <= {"succeeded", "cancelled"} and sum(counts.values()) == 60, counts
    assert counts.get("cancelled", 0) > 0, "the excess was dropped"
    ran = {d["_id"] for d in client.collection.find({"status": "succeeded"}, {"_id": 1})}
    assert peak(spans(mongo, db_name, ran)) <= 2, crowd(mongo, db_name)
    dropped = list(client.collection.find({"status": "cancelled"}))
    assert all(d["runs"] == [] and "overflow=drop" in d["error"] for d in dropped)
    assert client.limits()[0]["holders"] == []
