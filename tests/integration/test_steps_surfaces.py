"""Durable steps seen and steered from outside: ``mtask get`` shows a task's steps and
what it waits for, ``mtask signal`` and ``POST /tasks/{key}:signal`` send a signal (bad input:
exit 2 / 422, nothing written; no such task: exit 1 / 404; a finished one: exit 1 / 409)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from harness import running_worker

from mtask import AsyncTaskClient
from mtask.cli import main
from mtask.registry import Registry, TaskContext
from mtask.web import create_app

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
registry = Registry()


@registry.task("approval", options={"retry_delay_ms": 0})
async def approval(params: dict[str, Any], ctx: TaskContext) -> Any:
    def check(n: int) -> int:
        if ctx.attempt == 1:
            raise RuntimeError("the first check <fails>")
        return n

    await ctx.step("check", check, 7)
    return await ctx.wait_for("approved")


def cli(*argv: str) -> tuple[int, str, str]:
    """``mtask …`` in-process with wide consoles, its output captured (call it in a thread: the
    worker shares the test's event loop)."""
    from rich.console import Console

    from mtask.cli import common

    out, err = io.StringIO(), io.StringIO()
    saved = common.out._console, common.err._console
    common.out._console = Console(file=out, width=250, highlight=False)
    common.err._console = Console(file=err, width=250, highlight=False)
    try:
        with contextlib.redirect_stdout(out):  # --json writes to sys.stdout
            code = main(list(argv))
    finally:
        common.out._console, common.err._console = saved
    return code, out.getvalue(), err.getvalue()


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


async def test_get_shows_the_steps_and_the_wait_and_signal_wakes_it(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("approval", "a1", {})
        await events.wait("recorded", key="a1", state="WAITING")
        code, out, _ = await in_thread(cli, "get", "a1", *common)
        assert code == 0
        assert "signal 'approved', no deadline (step 2: wait:approved)" in out
        for cell in ("check", "call", "done", "wait:approved", "waiting", "#1, no deadline"):
            assert cell in out, cell
        assert "1 failed try, last: RuntimeError: the first check <fails>" in out
        code, out, _ = await in_thread(cli, "get", "a1", "--json", *common)
        doc = json.loads(out)
        assert [s["state"] for s in doc["steps"]] == ["done", "waiting"]
        assert doc["waiting"]["signal"] == "approved"

        code, out, _ = await in_thread(
            cli, "signal", "a1", "approved", "--payload", '{"by": "ann"}', "--json", *common
        )
        assert code == 0 and json.loads(out) == {"key": "a1", "signal": "approved", "woke": True}
        async with asyncio.timeout(30):
            task = await aclient.wait("a1")
    assert task.status.value == "succeeded" and task.result == {"by": "ann"}
    code, out, _ = await in_thread(cli, "get", "a1", *common)
    assert "signals" in out and "1: approved" in out and "waiting " not in out


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--payload", '{"by":'], 2, "--payload is not valid JSON"),
        (["--payload", json.dumps("y" * 70_000)], 2, "at most 65536"),
        (["--name-instead"], 2, "unrecognized arguments"),
    ],
)
async def test_signal_refuses_bad_input_with_exit_2_and_writes_nothing(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str, args: list[str], code: int, message: str
) -> None:
    await aclient.publish("approval", "b1", {})
    common = ("--uri", mongo_uri, "--database", db_name)
    if args == ["--name-instead"]:
        with pytest.raises(SystemExit) as exited:
            await in_thread(cli, "signal", "b1", "approved", *args, *common)
        assert exited.value.code == code
        return
    got, _, err = await in_thread(cli, "signal", "b1", "approved", *args, *common)
    assert got == code and message in err and "Traceback" not in err
    task = await aclient.get("b1")
    assert task is not None and task.signals == []


async def test_signal_names_what_is_wrong(
    aclient: AsyncTaskClient, mongo_uri: str, db_name: str
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    await aclient.publish("approval", "c1", {})
    code, _, err = await in_thread(cli, "signal", "c1", "", *common)
    assert code == 2 and "signal's name" in err
    code, _, err = await in_thread(cli, "signal", "nope", "approved", *common)
    assert code == 1 and "no task with key 'nope'" in err
    code, out, _ = await in_thread(cli, "signal", "c1", "approved", *common)
    assert code == 0 and "kept for its wait_for('approved')" in out  # not waiting yet
    await aclient.cancel("c1")
    code, _, err = await in_thread(cli, "signal", "c1", "approved", *common)
    assert code == 1 and "cancelled: it waits for no signal" in err
    task = await aclient.get("c1")
    assert task is not None and [s.name for s in task.signals] == ["approved"]


def test_rest_signal(mongo_uri: str, db_name: str) -> None:
    with TestClient(create_app(mongo_uri, database=db_name, token=TOKEN)) as api:
        api.post("/tasks", json={"name": "approval", "key": "r/1"}, headers=AUTH)
        path = "/tasks/r%2F1:signal"
        assert api.post(path, json={"name": "approved"}).status_code == 401
        sent = api.post(path, json={"name": "approved", "payload": [1, "a"]}, headers=AUTH)
        assert sent.status_code == 200, sent.text
        assert sent.json() == {"key": "r/1", "signal": "approved", "woke": False}
        for body, field in [
            ({"name": ""}, "name"),
            ({"name": "$status"}, "name"),
            ({"name": "x", "colour": 1}, "colour"),
            ({"payload": 1}, "name"),
            ({"name": "x", "payload": "y" * 70_000}, "payload"),
        ]:
            refused = api.post(path, json=body, headers=AUTH)
            assert refused.status_code == 422, body
            assert field in json.dumps(refused.json()["detail"]), refused.text
        missing = api.post("/tasks/nope:signal", json={"name": "x"}, headers=AUTH)
        assert missing.status_code == 404 and "nope" in missing.json()["detail"]
        api.post("/tasks/r%2F1:cancel", headers=AUTH)
        finished = api.post(path, json={"name": "approved"}, headers=AUTH)
        assert finished.status_code == 409 and "cancelled" in finished.json()["detail"]
        task = api.get("/tasks/r%2F1", headers=AUTH).json()
        assert [(s["name"], s["payload"]) for s in task["signals"]] == [("approved", [1, "a"])]
