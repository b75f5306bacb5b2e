"""Handler isolation and time limits in a real worker: process-isolated handlers that crash,
hang or are cancelled end as documented while the other runs finish; thread and async time
limits; per-handler option defaults."""

from __future__ import annotations

import os
import time

import poolhandlers
import pytest
from harness import gone, running_worker, wait_for

from mtask import TaskClient, TaskOptions
from mtask.errors import InvalidTask
from mtask.registry import Registry

NO_RETRY = {"max_retries": 0}


async def test_crashes_and_hangs_end_their_runs_while_the_others_finish(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, concurrency=6) as (
        worker,
        events,
    ):
        client.publish("segfault", "seg", options=NO_RETRY)
        client.publish("exit3", "exit", options=NO_RETRY)
        client.publish("sleepy", "sleepy", options=NO_RETRY)
        for i in range(3):
            client.publish("burn", f"burn-{i}", {"loops": 50_000})
        for key in ("seg", "exit", "sleepy", "burn-0", "burn-1", "burn-2"):
            await events.wait("recorded", key=key)
        client.publish("double", "after", {"n": 4})
        await events.wait("recorded", key="after")
        assert worker.state == "running"
        pool = worker.parts.process_pool
        assert pool is not None and pool.state()["died"] == 2 and pool.state()["killed"] == 1
    errors = {k: client.get(k) for k in ("seg", "exit", "sleepy")}
    assert errors["seg"] is not None and errors["seg"].status == "failed"
    assert errors["seg"].error == "handler process died: signal 11 (SIGSEGV)"
    assert (
        errors["exit"] is not None and errors["exit"].error == "handler process died: exit code 3"
    )
    assert errors["sleepy"] is not None and errors["sleepy"].error == "time limit exceeded (1 s)"
    for i in range(3):
        task = client.get(f"burn-{i}")
        assert task is not None and task.status == "succeeded"
    after = client.get("after")
    assert after is not None and after.result["value"] == 8 and after.result["pid"] != os.getpid()
    await wait_for(lambda: all(gone(pid) for pid in pool.pids))


async def test_a_crash_uses_the_retry_budget(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name) as (_, events):
        client.publish("exit3", "twice", options={"max_retries": 1, "retry_delay_ms": 10})
        await events.wait("recorded", key="twice", count=2)
    task = client.get("twice")
    assert task is not None and task.status == "failed" and task.attempts == 2


async def test_cancel_kills_the_child(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name) as (worker, events):
        client.publish("forever", "f", options={"ping_interval_ms": 100})
        await events.wait("claimed", key="f")
        pool = worker.parts.process_pool
        assert pool is not None
        await wait_for(lambda: pool.state()["busy"] == 1)
        (child,) = pool.pids
        client.cancel("f")
        await events.wait("recorded", key="f", state="CANCELLED")
        await wait_for(lambda: gone(child))
        assert pool.state()["killed"] == 1


async def test_a_long_child_run_keeps_its_lease(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    lease = {"ping_interval_ms": 200, "worker_timeout_ms": 2500}
    async with running_worker(poolhandlers.registry, mongo_uri, db_name) as (worker, events):
        client.publish("nap", "long", {"seconds": 6}, options=lease)  # 30 pings, 2.4 lease lengths
        await events.wait("recorded", key="long", timeout=30)
    task = client.get("long")
    assert task is not None and task.status == "succeeded" and task.result == 6.0
    assert len(task.runs) == 1 and worker.stats.lease_lost == 0


async def test_the_worker_wide_process_pool(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(
        poolhandlers.registry, mongo_uri, db_name, pool="process", max_tasks_per_child=1
    ) as (worker, events):
        client.publish("plain_pid", "a")
        client.publish("plain_pid", "b")
        await events.wait("recorded", key="a")
        await events.wait("recorded", key="b")
        assert (
            worker.parts.process_pool is not None
            and worker.parts.process_pool.state()["recycled"] == 2
        )
    pids = {client.get(k).result for k in "ab"}  # type: ignore[union-attr]
    assert len(pids) == 2 and os.getpid() not in pids


async def test_thread_and_async_time_limits(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name) as (_, events):
        client.publish("thread_coop", "coop")
        client.publish("thread_hang", "hang", options=NO_RETRY)
        client.publish("async_hang", "ahang", options=NO_RETRY)
        for key in ("coop", "hang", "ahang"):
            await events.wait("recorded", key=key)
    coop = client.get("coop")
    assert coop is not None and coop.result == "stopped at the soft limit"
    hang = client.get("hang")
    assert hang is not None and hang.status == "failed" and hang.error is not None
    assert hang.error.startswith("time limit exceeded (0.3 s); the handler's thread")
    ahang = client.get("ahang")
    assert ahang is not None and ahang.error == "time limit exceeded (0.3 s)"


def test_handler_option_defaults_fill_what_a_publish_does_not_say(
    mongo_uri: str, db_name: str
) -> None:
    with TaskClient(mongo_uri, database=db_name, registry=poolhandlers.registry) as client:
        plain = client.publish("defaulted", "d1").task
        given = client.publish("defaulted", "d2", options={"max_retries": 1}).task
        typed = client.publish("defaulted", "d3", options=TaskOptions(priority=9)).task
    assert (plain.options.max_retries, plain.options.priority) == (7, 5)
    assert (given.options.max_retries, given.options.priority) == (1, 5)
    assert (typed.options.max_retries, typed.options.priority) == (7, 9)
    assert plain.options.worker_timeout_ms == TaskOptions().worker_timeout_ms


@pytest.mark.parametrize(
    ("declaration", "field"),
    [
        ({"isolation": "fork"}, "isolation"),
        ({"time_limit": 0}, "time_limit"),
        ({"time_limit": 1, "soft_time_limit": 2}, "soft_time_limit"),
        ({"options": {"max_retries": -1}}, None),
        ({"options": {"nope": 1}}, None),
    ],
)
def test_bad_declarations_are_refused(declaration: dict[str, object], field: str | None) -> None:
    with pytest.raises(InvalidTask) as caught:
        Registry().task("x", **declaration)  # type: ignore[arg-type]
    assert caught.value.field == field if field else True


def test_process_isolation_needs_a_module_level_plain_def() -> None:
    registry = Registry()

    def local(params: dict[str, object]) -> None:
        time.sleep(0)

    with pytest.raises(InvalidTask, match="module level"):
        registry.task("local", isolation="process")(local)
