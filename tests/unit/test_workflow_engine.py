"""Issue 61's durable-step features in the engine, without MongoDB (``mtask.steps.RunSteps`` on
``MemorySteps``): a name repeated in a loop is numbered; parallel steps are matched by name in
any completion order (hypothesis: whatever order they end in and wherever a run dies, each
step's function succeeds once); a step's own retries, backoff and time limit; ``now``/``uuid``
decided once; patch markers; output said inside a step released once it is recorded; children
spawned, awaited and failed."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
import uuid
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtask.errors import InvalidTask
from mtask.follow.output import RunOutput
from mtask.steps import MemorySteps, RunSteps, StepError, StepMismatch, Suspended
from mtask.steps.children import ChildFailed, Spawn, child_key, spawn_plan
from mtask.steps.parallel import gather, gather_sync
from mtask.steps.policy import StepPolicy, StepTimeout

T0 = dt.datetime(2026, 11, 28, 12, 0, 0, 123456, tzinfo=dt.UTC)


def journal(store: MemorySteps, attempt: int, **kw: Any) -> RunSteps:
    return RunSteps(store, list(store.recorded), run_id=f"run-{attempt}", attempt=attempt, **kw)


# -- loops ---------------------------------------------------------------------------------------


def test_a_name_asked_again_from_the_same_place_is_numbered_and_replays() -> None:
    store = MemorySteps()
    calls: Counter[str] = Counter()

    def fetch(url: str) -> str:
        calls[url] += 1
        return f"<{url}>"

    async def handler(steps: RunSteps) -> list[str]:
        return [await steps.step("fetch", fetch, u) for u in ("a", "b", "c")]

    assert asyncio.run(handler(journal(store, 1))) == ["<a>", "<b>", "<c>"]
    assert [e["name"] for e in store.recorded] == ["fetch", "fetch#2", "fetch#3"]
    assert asyncio.run(handler(journal(store, 2))) == ["<a>", "<b>", "<c>"]  # replayed
    assert calls == {"a": 1, "b": 1, "c": 1}

    async def two_places(steps: RunSteps) -> None:  # not a loop: two steps share a name
        await steps.step("fetch", fetch, "x")
        await steps.step("fetch", fetch, "y")

    with pytest.raises(StepError, match="twice"):
        asyncio.run(two_places(journal(MemorySteps(), 1)))


# -- parallel steps ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    delays=st.lists(st.integers(0, 3), min_size=2, max_size=5),
    dies_after=st.integers(0, 5),
    reorder=st.randoms(use_true_random=False),
)
def test_parallel_steps_replay_by_name_in_any_order(
    delays: list[int], dies_after: int, reorder: Any
) -> None:
    """A run dies after ``dies_after`` of the gather's steps ended (in the order their delays
    make); the next run ends them in another order. Each function succeeded exactly once, the
    results are in the order given, and the step after the gather is recorded after it."""
    store = MemorySteps()
    calls: Counter[int] = Counter()
    succeeded: Counter[int] = Counter()
    names = [f"s{i}" for i in range(len(delays))]

    class Died(Exception):
        pass

    async def handler(steps: RunSteps, order: list[int], limit: int | None) -> list[Any]:
        ended = 0

        async def one(i: int) -> int:
            nonlocal ended
            await asyncio.sleep(order[i] / 1000)
            calls[i] += 1
            ended += 1
            if limit is not None and ended > limit:
                raise Died
            succeeded[i] += 1
            return i * 10

        results = await gather(steps, [steps.step(n, one, i) for i, n in enumerate(names)], None)
        after = await steps.step("after", lambda: "after")
        return [*results, after]

    with contextlib.suppress(Died):
        asyncio.run(handler(journal(store, 1), delays, dies_after))
    order = list(delays)
    reorder.shuffle(order)
    results = asyncio.run(handler(journal(store, 2), order, None))
    assert results == [i * 10 for i in range(len(delays))] + ["after"]
    done_names = [e["name"] for e in store.recorded]
    assert sorted(done_names[: len(names)]) == sorted(names) and done_names[-1] == "after"
    assert all(e.get("group") == "gather#1" for e in store.recorded[: len(names)])
    assert succeeded == dict.fromkeys(range(len(delays)), 1)  # each succeeded once, in all
    assert all(calls[i] <= 2 for i in range(len(delays)))  # the one that died: called again
    before = Counter(calls)
    assert asyncio.run(handler(journal(store, 3), order, None)) == results  # all replayed
    assert calls == before


def test_a_failed_branch_cancels_the_others_and_a_changed_group_mismatches() -> None:
    store = MemorySteps()
    cancelled: list[str] = []

    async def slow() -> str:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.append("slow")
            raise
        return "slow"

    async def bad() -> str:
        raise ValueError("bad branch")

    async def handler(steps: RunSteps) -> list[Any]:
        return await gather(steps, [steps.step("slow", slow), steps.step("bad", bad)], None)

    with pytest.raises(ValueError, match="bad branch"):
        asyncio.run(handler(journal(store, 1)))
    assert cancelled == ["slow"]
    assert [(e["name"], e["state"]) for e in store.recorded] == [("bad", "failed")]

    done = MemorySteps()

    async def first(steps: RunSteps) -> None:
        await gather(steps, [steps.step("a", lambda: 1), steps.step("b", lambda: 2)], None)

    asyncio.run(first(journal(done, 1)))

    async def changed(steps: RunSteps) -> None:  # the new code asks for a and c
        await gather(steps, [steps.step("a", lambda: 1), steps.step("c", lambda: 3)], None)

    with pytest.raises(StepMismatch, match="'b'"):
        asyncio.run(changed(journal(done, 2)))

    async def alone(steps: RunSteps) -> None:  # a step outside the gather meanwhile
        async def outside() -> None:
            await asyncio.sleep(0)
            await steps.step("x", lambda: 0)

        await asyncio.gather(gather(steps, [steps.step("a", asyncio.sleep, 0.01)], None), outside())

    with pytest.raises(StepError, match="gather#1"):
        asyncio.run(alone(journal(MemorySteps(), 1)))


def test_gather_sync_runs_each_branch_on_a_thread() -> None:
    store = MemorySteps()
    threads: set[str] = set()

    def work(i: int) -> int:
        import threading

        threads.add(threading.current_thread().name)
        time.sleep(0.02)
        return i

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        steps = RunSteps(store, [], run_id="r", attempt=1, loop=loop)
        branches = [(lambda i=i: steps.step_sync("w", work, i)) for i in range(3)]
        return await asyncio.to_thread(gather_sync, steps, branches, None)

    assert asyncio.run(main()) == [0, 1, 2]
    assert sorted(e["name"] for e in store.recorded) == ["w", "w#2", "w#3"]
    assert len(threads) == 3


# -- a step's own policy -------------------------------------------------------------------------


def test_a_step_policy_retries_in_place_and_records_once() -> None:
    store = MemorySteps()
    writes: list[str] = []
    original = store.record

    async def record(index: int, entry: dict[str, Any], prior: Any) -> None:
        writes.append(entry["state"])
        await original(index, entry, prior)

    store.record = record  # type: ignore[method-assign]
    left = [2]

    def flaky() -> str:
        if left[0]:
            left[0] -= 1
            raise ConnectionError("reset")
        return "ok"

    policy = StepPolicy(retries=3, backoff=0.001)
    assert asyncio.run(journal(store, 1).step("call", flaky, policy=policy)) == "ok"
    assert writes == ["done"]  # one record, after its last try
    entry = store.recorded[0]
    assert entry["attempts"] == 3 and [bool(t.get("error")) for t in entry["tries"]] == [
        True,
        True,
        False,
    ]

    spent = MemorySteps()
    with pytest.raises(ConnectionError):
        asyncio.run(
            journal(spent, 1).step("call", lambda: flaky_always(), policy=StepPolicy(retries=1))
        )
    assert spent.recorded[0]["state"] == "failed" and spent.recorded[0]["attempts"] == 2
    assert StepPolicy(backoff=1, factor=2, max_backoff=3).delay(3) == 3


def flaky_always() -> None:
    raise ConnectionError("always")


def test_a_step_past_its_timeout_fails_and_bad_policies_are_named() -> None:
    store = MemorySteps()

    async def stuck() -> None:
        await asyncio.sleep(5)

    with pytest.raises(StepTimeout, match="0.05 s"):
        asyncio.run(journal(store, 1).step("stuck", stuck, policy=StepPolicy(timeout=0.05)))
    assert "StepTimeout" in store.recorded[0]["error"]
    with pytest.raises(StepTimeout):  # a plain function in a thread handler's step
        journal(MemorySteps(), 1).step_sync(
            "sleepy", time.sleep, 1, policy=StepPolicy(timeout=0.05)
        )
    for bad in ({"retries": -1}, {"retries": True}, {"backoff": 1e9}, {"timeout": 0}):
        with pytest.raises(InvalidTask, match=next(iter(bad))):
            StepPolicy(**bad)


# -- values decided once, patches ----------------------------------------------------------------


def test_now_and_uuid_are_decided_once_and_written_with_the_next_step() -> None:
    store = MemorySteps(clock=lambda: T0)

    async def handler(steps: RunSteps) -> tuple[Any, Any, Any]:
        when, ident = steps.now(), steps.uuid()
        await steps.step("use", lambda: 1)
        return when, ident, steps.now()

    when, ident, later = asyncio.run(handler(journal(store, 1)))
    assert when == T0.replace(microsecond=123000) and isinstance(ident, uuid.UUID)
    assert [e["name"] for e in store.recorded] == ["now#1", "uuid#1", "use"]  # not now#2
    store.clock = lambda: T0 + dt.timedelta(days=1)
    again = asyncio.run(handler(journal(store, 2)))
    assert again[:2] == (when, ident) and again[2] != later  # now#2 was never recorded

    nothing = MemorySteps()
    journal(nothing, 1).now()  # decided, but no step came after it: nothing written
    assert nothing.recorded == []


def test_patched_is_new_where_the_journal_has_not_gone_and_old_where_it_has() -> None:
    calls: list[str] = []

    async def v1(steps: RunSteps) -> None:
        await steps.step("charge", calls.append, "charge")
        await steps.sleep(60)
        await steps.step("ship", calls.append, "ship")

    async def v2(steps: RunSteps) -> None:
        await steps.step("charge", calls.append, "charge")
        if steps.patched("ship-first"):
            await steps.step("ship", calls.append, "ship")
            await steps.sleep(60)
        else:
            await steps.sleep(60)
            await steps.step("ship", calls.append, "ship")

    async def v3(steps: RunSteps) -> None:
        await steps.step("charge", calls.append, "charge")
        steps.deprecate_patch("ship-first")
        await steps.step("ship", calls.append, "ship")
        await steps.sleep(60)

    parked = MemorySteps(clock=lambda: T0)
    with pytest.raises(Suspended) as slept:
        asyncio.run(v1(journal(parked, 1)))
    parked.recorded.append(dict(slept.value.wait.entry or {}))
    parked.clock = lambda: T0 + dt.timedelta(minutes=2)
    asyncio.run(v2(journal(parked, 2)))  # the old branch: sleep, then ship
    assert [e["name"] for e in parked.recorded] == ["charge", "sleep#1", "ship"]

    fresh = MemorySteps(clock=lambda: T0)
    with pytest.raises(Suspended) as slept:
        asyncio.run(v2(journal(fresh, 1)))  # the new branch: ship, then sleep
    fresh.recorded.append(dict(slept.value.wait.entry or {}))
    assert [e["name"] for e in fresh.recorded] == ["charge", "patch:ship-first", "ship", "sleep#1"]
    fresh.clock = lambda: T0 + dt.timedelta(minutes=2)
    asyncio.run(v3(journal(fresh, 2)))  # the marker passed over, the rest replayed
    with pytest.raises(StepMismatch):  # v3 over a task that took the old branch
        asyncio.run(v3(journal(parked, 3)))


# -- output said inside a step -------------------------------------------------------------------


def test_what_a_step_says_is_released_once_its_record_is_written() -> None:
    output = RunOutput()
    store = MemorySteps()
    seen_at_record: list[int] = []
    original = store.record

    async def record(index: int, entry: dict[str, Any], prior: Any) -> None:
        seen_at_record.append(len(output.take().entries))  # nothing of the step's yet
        await original(index, entry, prior)

    store.record = record  # type: ignore[method-assign]

    def talk() -> int:
        output.log.info("inside the step")
        output.emit("chunk")
        return 1

    async def handler(steps: RunSteps) -> None:
        await steps.step("talk", talk)

    asyncio.run(handler(journal(store, 1, release=output.release)))
    assert seen_at_record == [0]
    kinds = [e["kind"] for e in output.take().entries]
    assert kinds == ["log", "chunk"]
    asyncio.run(handler(journal(store, 2, release=output.release)))  # replayed: says nothing
    assert output.take().entries == []


# -- children ------------------------------------------------------------------------------------


def test_children_are_spawned_once_awaited_and_their_results_come_in_order() -> None:
    store = MemorySteps(clock=lambda: T0)
    kids = [Spawn("resize", {"n": n}) for n in range(3)] + [("resize", "last", {"n": 9})]

    async def handler(steps: RunSteps) -> list[Any]:
        return await steps.run_plan(spawn_plan(steps, "p", kids, None))

    with pytest.raises(Suspended) as waited:
        asyncio.run(handler(journal(store, 1)))
    wait = waited.value.wait
    assert wait.children == "spawn#1" and wait.entry is None  # recorded by the spawn itself
    assert wait.to_document()["children"] == "spawn#1"
    assert store.recorded[0]["state"] == "waiting" and store.recorded[0]["total"] == 4
    keys = [child_key("p", "spawn#1", part) for part in ("0", "1", "2", "last")]
    assert sorted(store.tasks) == sorted(keys)
    for n, key in enumerate(keys[:3]):
        store.finish(key, n * 2)
    with pytest.raises(Suspended):  # woken early: one child is open, it waits again
        asyncio.run(handler(journal(store, 2)))
    store.finish(keys[3], 18)
    assert asyncio.run(handler(journal(store, 3))) == [0, 2, 4, 18]
    assert store.recorded[0]["state"] == "done"
    store.tasks.clear()  # replayed from the record, children gone or not
    assert asyncio.run(handler(journal(store, 4))) == [0, 2, 4, 18]


def test_a_failed_child_raises_in_the_parent_and_again_on_replay() -> None:
    store = MemorySteps(clock=lambda: T0)

    async def handler(steps: RunSteps) -> Any:
        try:
            return await steps.run_plan(spawn_plan(steps, "p", [("a", {}), ("b", {})], "kids"))
        except ChildFailed as exc:
            return {"failed": exc.failed, "results": exc.results, "said": str(exc)}

    with pytest.raises(Suspended):
        asyncio.run(handler(journal(store, 1)))
    store.finish("p/kids/0", "fine")
    store.finish("p/kids/1", status="failed", error="Traceback…\nValueError: bad image")
    caught = asyncio.run(handler(journal(store, 2)))
    assert caught["failed"] == 1 and caught["results"] == ["fine", None]
    assert "'p/kids/1' (b) failed: ValueError: bad image" in caught["said"]
    assert asyncio.run(handler(journal(store, 3))) == caught  # the same on replay
    for bad in ([], [("x",)], [Spawn("a"), Spawn("b", key="0")]):
        with pytest.raises(StepError):
            asyncio.run(
                journal(MemorySteps(), 1).run_plan(spawn_plan(journal(store, 9), "p", bad, None))
            )


def test_run_handler_spawns_children_a_test_ends_them() -> None:
    from mtask.registry import Registry, TaskContext
    from mtask.testing import run_handler
    from mtask.vocabulary import RunState

    registry = Registry()

    @registry.task("parent")
    async def parent(params: dict[str, Any], ctx: TaskContext) -> list[Any]:
        return await ctx.spawn_and_wait([("child", {"n": n}) for n in range(2)])

    steps = MemorySteps()
    waiting = run_handler(registry, "parent", {}, key="p", steps=steps)
    assert waiting.state is RunState.WAITING and sorted(steps.tasks) == [
        "p/spawn#1/0",
        "p/spawn#1/1",
    ]
    steps.finish("p/spawn#1/0", "zero")
    steps.finish("p/spawn#1/1", "one")
    done = run_handler(registry, "parent", {}, key="p", steps=steps, attempt=2)
    assert done.state is RunState.SUCCESS and done.result == ["zero", "one"]
