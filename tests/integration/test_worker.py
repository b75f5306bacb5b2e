"""The worker on the real server: outcomes, retries, leases, cancel, stop, pause, sweeps."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time
from typing import Any

import pytest
from harness import (
    hand_written,
    kill_change_streams,
    pad_to_the_limit,
    running_worker,
    wait_for,
)
from workerapp import registry

from mtask import TaskClient, store
from mtask.clock import ServerClock
from mtask.errors import ConfigError, WorkerCrashed
from mtask.registry import Registry
from mtask.vocabulary import DEFAULT_KEEP_MS
from mtask.worker import Worker
from mtask.worker.running.executor import Executor
from mtask.worker.running.pinger import LeasePinger, LoopTicker
from mtask.worker.running.recorder import OutcomeRecorder


async def test_runs_tasks_and_stores_results(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, concurrency=4) as (worker, events):
        client.publish("add", "sum", {"a": 2, "b": 3})
        client.publish("echo", "e", {"x": 1})
        await events.wait("recorded", key="sum")
        await events.wait("recorded", key="e")
    task = client.get("sum")
    assert task is not None and task.status == "succeeded" and task.result == 5
    assert task.runs[0].state == "SUCCESS" and task.runs[0].worker_id == worker.worker_id
    echo = client.get("e")
    assert echo is not None and echo.result == {
        "params": {"x": 1},
        "worker": worker.worker_id,
        "attempt": 1,
    }


@pytest.mark.parametrize("keep", [1e15, float("inf"), float("nan")])
async def test_a_stored_retention_no_date_can_hold_is_kept_as_by_default(
    mongo_uri: str, db_name: str, client: TaskClient, keep: float
) -> None:
    """A document edited by hand with such a ``keep_*_ms`` stopped the worker that finished it
    (a date past year 9999: OverflowError), and then every worker that took the task over;
    on the server's side it wrote a date no driver can read. Both sides now read it as unset."""
    client.publish("add", "ok", {"a": 1, "b": 2})
    client.publish("add", "no", {"a": "one", "b": 2})  # invalid params: failed for good
    client.collection.update_many(
        {}, {"$set": {"options.keep_succeeded_ms": keep, "options.keep_failed_ms": keep}}
    )
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("recorded", key="ok")
        await events.wait("recorded", key="no")
    for key, status in (("ok", "succeeded"), ("no", "failed")):
        doc = client.collection.find_one({"_id": key})
        assert doc is not None and doc["status"] == status
        default = dt.timedelta(milliseconds=DEFAULT_KEEP_MS[status])
        assert doc["expire_at"] == doc["finished_at"] + default


async def test_an_outcome_whose_update_cannot_be_built_stops_nothing_else(
    mongo_uri: str, db_name: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any error building an outcome's update (here injected, for the first run's outcome:
    in its batch and alone) drops that outcome alone: the others of its batch are recorded,
    the writer goes on, and the task is run again once its lease ends. Such an error stopped
    the writer, and so the worker."""
    original = store.finish_many
    poisoned: list[int] = []

    def finish_many(batch: list[store.Outcome], now: dt.datetime) -> Any:
        if len(poisoned) < 2 and any(o.key == "poison" for o in batch):
            poisoned.append(len(batch))
            raise OverflowError("date value out of range")
        return original(batch, now)

    monkeypatch.setattr(store, "finish_many", finish_many)
    client.publish("add", "poison", {"a": 1, "b": 1}, options={"worker_timeout_ms": 500})
    client.publish("add", "plain", {"a": 2, "b": 2})
    async with running_worker(registry, mongo_uri, db_name, concurrency=2) as (_, events):
        await events.wait("recorded", key="plain")
        await events.wait("not_recorded", key="poison", state="SUCCESS")  # dropped
        await events.wait("recorded", key="poison")  # again, after the lease
    poison, plain = client.get("poison"), client.get("plain")
    assert plain is not None and plain.status == "succeeded" and plain.result == 4
    assert poison is not None and poison.status == "succeeded" and poison.result == 2
    assert [r.state for r in poison.runs] == ["TIMEOUT", "SUCCESS"]
    assert poisoned[-1] == 1  # tried alone before it was dropped
    # only what was written is reported recorded
    assert len(events.matching("recorded", key="poison")) == 1


async def test_invalid_params_fail_at_once(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        client.publish("add", "bad", {"a": "two", "b": 3}, options={"max_retries": 5})
        await events.wait("recorded", key="bad")
    task = client.get("bad")
    assert task is not None and task.status == "failed" and task.attempts == 1
    assert task.error is not None and "params.a" in task.error and "AddParams" in task.error


async def test_retries_backoff_and_final_failure(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    fast = {"retry_delay_ms": 20, "max_retries": 2}
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        client.publish("flaky", "f", {"fail_times": 2}, options=fast)
        client.publish("always_fails", "a", options=fast)
        client.publish("give_up", "g", options=fast)
        client.publish("retry_later", "r", options=fast)
        await events.wait("recorded", key="f", count=3)
        await events.wait("recorded", key="a", count=3)
        await events.wait("recorded", key="g")
        await events.wait("recorded", key="r", count=2)
    flaky = client.get("f")
    assert flaky is not None and flaky.status == "succeeded" and flaky.attempts == 3
    assert flaky.failures == 2 and "flaky failure on attempt 2" in (flaky.error or "")
    fails = client.get("a")
    assert fails is not None and fails.status == "failed" and fails.attempts == 3
    assert "Traceback" in (fails.error or "") and "ValueError" in (fails.error or "")
    gave_up = client.get("g")
    assert gave_up is not None and gave_up.status == "failed" and gave_up.attempts == 1
    assert gave_up.error == "failed: the input can never work"
    later = client.get("r")
    assert later is not None and later.status == "succeeded" and later.attempts == 2
    # each FAIL run keeps the importable class of what its handler raised
    assert [r.error_class for r in fails.runs] == ["builtins.ValueError"] * 3
    assert [r.error_class for r in gave_up.runs] == ["mtask.registry.Fail"]
    assert [r.error_class for r in later.runs] == ["mtask.registry.Retry", None]  # then SUCCESS


async def test_result_too_large(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        client.publish("huge_result", "h")
        await events.wait("recorded", key="h")
    task = client.get("h")
    assert task is not None and task.status == "failed" and "the limit is" in (task.error or "")


async def test_handler_publishes_follow_up(client: TaskClient, drain: Any) -> None:
    await drain(registry, lambda: client.publish("follow_up", "p"), "p/next")
    assert client.get("p/next").result == 3  # type: ignore[union-attr]


async def test_three_workers_run_each_task_once(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with (
        running_worker(registry, mongo_uri, db_name, concurrency=5) as (w1, _e1),
        running_worker(registry, mongo_uri, db_name, concurrency=5) as (w2, _e2),
        running_worker(registry, mongo_uri, db_name, concurrency=5) as (w3, _e3),
    ):
        client.publish_many(
            [{"name": "add", "key": f"k{i}", "params": {"a": i, "b": 0}} for i in range(300)]
        )
        await wait_for(lambda: client.stats().get("add", {}).get("succeeded") == 300)
        ran = [w.stats.succeeded for w in (w1, w2, w3)]
    assert sum(ran) == 300
    assert all(t.attempts == 1 for t in client.list(limit=300))


async def test_concurrency_runs_on_distinct_workers(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with (
        running_worker(registry, mongo_uri, db_name, worker_id="w1") as (_, e1),
        running_worker(registry, mongo_uri, db_name, worker_id="w2") as (_, e2),
        running_worker(registry, mongo_uri, db_name, worker_id="w3") as (_, e3),
    ):
        client.publish("echo", "multi", options={"concurrency": 3})
        for events in (e1, e2, e3):
            await events.wait("recorded", key="multi")
    task = client.get("multi")
    assert task is not None and task.status == "succeeded" and task.successes == 3
    assert sorted(r.worker_id for r in task.runs) == ["w1", "w2", "w3"]


async def test_specific_workers(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    async with (
        running_worker(registry, mongo_uri, db_name, worker_id="w1") as (_, _e1),
        running_worker(registry, mongo_uri, db_name, worker_id="w2") as (_, e2),
    ):
        for i in range(10):
            client.publish("echo", f"only-w2-{i}", options={"specific_worker_ids": ["w2"]})
        await e2.wait("recorded", count=10)
    assert {r.worker_id for t in client.list() for r in t.runs} == {"w2"}


async def test_unknown_names_are_left_alone(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, names=["add"]) as (_, events):
        client.publish("echo", "not-mine")
        client.publish("add", "mine", {"a": 1, "b": 1})
        await events.wait("recorded", key="mine")
    assert client.get("not-mine").status == "pending"  # type: ignore[union-attr]


async def test_cancel_running_task(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (worker, events):
        client.publish("wait_cancel", "c", options={"ping_interval_ms": 100})
        await events.wait("claimed", key="c")
        client.cancel("c")
        await events.wait("recorded", key="c", state="CANCELLED")
    task = client.get("c")
    assert task is not None and task.status == "cancelled" and task.runs[0].state == "CANCELLED"
    assert worker.stats.cancelled == 1 and task.result is None


async def test_lost_lease_stops_the_handler_and_fences_it(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (worker, events):
        client.publish("sleep", "z", {"seconds": 3600}, options={"ping_interval_ms": 100})
        claimed = await events.wait("claimed", key="z")
        # Another worker's claim after expiry would do exactly this: TIMEOUT the run.
        client.collection.update_one(
            {"_id": "z", "runs.run_id": claimed["run_id"]},
            {"$set": {"runs.$.state": "TIMEOUT"}},
        )
        await events.wait("stopping_run", key="z", reason="lost")
    assert worker.stats.lease_lost == 1
    task = client.get("z")
    assert task is not None and task.runs[0].state == "TIMEOUT" and task.successes == 0


async def test_specific_worker_change_stops_the_run(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, worker_id="w1") as (_, events):
        client.publish("sleep", "moved", options={"ping_interval_ms": 100})
        await events.wait("claimed", key="moved")
        client.collection.update_one(
            {"_id": "moved"}, {"$set": {"options.specific_worker_ids": ["w9"]}}
        )
        await events.wait("recorded", key="moved", state="RELEASED")
    task = client.get("moved")
    assert task is not None and task.status == "pending" and task.failures == 0


async def test_graceful_stop_finishes_within_grace(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    events_seen = []
    worker = Worker(
        registry,
        uri=mongo_uri,
        database=db_name,
        grace=30,
        on_event=lambda e, **d: events_seen.append((e, d)),
    )
    task = asyncio.create_task(worker.run())
    client.publish("sleep", "short", {"seconds": 0.3})
    await wait_for(lambda: any(e == "claimed" for e, _ in events_seen))
    worker.stop()
    assert worker.state == "stopping"
    await asyncio.wait_for(task, 30)
    assert worker.state == "stopped"
    assert client.get("short").status == "succeeded"  # type: ignore[union-attr]
    assert client.workers() == []  # deregistered


async def test_the_started_line_says_which_mongodb_and_database(
    mongo_uri: str, db_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's first INFO line names the servers it reached and its database, and no
    password: an operator sees at once which MongoDB it uses."""
    caplog.set_level(logging.INFO, logger="mtask.worker.events")
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("started")
    host = mongo_uri.split("//", 1)[1].split("/", 1)[0].split(",")[0]
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("started ")]
    assert f"database={db_name}" in line and host in line.split("mongodb=", 1)[1], line


async def test_stop_after_grace_releases_without_spending_retries(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, grace=0.2) as (w1, e1):
        client.publish("sleep", "long", {"seconds": 3600}, options={"max_retries": 0})
        await e1.wait("claimed", key="long")
        w1.stop()
        await e1.wait("stopped")
    task = client.get("long")
    assert task is not None and task.status == "pending" and task.failures == 0
    assert task.runs[0].state == "RELEASED" and task.next_claim_at is not None
    async with running_worker(registry, mongo_uri, db_name) as (_w2, e2):
        await e2.wait("claimed", key="long")  # taken at once by another worker


async def test_remote_stop(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    async with running_worker(registry, mongo_uri, db_name, worker_id="remote") as (w, events):
        assert [x["_id"] for x in client.workers()] == ["remote"]
        assert client.stop_worker("remote")
        await events.wait("stopped")
    assert w.state == "stopped"
    assert not client.stop_worker("remote")


async def test_pause_and_resume(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_worker, events):
        client.pause("add")
        await events.wait("paused_changed", paused=["add"])
        client.publish("add", "held", {"a": 1, "b": 1})
        client.publish("echo", "free")
        await events.wait("recorded", key="free")
        assert client.get("held").status == "pending"  # type: ignore[union-attr]
        client.resume("add")
        await events.wait("recorded", key="held")


@pytest.mark.parametrize("stream", ["shared", "own"])
async def test_a_worker_started_while_a_name_is_paused_never_claims_it(
    mongo_uri: str, db_name: str, client: TaskClient, stream: str
) -> None:
    """The first heartbeat reads the paused names before the first claim, whatever the stream
    (with the shared one it read them only at every fifth beat, the start-up's not one of them:
    a worker started while a name was paused claimed its tasks at once). The heartbeat's
    interval is an hour: only the start-up's beat can have told it."""
    client.pause("add")
    client.publish("add", "held", {"a": 1, "b": 1})
    client.publish("echo", "free")
    async with running_worker(
        registry, mongo_uri, db_name, stream=stream, heartbeat_interval=3600
    ) as (worker, events):
        await events.wait("recorded", key="free")
        assert worker.parts.assignment.paused == {"add"}
        assert not events.matching("claimed", key="held")
    assert client.get("held").status == "pending"  # type: ignore[union-attr]


async def test_lost_events_are_caught_by_the_sweep(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, sweep_interval=0.3) as (w, events):
        w.parts.finding.finder.on_change = lambda change: None  # type: ignore[method-assign]  # events lost
        client.publish("add", "missed", {"a": 1, "b": 1})
        await events.wait("recorded", key="missed")
        assert w.parts.finding.finder.scanner.rescans >= 2


async def test_killed_change_stream_resumes(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_worker, events):
        killed = kill_change_streams(client.mongo, db_name, in_flight=False)
        assert killed >= 1
        client.publish("add", "after-kill", {"a": 1, "b": 1})
        await events.wait("recorded", key="after-kill")


async def test_skewed_clocks_change_nothing(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    ahead = ServerClock(monotonic=lambda: time.monotonic() + 600)
    behind = ServerClock(monotonic=lambda: time.monotonic() - 600)
    async with (
        running_worker(registry, mongo_uri, db_name, clock=ahead, worker_id="ahead") as (_, _e1),
        running_worker(registry, mongo_uri, db_name, clock=behind, worker_id="behind") as (_, _e2),
    ):
        for clock in (ahead, behind):  # each corrects its host's 600 s skew
            assert abs((clock.now() - client.now()).total_seconds()) < 60
        for i in range(6):
            client.publish("echo", f"d{i}", delay=0.3)
        await wait_for(lambda: client.stats().get("echo", {}).get("succeeded") == 6)
    for task in client.list():
        run = task.runs[0]
        assert task.options.run_at is not None and run.claimed_at >= task.options.run_at
        # the worker whose host is 600 s behind claims it at its time, not 600 s late
        assert run.claimed_at - task.options.run_at < dt.timedelta(seconds=300)


async def test_blocking_handler_keeps_its_lease(
    mongo_uri: str, db_name: str, client: TaskClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mtask.worker")
    async with running_worker(registry, mongo_uri, db_name) as (worker, events):
        client.publish(
            "block_loop",
            "b",
            {"seconds": 3.0},
            options={"worker_timeout_ms": 1000, "ping_interval_ms": 200},
        )
        await events.wait("recorded", key="b", timeout=30)
    task = client.get("b")
    assert task is not None and task.status == "succeeded" and task.attempts == 1
    assert worker.stats.lease_lost == 0
    assert any("event loop has been blocked" in r.message for r in caplog.records)


async def test_idle_workers_do_not_stampede(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with (
        running_worker(registry, mongo_uri, db_name) as (w1, _e1),
        running_worker(registry, mongo_uri, db_name) as (w2, _e2),
        running_worker(registry, mongo_uri, db_name) as (w3, _e3),
        running_worker(registry, mongo_uri, db_name) as (w4, _e4),
    ):
        workers = (w1, w2, w3, w4)

        def ready(w: Worker) -> bool:  # its relay hands it its tasks, or it ranks by all four
            ranks = w.parts.finding.ranks()
            return not ranks or len(w.parts.assignment.peers.get("add", ())) == 4

        await wait_for(lambda: all(ready(w) for w in workers))
        for i in range(40):
            client.publish("add", f"s{i}", {"a": i, "b": 0})
            await wait_for(lambda i=i: client.get(f"s{i}").status == "succeeded")  # type: ignore[union-attr,misc]
        attempts = sum(w.stats.claim_attempts for w in workers)
        claimed = sum(w.stats.claimed for w in workers)
    assert claimed == 40
    assert attempts / claimed <= 1.5, (attempts, claimed)


async def test_a_dying_side_task_stops_the_worker_loudly(
    mongo_uri: str, db_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_ticker(self: LoopTicker) -> None:
        raise RuntimeError("ticker broke")

    monkeypatch.setattr(LoopTicker, "run", broken_ticker)
    worker = Worker(registry, uri=mongo_uri, database=db_name)
    with pytest.raises(WorkerCrashed, match="ticker broke"):
        await asyncio.wait_for(worker.run(), 30)
    assert worker.state == "stopped"


@pytest.mark.parametrize("ends", ["raises", "returns"])
async def test_a_side_task_that_ends_as_stopping_cancels_it_is_no_crash(
    mongo_uri: str, db_name: str, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    """pymongo's async lock, cancelled with MongoDB gone, can raise ``RuntimeError`` instead
    of the cancel (and a service may swallow it and return): a side service told to end by the
    worker's stop is not a part that died."""
    began = asyncio.Event()

    async def ends_when_cancelled(self: LoopTicker) -> None:
        began.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if ends == "raises":
                raise RuntimeError("Lock is not acquired") from None

    monkeypatch.setattr(LoopTicker, "run", ends_when_cancelled)
    worker = Worker(registry, uri=mongo_uri, database=db_name)
    running = asyncio.create_task(worker.run())
    await asyncio.wait_for(began.wait(), 30)
    worker.stop()
    await asyncio.wait_for(running, 30)  # no WorkerCrashed
    assert worker.state == "stopped"


def test_bad_worker_arguments() -> None:
    with pytest.raises(ConfigError, match="^names: no handler registered for nope"):
        Worker(registry, names=["nope"])
    with pytest.raises(ConfigError, match="^concurrency"):
        Worker(registry, concurrency=0)
    with pytest.raises(ConfigError, match="no handlers"):
        Worker(Registry())


async def test_malformed_documents_do_not_stop_the_worker(
    mongo_uri: str, db_name: str, client: TaskClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mtask.worker")
    now, nan = client.now(), float("nan")
    well_formed = hand_written(now)
    opts = well_formed["options"]
    junk = [
        {"_id": "no-runs", "name": "add", "status": "pending", "next_claim_at": now},
        {
            "_id": "bad-options",
            "name": "add",
            "status": "pending",
            "next_claim_at": now,
            "options": "fast",
            "runs": "many",
            "successes": "x",
        },
        {
            "_id": "bad-specific",
            "name": "add",
            "status": "pending",
            "next_claim_at": now,
            "options": {"specific_worker_ids": "w1", "priority": "high"},
            "runs": [],
        },
        {
            "_id": "half",
            "name": "add",
            "status": "pending",
            "next_claim_at": now,
            "options": {"specific_worker_ids": [], "priority": "high"},
        },
        {
            "_id": "half2",
            "name": "add",
            "status": "running",
            "next_claim_at": now,
            "options": {"specific_worker_ids": [], "concurrency": 1},
            "runs": [{"state": 3}],
            "successes": 0,
        },
        {**well_formed, "_id": 12345},  # well formed but for its key, which is not a string
        {**well_formed, "_id": "weird-status", "status": "paused"},
        {**well_formed, "_id": "bad-run", "runs": [3]},
        # so near BSON's 16 MiB limit that no run can be added: the claim itself fails
        {**well_formed, "_id": "full", "params": {"pad": "x" * (16 * 1024 * 1024 - 400)}},
        # huge, but a well-formed task: it runs
        {**well_formed, "_id": "big", "params": {"a": 1, "b": 2, "pad": "x" * 10_000_000}},
        # everything a claim needs but the ping interval the worker reads when it starts
        {
            **well_formed,
            "_id": "no-ping",
            "options": {k: v for k, v in well_formed["options"].items() if k != "ping_interval_ms"},
        },
        # a lease no date can end (it was claimed, and stranded running until the year 33,700),
        # and pings at no interval (each claim failed for its whole batch: date overflow)
        {**well_formed, "_id": "far", "options": {**opts, "worker_timeout_ms": 1e15}},
        {**well_formed, "_id": "nan", "options": {**opts, "worker_timeout_ms": nan}},
        {**well_formed, "_id": "tiny", "options": {**opts, "ping_interval_ms": 1}},
    ]
    client.collection.insert_many(junk)
    async with running_worker(registry, mongo_uri, db_name, sweep_interval=0.2) as (w, events):
        # junk that arrives by change event, soon due: queued, refused by the claim, requeued
        soon = client.now() + dt.timedelta(milliseconds=50)
        client.collection.insert_many(
            [
                {"_id": "late-junk", "name": "add", "status": "pending", "next_claim_at": soon},
                {
                    **well_formed,
                    "_id": "late-no-ping",
                    "next_claim_at": soon,
                    "options": {
                        k: v for k, v in well_formed["options"].items() if k != "ping_interval_ms"
                    },
                },
            ]
        )
        client.publish_many(
            [{"name": "add", "key": f"ok{i}", "params": {"a": i, "b": 1}} for i in range(20)]
        )
        await events.wait("recorded", count=20)
        rescans = w.parts.finding.finder.scanner.rescans
        await wait_for(lambda: w.parts.finding.finder.scanner.rescans >= rescans + 2)
        assert w.state == "running"
        big = {"_id": "big", "status": "succeeded"}
        await wait_for(lambda: client.collection.find_one(big, {"_id": 1}))
    assert client.stats()["add"]["succeeded"] == 22  # 20 published, "big", "bad-run"
    reasons = {
        doc["_id"]: doc.get("invalid_reason")
        for doc in client.collection.find({"status": "invalid"}, {"invalid_reason": 1})
    }
    ping = "'options.ping_interval_ms' must be a number from 50 to 3600000,"
    timeout = "'options.worker_timeout_ms' must be a number from 100 to 86400000,"
    expected = {
        "no-runs": "'runs' must be an array, found missing",
        "bad-options": "'runs' must be an array, found string",
        "bad-specific": "'successes' must be a number, found missing",
        "half": "'runs' must be an array, found missing",
        "half2": "'failures' must be a number, found missing",
        12345: "'_id' must be a string, found int",
        "weird-status": "'status' must be a known status, found paused",
        "no-ping": f"{ping} found missing",
        "late-junk": "'runs' must be an array, found missing",
        "late-no-ping": f"{ping} found missing",
        "far": f"{timeout} found double 1e+15",
        "nan": f"{timeout} found double NaN",
        "tiny": f"{ping} found int 1",
    }
    for key, reason in expected.items():
        assert reason in (reasons.get(key) or ""), (key, reasons.get(key))
    # a document the claim cannot write is marked invalid, or if even that cannot be
    # written, left alone and logged once
    full = client.collection.find_one({"_id": "full"}, {"status": 1, "runs": 1})
    assert full is not None and full["runs"] == []
    logged = [r.message for r in caplog.records if "'full'" in r.message]
    assert full["status"] == "invalid" or len(logged) == 1, logged
    # every malformed document reads as an invalid task instead of raising
    junk_task = client.get("no-runs")
    assert junk_task is not None and junk_task.status == "invalid" and junk_task.invalid_reason
    assert {t.key for t in client.list(status="invalid")} >= {"no-runs", "12345", "no-ping"}


async def test_refused_outcome_does_not_block_the_others(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    # a document a service padded (unknown fields are kept) to within 1 MB of 16 MiB: the
    # SUCCESS of a 1 MB result would pass it, and the server refuses that update
    client.publish("too_big", "deep", options={"worker_timeout_ms": 500, "max_retries": 3})
    for half in ("padding", "more_padding"):  # in two writes: a smaller server's cache
        client.collection.update_one({"_id": "deep"}, {"$set": {half: "p" * 7_900_000}})
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        client.publish_many(
            [{"name": "add", "key": f"n{i}", "params": {"a": i, "b": 0}} for i in range(10)]
        )
        await wait_for(lambda: client.stats().get("add", {}).get("succeeded") == 10)
        # recorded once, as the run's permanent FAIL naming why: not run again at each
        # lease's end (each a failure) until the retries ran out
        recorded = await events.wait("recorded", key="deep")
    assert recorded["state"] == "FAIL"
    assert not events.matching("recorded", key="deep", state="SUCCESS")
    task = client.get("deep")
    assert task is not None and task.status == "failed" and task.attempts == 1
    assert [r.state for r in task.runs] == ["FAIL"]
    assert task.error is not None and task.error.startswith("the result could not be stored: ")
    assert "MongoDB: WriteError: " in task.error  # the server's reason


async def test_a_result_within_a_raised_limit_that_no_document_can_hold_fails_once(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """``max_result_bytes`` raised past what a task document holds (the result is stored
    twice: on its run and on the task): its SUCCESS was dropped and the task run again at
    each lease's end. It is recorded once, as a permanent FAIL naming why."""
    size = 8_500_000  # twice that is past 16 MiB
    client.publish(
        "huge_result",
        "huge",
        {"bytes": size},
        options={"worker_timeout_ms": 500, "max_retries": 3},
    )
    limit = size + 100
    async with running_worker(registry, mongo_uri, db_name, max_result_bytes=limit) as (
        _,
        events,
    ):
        client.publish("add", "after", {"a": 1, "b": 1})
        recorded = await events.wait("recorded", key="huge")
        await events.wait("recorded", key="after")
    assert recorded["state"] == "FAIL"
    task = client.get("huge")
    assert task is not None and task.status == "failed" and task.attempts == 1
    assert [r.state for r in task.runs] == ["FAIL"]
    assert task.error is not None and task.error.startswith("the result could not be stored: ")


async def test_a_document_that_refuses_even_the_fail_is_marked_invalid(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A document with no room for its run's SUCCESS, nor for the FAIL naming why, is marked
    invalid (fenced by the run) and reported ``not_recorded``: not ``recorded``, and not run
    again at each lease's end."""
    go = asyncio.Event()
    tight = Registry()

    @tight.task("tight")
    async def handler(params: dict[str, Any]) -> str:
        await go.wait()
        return "x" * 2000  # more than the room left

    client.publish("tight", "full", options={"worker_timeout_ms": 2000, "max_retries": 3})
    tasks = client.collection
    async with running_worker(tight, mongo_uri, db_name) as (_, events):
        await events.wait("claimed", key="full")
        # 180 bytes short of 16 MiB: less than the FAIL takes (two copies of its error,
        # about 110 bytes each, and its dates: about 250), more than the mark invalid (one
        # copy, and the status it had: about 150)
        pad_to_the_limit(tasks, "full", 180)
        go.set()
        dropped = await events.wait("not_recorded", key="full")
    assert dropped["state"] == "SUCCESS"
    assert not events.matching("recorded", key="full")
    doc = tasks.find_one({"_id": "full"}, {"padding": 0, "more_padding": 0})
    assert doc is not None and doc["status"] == "invalid" and doc["invalid_status"] == "running"
    assert doc["invalid_reason"].startswith("the result could not be stored: MongoDB: ")
    assert doc["next_claim_at"] is None and doc["attempts"] == 1


async def test_a_document_with_no_room_for_a_run_is_marked_invalid(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A pending document a service padded to within a few bytes of 16 MiB: a claim's run does
    not fit, and the server refuses the claim for the document itself (a ``findAndModify``
    fails with code 17419, not a write error). The claim was retried each second for ever;
    the task is now marked invalid, naming why, and the worker goes on. (With no room even for
    that mark, the worker ignores the task from then on, logged once.)"""
    client.publish("add", "full", {"a": 1, "b": 1})
    tasks = client.collection
    # 180 bytes short: a claim's run takes about 190-250 (with the worker's id twice), the
    # marking about 150 (its reason without pymongo's dump of the server's reply)
    pad_to_the_limit(tasks, "full", 180)
    invalid = {"_id": "full", "status": "invalid"}
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await wait_for(lambda: tasks.find_one({"_id": "full"}, {"status": 1}) == invalid)
        client.publish("add", "after", {"a": 1, "b": 1})
        await events.wait("recorded", key="after")
    doc = tasks.find_one({"_id": "full"}, {"padding": 0, "more_padding": 0})
    assert doc is not None and doc["invalid_status"] == "pending" and doc["attempts"] == 0
    assert doc["invalid_reason"].startswith("a claim cannot update the document: ")
    assert "16777216" in doc["invalid_reason"]


async def test_pause_reaches_workers_without_waiting_for_a_heartbeat(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, heartbeat_interval=3600) as (
        _,
        events,
    ):
        client.pause("echo")
        await events.wait("paused_changed", paused=["echo"], timeout=5)
        client.resume("echo")
        await events.wait("paused_changed", paused=[], timeout=5)


async def test_changed_ping_interval_applies_at_the_next_ping(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (worker, events):
        client.publish("sleep", "p", options={"ping_interval_ms": 100})
        claimed = await events.wait("claimed", key="p")
        lease = worker.parts.pinger._leases[claimed["run_id"]]
        client.collection.update_one({"_id": "p"}, {"$set": {"options.ping_interval_ms": 250}})
        await wait_for(lambda: lease.interval == 0.25)
        pings = worker.parts.pinger.pings
        await wait_for(lambda: worker.parts.pinger.pings >= pings + 2)


async def test_a_run_longer_than_its_lease_with_the_default_ping_interval_succeeds(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A 1.5 s lease under the default 5 s ping interval: pinged every 0.5 s (``ping_every``),
    not after the lease has run out. The run outlives its lease three times and succeeds,
    once."""
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        client.publish("sleep", "long", {"seconds": 4.5}, options={"worker_timeout_ms": 1500})
        await events.wait("recorded", key="long", timeout=30)
    task = client.get("long")
    assert task is not None and task.options.ping_interval_ms == 5000
    assert task.status == "succeeded" and [r.state.value for r in task.runs] == ["SUCCESS"]


def test_the_pinger_thread_is_woken_only_for_a_ping_due_before_its_wait_ends(
    client: TaskClient,
) -> None:
    """Waking the pinger thread takes the GIL from the event loop: a claim wakes it only if
    the new lease's first ping is due before the thread would wake anyway (at most 1 s)."""
    lost: list[str] = []
    found = threading.Event()

    def on_lost(run_id: str, doc: dict[str, Any] | None) -> None:
        lost.append(run_id)
        found.set()

    client.now()  # calibrates the client's server clock, which the pings read
    pinger = LeasePinger(client._driver, "w1", client.clock, on_lost, lambda r, s: None)
    notified: list[bool] = []
    real_notify = pinger._cond.notify
    pinger._cond.notify = lambda n=1: (notified.append(True), real_notify(n))[1]  # type: ignore[method-assign]
    pinger.start()
    try:
        deadline = time.monotonic() + 10
        while pinger._wake_at == 0.0 and time.monotonic() < deadline:
            time.sleep(0.001)  # until the idle thread waits (up to 1 s)
        assert pinger._wake_at > 0.0
        pinger.add("late", "run-late", 60_000, 180_000, time.monotonic())
        assert notified == []  # its first ping is a minute away: the thread is left alone
        pinger.add("soon", "run-soon", 1, 30_000, time.monotonic())
        assert notified == [True]
        # the woken thread pinged it at once: no such task, so the run is reported lost
        assert found.wait(10) and lost == ["run-soon"]
    finally:
        pinger.stop()


async def test_more_tasks_than_the_queue_holds(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    client.publish_many(
        [{"name": "add", "key": f"q{i:04}", "params": {"a": i, "b": 0}} for i in range(1200)]
    )
    # No periodic sweep: only the top-ups of a queue that left tasks out (or a refill once it
    # ran dry) can find them.
    async with running_worker(
        registry, mongo_uri, db_name, concurrency=32, queue_size=100, sweep_interval=3600
    ) as (worker, events):
        await events.wait("recorded", count=1200, timeout=60)
        scanner = worker.parts.finding.finder.scanner
        # each reads at most 101 documents; the top-ups go first (here: 1 rescan, 18 top-ups)
        assert scanner.rescans + scanner.top_ups >= 12 and scanner.top_ups >= 5
    assert client.stats(exact=True) == {"add": {"succeeded": 1200}}


@pytest.mark.parametrize(("prefetch", "bound"), [(0, 16), ("auto", 32)])
async def test_a_worker_bounds_the_leases_it_holds(
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
    monkeypatch: pytest.MonkeyPatch,
    prefetch: int | str,
    bound: int,
) -> None:
    original = OutcomeRecorder.record

    async def slow_record(self: OutcomeRecorder, batch: list[Any]) -> int:
        await asyncio.sleep(0.05)  # a lagging outcome writer
        return await original(self, batch)

    monkeypatch.setattr(OutcomeRecorder, "record", slow_record)
    client.publish_many(
        [{"name": "add", "key": f"c{i}", "params": {"a": i, "b": 0}} for i in range(300)]
    )
    most = 0
    async with running_worker(
        registry, mongo_uri, db_name, concurrency=8, prefetch=prefetch, worker_id="bounded"
    ) as (worker, _events):
        while client.stats().get("add", {}).get("succeeded", 0) < 300:
            held = client.collection.count_documents(
                {"runs": {"$elemMatch": {"worker_id": "bounded", "state": "RUNNING"}}}
            )
            most = max(most, held)
            await asyncio.sleep(0.005)
        ahead = worker.parts.claimer.ahead.allowed()
    # running handlers (8) and runs claimed ahead (8 with "auto": these are short runs), and
    # finished runs whose outcome is on its way (at most as many)
    assert 0 < most <= bound
    assert ahead == (8 if prefetch == "auto" else 0)


async def test_every_run_of_a_batch_claim_keeps_its_lease(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    options = {"worker_timeout_ms": 1000, "ping_interval_ms": 100}
    client.publish_many([{"name": "sleep", "key": f"b{i}", "options": options} for i in range(8)])
    async with running_worker(registry, mongo_uri, db_name, concurrency=8) as (worker, events):
        await events.wait("claimed", count=8)
        assert worker.in_flight == 8
        first = {t.key: t.runs[0].lease_expires_at for t in client.list(limit=8)}
        # every lease is pushed by pings, not only one per batch
        await wait_for(
            lambda: all(
                t.runs[0].lease_expires_at > first[t.key] + dt.timedelta(seconds=1)  # type: ignore[operator]
                for t in client.list(limit=8)
            )
        )
        assert {t.status for t in client.list(limit=8)} == {"running"}
        assert worker.stats.lease_lost == 0


async def test_a_run_lost_twice_is_stopped_once(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The local lease deadline and a ping answered just after may both report the same lost
    run; the handler is cancelled once, so its cleanup runs to the end."""
    from workerapp import cleaned_up

    async with running_worker(registry, mongo_uri, db_name) as (worker, events):
        client.publish("slow_cleanup", "twice")
        claimed = await events.wait("claimed", key="twice")
        run = worker.parts.inflight.get(claimed["run_id"])
        worker.parts.executor.lost(claimed["run_id"], None)
        assert run is not None and run.ctx.lease_lost  # its check_lease raises LeaseLost now
        await asyncio.sleep(0.05)
        worker.parts.executor.lost(claimed["run_id"], None)
        await wait_for(lambda: "twice" in cleaned_up)
        assert worker.stats.lease_lost == 1


async def test_a_dropped_database_does_not_stall_the_worker(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """Dropping the database invalidates the change stream; a closed stream answers at once
    with nothing, and the worker used to spin on it with its event loop blocked (deaf even to
    SIGTERM). It reopens the stream and goes on."""
    async with running_worker(registry, mongo_uri, db_name) as (worker, events):
        client.publish("add", "before", {"a": 1, "b": 1})
        await events.wait("recorded", key="before")
        restarts = worker.parts.finding.restarts
        client.mongo.drop_database(db_name)
        await wait_for(lambda: worker.parts.finding.restarts > restarts)
        client.publish("add", "after", {"a": 2, "b": 2})
        await events.wait("recorded", key="after")
        assert worker.state == "running"


async def test_rescans_that_overlap_run_one_after_the_other(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    # The stream's reopen (after a killed cursor) rescans while the sweep may be rescanning:
    # the two must not share one half-finished scan's state (a crash here stopped the worker).
    client.publish_many(
        [
            {"name": "add", "key": f"o{i:04}", "params": {"a": i, "b": 0}, "delay": 3600}
            for i in range(300)
        ]
    )
    async with running_worker(registry, mongo_uri, db_name, sweep_interval=3600) as (worker, _):
        worker.parts.finding.finder.scanner.page_size = 10  # many pages: the scans interleave
        before = worker.parts.finding.finder.scanner.rescans
        found = await asyncio.gather(
            *(worker.parts.finding.finder.scanner.rescan() for _ in range(3))
        )
        assert found == [300, 300, 300]
        assert worker.parts.finding.finder.scanner.rescans == before + 3
        assert len(worker.parts.queue) == 300
        assert worker.state == "running"


async def test_a_run_stopped_before_its_task_began_is_released(
    mongo_uri: str, db_name: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stop (SIGTERM's drain) that comes between the claim's reply and the first step of the
    # run's task: a task cancelled before it begins never runs its body, so nothing would
    # release the task (it stayed "running" until its lease ran out; CI's flaky
    # test_sigterm_drains_then_releases).
    original = Executor.start

    stopped: list[str] = []

    def start_then_stop(
        self: Executor, doc: dict[str, Any], sent: float, slots: tuple[str, ...] = ()
    ) -> None:
        original(self, doc, sent, slots)
        run = self.inflight.get(doc["claim_run_id"])
        if not stopped:  # the first run only (the released task is claimed again)
            assert run is not None and not run.begun
            stopped.append(run.run_id)
            self.stop(run, "shutdown")

    monkeypatch.setattr(Executor, "start", start_then_stop)
    client.publish("sleep", "early", {"seconds": 3600})
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await events.wait("recorded", timeout=10)  # without the fix: nothing is ever recorded
        task = client.get("early")
        assert task is not None
        assert (task.runs[0].run_id, task.runs[0].state) == (stopped[0], "RELEASED")


async def test_a_worker_follows_a_stepped_server_clock_at_its_next_heartbeat(
    mongo_uri: str, db_name: str, mongo: Any
) -> None:
    """The heartbeat writes the server's time (``$currentDate``); a worker whose clock
    disagrees with it calibrates again at once, not at its next periodic calibration
    (``KEEP_BEST`` later)."""
    step = [0.0]
    clock = ServerClock(lambda: time.monotonic() + step[0])

    def off() -> float:
        """Seconds the worker's clock is off the server's (within a round trip)."""
        before = clock.now()
        server = mongo.admin.command("hello")["localTime"].replace(tzinfo=dt.UTC)
        return abs((server - before).total_seconds())

    async with running_worker(registry, mongo_uri, db_name, clock=clock) as (worker, _):
        presence = worker.parts.presence
        await wait_for(lambda: presence.beats > 5)  # past the calibrations soon after the start
        assert off() < 0.5
        step[0] = 2.0  # as if the server's clock were stepped 2 s back
        assert off() > 1.5
        await wait_for(lambda: off() < 0.5, timeout=10)  # its next written beat: 0.6 s here
