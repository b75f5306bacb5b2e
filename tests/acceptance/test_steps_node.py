"""A Node.js service signals a task with the plain ``mongodb`` npm driver (docs/steps.md,
"Signals from any language"): ``interop/signal.mjs`` sends the documented
``updateOne(filter, pipeline)`` to a real worker's tasks on the real replica set. A waiting task
resumes with the payload; a signal sent before the wait is not lost; a finished task is not
touched. And the page cannot drift: its update, signal.mjs's and ``mtask.store.steps.signal``'s
are compared structurally."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import node as find_node
from harness import running_worker
from pymongo import MongoClient
from pymongo.collection import Collection

from mtask import AsyncTaskClient, Task
from mtask.driver import Call
from mtask.registry import Registry, TaskContext
from mtask.store import steps as store_steps

HERE = Path(__file__).parent
INTEROP = HERE / "interop"
SCRIPT = INTEROP / "signal.mjs"
DOC = HERE.parents[1] / "docs" / "steps.md"
SECTION = "## Signals from any language"
COLLECTION = "jobs"  # not the default: signal.mjs is told which collection
KEY = "<key>"  # the task key compared in the filters (the page's `key` variable)

# a nested object, numbers, strings (one that would be a field path without $literal), a bool,
# a null and an array: what a JSON payload can hold, each of its types kept
PAYLOAD: dict[str, Any] = {
    "by": "ann",
    "order": {"id": "o-17", "lines": [{"sku": "A-1", "qty": 2}, {"sku": "B-9", "qty": 1}]},
    "amount": 1234,
    "ratio": 0.25,
    "note": "$status",
    "text": "ünïcode ✓",
    "gift": False,
    "coupon": None,
    "tags": ["rush", 7, True],
}

registry = Registry()
ENTERED: dict[str, asyncio.Event] = {}
GATES: dict[str, asyncio.Event] = {}


@registry.task("approval")
async def approval(params: dict[str, Any], ctx: TaskContext) -> Any:
    if ctx.key in GATES:  # the test sends its signal while the run is here, before the wait
        ENTERED[ctx.key].set()
        await GATES[ctx.key].wait()
    return await ctx.wait_for("approved", timeout=params.get("timeout"))


async def run_script(node: str, *args: str) -> Any:
    proc = await asyncio.create_subprocess_exec(
        node,
        str(SCRIPT),
        *args,
        cwd=INTEROP,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


async def node_signal(node: str, uri: str, db: str, key: str, payload: Any) -> dict[str, int]:
    """Node sends signal ``approved``; its ``matchedCount`` and ``modifiedCount``."""
    result: dict[str, int] = await run_script(
        node, uri, db, COLLECTION, key, "approved", json.dumps(payload)
    )
    return result


def typed(value: Any) -> Any:
    """``value`` with each scalar's type beside it (``True == 1`` and ``1 == 1.0`` in Python)."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    return (type(value).__name__, value)


@pytest.fixture
async def jobs(mongo_uri: str, db_name: str) -> AsyncIterator[AsyncTaskClient]:
    async with AsyncTaskClient(mongo_uri, database=db_name, collection=COLLECTION) as c:
        yield c


@pytest.fixture
def raw(mongo: MongoClient[dict[str, Any]], db_name: str) -> Collection[dict[str, Any]]:
    """The jobs' collection as Node's driver sees it: plain documents."""
    return mongo[db_name][COLLECTION]


async def finished(jobs: AsyncTaskClient, key: str) -> Task:
    async with asyncio.timeout(60):
        return await jobs.wait(key)


# -- against a real worker ------------------------------------------------------------------------


async def test_a_node_signal_resumes_a_waiting_task_with_its_payload(
    mongo_uri: str, db_name: str, jobs: AsyncTaskClient
) -> None:
    node = find_node(INTEROP)
    async with running_worker(registry, mongo_uri, db_name, collection=COLLECTION) as (_, events):
        await jobs.publish("approval", "wait-1", {})  # no timeout: only the signal can wake it
        await events.wait("recorded", key="wait-1", state="WAITING", timeout=60)
        waiting = await jobs.get("wait-1")
        assert waiting is not None and waiting.status == "pending", waiting
        assert waiting.waiting is not None and waiting.waiting.signal == "approved"
        # it waits for the signal and nothing else (9999-01-01: no timeout)
        assert waiting.available_at is not None and waiting.available_at.year == 9999
        assert await node_signal(node, mongo_uri, db_name, "wait-1", PAYLOAD) == {
            "matchedCount": 1,
            "modifiedCount": 1,
        }
        task = await finished(jobs, "wait-1")
    assert task.status == "succeeded", task
    assert typed(task.result) == typed(PAYLOAD)
    assert [r.state.value for r in task.runs] == ["WAITING", "SUCCESS"]
    [sent] = task.signals
    assert sent.name == "approved" and typed(sent.payload) == typed(PAYLOAD)
    assert task.waiting is None


async def test_a_node_signal_sent_before_the_wait_is_not_lost(
    mongo_uri: str, db_name: str, jobs: AsyncTaskClient, raw: Collection[dict[str, Any]]
) -> None:
    node = find_node(INTEROP)
    # before any worker claimed the task: the signal is kept, and does not move the task's times
    await jobs.publish("approval", "queued", {})
    before = raw.find_one({"_id": "queued"})
    assert await node_signal(node, mongo_uri, db_name, "queued", PAYLOAD) == {
        "matchedCount": 1,
        "modifiedCount": 1,
    }
    after = raw.find_one({"_id": "queued"})
    assert before is not None and after is not None
    assert after["status"] == "pending" and "waiting" not in after
    assert (after["available_at"], after["next_claim_at"]) == (
        before["available_at"],
        before["next_claim_at"],
    )
    assert [(s["name"], s["payload"]) for s in after["signals"]] == [("approved", PAYLOAD)]
    # while a run holds the task, before its wait begins
    ENTERED["running"], GATES["running"] = asyncio.Event(), asyncio.Event()
    try:
        async with running_worker(registry, mongo_uri, db_name, collection=COLLECTION) as (
            _,
            events,
        ):
            await jobs.publish("approval", "running", {})
            await asyncio.wait_for(ENTERED["running"].wait(), 60)
            held = raw.find_one({"_id": "running"}, {"status": 1})
            assert held is not None and held["status"] == "running"
            assert await node_signal(node, mongo_uri, db_name, "running", "go") == {
                "matchedCount": 1,
                "modifiedCount": 1,
            }
            GATES["running"].set()
            running = await finished(jobs, "running")
            queued = await finished(jobs, "queued")
    finally:
        del ENTERED["running"], GATES["running"]
    for task, payload in ((queued, PAYLOAD), (running, "go")):
        assert task.status == "succeeded", task
        assert typed(task.result) == typed(payload)
        assert [r.state.value for r in task.runs] == ["SUCCESS"]  # it never had to wait
        assert not events.matching("waiting", key=task.key)


async def test_a_node_signal_to_a_finished_task_matches_nothing(
    mongo_uri: str, db_name: str, jobs: AsyncTaskClient, raw: Collection[dict[str, Any]]
) -> None:
    node = find_node(INTEROP)
    await jobs.publish("approval", "done", {})
    assert await jobs.signal("done", "approved", {"first": 1}) is False
    async with running_worker(registry, mongo_uri, db_name, collection=COLLECTION):
        task = await finished(jobs, "done")
    assert task.status == "succeeded" and task.result == {"first": 1}
    before = raw.find_one({"_id": "done"})
    assert await node_signal(node, mongo_uri, db_name, "done", PAYLOAD) == {
        "matchedCount": 0,
        "modifiedCount": 0,
    }
    assert raw.find_one({"_id": "done"}) == before  # not a field changed, updated_at neither
    # the filter's other refusals: no such task (and no upsert), a task holding 1,000 signals
    assert await node_signal(node, mongo_uri, db_name, "nope", PAYLOAD) == {
        "matchedCount": 0,
        "modifiedCount": 0,
    }
    assert raw.count_documents({"_id": "nope"}) == 0
    await jobs.publish("approval", "full", {})
    at = raw.find_one({"_id": "full"}, {"created_at": 1})
    assert at is not None
    sent = [{"name": f"s{i}", "payload": i, "at": at["created_at"]} for i in range(1000)]
    raw.update_one({"_id": "full"}, {"$set": {"signals": sent}})
    before = raw.find_one({"_id": "full"})
    assert await node_signal(node, mongo_uri, db_name, "full", PAYLOAD) == {
        "matchedCount": 0,
        "modifiedCount": 0,
    }
    assert raw.find_one({"_id": "full"}) == before


# -- the page, signal.mjs and the code: one update -----------------------------------------------


@dataclass(frozen=True)
class Ident:
    """A bare JavaScript identifier used as a value (the page's ``key``)."""

    name: str


TOKEN = re.compile(
    r"""\s*(?:(?P<punct>[{}\[\]:,()])|(?P<string>"(?:[^"\\]|\\.)*")"""
    r"""|(?P<number>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)|(?P<ident>[A-Za-z_$][\w$]*))""",
    re.S,
)


class JsLiteral:
    """Reads JavaScript object and array literals as the page writes them: unquoted or
    double-quoted keys, double-quoted strings, numbers, true/false/null, bare identifiers
    (``Ident``), trailing commas. Anything else fails."""

    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while text[pos:].strip():
            found = TOKEN.match(text, pos)
            assert found, f"cannot read the page's JavaScript at {text[pos : pos + 40]!r}"
            kind = found.lastgroup
            assert kind is not None
            self.tokens.append((kind, found.group(kind)))
            pos = found.end()
        self.at = 0

    def next(self) -> tuple[str, str]:
        token = self.tokens[self.at]
        self.at += 1
        return token

    def peek(self) -> str:
        return self.tokens[self.at][1]

    def expect(self, punct: str) -> None:
        token = self.next()
        assert token == ("punct", punct), f"expected {punct!r}, found {token[1]!r}"

    def value(self) -> Any:
        kind, text = self.next()
        if kind == "string":
            return json.loads(text)
        if kind == "number":
            return json.loads(text)
        if kind == "ident":
            return {"true": True, "false": False, "null": None}.get(text, Ident(text))
        if text == "[":
            items = []
            while self.peek() != "]":
                items.append(self.value())
                if self.peek() != "]":
                    self.expect(",")
            self.expect("]")
            return items
        assert text == "{", f"unexpected {text!r}"
        obj: dict[str, Any] = {}
        while self.peek() != "}":
            kind, name = self.next()
            assert kind in ("ident", "string"), f"unexpected key {name!r}"
            name = json.loads(name) if kind == "string" else name
            assert name not in obj, f"{name!r} twice in one object"
            self.expect(":")
            obj[name] = self.value()
            if self.peek() != "}":
                self.expect(",")
        self.expect("}")
        return obj


def documented() -> tuple[Any, Any]:
    """The filter and the pipeline of the page's ``tasks.updateOne(filter, pipeline)``, its
    only arguments (an options argument, an upsert, would be drift)."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```js\n(.*?)```", section, re.S)
    assert block, f"no js block under {SECTION!r}"
    code = block.group(1).strip()
    prefix = "await tasks.updateOne("
    assert code.startswith(prefix), code[:60]
    reader = JsLiteral(code[len(prefix) :].rstrip().removesuffix(";"))
    filt = reader.value()
    reader.expect(",")
    pipeline = reader.value()
    if reader.at < len(reader.tokens) and reader.peek() == ",":
        reader.expect(",")
    reader.expect(")")
    assert reader.at == len(reader.tokens), "more after updateOne(...)"
    return filt, pipeline


def example_signal(pipeline: Any) -> tuple[str, Any]:
    """The page's example signal name and payload, read from its pipeline's new entry."""
    entry = pipeline[0]["$set"]["signals"]["$concatArrays"][1][0]
    assert set(entry) == {"name", "payload", "at"}, entry
    assert set(entry["payload"]) == {"$literal"}, entry["payload"]
    return entry["name"], entry["payload"]["$literal"]


def the_code(key: str, name: str, payload: Any) -> tuple[Any, Any]:
    """The filter and pipeline ``client.signal(key, name, payload)`` sends: the first call of
    ``mtask.store.steps.signal``, its update ``signal_pipeline(name, payload)``."""
    op = store_steps.signal(key, name, payload)
    call = next(op)
    op.close()
    assert isinstance(call, Call) and call.method == "find_one_and_update", call
    filt, pipeline = call.args
    assert pipeline == store_steps.signal_pipeline(name, payload)
    return filt, pipeline


def keyed(value: Any, key: str) -> Any:
    """The page's ``key`` variable replaced by ``key``."""
    if value == Ident("key"):
        return key
    if isinstance(value, dict):
        return {k: keyed(v, key) for k, v in value.items()}
    if isinstance(value, list):
        return [keyed(v, key) for v in value]
    assert not isinstance(value, Ident), f"the page's update uses {value.name!r}"
    return value


def test_the_documented_update_is_the_codes() -> None:
    filt, pipeline = documented()
    name, payload = example_signal(pipeline)
    code_filter, code_pipeline = the_code(KEY, name, payload)
    assert filt["_id"] == Ident("key")
    assert keyed(filt, KEY) == code_filter
    assert keyed(pipeline, KEY) == code_pipeline
    # …key order too: a $set's fields and a filter's are BSON documents
    assert json.dumps(keyed(filt, KEY)) == json.dumps(code_filter)
    assert json.dumps(keyed(pipeline, KEY)) == json.dumps(code_pipeline)
    # the page's figures around it
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    assert f"{store_steps.MAX_SIGNALS:,} signals already" in section
    assert f'"signals.{store_steps.MAX_SIGNALS - 1}"' in section


async def test_signal_mjs_sends_the_documented_update() -> None:
    node = find_node(INTEROP)
    filt, pipeline = documented()
    name, payload = example_signal(pipeline)
    # with the page's example values: the page's update, exactly
    printed = await run_script(node, "--print", "key", name, json.dumps(payload))
    assert printed == {"filter": keyed(filt, "key"), "pipeline": keyed(pipeline, "key")}
    assert json.dumps(printed) == json.dumps(
        {"filter": keyed(filt, "key"), "pipeline": keyed(pipeline, "key")}
    )
    # with the payload the tests send: the code's update, exactly
    code_filter, code_pipeline = the_code("wait-1", "approved", PAYLOAD)
    printed = await run_script(node, "--print", "wait-1", "approved", json.dumps(PAYLOAD))
    assert printed == {"filter": code_filter, "pipeline": code_pipeline}
    literal = printed["pipeline"][0]["$set"]["signals"]["$concatArrays"][1][0]["payload"]
    assert typed(literal) == typed({"$literal": PAYLOAD})
