"""The process pool with real child processes: results, Retry/Fail across the boundary,
crashes, memory caps, hard time limits, cancellation, recycling, and no child left behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import poolhandlers
import pytest
from harness import dead, gone

from mtask import Fail, Retry, Worker
from mtask.errors import ConfigError
from mtask.worker.running.pool.errors import (
    ChildDied,
    HandlerError,
    MemoryLimitExceeded,
    TimeLimitExceeded,
)
from mtask.worker.running.pool.pipe import RunInfo
from mtask.worker.running.pool.pool import ProcessPool

INFO = RunInfo("k", "n", 1, "run-1", "w-1")


async def until(condition: Any, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def run(pool: ProcessPool, name: str, params: Any = None, **kw: Any) -> Any:
    return await pool.run(poolhandlers.registry[name], params or {}, INFO, **kw)


async def test_results_and_handler_outcomes_cross_the_boundary(pool: ProcessPool) -> None:
    first = await run(pool, "double", {"n": 21})
    assert first["value"] == 42 and first["pid"] != os.getpid()
    with pytest.raises(Retry) as retry:
        await run(pool, "retry")
    assert str(retry.value) == "later" and retry.value.delay == 2.5
    with pytest.raises(Fail, match="no"):
        await run(pool, "fail")
    with pytest.raises(HandlerError, match="boom in child") as boom:
        await run(pool, "boom")
    assert boom.value.error_class == "builtins.ValueError"  # the handler's, for runs.error_class
    again = await run(pool, "double", {"n": 1})
    assert again["pid"] == first["pid"]  # one child served them all
    assert pool.state()["started"] == 1


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("exit3", "handler process died: exit code 3"),
        ("segfault", r"handler process died: signal 11 \(SIGSEGV\)"),
    ],
)
async def test_a_crashing_child_ends_its_run_and_is_replaced(
    pool: ProcessPool, name: str, reason: str
) -> None:
    before = await run(pool, "pid")
    with pytest.raises(ChildDied, match=reason):
        await run(pool, name)
    await until(lambda: gone(before))
    after = await run(pool, "pid")
    assert after != before and not gone(after)
    assert pool.state()["died"] == 1


async def test_the_hard_memory_limit_kills_the_child_mid_run() -> None:
    capped = ProcessPool(memory_limit=200 * 1024 * 1024)
    try:
        child = await capped.run(poolhandlers.registry["pid"], {}, INFO)
        with pytest.raises(MemoryLimitExceeded, match=r"over its limit of 200 MiB; it was killed"):
            await capped.run(poolhandlers.registry["hog"], {}, INFO)
        await until(lambda: gone(child))
        assert await capped.run(poolhandlers.registry["pid"], {}, INFO) != child
        assert capped.state()["memory_kills"] == 1 and capped.state()["died"] == 0
    finally:
        await capped.close()


async def test_a_result_bson_stores_but_pickle_refuses_comes_back_as_a_document(
    pool: ProcessPool,
) -> None:
    # a defaultdict with a lambda: stored as a document from a thread, so from a child too
    assert await run(pool, "unpicklable_result") == {"a": 2, "b": 1}
    with pytest.raises(Fail, match="the result cannot be stored"):  # for good, as on a thread
        await run(pool, "unpicklable_and_no_bson")
    assert pool.state()["started"] == 1 and pool.state()["idle"] == 1


async def test_sys_exit_or_an_unsayable_fail_in_a_child_is_its_runs_failure_as_on_a_thread(
    pool: ProcessPool,
) -> None:
    """``sys.exit()`` in a child's handler ended the child (a retryable "process died"), and a
    ``Fail`` whose ``__str__`` raises ended it too; on a thread each is the run's failure. The
    child now replies them as such, and lives on."""
    child = await run(pool, "pid")
    with pytest.raises(HandlerError, match="SystemExit: 3") as exited:
        await run(pool, "sys_exit_in_child")
    assert exited.value.error_class == "builtins.SystemExit"
    with pytest.raises(Fail, match=r"<exception str\(\) failed>"):
        await run(pool, "unsaid_fail_in_child")
    assert await run(pool, "pid") == child and pool.state()["died"] == 0


async def test_what_a_run_leaves_running_ends_with_it(pool: ProcessPool, tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild"
    assert await run(pool, "leave_behind", {"pidfile": str(pidfile)}) == "left"
    grandchild = int(pidfile.read_text())
    assert dead(grandchild)  # killed and reaped before the reply
    assert pool.state()["started"] == 1 and pool.state()["died"] == 0


async def test_a_killed_child_takes_its_process_group_along(
    pool: ProcessPool, tmp_path: Path
) -> None:
    pidfile = tmp_path / "grandchild"
    running = asyncio.ensure_future(run(pool, "spawn_and_sleep", {"pidfile": str(pidfile)}))
    await until(lambda: pidfile.exists() and pidfile.read_text() != "")
    grandchild = int(pidfile.read_text())
    assert not dead(grandchild)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await until(lambda: dead(grandchild), 2)


async def test_a_child_stops_itself_when_its_lease_runs_out(
    pool: ProcessPool, tmp_path: Path
) -> None:
    """No renewal after the last one (as from a worker frozen then): the child kills itself and
    its group by the deadline, and says why."""
    pidfile = tmp_path / "grandchild"
    renewals: list[Any] = []

    def lease(on_expiry: Any) -> Any:
        renewals.append(on_expiry)
        on_expiry(time.monotonic() + 600)  # until the grandchild runs (a loaded machine's start)
        return lambda: None

    running = asyncio.ensure_future(
        run(pool, "spawn_and_sleep", {"pidfile": str(pidfile)}, lease=lease)
    )
    await until(lambda: pidfile.exists() and pidfile.read_text() != "", limit=120)
    grandchild = int(pidfile.read_text())
    expiry = time.monotonic() + 1.0
    renewals[0](expiry)  # the last renewal
    with pytest.raises(ChildDied, match="lease ran out with no renewal"):
        await running
    assert time.monotonic() >= expiry and dead(grandchild)  # not before its deadline (how soon
    # after it is the bench's to measure: no wall-clock bound in a test)
    assert len(renewals) == 1


async def test_a_renewed_lease_keeps_the_child_running(pool: ProcessPool) -> None:
    def lease(on_expiry: Any) -> Any:
        async def renew() -> None:
            while True:
                on_expiry(time.monotonic() + 0.3)
                await asyncio.sleep(0.1)

        renewing = asyncio.ensure_future(renew())
        return renewing.cancel

    assert await run(pool, "nap", {"seconds": 1.0}, lease=lease) == 1.0


@pytest.mark.parametrize("name", ["spin", "sleepy"])
async def test_the_hard_time_limit_kills_the_child(pool: ProcessPool, name: str) -> None:
    child = await run(pool, "pid")
    handler = poolhandlers.registry[name]
    with pytest.raises(TimeLimitExceeded, match="time limit exceeded"):
        await run(pool, name, hard_timeout=handler.time_limit)
    assert gone(child) and pool.state()["killed"] == 1
    assert await run(pool, "pid") != child


async def test_the_soft_limit_and_the_cancelled_event_reach_the_child(pool: ProcessPool) -> None:
    assert await run(pool, "cooperative", soft_timeout=0.2, hard_timeout=30) == "saw cancelled"
    cancelled = asyncio.Event()
    running = asyncio.ensure_future(run(pool, "cooperative", cancelled=cancelled))
    await asyncio.sleep(0.1)
    cancelled.set()
    assert await running == "saw cancelled"
    assert pool.state()["killed"] == 0


async def test_cancelling_the_await_kills_the_child(pool: ProcessPool) -> None:
    child = await run(pool, "pid")
    running = asyncio.ensure_future(run(pool, "sleepy"))
    await until(lambda: pool.state()["busy"] == 1)
    await asyncio.sleep(0.1)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert gone(child) and pool.state() | {"busy": 0} == pool.state()


async def test_children_are_recycled_by_task_count_and_memory() -> None:
    by_count = ProcessPool(max_tasks_per_child=2)
    by_memory = ProcessPool(max_memory_per_child=1)
    try:
        pids = [await by_count.run(poolhandlers.registry["pid"], {}, INFO) for _ in range(3)]
        assert pids[0] == pids[1] != pids[2]
        await until(lambda: gone(pids[0]))
        mem = [await by_memory.run(poolhandlers.registry["pid"], {}, INFO) for _ in range(2)]
        assert mem[0] != mem[1] and by_memory.state()["recycled"] == 2
    finally:
        await by_count.close()
        await by_memory.close()


async def test_children_started_ahead_take_the_first_runs(pool: ProcessPool) -> None:
    await pool.start(2)
    ahead = set(pool.pids)
    assert len(ahead) == 2 and pool.state() | {"idle": 2, "busy": 0} == pool.state()
    results = await asyncio.gather(run(pool, "pid"), run(pool, "pid"))
    assert set(results) == ahead and pool.state()["started"] == 2
    (child,) = [c for c in pool.children() if c["pid"] == results[0]]
    assert child["state"] == "idle" and child["tasks"] == 1 and child["rss"] > 0


async def test_other_runs_go_on_while_a_child_crashes(pool: ProcessPool) -> None:
    results = await asyncio.gather(
        run(pool, "burn", {"loops": 100_000}),
        run(pool, "segfault"),
        run(pool, "double", {"n": 2}),
        return_exceptions=True,
    )
    assert isinstance(results[0], int)
    assert isinstance(results[1], ChildDied)
    assert results[2]["value"] == 4


def test_no_child_outlives_a_killed_parent(tmp_path: Path) -> None:
    """kill -9 of the process holding the pool: its children die with it (no orphans)."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, sys
            sys.path.insert(0, sys.argv[1])
            import poolhandlers
            from mtask.worker.running.pool.pool import ProcessPool
            from mtask.worker.running.pool.pipe import RunInfo

            async def main():
                pool = ProcessPool()
                info = RunInfo("k", "n", 1, "r", "w")
                pid = await pool.run(poolhandlers.registry["pid"], {}, info)
                print(pid, flush=True)
                await pool.run(poolhandlers.registry["sleepy"], {}, info)

            if __name__ == "__main__":
                asyncio.run(main())
            """
        )
    )
    with subprocess.Popen(
        [sys.executable, str(script), str(Path(__file__).parents[1])], stdout=subprocess.PIPE
    ) as parent:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not gone(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while not gone(child):
        assert time.monotonic() < deadline, f"child {child} outlived its parent"
        time.sleep(0.05)


def test_the_hard_memory_limit_must_be_positive() -> None:
    with pytest.raises(ConfigError) as caught:
        Worker(poolhandlers.registry, memory_limit_per_child=0)
    assert caught.value.field == "memory_limit_per_child"
