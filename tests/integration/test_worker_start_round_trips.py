"""What a worker asks MongoDB before its first claim, command by command (its start-up: bench
WST measures its time, this what it waits for): one calibration of the clock, the user's
privileges read beside the rest and not after it, no index asked for where they are there."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Commands, running_worker

from mtask import Registry, TaskClient
from mtask.connection.clients import async_client
from mtask.worker import assembly


async def test_a_workers_start_before_its_first_claim(
    mongo_uri: str, db_name: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.publish("stamp", "due")  # due before the worker starts; the indexes made
    listener = Commands()

    def listened(uri: str | None = None, **options: Any) -> Any:
        return async_client(uri, event_listeners=[listener], **options)

    monkeypatch.setattr(assembly, "async_client", listened)
    registry = Registry()

    @registry.task("stamp")
    async def stamp(params: dict[str, Any]) -> int:
        return 1

    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("recorded", key="due")
    sent = listener.sent
    claim = sent.index("findAndModify tasks")  # one key: one findAndModify
    before = sent[:claim]
    beat = before.index("findAndModify workers")
    # one calibration of three round trips before the heartbeat takes the clock's time (the
    # claim decides by it too; a quicker heartbeat may calibrate again after it)
    assert before[:beat].count("hello") == 3, before
    # the privileges read beside the clock and the heartbeat, not after them
    assert before.index("connectionStatus") < beat, before
    assert not [c for c in before if c.startswith("createIndexes tasks")], before
    assert "find tasks" in before and "aggregate" in before, before  # the stream, the scan
