"""A handler's back-off, with three real worker processes: after a 429-style
``BackOff(group=True, seconds=…)`` no task of that group is claimed until the hold ends (the
claims' times and the hold's own dates: the server's clock as the workers read it), the other
group goes on, and the task that backed off spends no retry."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from harness import Cluster, until_finished

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


async def test_no_task_of_a_group_is_claimed_while_its_back_off_holds(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    client.set_limit("call_api", concurrency=100)  # a limited name: its claims take its slot
    for worker in ("a", "b", "c"):
        cluster.spawn(worker, "--concurrency", "4")
    client.publish("call_api", "acme/429", {"back_off": 2.0}, options={"group": "acme"})
    client.publish_many(
        [
            {
                "name": "call_api",
                "key": f"{g}/{i:02d}",
                "params": {"ms": 40},
                "options": {"group": g},
            }
            for i in range(40)
            for g in ("acme", "beta")
        ]
    )
    await until_finished(client, 81, timeout=240, explain=cluster.explainer(client))
    assert client.stats()["call_api"] == {"succeeded": 81}
    hold = mongo[db_name]["limits"].find_one({"_id": "call_api"})
    (until,) = [h["until"] for h in hold["group_holds"] if h["group"] == "acme"]
    # the hold's write, as its worker read the server's clock; a claim an instant before it, by
    # a worker whose reading is a few ms ahead, may say a later time (the take's own ``now`` is
    # what the hold is compared with: ``until`` needs no such slack)
    held_at = hold["updated_at"] + dt.timedelta(milliseconds=50)
    claims = [
        (doc["_id"], run["claimed_at"])
        for doc in client.collection.find({}, {"runs": 1})
        for run in doc["runs"]
    ]
    during = [k for k, at in claims if held_at < at < until]
    assert during, "the other group went on meanwhile"
    assert all(k.startswith("beta/") for k in during), (held_at, until, sorted(during))
    assert any(k.startswith("acme/") and at >= until for k, at in claims)
    task = client.get("acme/429")
    assert [r.state.value for r in task.runs] == ["RELEASED", "SUCCESS"]
    assert task.failures == 0  # no retry spent
