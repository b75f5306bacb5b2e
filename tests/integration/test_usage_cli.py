"""``mtask usage`` and ``mtask budget`` (docs/usage.md): the totals of names and groups, and
their budgets set, listed and cleared from the command line; bad input exits 2 and writes
nothing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from harness import running_worker
from harness.cli import run_cli
from pymongo import MongoClient
from test_usage import registry

from mtask import AsyncTaskClient


async def test_usage_and_budgets_from_the_command_line(
    aclient: AsyncTaskClient, mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    at = ("--uri", mongo_uri, "--database", db_name)
    code, out, _ = run_cli("usage", *at)
    assert code == 0 and "no usage recorded yet" in out, out
    code, out, _ = run_cli("budget", "set", "--group", "acme", "--tokens", "1000", "--period",
                           "day", *at)  # fmt: skip
    assert code == 0 and "group acme: at most 1000 tokens a day" in out, out
    calls = [["small", 100, 20, 30], ["small", 50, 10, 0]]
    async with running_worker(registry, mongo_uri, db_name):
        await aclient.publish("chat", "c1", {"calls": calls}, options={"group": "acme"})
        assert (await asyncio.wait_for(aclient.wait("c1"), 60)).status.value == "succeeded"
    code, out, _ = run_cli("usage", *at, width=200)
    assert code == 0, out
    assert "name chat" in out and "group acme" in out, out
    assert "180 (150 in, 30 cached, 30 out)" in out, out
    assert "1000 tokens a day: 180 tokens spent this period" in out, out
    code, out, _ = run_cli("usage", "--name", "chat", "--json", *at)
    (chat,) = json.loads(out)
    assert (chat["scope"], chat["id"], chat["input_tokens"], chat["requests"]) == (
        "name", "chat", 150, 2
    )  # fmt: skip
    code, out, _ = run_cli("budget", "list", *at, width=200)
    assert code == 0 and "group acme" in out and "name chat" not in out, out
    code, out, _ = run_cli("budget", "list", "--json", *at)
    assert [b["id"] for b in json.loads(out)] == ["acme"]
    code, out, _ = run_cli("budget", "clear", "--group", "acme", *at)
    assert code == 0 and "group acme: budget removed" in out, out
    code, out, _ = run_cli("budget", "clear", "--group", "acme", *at)
    assert code == 1 and "had no budget" in out, out
    code, out, _ = run_cli("budget", "list", *at)
    assert code == 0 and "no budgets" in out, out


def test_a_bad_budget_exits_2_and_writes_nothing(
    mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    at = ("--uri", mongo_uri, "--database", db_name)
    bad = [
        (("set", "--name", "chat"), "give at least one"),  # neither tokens nor cost
        (("set", "--name", "chat", "--tokens", "-5"), "tokens"),
        (("set", "--name", "chat", "--tokens", "5", "--period", "fortnight"), "fortnight"),
        (("set", "--name", "chat", "--tokens", "5", "--period", "0"), "period"),
        (("set", "--tokens", "5"), "--name N or --group G"),
        (("set", "--name", "a", "--group", "b", "--tokens", "5"), "--name N or --group G"),
        (("clear", "--name", "chat", "--tokens", "5"), "takes no --tokens"),
        (("list", "--name", "chat"), "takes no --name"),
    ]
    for args, said in bad:
        code, _, err = run_cli("budget", *args, *at)
        assert code == 2 and said in err, (args, code, err)
    assert mongo[db_name]["tasks.usage"].count_documents({}) == 0
