"""Waiting for outcomes and following task events: races, a worker killed mid-run,
a killed change-stream cursor, resume tokens; trace context that follows the task."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness import kill_change_streams, running_worker, wait_for
from workerapp import registry

from mtask import AsyncTaskClient, TaskClient
from mtask.clock import FixedClock
from mtask.connection.clients import async_client
from mtask.errors import TaskNotFound, WaitTimeout
from mtask.follow import waiters
from mtask.follow.events import TaskEvent, events
from mtask.store import claim


def change_stream_getmores(client: TaskClient, db_name: str) -> list[dict[str, Any]]:
    """The getMore commands in flight on the test database's change streams."""
    return list(
        client.mongo.admin.aggregate(
            [
                {"$currentOp": {"allUsers": True}},
                {
                    "$match": {
                        "ns": {"$regex": f"^{db_name}\\."},
                        "command.getMore": {"$exists": True},
                        "cursor.originatingCommand.pipeline.0.$changeStream": {"$exists": True},
                    }
                },
            ]
        )
    )


def kill_getmores(client: TaskClient, db_name: str, how: str) -> int:
    """Kill the change streams' getMores in flight, by ``killCursors`` (the getMore fails with
    ``CursorKilled``) or ``killOp`` (``Interrupted``): neither is resumable for the driver."""
    killed = 0
    for op in change_stream_getmores(client, db_name):
        if how == "killOp":
            client.mongo.admin.command("killOp", op=op["opid"])
            killed += 1
        else:
            collection = op["ns"].split(".", 1)[1]
            reply = client.mongo[db_name].command(
                "killCursors", collection, cursors=[op["cursor"]["cursorId"]]
            )
            killed += len(reply["cursorsKilled"])
    return killed


@contextlib.asynccontextmanager
async def following(aclient: AsyncTaskClient, **kwargs: Any) -> AsyncIterator[list[TaskEvent]]:
    """Collect ``aclient.events(**kwargs)`` into a list while the block runs."""
    seen: list[TaskEvent] = []
    opened = asyncio.Event()

    async def consume() -> None:
        async for event in events(aclient.collection, **kwargs, opened=opened):
            seen.append(event)

    task = asyncio.create_task(consume())
    await opened.wait()
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await task


async def test_wait_returns_each_outcome_over_one_stream(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    await aclient.publish("add", "ok", {"a": 2, "b": 3})
    await aclient.publish("give_up", "no")
    both = asyncio.gather(aclient.wait("ok", timeout=30), aclient.wait("no", timeout=30))
    await wait_for(lambda: aclient._waiter is not None and len(aclient._waiter.waiting) == 2)
    async with running_worker(registry, mongo_uri, db_name, concurrency=4):
        done, failed = await both
    assert done.status == "succeeded" and done.result == 5
    assert failed.status == "failed" and failed.runs[-1].state == "FAIL"
    waiter = aclient._waiter
    assert waiter is not None and waiter.opened == 1  # two waits, one change stream
    assert not waiter.waiting and waiter._task is None  # closed when no wait remained
    again = await aclient.wait("ok", timeout=5)  # an already finished task returns at once
    assert again.status == "succeeded"


async def test_clients_on_one_mongoclient_share_one_wait_stream(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """One change stream per MongoClient, database and collection, whichever client waits: two
    ``AsyncTaskClient``s on one AsyncMongoClient share a waiter; another MongoClient (and the
    other side, sync or async) has its own."""
    mongo = async_client(mongo_uri)
    try:
        one = AsyncTaskClient(database=db_name, mongo_client=mongo)
        two = AsyncTaskClient(database=db_name, mongo_client=mongo)
        for key in ("x1", "x2"):
            client.publish("add", key, {"a": 1, "b": 1})
        both = asyncio.gather(one.wait("x1", timeout=30), two.wait("x2", timeout=30))
        await wait_for(lambda: one._waiter is not None and len(one._waiter.waiting) == 2)
        async with running_worker(registry, mongo_uri, db_name):
            done = await both
        assert [t.status for t in done] == ["succeeded", "succeeded"]
        assert one._waiter is two._waiter and one._waiter.opened == 1
        assert waiters.async_waiter_for(mongo[db_name]["other"]) is not one._waiter
        async with AsyncTaskClient(mongo_uri, database=db_name) as own:
            await own.wait("x1", timeout=5)  # finished: no waiter needed
            assert waiters.async_waiter_for(own.collection) is not one._waiter
        client.wait("x2", timeout=5)
        assert client._waiter is None  # (finished: the sync side never opened one)
    finally:
        await mongo.close()


async def test_wait_unknown_key_timeout_and_invalid(aclient: AsyncTaskClient) -> None:
    with pytest.raises(TaskNotFound, match="nope"):
        await aclient.wait("nope", timeout=10)
    await aclient.publish("add", "idle", {"a": 1, "b": 1})
    with pytest.raises(WaitTimeout, match="idle"):
        await aclient.wait("idle", timeout=0.5)  # no worker runs it
    waiting = asyncio.create_task(aclient.wait("idle", timeout=30))
    await wait_for(lambda: aclient._waiter is not None and aclient._waiter.ready.is_set())
    await wait_for(lambda: "idle" in aclient._waiter.waiting)  # type: ignore[union-attr]
    await aclient.collection.update_one(
        {"_id": "idle"}, {"$set": {"status": "invalid", "invalid_reason": "test"}}
    )
    assert (await waiting).status == "invalid"  # invalid is final: it ends a wait


async def test_sync_wait_from_threads(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    with pytest.raises(TaskNotFound):
        client.wait("nope", timeout=10)
    async with running_worker(registry, mongo_uri, db_name, concurrency=4):
        for i in range(3):
            client.publish("add", f"s{i}", {"a": i, "b": 1})
        results = await asyncio.gather(
            *(asyncio.to_thread(client.wait, f"s{i}", 30) for i in range(3))
        )
    assert [t.result for t in results] == [1, 2, 3]
    with pytest.raises(WaitTimeout):
        client.publish("add", "later", {"a": 1, "b": 1})
        client.wait("later", timeout=0.3)


async def test_wait_outlives_a_worker_killed_mid_run(
    mongo_uri: str, db_name: str, aclient: AsyncTaskClient
) -> None:
    # a worker claimed the task long ago on the server's timeline and died: its lease expired
    clock = FixedClock(dt_past())
    with TaskClient(mongo_uri, database=db_name, clock=clock) as old:
        old.publish("add", "orphan", {"a": 20, "b": 22}, options={"worker_timeout_ms": 1000})
        [_claimed] = old._run(claim(["orphan"], ["add"], "dead-worker", clock.now()))
    async with following(aclient, names=["add"]) as seen:
        waiting = asyncio.create_task(aclient.wait("orphan", timeout=60))
        await wait_for(lambda: aclient._waiter is not None and "orphan" in aclient._waiter.waiting)
        async with running_worker(registry, mongo_uri, db_name):
            task = await waiting
            await wait_for(lambda: any(e.status == "succeeded" for e in seen))
    assert task.status == "succeeded" and task.result == 42
    assert [e.status for e in seen].count("succeeded") == 1  # the events saw the outcome once
    assert {e.key for e in seen} == {"orphan"}
    assert [r.state for r in task.runs] == ["TIMEOUT", "SUCCESS"]
    assert task.runs[0].worker_id == "dead-worker"


def dt_past() -> Any:
    import datetime as dt

    return dt.datetime(2020, 1, 1, tzinfo=dt.UTC)


async def test_wait_and_events_survive_a_killed_cursor(
    mongo_uri: str, db_name: str, client: TaskClient, aclient: AsyncTaskClient
) -> None:
    keys = [f"k{i}" for i in range(6)]
    async with following(aclient, names=["add"], statuses=["succeeded"]) as seen:
        for key in keys[:3]:
            client.publish("add", key, {"a": 1, "b": 1})
        waits = [asyncio.create_task(aclient.wait(k, timeout=60)) for k in keys[:3]]
        await wait_for(lambda: aclient._waiter is not None and aclient._waiter.ready.is_set())
        # the waiter's and the events'
        assert kill_change_streams(client.mongo, db_name, in_flight=False) >= 2
        for key in keys[3:]:
            client.publish("add", key, {"a": 1, "b": 1})
            waits.append(asyncio.create_task(aclient.wait(key, timeout=60)))
        async with running_worker(registry, mongo_uri, db_name, concurrency=4):
            finished = await asyncio.gather(*waits)
            await wait_for(lambda: {e.key for e in seen} == set(keys))
    assert all(t.status == "succeeded" for t in finished)
    assert len(seen) == len(keys)  # nothing twice
    assert len({e.token for e in seen}) == len(keys)
    assert all(e.name == "add" and e.status == "succeeded" for e in seen)


@pytest.mark.parametrize("how", ["killCursors", "killOp"])
async def test_events_reopen_where_the_killed_stream_stood(
    how: str, db_name: str, client: TaskClient, aclient: AsyncTaskClient
) -> None:
    """A stream killed before it handed out anything reopens where it opened, not at "now": the
    outcomes written while it is down arrive, once. (The event loop is blocked from the kill to
    the last write, so the consumer cannot reopen in between.)"""
    keys = ["g1", "g2"]
    for key in keys:
        client.publish("add", key, {"a": 1, "b": 1})
    async with following(aclient, names=["add"], statuses=["succeeded"]) as seen:
        await wait_for(lambda: change_stream_getmores(client, db_name))
        assert kill_getmores(client, db_name, how) == 1
        for key in keys:
            client.collection.update_one({"_id": key}, {"$set": {"status": "succeeded"}})
        await wait_for(lambda: {e.key for e in seen} == set(keys))
        client.publish("add", "g3", {"a": 1, "b": 1})  # one more after the reopen
        client.collection.update_one({"_id": "g3"}, {"$set": {"status": "succeeded"}})
        await wait_for(lambda: any(e.key == "g3" for e in seen))
    assert [e.key for e in seen] == [*keys, "g3"]  # each once, in order
    assert len({e.token for e in seen}) == 3


async def test_sync_events_ride_out_a_killed_getmore(db_name: str, client: TaskClient) -> None:
    """``TaskClient.events`` reopens at its position too (it used to raise ``StorageError``)."""
    keys = ["s1", "s2"]
    for key in keys:
        client.publish("add", key, {"a": 1, "b": 1})
    stream = client.events(names=["add"], statuses=["succeeded"])
    try:
        first = asyncio.ensure_future(asyncio.to_thread(next, stream))
        await wait_for(lambda: change_stream_getmores(client, db_name))
        assert kill_getmores(client, db_name, "killCursors") == 1
        for key in keys:
            client.collection.update_one({"_id": key}, {"$set": {"status": "succeeded"}})
        got = [(await first).key, (await asyncio.to_thread(next, stream)).key]
    finally:
        stream.close()  # type: ignore[attr-defined]
    assert got == keys


async def test_events_resume_after_the_last_token(
    mongo_uri: str, db_name: str, client: TaskClient, aclient: AsyncTaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=4):
        async with following(aclient, names=["add"]) as first:
            client.publish("add", "a1", {"a": 1, "b": 1})
            client.publish("echo", "other", {})  # another name: filtered on the server
            await aclient.wait("a1", timeout=30)
            await wait_for(lambda: any(e.status == "succeeded" for e in first))
        last = first[-1].token
        # while nobody listens
        client.publish("add", "a2", {"a": 1, "b": 1})
        await aclient.wait("a2", timeout=30)
        async with following(aclient, names=["add"], resume_after=last) as second:
            await wait_for(lambda: any(e.key == "a2" and e.status == "succeeded" for e in second))
    assert {e.key for e in first} == {"a1"}
    assert [e.status for e in first] == ["pending", "running", "succeeded"]
    assert {e.key for e in second} == {"a2"}  # nothing from before the token again
    assert [e.status for e in second][-1] == "succeeded"
    assert all(e.cluster_time is not None for e in first + second)
    # the sync iterator resumes the same way
    stream = client.events(names=["add"], resume_after=last)
    assert next(stream).key == "a2"
    stream.close()  # type: ignore[attr-defined]


async def test_trace_context_follows_the_task(
    mongo_uri: str, db_name: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from mtask import tracing

    # without a tracer provider nothing is stored (the global one can be set once per
    # process, and tests/test_metrics.py does: this test uses its own provider's tracer)
    monkeypatch.setattr(tracing, "_configured", lambda: False)
    client.publish("add", "untraced", {"a": 1, "b": 1})
    assert "trace" not in client.collection.find_one({"_id": "untraced"}, {"trace": 1})

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("mtask"))
    monkeypatch.setattr(tracing, "_configured", lambda: True)
    outer = provider.get_tracer("app")
    with outer.start_as_current_span("request"):
        client.publish("add", "traced", {"a": 1, "b": 1})
    stored = client.collection.find_one({"_id": "traced"})
    assert stored is not None and stored["trace"]["traceparent"].startswith("00-")
    async with running_worker(registry, mongo_uri, db_name):
        await asyncio.to_thread(client.wait, "traced", 30)
    provider.shutdown()
    spans = {
        (s.name, (s.attributes or {}).get("messaging.message.id")): s
        for s in exporter.get_finished_spans()
    }
    publish, run = spans["mtask.publish", "traced"], spans["mtask.run", "traced"]
    # no context stored: its first run began the task's trace (a root ``mtask.task`` span),
    # and stored it, fenced by the run, for every later run to join
    begun, untraced = spans["mtask.task", None], spans["mtask.run", "untraced"]
    assert begun.parent is None and begun.attributes["mtask.key"] == "untraced"
    assert untraced.parent is not None and untraced.parent.span_id == begun.context.span_id
    kept = client.collection.find_one({"_id": "untraced"}, {"trace": 1})
    assert kept["trace"]["traceparent"].split("-")[2] == f"{begun.context.span_id:016x}"
    assert publish.kind == trace.SpanKind.PRODUCER and run.kind == trace.SpanKind.CONSUMER
    assert run.parent is not None and run.parent.span_id == publish.context.span_id
    assert run.context.trace_id == spans["request", None].context.trace_id
    assert stored["trace"]["traceparent"].split("-")[2] == f"{publish.context.span_id:016x}"
    for span, operation in ((publish, "send"), (run, "process")):
        assert span.attributes is not None
        assert span.attributes["messaging.system"] == "mtask"
        assert span.attributes["messaging.operation.type"] == operation
        assert span.attributes["messaging.destination.name"] == "add"
        assert span.attributes["messaging.message.id"] == "traced"


async def test_mtask_wait_exit_codes(
    capsys: pytest.CaptureFixture[str], mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    from mtask.cli import main

    def cli(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--uri", mongo_uri, "--database", db_name])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, _, err = cli("wait", "missing", "--timeout", "5")
    assert code == 1 and "missing" in err  # not found: 1, as every command (was 2)
    client.publish("add", "w1", {"a": 1, "b": 2})
    code, _, err = cli("wait", "w1", "--timeout", "0.3")
    assert code == 124 and "did not finish" in err
    async with running_worker(registry, mongo_uri, db_name):
        code, out, _ = await asyncio.to_thread(cli, "wait", "w1", "--json", "--timeout", "30")
        assert code == 0 and json.loads(out)["result"] == 3
        client.publish("give_up", "w2")
        code, out, _ = await asyncio.to_thread(cli, "wait", "w2", "--timeout", "30")
        assert code == 1 and "failed" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["wait", "w1", "--timeout", "soon"])
    assert exit_info.value.code == 2


async def test_follow_says_whether_the_stream_holds_more_changes_read(
    mongo_uri: str, db_name: str
) -> None:
    """``Position.buffered`` reads PyMongo's cursor (nothing public says it): of three changes
    read in one ``getMore`` the first two are ``buffered``, the last not. A PyMongo whose cursor
    cannot be read fails here (its relay would never wait for its own worker's claim: W2,
    docs/performance.md, Latency)."""
    from mtask.follow import events as events_module

    mongo = async_client(mongo_uri)
    collection = mongo[db_name]["buffered"]
    at = events_module.Position()

    async def on_open() -> None:  # after the stream opened, before its first getMore
        await collection.insert_many([{"_id": n} for n in range(3)])

    follow = events_module.follow_waits(
        collection, lambda: [{"$match": {"operationType": "insert"}}], at, on_open=on_open
    )
    seen: list[tuple[Any, bool]] = []
    try:
        while len(seen) < 3:
            change = await anext(follow)
            if change is not None:
                seen.append((change["documentKey"]["_id"], at.buffered))
    finally:
        await follow.aclose()
        await mongo.close()
    assert seen == [(0, True), (1, True), (2, False)]


async def test_a_task_finished_with_a_document_as_key_does_not_stop_the_waits(
    aclient: AsyncTaskClient, client: TaskClient
) -> None:
    """A document's ``_id`` may be a document (one written by hand); its finish arrives on
    the waiters' streams like any other and must not end them (an unhashable key)."""
    await aclient.publish("add", "idle", {"a": 1, "b": 1})
    client.publish("add", "sidle", {"a": 1, "b": 1})
    waiting = asyncio.create_task(aclient.wait("idle", timeout=30))
    sync_waiting = asyncio.create_task(asyncio.to_thread(client.wait, "sidle", 30))
    await wait_for(lambda: aclient._waiter is not None and aclient._waiter.ready.is_set())
    await wait_for(lambda: "idle" in aclient._waiter.waiting)  # type: ignore[union-attr]
    await wait_for(lambda: client._waiter is not None and client._waiter.ready.is_set())
    await wait_for(lambda: "sidle" in client._waiter.waiting)  # type: ignore[union-attr]
    await aclient.collection.insert_one({"_id": {"by": "hand"}, "name": "add", "status": "failed"})
    # each stream has read past the odd key: a change after it is written
    await aclient.collection.insert_one({"_id": "after", "name": "add", "status": "failed"})
    for key in ("idle", "sidle"):
        await aclient.collection.update_one(
            {"_id": key}, {"$set": {"status": "invalid", "invalid_reason": "test"}}
        )
    assert (await waiting).status == "invalid"
    assert (await sync_waiting).status == "invalid"
