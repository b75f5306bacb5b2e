"""A run's objects are freed when it ends, without the garbage collector: the worker's parts as
``assembly.build`` makes them (their clients never connect), runs started by
``Executor.start`` as the claimer starts them."""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import time
import types
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop

from mtask.registry import Registry, TaskContext
from mtask.worker.assembly import Parts, build
from mtask.worker.config import WorkerConfig
from mtask.worker.stats import WorkerStats

OPTIONS = {"concurrency": 1, "ping_interval_ms": 5000, "worker_timeout_ms": 30000}


class Clock:
    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)


def parts(registry: Registry) -> Parts:
    config = WorkerConfig(uri="mongodb://127.0.0.1:9/?directConnection=true", concurrency=8)
    return build(
        config,
        registry,
        names=config.chosen_names(registry),
        worker_id="w1",
        clock=Clock(),
        server_clock=None,
        stats=WorkerStats(),
        lifecycle=types.SimpleNamespace(state="running", stop=lambda immediate=False: None),
    )


def claimed(key: str, name: str) -> dict[str, Any]:
    """A document as the claim's read returns it."""
    run_id = f"batch:{key}"
    return {
        "_id": key,
        "name": name,
        "params": {},
        "options": dict(OPTIONS),
        "attempts": 1,
        "runs": [{"state": "RUNNING", "run_id": run_id}],
        "claim_run_id": run_id,
    }


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Only reference counting frees objects during the test."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.usefixtures("no_collector")
@pytest.mark.parametrize("kind", ["async", "thread"])
def test_an_ended_run_leaves_no_reference_cycle(kind: str) -> None:
    """A cycle through a run (its context holding a closure over it) kept every run's objects
    until the collector's next pass: about 20 objects a run, and a fifth of a draining
    worker's CPU spent collecting them (docs/journal/2026-11.md, "A drain's garbage")."""
    registry = Registry()
    seen: list[weakref.ref[Any]] = []

    if kind == "async":

        @registry.task("noop")
        async def noop(params: dict[str, Any], ctx: TaskContext) -> None:
            seen.append(weakref.ref(ctx))

    else:

        @registry.task("noop")
        def noop_sync(params: dict[str, Any], ctx: TaskContext) -> None:
            seen.append(weakref.ref(ctx))

    async def main() -> None:
        worker = parts(registry)
        for i in range(5):
            worker.executor.start(claimed(f"k{i}", "noop"), time.monotonic())
        runs = [weakref.ref(run) for run in worker.inflight.runs.values()]
        await asyncio.wait([run.task for run in worker.inflight.runs.values() if run.task])
        assert [o.state.value for o in worker.recorder.pending] == ["SUCCESS"] * 5, [
            o.error for o in worker.recorder.pending
        ]
        assert len(runs) == len(seen) == 5
        assert [r() for r in runs] == [None] * 5, "a run outlived its end"
        assert [c() for c in seen] == [None] * 5, "a run's context outlived its end"
        worker.executor.deadlines.close()

    asyncio.run(main())


def test_the_worker_command_freezes_what_lives_before_its_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``mtask-worker`` moves what is alive before its event loop starts (modules, the registry,
    the worker's parts) out of the collector's way (``gc.freeze``): full collections during a
    drain then go through the runs' objects only."""
    from mtask.cli import worker as cli

    frozen: list[int] = []
    factories: list[Any] = []

    def run(coro: Any, loop_factory: Any) -> None:  # the loop is never made
        factories.append(loop_factory)
        frozen.append(gc.get_freeze_count())
        coro.close()

    monkeypatch.setattr("mtask.cli.worker._run", run)
    gc.unfreeze()
    try:
        uri = "mongodb://127.0.0.1:9/?directConnection=true"
        assert cli.main(["bench.app:registry", "--uri", uri]) == 0
    finally:
        gc.unfreeze()
    assert len(frozen) == 1 and frozen[0] > 1000
    assert factories == [uvloop.new_event_loop]  # --loop auto, uvloop installed


def test_a_run_whose_output_cannot_be_finished_still_records_its_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error out of the output's end (an unexpected one: not MongoDB's) escaped
    ``Executor.execute``: the run's SUCCESS was never recorded, and the task failed later as a
    TIMEOUT, on every retry."""
    registry = Registry()

    @registry.task("talk")
    async def talk(params: dict[str, Any], ctx: TaskContext) -> str:
        ctx.emit("hello")
        return "done"

    async def broken(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("the output writer broke")

    async def main() -> None:
        worker = parts(registry)
        monkeypatch.setattr(worker.outputs, "finish", broken)
        worker.executor.start(claimed("k", "talk"), time.monotonic())
        await asyncio.wait([run.task for run in worker.inflight.runs.values() if run.task])
        [outcome] = worker.recorder.pending
        assert outcome.state.value == "SUCCESS" and outcome.has_output
        worker.executor.deadlines.close()

    asyncio.run(main())
