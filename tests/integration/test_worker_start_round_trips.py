"""What a worker asks MongoDB before its first claim, command by command (its start-up: bench
WST measures its time, this what it waits for): one calibration of the clock, the user's
privileges read beside the rest and not after it, no index asked for where they are there."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from harness import Commands, running_worker
from pymongo import monitoring

from mtask import Registry, TaskClient
from mtask.connection.clients import async_client
from mtask.worker import Worker, assembly


class Privileges(Commands):
    """``Commands``, with an event set once the user's privileges are asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = asyncio.Event()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        super().started(event)
        if event.command_name == "connectionStatus":
            self.asked.set()


async def test_a_workers_start_before_its_first_claim(
    mongo_uri: str, db_name: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.publish("stamp", "due")  # due before the worker starts; the indexes made
    listener = Privileges()

    def listened(uri: str | None = None, **options: Any) -> Any:
        return async_client(uri, event_listeners=[listener], **options)

    monkeypatch.setattr(assembly, "async_client", listened)
    beat = Worker._calibrated_beat

    async def after_the_privileges_asked(worker: Worker) -> None:
        # the clock and the heartbeat held until the privileges are asked for: a start that
        # asked for them only after the heartbeat would never get there (a hang guard, not a
        # measure); concurrent tasks' commands come in any order, this one now in one
        await asyncio.wait_for(listener.asked.wait(), 60)
        await beat(worker)

    monkeypatch.setattr(Worker, "_calibrated_beat", after_the_privileges_asked)
    registry = Registry()

    @registry.task("stamp")
    async def stamp(params: dict[str, Any]) -> int:
        return 1

    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("recorded", key="due")
    sent = listener.sent
    claim = sent.index("findAndModify tasks")  # one key: one findAndModify
    before = sent[:claim]
    heartbeat = before.index("findAndModify workers")
    # one calibration of three round trips before the heartbeat takes the clock's time (the
    # claim decides by it too; a quicker heartbeat may calibrate again after it)
    assert before[:heartbeat].count("hello") == 3, before
    # the privileges read beside the clock and the heartbeat, not after them (held above)
    assert before.index("connectionStatus") < heartbeat, before
    assert not [c for c in before if c.startswith("createIndexes tasks")], before
    assert "find tasks" in before and "aggregate" in before, before  # the stream, the scan
