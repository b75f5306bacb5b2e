"""A shared resource limited in tokens (docs/flow-control.md#limits-in-tokens): runs take the
resource while its window's charged tokens are below the limit, each step of a run is admitted
the same way before it starts, each charges what it spent when it returns
(``ctx.record_usage``), and the next take or step waits for the next window: with three worker
processes, no window (on the server's clock) is charged more than the limit plus one step's
tokens per step in flight (a run without steps: one run's)"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import json
from typing import Any

import pytest
import usageapp
from fastapi.testclient import TestClient
from harness import clear_of_a_window_end, running_worker, wait_for, worker_process
from harness.cli import run_cli
from pymongo import MongoClient

from mtask import AsyncTaskClient, InvalidTask
from mtask.limits import measured
from mtask.web import create_app

APP = "usageapp:registry"
LIMIT = 250
WINDOW_S = 1.5


def _within_bound(notes: list[dict[str, Any]], width_ms: int, bound: int) -> dict[int, int]:
    """Whether the charges, each known to have been written between two times of the server's
    (``before`` and ``after``), can have charged every window at most ``bound``: a charge
    whose bracket lies in one window is in it; one whose bracket spans a window's end (rare:
    milliseconds) may be in either, and some choice must keep every window within the bound.
    Returns the tokens of each window under the first such choice (raises if there is none)."""
    fixed: dict[int, int] = {}
    spanning: list[tuple[range, int]] = []
    for note in notes:
        first, last = (int(note[f].timestamp() * 1000) // width_ms for f in ("before", "after"))
        if first == last:
            fixed[first] = fixed.get(first, 0) + note["tokens"]
        else:
            spanning.append((range(first, last + 1), note["tokens"]))
    assert len(spanning) <= 8, spanning  # a few at most: each is a charge at a window's end
    for choice in itertools.product(*(r for r, _ in spanning)):
        spent = dict(fixed)
        for window, (_, tokens) in zip(choice, spanning, strict=True):
            spent[window] = spent.get(window, 0) + tokens
        if max(spent.values()) <= bound:
            return spent
    raise AssertionError(f"a window was charged past {bound}: {fixed}, spanning {spanning}")


async def test_three_workers_never_charge_a_window_past_the_limit_plus_one_run(
    aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    await aclient.set_limit(resource="llm", concurrency=1, tokens_per=(LIMIT, WINDOW_S))
    keys = [f"m{i}" for i in range(9)]
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(worker_process(mongo_uri, db_name, app=APP))
        await wait_for(lambda: _registered(aclient, 3), timeout=60, every=0.2)
        for key in keys:
            await aclient.publish("metered", key, {"uri": mongo_uri, "db": db_name})
        tasks = [await asyncio.wait_for(aclient.wait(key), 60) for key in keys]
    assert all(t.status.value == "succeeded" for t in tasks), tasks
    notes = list(mongo[db_name]["charges"].find({"after": {"$type": "date"}}))
    assert len(notes) == len(keys)  # one charge per run, each bracketed by the server's times
    assert all(isinstance(n["before"], dt.datetime) for n in notes)
    bound = LIMIT + usageapp.METERED_TOKENS
    spent = _within_bound(notes, round(WINDOW_S * 1000), bound)
    assert len(spent) >= 3, spent  # 900 tokens at most 350 a window: spread over windows
    doc = mongo[db_name]["limits"].find_one({"_id": "\x00llm"})
    assert doc is not None and doc[measured.USED] <= bound  # its current window's count


STEPS_LIMIT = 250
STEPS_WINDOW_S = 1.5


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_three_workers_admit_each_step_so_no_window_passes_the_limit_plus_one_step(
    aclient: AsyncTaskClient,
    mongo: MongoClient[dict[str, Any]],
    mongo_uri: str,
    db_name: str,
    concurrency: int,
) -> None:
    """Runs of four steps of 100 tokens each: admitted per run, a run admitted with room
    would charge a window 400 (past 250 + 100); each step admitted while the window has room
    keeps every window within 250 + 100 times the steps in flight at once (the resource's
    concurrency: a run's steps follow one another), on the server's clock."""
    await aclient.set_limit(
        resource="llm", concurrency=concurrency, tokens_per=(STEPS_LIMIT, STEPS_WINDOW_S)
    )
    keys = [f"s{i}" for i in range(3)]
    params = {"uri": mongo_uri, "db": db_name, "steps": 4}
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(worker_process(mongo_uri, db_name, app=APP))
        await wait_for(lambda: _registered(aclient, 3), timeout=60, every=0.2)
        for key in keys:
            await aclient.publish("metered_steps", key, params)
        tasks = [await asyncio.wait_for(aclient.wait(key), 60) for key in keys]
    assert all(t.status.value == "succeeded" for t in tasks), tasks
    notes = list(mongo[db_name]["charges"].find({"after": {"$type": "date"}}))
    assert len(notes) == 4 * len(keys), notes  # one charge per step, none sent twice
    bound = STEPS_LIMIT + concurrency * usageapp.STEP_CHARGE
    spent = _within_bound(notes, round(STEPS_WINDOW_S * 1000), bound)
    assert len(spent) >= 1200 // bound, spent  # 1200 tokens at most 350 (450) a window
    doc = mongo[db_name]["limits"].find_one({"_id": "\x00llm"})
    assert doc is not None and doc[measured.USED] <= bound


async def test_a_step_refused_by_a_long_window_snoozes_its_run_holding_no_slot(
    aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    """A window of 50 tokens an hour: the first step charges 100, the second is refused
    until the window's end, so its run snoozes until then (on the server's clock) instead of
    waiting in place; its first step is recorded and not called again."""
    await aclient.set_limit(resource="llm", concurrency=1, tokens_per=(50, 3600))
    params = {"uri": mongo_uri, "db": db_name, "steps": 2}
    tasks = mongo[db_name]["tasks"]
    await clear_of_a_window_end(aclient.now, 3600)  # both steps in one window
    async with running_worker(usageapp.registry, mongo_uri, db_name):
        await aclient.publish("metered_steps", "w1", params)
        await wait_for(lambda: _snoozed(tasks, "w1"), timeout=30, every=0.05)
        doc = mongo[db_name]["limits"].find_one({"_id": "\x00llm"})
        assert doc is not None and doc[measured.USED] == usageapp.STEP_CHARGE
        window_ends = doc[measured.AT] + dt.timedelta(hours=1)
        task = tasks.find_one({"_id": "w1"})
        assert task is not None and task["status"] == "pending" and task["snoozes"] == 1, task
        said = (await aclient.explain(await aclient.get("w1"))).reason
        assert "waiting for the next window of tokens of resource `llm`: 100 of 50" in said, said
        due = task["available_at"]  # the window's end, as the worker estimated the server's time
        assert abs((due - window_ends).total_seconds()) < 1, (due, window_ends)
        limits = mongo[db_name]["limits"]
        await wait_for(lambda: _given_back(limits), timeout=30, every=0.05)  # no slot held
    notes = list(mongo[db_name]["charges"].find())
    assert [n["step"] for n in notes] == [0], notes  # the second step never started


async def test_a_resource_s_window_of_tokens_is_shown_and_a_task_it_keeps_says_why(
    aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    """A run charged a window of 50 tokens an hour 100: ``mtask limits``, ``GET /limits?use``
    and the dashboard show the window's charge, and a task of a name that uses the resource
    says it waits for it."""
    await aclient.set_limit(resource="llm", tokens_per=(50, 3600))
    params = {"uri": mongo_uri, "db": db_name}
    await clear_of_a_window_end(aclient.now, 3600)  # the charge still in its window when shown
    async with running_worker(usageapp.registry, mongo_uri, db_name):
        await aclient.publish("metered", "a1", params)
        assert (await asyncio.wait_for(aclient.wait("a1"), 60)).status.value == "succeeded"
        await aclient.publish("metered", "a2", params)
        explained = await aclient.explain(await aclient.get("a2"))
        said = "resource `llm`, which `metered` uses, has spent its tokens: 100 of 50 tokens"
        assert explained.why == "limit" and explained.reason.startswith(said), explained
        assert "charged in this 3600 s window, full until" in explained.reason
        at = ("--uri", mongo_uri, "--database", db_name)
        code, out, _ = run_cli("limits", *at, width=250)
        shown = "at most 50 tokens each 3600 s (100 charged in this window, full until"
        assert code == 0 and shown in out, out
        code, out, _ = run_cli("limits", "--json", *at)
        (used,) = [u["use"] for u in json.loads(out) if u["use"]["resource"]]
        assert used["token_window"]["charged"] == 100 and used["token_window"]["limit"] == 50
        with TestClient(create_app(mongo_uri, database=db_name, token="t")) as http:
            auth = {"Authorization": "Bearer t"}
            answer = http.get("/limits", params={"use": "true"}, headers=auth).json()
            (window,) = [u["use"]["token_window"] for u in answer if u["use"]["resource"]]
            assert (window["charged"], window["limit"], window["seconds"]) == (100, 50, 3600)
            page = http.get("/ui/limits", headers=auth).text
            assert 'class="token-window">at most 50 each 3600 s · 100 charged' in page, page
            assert "full until" in page
        await aclient.cancel("a2")


async def _given_back(limits: Any) -> bool:
    doc = limits.find_one({"_id": "\x00llm"}, {"holders": 1})
    return doc is not None and not doc.get("holders")


async def _snoozed(tasks: Any, key: str) -> bool:
    doc = tasks.find_one({"_id": key}, {"snoozes": 1})
    return bool(doc and doc.get("snoozes"))


async def _registered(aclient: AsyncTaskClient, count: int) -> bool:
    return len(await aclient.workers()) >= count


@pytest.mark.parametrize(
    ("tokens_per", "said"),
    [
        ((-1, 60), "the tokens must be an integer"),
        ((0, 60), "the tokens must be an integer"),
        ((100, 0), "the window must be a number of seconds"),
        ((100, -5), "the window must be a number of seconds"),
        ((100.5, 60), "the tokens must be an integer"),
        ((100,), "must be a pair"),
    ],
)
async def test_a_bad_limit_in_tokens_is_refused_and_nothing_written(
    aclient: AsyncTaskClient,
    mongo: MongoClient[dict[str, Any]],
    db_name: str,
    tokens_per: Any,
    said: str,
) -> None:
    with pytest.raises(InvalidTask, match=said):
        await aclient.set_limit(resource="llm", tokens_per=tokens_per)
    assert mongo[db_name]["limits"].find_one({"_id": "\x00llm"}) is None


async def test_only_a_resource_takes_a_limit_in_tokens_and_one_without_charges_nothing(
    aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    with pytest.raises(InvalidTask, match="only a resource's limit takes tokens_per"):
        await aclient.set_limit("metered", concurrency=1, tokens_per=(100, 60))
    doc = await aclient.set_limit(resource="llm", concurrency=2)
    assert doc[measured.LIMIT] is None and doc[measured.WINDOW] is None
    assert measured.slots_of("metered", {"metered": ("\x00llm",)}, {"\x00llm": doc}) == ()
    doc = await aclient.set_limit(resource="llm", tokens_per=(100, 60))  # tokens alone
    assert (doc[measured.LIMIT], doc[measured.WINDOW]) == (100, 60_000)
    assert measured.slots_of("metered", {"metered": ("\x00llm",)}, {"\x00llm": doc}) == ("\x00llm",)


def test_a_limit_in_tokens_is_set_by_the_cli_and_rest_and_bad_input_refused(
    mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    at = ("--uri", mongo_uri, "--database", db_name)
    code, out, _ = run_cli("limit", "--resource", "llm", "--tokens", "500/30", *at, width=160)
    assert code == 0 and "at most 500 tokens each 30 s" in out, out
    doc = mongo[db_name]["limits"].find_one({"_id": "\x00llm"})
    assert doc is not None and (doc[measured.LIMIT], doc[measured.WINDOW]) == (500, 30_000)
    for bad in ("-5/m", "5/0", "many/m", "5/fortnight"):
        code, _, err = run_cli("limit", "--resource", "llm", f"--tokens={bad}", *at)
        assert code == 2 and "tokens_per" in err, (bad, err)
    code, _, err = run_cli("limit", "work", "--tokens", "5/m", *at)
    assert code == 2 and "--tokens belongs to a shared resource's limit" in err
    with TestClient(create_app(mongo_uri, database=db_name, token="t")) as http:
        auth = {"Authorization": "Bearer t"}
        put = http.put("/resources/llm", json={"tokens_per": [9000, 60]}, headers=auth)
        assert put.status_code == 200 and put.json()[measured.LIMIT] == 9000, put.text
        for bad in ([-1, 60], [100, 0], [100]):
            answer = http.put("/resources/llm", json={"tokens_per": bad}, headers=auth)
            assert answer.status_code == 422, (bad, answer.text)
    doc = mongo[db_name]["limits"].find_one({"_id": "\x00llm"})
    assert doc is not None and (doc[measured.LIMIT], doc[measured.WINDOW]) == (9000, 60_000)


async def test_a_limit_in_tokens_alone_holds_the_next_run_until_the_next_window(
    aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    """No concurrency, no rate: a run that charged the window full (100 of 50) keeps the next
    one out until the window ends, on the server's clock."""
    width_ms = 3000
    await aclient.set_limit(resource="llm", tokens_per=(50, width_ms / 1000))
    params = {"uri": mongo_uri, "db": db_name}
    async with running_worker(usageapp.registry, mongo_uri, db_name):
        for key in ("a1", "a2"):  # one after the other: both in flight would both be admitted
            await aclient.publish("metered", key, params)
            assert (await asyncio.wait_for(aclient.wait(key), 60)).status.value == "succeeded"
    notes = {n["key"]: n for n in mongo[db_name]["charges"].find()}
    # the window a1's charge landed in: the one of the server's time just before it, or, if the
    # charge straddled a window's end, possibly the next (the test of three workers allows both)
    first = int(notes["a1"]["before"].timestamp() * 1000) // width_ms
    assert int(notes["a2"]["before"].timestamp() * 1000) // width_ms > first, list(notes.values())


@pytest.mark.parametrize(
    ("window", "used", "room"),
    [
        ("60000", 10**6, True),  # a window that is no number: no limit in tokens
        (float("nan"), 5, True),  # read as 1 ms: the stored window is an older one
        (-3, 5, True),
        (float("inf"), 99, True),  # read as 31 days, the stored window's start is not it
        (60_000, "many", True),  # a count that is no number counts nothing
    ],
)
def test_a_limit_in_tokens_written_by_hand_never_breaks_a_take_or_a_charge(
    mongo: MongoClient[dict[str, Any]], db_name: str, window: Any, used: Any, room: bool
) -> None:
    limits = mongo[db_name]["limits"]
    at = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    fields = {measured.LIMIT: 10, measured.WINDOW: window, measured.AT: at, measured.USED: used}
    limits.insert_one({"_id": "\x00llm", **fields})
    [found] = limits.aggregate([{"$project": {"room": measured.room()}}])
    assert found["room"] is room
    limits.update_one({"_id": "\x00llm"}, measured.charged(7, "taken_at"))
    doc = limits.find_one({"_id": "\x00llm"})
    assert doc is not None and (isinstance(window, str) or doc[measured.USED] == 7), doc
