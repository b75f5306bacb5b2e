"""A Node.js publisher sets a group with the plain ``mongodb`` driver, and the group is
honoured: under ``group_concurrency=1`` a real worker process runs each group's tasks one at a
time, in publish order (docs/publishing.md, "Groups")."""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any

import pytest
from interop.test_node import HERE, node_or_skip, run_node, spawn, wait_for_worker

from mtask import TaskClient


@pytest.mark.timeout(300)
def test_a_node_publishers_groups_are_honoured(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    node = node_or_skip()
    client.set_limit("timed_sleep", group_concurrency=1)
    worker = spawn(mongo_uri, db_name)
    try:
        wait_for_worker(client, worker)
        run_node(node, HERE / "groups.mjs", mongo_uri, db_name)
        deadline = time.monotonic() + 120
        while client.collection.count_documents({"status": "succeeded"}) < 12:
            assert time.monotonic() < deadline, "the groups did not finish"
            time.sleep(0.1)
    finally:
        worker.terminate()
        worker.communicate(timeout=30)
    docs: dict[str, dict[str, Any]] = {d["_id"]: d for d in client.collection.find()}
    for group in ("tenant-a", "tenant-b", "tenant-c"):
        mine = [docs[f"{group}/{i}"] for i in range(4)]  # in publish order
        assert all(d["options"]["group"] == group for d in mine)
        assert all(isinstance(d["publish_seq"], int) for d in mine)  # given by the completion
        assert all(len(d["runs"]) == 1 for d in mine)
        # each handler's (start, end) on the worker process's monotonic clock: one clock (the
        # documents' claimed_at and finished_at come from two writes' own clock readings)
        spans = [d["result"] for d in mine]
        for before, after in pairwise(spans):
            assert before[1] <= after[0], f"{group}: not one at a time, in order: {spans}"
