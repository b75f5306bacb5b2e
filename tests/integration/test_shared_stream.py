"""The host's shared change stream with several workers in one process (the relay works the
same whether its subscribers are processes or ``Worker`` objects): a slow subscriber is
dropped, reconnects and rescans; a stopped relay is taken over."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from harness import running_worker, wait_for
from workerapp import registry

from mtask import TaskClient
from mtask.worker import stream_relay
from mtask.worker.stream_relay import SharedStream


def shared(worker: Any) -> SharedStream:
    assert isinstance(worker.stream, SharedStream)
    return worker.stream


def done(client: TaskClient, count: int) -> bool:
    return client.collection.count_documents({"status": "succeeded"}) == count


async def test_a_slow_subscriber_is_dropped_then_reconnects_and_rescans(
    mongo_uri: str, db_name: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_relay, "SUBSCRIBER_BUFFER", 65536)
    async with running_worker(
        registry, mongo_uri, db_name, worker_id="a", stream="shared", concurrency=20
    ) as (
        a,
        _,
    ):
        relay = shared(a).relay
        assert relay is not None and relay.solo  # alone: the server leaves out its own writes
        a_rescans = a.watcher.rescans
        async with running_worker(
            registry, mongo_uri, db_name, worker_id="b", stream="shared", concurrency=20
        ) as (
            b,
            b_events,
        ):
            assert shared(b).relay is None  # the endpoint was taken: b subscribes
            await wait_for(lambda: len(relay.subscribers) == 2 and not relay.solo, timeout=60)
            await wait_for(lambda: relay.switches == 1)  # resumed with the shared pipeline
            assert a.watcher.rescans == a_rescans  # no gap: a had nothing to rescan

            unblocked = asyncio.Event()
            settle = b.watcher.settle

            async def slow_settle() -> None:
                await unblocked.wait()  # b reads no more frames: its buffer at the relay fills
                await settle()

            b.watcher.settle = slow_settle  # type: ignore[method-assign]
            connections, rescans = shared(b).connections, b.watcher.rescans
            client.publish_many(
                [
                    {"name": "add", "key": f"t{i:04}", "params": {"a": i, "b": 1}}
                    for i in range(3000)
                ]
            )
            await wait_for(lambda: relay.dropped >= 1, timeout=60)
            assert list(relay.subscribers.values()) == ["a"]  # a's own subscription goes on
            unblocked.set()
            await wait_for(lambda: shared(b).connections > connections, timeout=30)
            await wait_for(lambda: b.watcher.rescans > rescans, timeout=60)  # after it reconnected
            # b hears events again: a task only b may run
            client.publish("add", "for-b", {"a": 1, "b": 2}, options={"specific_worker_ids": ["b"]})
            await b_events.wait("recorded", key="for-b")
            await wait_for(lambda: done(client, 3001), timeout=300)
            assert a.state == b.state == "running"


async def test_a_stopped_relay_is_taken_over(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, worker_id="b", stream="shared") as (
        b,
        b_events,
    ):
        async with running_worker(registry, mongo_uri, db_name, worker_id="a", stream="shared") as (
            a,
            _,
        ):
            assert shared(b).relay is not None and shared(a).relay is None
            client.publish("add", "one", {"a": 1, "b": 1})
            await wait_for(lambda: done(client, 1))
        # a was the subscriber; now stop b's relay by hand and see a newcomer take it over
        async with running_worker(registry, mongo_uri, db_name, worker_id="c", stream="shared") as (
            c,
            c_events,
        ):
            await wait_for(lambda: len(shared(b).relay.subscribers) == 2)  # type: ignore[union-attr]
            task = shared(b)._relay_task
            assert task is not None
            rescans = c.watcher.rescans
            task.cancel()  # the relay goes (as in a crash of its process, its sockets close)

            def live_relays() -> list[SharedStream]:
                streams = (shared(b), shared(c))
                return [s for s in streams if s._relay_task and not s._relay_task.done()]

            await wait_for(lambda: len(live_relays()) == 1)  # the bind race: one winner
            await wait_for(lambda: c.watcher.rescans > rescans)  # reconnected and rescanned
            client.publish("add", "for-c", {"a": 2, "b": 2}, options={"specific_worker_ids": ["c"]})
            await c_events.wait("recorded", key="for-c")
            client.publish("add", "for-b", {"a": 3, "b": 3}, options={"specific_worker_ids": ["b"]})
            await b_events.wait("recorded", key="for-b")
            assert b.state == c.state == "running"
