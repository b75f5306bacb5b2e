"""Durable steps in a process-isolated plain-def handler (docs/steps.md): its child asks the
worker over its pipe for each write and read of its journal
(``worker/running/pool/child_steps.py``), so
``ctx.step_sync``/``sleep_sync``/``wait_for_sync`` work as on a thread: steps recorded once and
replayed across a retry, a sleep and a signal wait that end the run WAITING and resume it, a
large result spilled and loaded back, a mismatch that fails the task for good. The step
functions count their calls in MongoDB: they run in another process than the test."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from typing import Any

import poolhandlers
import pytest
from harness import clear_of_a_window_end, running_worker, wait_for
from prometheus_client import REGISTRY
from test_pool import INFO
from test_steps import woke_after_its_sleep

from mtask import AsyncTaskClient, TaskContext
from mtask.limits import measured
from mtask.steps import StepError, Suspended
from mtask.worker.running.pool.child_steps import ParentSteps
from mtask.worker.running.pool.errors import TimeLimitExceeded
from mtask.worker.running.pool.pool import ProcessPool


async def _finished(aclient: AsyncTaskClient, key: str, timeout: float = 30) -> Any:
    async with asyncio.timeout(timeout):
        return await aclient.wait(key)


async def _calls(aclient: AsyncTaskClient, label: str) -> int:
    found = await aclient.collection.database["step_calls"].find_one({"_id": label})
    return 0 if found is None else int(found["n"])


@pytest.fixture
def where(mongo_uri: str, db_name: str) -> dict[str, Any]:
    """What a step function in a child needs to count its calls."""
    return {"uri": mongo_uri, "db": db_name}


async def test_steps_run_once_and_replay_across_a_retry(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, where: dict[str, Any]
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process"):
        await aclient.publish("steps_in_child", "c1", {**where, "fail_once": ["c1:label"]})
        task = await _finished(aclient, "c1")
    assert task.status.value == "succeeded", task
    first_child = task.result["charged"]["pid"]
    assert first_child != os.getpid()  # recorded in a child by run 1
    assert task.result["label"] == "L-42" and task.result["attempt"] == 2
    assert await _calls(aclient, "c1:charge") == 1  # replayed by run 2, not called
    assert await _calls(aclient, "c1:label") == 2  # failed in run 1, called again in run 2
    assert [s.name for s in task.steps] == ["charge", "label"]
    charge, label = task.steps
    assert charge.state == "done" and charge.attempts == 1
    assert charge.run_id == task.runs[0].run_id
    assert label.state == "done" and label.attempts == 2
    assert [t.error for t in label.tries] == ["RuntimeError: c1:label failed once", None]
    assert label.run_id == task.runs[1].run_id
    assert task.progress is not None and task.progress.label == "charged"


async def test_a_handler_in_a_child_continues_as_new_with_each_journals_children_its_own(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process"):
        await aclient.publish("rounds_in_child", "rc", {"round": 0, "done": []})
        task = await _finished(aclient, "rc", timeout=60)
    assert task.status.value == "succeeded", task.error
    assert task.result["done"] == [0, 2, 4] and task.result["pid"] != os.getpid()
    assert task.continued is not None and task.continued.n == 2
    assert [r.state.value for r in task.runs].count("CONTINUED") == 2


async def test_sleep_sync_ends_the_run_waiting_and_resumes(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, where: dict[str, Any]
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process") as (
        _,
        events,
    ):
        await aclient.publish("nap_in_child", "n1", {**where, "seconds": 1})
        await events.wait("recorded", key="n1", state="WAITING")
        waiting = await aclient.get("n1")
        assert waiting is not None and waiting.status.value == "pending"
        assert waiting.waiting is not None and waiting.waiting.step == "sleep#1"
        task = await _finished(aclient, "n1")
    assert task.result == "1+2"
    assert await _calls(aclient, "n1:before") == 1 and await _calls(aclient, "n1:after") == 1
    woke_after_its_sleep(task, seconds=0.9)


async def test_wait_for_sync_gets_a_signal_sent_after_the_wait(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, where: dict[str, Any]
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process") as (
        _,
        events,
    ):
        await aclient.publish("approval_in_child", "after", where)
        await aclient.publish("approval_in_child", "never", {**where, "timeout": 1})
        await events.wait("recorded", key="after", state="WAITING")
        assert await aclient.signal("after", "approved", {"by": "bob"}) is True
        after = await _finished(aclient, "after")
        never = await _finished(aclient, "never")
    assert after.result["decision"] == {"by": "bob"} and after.result["pid"] != os.getpid()
    assert [r.state.value for r in after.runs] == ["WAITING", "SUCCESS"]
    assert [s.state for s in after.steps] == ["done", "done"]
    assert never.result == "timed out"  # SignalTimeout raised in the child, caught there
    assert [s.state for s in never.steps] == ["done", "timed_out"]
    assert await _calls(aclient, "after:ask") == 1 and await _calls(aclient, "never:ask") == 1


async def test_a_large_result_spills_through_the_worker_and_comes_back(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, where: dict[str, Any]
) -> None:
    size = 100_000
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process"):
        await aclient.publish("big_in_child", "b1", {**where, "size": size})
        task = await _finished(aclient, "b1")
    assert task.result == {"bytes": size, "ok": True, "attempt": 2}, task
    assert await _calls(aclient, "b1:blob") == 1
    step = task.steps[0]
    assert step.result is None and step.spill is not None and step.spill["chunks"] == 1
    side = aclient.collection.database[f"{aclient.collection.name}.steps"]
    assert await side.count_documents({"task": "b1", "expire_at": task.expire_at}) == 1


async def test_a_step_result_bson_stores_but_pickle_refuses_is_recorded_once(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, where: dict[str, Any]
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process"):
        await aclient.publish("unpicklable_step", "u1", where)
        task = await _finished(aclient, "u1")
    assert task.status.value == "succeeded", task
    assert task.result == {"counts": {"a": 2, "b": 1}, "attempt": 2}
    assert await _calls(aclient, "u1:tally") == 1  # recorded by run 1, replayed by run 2
    assert task.steps[0].state == "done" and task.steps[0].result == {"a": 2, "b": 1}


async def test_a_step_mismatch_fails_the_task_for_good(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, where: dict[str, Any]
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process"):
        await aclient.publish("fickle_in_child", "f1", where, options={"max_retries": 5})
        task = await _finished(aclient, "f1")
    assert task.status.value == "failed"
    assert (task.error or "").startswith("StepMismatch: ")
    assert "recorded as 'a' (call); this run asked for 'b'" in (task.error or "")
    assert len(task.runs) == 2  # no retry after the mismatch
    assert [s.name for s in task.steps] == ["a", "sleep#1"]  # nothing half-written
    assert await _calls(aclient, "f1:b") == 0


async def test_the_workers_refusal_is_raised_in_the_child_as_itself(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process"):
        await aclient.publish("steps_refused_in_child", "r1", {}, options={"concurrency": 2})
        task = await _finished(aclient, "r1")
    assert task.status.value == "failed", task
    assert (task.error or "").startswith("failed: caught StepError in ")
    assert f"in {os.getpid()}:" not in (task.error or "")  # caught in the child
    assert "durable steps need a task of concurrency 1" in (task.error or "")
    assert task.steps == []


# -- the pool: what the run ends with arrives as itself --------------------------------------------


async def test_a_sleep_in_a_child_raises_suspended_with_its_wait(pool: ProcessPool) -> None:
    ctx = TaskContext("k", "n", 1, "run-1", "w-1")  # its journal in memory
    with pytest.raises(Suspended) as raised:
        await pool.run(
            poolhandlers.registry["sleep_in_child"],
            {"seconds": 60},
            INFO,
            on_step=ParentSteps(ctx).answer,
        )
    wait = raised.value.wait
    assert wait.index == 0 and wait.entry is not None and wait.entry["name"] == "nap"
    assert wait.until - dt.datetime.now(dt.UTC) > dt.timedelta(seconds=50)
    assert pool.state()["idle"] == 1  # the child is kept: a wait is no failure


async def test_steps_in_a_run_without_a_journal_are_a_step_error(pool: ProcessPool) -> None:
    with pytest.raises(StepError, match="no journal"):
        await pool.run(poolhandlers.registry["steps_without_a_worker"], {}, INFO)
    assert pool.state()["idle"] == 1


async def test_a_step_answer_that_hangs_does_not_keep_the_run_from_its_time_limit(
    pool: ProcessPool,
) -> None:
    asked: list[str] = []
    given_up = asyncio.Event()

    async def hang(op: str, args: tuple[Any, ...]) -> Any:
        asked.append(op)
        try:
            await asyncio.Event().wait()  # MongoDB does not answer
        finally:
            given_up.set()

    handler = poolhandlers.registry["steps_without_a_worker"]
    with pytest.raises(StepError, match="no journal"):  # a child started and idle: the time
        await pool.run(handler, {}, INFO)  # limit below counts the run, not a child's start
    assert pool.state()["idle"] == 1
    with pytest.raises(TimeLimitExceeded):
        await pool.run(handler, {}, INFO, hard_timeout=3.0, on_step=hang)
    assert asked == ["journal"]
    await asyncio.wait_for(given_up.wait(), 5)  # the answer is abandoned with the run
    assert pool.state()["time_limit_kills"] == 1


async def test_usage_recorded_in_a_child_is_the_workers_per_run_and_model(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    """``ctx.record_usage_sync`` in a process-isolated handler's steps (and outside them) is
    charged by the worker: priced, per run and per model, to its name, and a retry's replayed
    steps charge nothing."""
    calls = [["small", 1000, 200], ["big", 50, 5], ["small", 2000, 100]]
    metric = {"name": "usage_in_child", "model": "small", "kind": "input"}
    before = REGISTRY.get_sample_value("mtask_tokens_total", metric) or 0.0
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process"):
        await aclient.publish("usage_in_child", "u1", {"calls": calls})
        task = await _finished(aclient, "u1")
    assert task.status.value == "succeeded", task.error
    assert task.result != os.getpid() and len(task.runs) == 2
    usage = task.usage
    assert (usage.input_tokens, usage.output_tokens, usage.requests) == (3051, 305, 4)
    # 3000 x 1 + 300 x 4 per million tokens (4_200_000 nanos), and 0.5 said outside any step
    assert usage.cost_nanos == 4_200_000 + 500_000_000
    by_model = {m.model: m for m in usage.models}
    assert (by_model["small"].input_tokens, by_model["small"].output_tokens) == (3000, 300)
    assert by_model["small"].cost_nanos == 4_200_000 and by_model["small"].requests == 2
    assert by_model["big"].input_tokens == 50 and by_model["big"].cost_nanos is None
    first, second = task.runs
    assert first.usage is not None and first.usage.input_tokens == 3050
    assert second.usage is not None and (second.usage.input_tokens, second.usage.requests) == (1, 1)
    scopes = aclient.collection.database["tasks.usage"]
    name = await scopes.find_one({"_id.scope": "name", "_id.id": "usage_in_child"})
    assert name is not None and name["input_tokens"] == 3051 and name["requests"] == 4
    after = REGISTRY.get_sample_value("mtask_tokens_total", metric) or 0.0
    assert after - before == 3000


async def test_a_budget_stops_a_process_isolated_handlers_next_step(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process"):
        await aclient.publish(
            "spender_in_child", "b1", {"steps": 5}, options={"budget": {"tokens": 250}}
        )
        task = await _finished(aclient, "b1")
    assert task.status.value == "failed" and task.failed_permanently, task
    assert task.error is not None and "budget exceeded: the task budget of 250 tokens" in task.error
    assert "300 tokens spent" in task.error
    assert [s.name for s in task.steps] == ["call0", "call1", "call2"]  # call3 never started
    assert task.usage.input_tokens + task.usage.output_tokens == 300
    assert len(task.runs) == 1  # a budget spent is for good: no retry


async def test_a_window_of_tokens_admits_a_process_isolated_handlers_steps(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    """A window of 50 tokens an hour: the child's first step charges 100 to it, its second
    is refused until the window's end, so the run snoozes, as on a thread."""
    await aclient.set_limit(resource="llm", concurrency=1, tokens_per=(50, 3600))
    snoozed = {"_id": "w1", "snoozes": 1}
    await clear_of_a_window_end(aclient.now, 3600)  # both steps in one window
    async with running_worker(poolhandlers.registry, mongo_uri, db_name, pool="process"):
        await aclient.publish("metered_in_child", "w1", {"steps": 2})
        await wait_for(lambda: aclient.collection.find_one(snoozed), timeout=30, every=0.05)
    limit = await aclient.collection.database["limits"].find_one({"_id": "\x00llm"})
    assert limit is not None and limit[measured.USED] == 100
    task = await aclient.get("w1")
    assert task.status.value == "pending" and [s.name for s in task.steps] == ["call0"]
    said = (await aclient.explain(task)).reason
    assert "waiting for the next window of tokens of resource `llm`: 100 of 50" in said, said
