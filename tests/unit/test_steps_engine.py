"""The durable-steps engine without MongoDB (``mtask.steps.RunSteps`` on ``MemorySteps``):
replay across runs, failures recorded and retried, the replay rules, sleeps and signal waits
(property tests with hypothesis); and the fenced writes it asks the store for
(``mtask.store.steps``), read without I/O."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtask.steps import (
    INLINE_BYTES,
    NEVER,
    MemorySteps,
    RunSteps,
    SignalTimeout,
    StepError,
    StepMismatch,
    Suspended,
)
from mtask.store import steps as store_steps
from mtask.store.outcomes import Outcome, finish_update
from mtask.vocabulary import RunState

T0 = dt.datetime(2026, 11, 24, 12, 0, tzinfo=dt.UTC)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now


def journal(store: MemorySteps, attempt: int) -> RunSteps:
    return RunSteps(store, list(store.recorded), run_id=f"run-{attempt}", attempt=attempt)


names = st.lists(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=20),
    min_size=1,
    max_size=8,
    unique=True,
)


@settings(max_examples=150, deadline=None)
@given(names=names, failures=st.data())
def test_each_step_runs_until_it_succeeds_once_then_replays(
    names: list[str], failures: Any
) -> None:
    """Whatever fails when, every step's function succeeds exactly once per task; a failed
    step is called again by the next run; a done one is never called again."""
    fails = {n: failures.draw(st.integers(0, 2), label=n) for n in names}
    initial = dict(fails)
    calls: Counter[str] = Counter()
    store = MemorySteps()

    def fn(name: str) -> str:
        calls[name] += 1
        if fails[name] > 0:
            fails[name] -= 1
            raise RuntimeError(f"{name} failed")
        return f"result of {name}"

    async def handler(steps: RunSteps) -> list[Any]:
        return [await steps.step(n, fn, n) for n in names]

    runs, results = 0, None
    while results is None:
        runs += 1
        assert runs < 100
        with contextlib.suppress(RuntimeError):
            results = asyncio.run(handler(journal(store, runs)))
    assert results == [f"result of {n}" for n in names]
    expected_calls = {n: 1 + initial[n] for n in names}
    assert dict(calls) == expected_calls
    assert [e["name"] for e in store.recorded] == names
    assert all(e["state"] == "done" for e in store.recorded)
    assert [e["attempts"] for e in store.recorded] == [expected_calls[n] for n in names]
    assert all(len(e["tries"]) == e["attempts"] for e in store.recorded)
    # one more run replays everything: no call
    before = Counter(calls)
    assert asyncio.run(handler(journal(store, runs + 1))) == results
    assert calls == before


@settings(max_examples=100, deadline=None)
@given(recorded=names, asked=names)
def test_asking_for_other_steps_than_recorded_is_a_mismatch_and_writes_nothing(
    recorded: list[str], asked: list[str]
) -> None:
    store = MemorySteps()

    async def record_all() -> None:
        steps = journal(store, 1)
        for n in recorded:
            await steps.step(n, lambda: 1)

    asyncio.run(record_all())
    kept = [dict(e) for e in store.recorded]
    steps = journal(store, 2)

    async def ask() -> None:
        for n in asked:
            await steps.step(n, lambda: 2)

    prefix = all(a == r for a, r in zip(asked, recorded, strict=False))
    if prefix:
        asyncio.run(ask())
        assert [e["name"] for e in store.recorded][: len(recorded)] == recorded
    else:
        with pytest.raises(StepMismatch, match="recorded order"):
            asyncio.run(ask())
        assert store.recorded[: len(kept)] == kept  # nothing half-written in their place


def test_a_name_twice_and_bad_names_are_refused() -> None:
    steps = journal(MemorySteps(), 1)

    async def twice() -> None:
        await steps.step("a", lambda: 1)
        await steps.step("a", lambda: 2)

    with pytest.raises(StepError, match="twice"):
        asyncio.run(twice())
    for bad in ("", "x" * 201, "a\x00b", 3):
        with pytest.raises(StepError, match="name"):
            asyncio.run(journal(MemorySteps(), 1).step(bad, lambda: 1))  # type: ignore[arg-type]
    for bad in ("", "$status", "a\x00b"):  # a signal's name is a value in a pipeline: no "$"
        with pytest.raises(StepError, match="signal's name"):
            asyncio.run(journal(MemorySteps(), 1).wait_for(bad))


def test_a_result_must_be_bson_and_large_ones_spill() -> None:
    store = MemorySteps()
    with pytest.raises(StepError, match="BSON"):
        asyncio.run(journal(store, 1).step("bad", lambda: object()))
    big = "x" * (INLINE_BYTES + 1)
    steps = journal(MemorySteps(), 1)
    assert asyncio.run(steps.step("big", lambda: big)) == big
    entry = steps.store.recorded[0]  # type: ignore[attr-defined]
    assert "result" not in entry and entry["spill"]["bytes"] > INLINE_BYTES and steps.spilled
    replay = RunSteps(steps.store, steps.store.recorded, run_id="r2", attempt=2)  # type: ignore[attr-defined]
    assert asyncio.run(replay.step("big", lambda: "called again")) == big


def test_sleep_suspends_then_resumes_once_the_clock_passes() -> None:
    clock = Clock()
    store = MemorySteps(clock=clock)

    async def handler(steps: RunSteps) -> str:
        await steps.sleep(60)
        return "awake"

    with pytest.raises(Suspended) as waited:
        asyncio.run(handler(journal(store, 1)))
    wait = waited.value.wait
    assert wait.until == T0 + dt.timedelta(seconds=60) and wait.signal is None
    assert wait.entry is not None and wait.entry["state"] == "waiting"
    store.recorded.append(wait.entry)  # what the WAITING outcome writes
    clock.now = T0 + dt.timedelta(seconds=30)  # resumed early (a manual retry): sleeps on
    with pytest.raises(Suspended) as again:
        asyncio.run(handler(journal(store, 2)))
    assert again.value.wait.until == wait.until and again.value.wait.entry is None
    clock.now = T0 + dt.timedelta(seconds=61)
    assert asyncio.run(handler(journal(store, 3))) == "awake"
    assert store.recorded[0]["state"] == "done"


def test_wait_for_takes_the_nth_signal_of_its_name_and_times_out() -> None:
    clock = Clock()
    store = MemorySteps(clock=clock)

    async def handler(steps: RunSteps) -> list[Any]:
        first = await steps.wait_for("ok", timeout=10)
        second = await steps.wait_for("ok", timeout=10)
        return [first, second]

    store.signal("ok", 1)  # before the wait: not lost
    with pytest.raises(Suspended) as waited:
        asyncio.run(handler(journal(store, 1)))
    wait = waited.value.wait
    assert (wait.signal, wait.nth, wait.index) == ("ok", 1, 1)
    assert [e["name"] for e in store.recorded] == ["wait:ok"]
    store.recorded.append(dict(wait.entry or {}))
    store.signal("other", 3)
    store.signal("ok", 2)
    assert asyncio.run(handler(journal(store, 2))) == [1, 2]
    assert [e["name"] for e in store.recorded] == ["wait:ok", "wait:ok#2"]

    late = MemorySteps(clock=clock)
    with pytest.raises(Suspended) as never:
        asyncio.run(journal(late, 1).wait_for("ok", timeout=5))
    late.recorded.append(dict(never.value.wait.entry or {}))
    clock.now += dt.timedelta(seconds=6)
    with pytest.raises(SignalTimeout):
        asyncio.run(journal(late, 2).wait_for("ok", timeout=5))
    assert late.recorded[0]["state"] == "timed_out"
    with pytest.raises(SignalTimeout, match="recorded"):  # a replay raises it again
        asyncio.run(journal(late, 3).wait_for("ok", timeout=5))
    forever = MemorySteps(clock=clock)
    with pytest.raises(Suspended) as unbounded:
        asyncio.run(journal(forever, 1).wait_for("ok"))
    assert unbounded.value.wait.until == NEVER


def test_sync_calls_from_a_thread_run_their_io_on_the_loop() -> None:
    store = MemorySteps()

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        steps = RunSteps(store, [], run_id="r", attempt=1, loop=loop)
        got = await asyncio.to_thread(lambda: [steps.step_sync("a", lambda: 1)])
        with pytest.raises(StepError, match="await"):
            steps.step_sync("b", lambda: 2)  # on the loop's own thread: refused
        return got

    assert asyncio.run(main()) == [1]
    assert [e["name"] for e in store.recorded] == ["a"]


def test_record_writes_are_fenced_and_positioned() -> None:
    entry = {"name": "a", "kind": "call", "state": "done", "attempts": 1}
    filt, update = store_steps.record_update("k", "r1", 2, entry, None)
    assert filt["_id"] == "k" and filt["status"] == "running"
    assert filt["runs"] == {"$elemMatch": {"run_id": "r1", "state": "RUNNING"}}
    assert "$expr" in filt  # the lease, on the server's clock
    assert filt["steps.2"] == {"$exists": False} and filt["steps.1"] == {"$exists": True}
    assert update == {"$push": {"steps": entry}, "$unset": {"waiting": ""}}
    prior = {"name": "a", "kind": "call", "state": "failed", "attempts": 1}
    filt, update = store_steps.record_update("k", "r1", 0, {**entry, "attempts": 2}, prior)
    assert filt["steps.0.attempts"] == 1 and filt["steps.0.state"] == "failed"
    assert update["$set"] == {"steps.0": {**entry, "attempts": 2}}
    call = store_steps.record("k", "r1", 0, entry, None, in_transaction=True).send(None)
    assert call.method == "update_one"  # a transactional step's record frees its session's id
    assert call.args[1]["$unset"] == {"waiting": "", "runs.$[mine].txn": ""}
    assert call.kwargs == {"array_filters": [{"mine.run_id": "r1"}]}
    plain = store_steps.record("k", "r1", 0, entry, None).send(None)
    assert plain.args[1]["$unset"] == {"waiting": ""} and plain.kwargs == {}


def test_a_waiting_outcome_records_its_step_and_when_to_wake() -> None:
    steps = RunSteps(MemorySteps(clock=lambda: T0), [], run_id="r1", attempt=1)
    with pytest.raises(Suspended) as waited:
        asyncio.run(steps.wait_for("ok", timeout=60))
    outcome = Outcome("k", "r1", RunState.WAITING, wait=waited.value.wait)
    filt, pipeline = finish_update(outcome, T0)
    assert filt == {"_id": "k", "runs": {"$elemMatch": {"run_id": "r1", "state": "RUNNING"}}}
    sets = pipeline[0]["$set"]
    assert sets["waiting"]["$literal"]["signal"] == "ok"
    wake = sets["available_at"]["$cond"]
    assert wake[1] == T0 and wake[2] == T0 + dt.timedelta(seconds=60)  # now if it came
    assert "steps" in sets and "failures" not in sets  # a wait is no failure
    signal = store_steps.signal_pipeline("ok", {"a": 1})[0]["$set"]
    assert signal["signals"]["$concatArrays"][1][0]["payload"] == {"$literal": {"a": 1}}
    assert signal["available_at"]["$cond"][1] == "$$NOW"


def test_steps_run_one_at_a_time() -> None:
    store = MemorySteps()
    steps = journal(store, 1)

    async def inner() -> int:
        return int(await steps.step("inner", lambda: 1))

    async def nested() -> None:
        await steps.step("outer", inner)

    with pytest.raises(StepError, match="one step at a time"):
        asyncio.run(nested())
    assert [e["state"] for e in store.recorded] == ["failed"]  # the outer one, refused inside

    async def slow(i: int) -> int:
        await asyncio.sleep(0.01)
        return i

    async def both() -> list[Any]:
        return list(await asyncio.gather(steps2.step("a", slow, 1), steps2.step("b", slow, 2)))

    steps2 = journal(MemorySteps(), 1)
    with pytest.raises(StepError, match="one step at a time"):
        asyncio.run(both())
