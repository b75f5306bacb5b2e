"""Live output from a process-isolated handler: its child sends what the handler says to the
worker, which writes it under the run's fence like any run's (docs/output.md)."""

from __future__ import annotations

import os
from typing import Any

import poolhandlers
from harness import running_worker

from mtask import TaskClient


async def test_a_childs_progress_lines_and_chunks_are_written_in_order(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name) as (_, events):
        client.publish("narrate_in_child", "c", {"chunks": 50})
        await events.wait("recorded", key="c")
    task = client.get("c")
    assert task is not None and task.status == "succeeded"
    child = task.result
    assert child != os.getpid()  # it ran in a child
    assert task.progress is not None and task.progress.label == "all sent"  # the last lands
    assert task.output_seq == 55
    counts = task.runs[-1].output
    assert counts is not None and (counts.logs, counts.chunks) == (5, 50)
    stored: list[dict[str, Any]] = list(client.db["tasks.output"].find({"task": "c"}).sort("seq"))
    assert [d["seq"] for d in stored] == list(range(1, 56))
    chunks = [d["data"] for d in stored if d["kind"] == "chunk"]
    assert chunks == [{"i": i, "pid": child} for i in range(1, 51)]
    lines = [d["fields"]["i"] for d in stored if d["kind"] == "log"]
    assert lines == [10, 20, 30, 40, 50]
    assert all(d.get("at") is not None for d in stored)  # stamped by the worker
