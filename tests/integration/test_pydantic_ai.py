"""Pydantic AI agents as durable tasks (``mtask.contrib.pydantic_ai``), with real worker
processes (``tests/agentapp.py``) and the embedded mongod; the model is a ``FunctionModel``
that counts its calls in the test's database (no network)."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
from harness import wait_for, worker_process
from needs import missing

from mtask import TaskClient

try:
    import pydantic_ai
except ImportError:  # pragma: no cover - CI installs the extra
    pydantic_ai = None

OPTIONS = {"worker_timeout_ms": 2000, "ping_interval_ms": 200, "retry_delay_ms": 0}
MCP_OPTIONS = {**OPTIONS, "worker_timeout_ms": 8000}
APP = "agentapp:registry"


@pytest.fixture(autouse=True)
def _needs_pydantic_ai() -> None:
    if pydantic_ai is None:
        missing("pydantic-ai-slim is not installed (pip install 'mtask[pydantic-ai]')")


def _task(client: TaskClient, key: str) -> dict[str, Any]:
    doc = client.collection.find_one({"_id": key})
    assert doc is not None
    return doc


def _calls(client: TaskClient, key: str) -> Counter[str]:
    return Counter(d["what"] for d in client.db["agent_calls"].find({"task": key}))


def _written(client: TaskClient, key: str) -> list[Any]:
    """The chunks of ``key``'s output written so far, in order (read once, not followed)."""
    docs = client.db["tasks.output"].find({"task": key, "kind": "chunk"}).sort("seq", 1)
    return [d["data"] for d in docs]


USAGE = ("input_tokens", "output_tokens", "cached_tokens", "requests", "cost_nanos")


def _usage(doc: dict[str, Any]) -> dict[str, int]:
    """A task's (or a run's) usage totals."""
    return {k: doc["usage"][k] for k in USAGE}


def _reported(messages: list[dict[str, Any]]) -> dict[str, int]:
    """What the model's responses among ``messages`` (as JSON) said they used, summed, and its
    price (agentapp's: 1 per million tokens in, 0.5 cached, 2 out; in nano-units, per token:
    1000, 500, 2000)."""
    used = [m["usage"] for m in messages if m["kind"] == "response"]
    total = {
        "input_tokens": sum(u["input_tokens"] for u in used),
        "output_tokens": sum(u["output_tokens"] for u in used),
        "cached_tokens": sum(u["cache_read_tokens"] for u in used),
        "requests": len(used),
    }
    fresh = total["input_tokens"] - total["cached_tokens"]
    cost = 1000 * fresh + 500 * total["cached_tokens"] + 2000 * total["output_tokens"]
    return {**total, "cost_nanos": cost}


def _params(uri: str, db: str, **more: Any) -> dict[str, Any]:
    return {"prompt": "go", "uri": uri, "db": db, **more}


BOT_STEPS = [
    "bot__model.request_stream",
    "bot__function_toolset__<agent>.call_tool:a",
    "bot__model.request_stream#2",
    "bot__function_toolset__<agent>.call_tool:b",
    "bot__model.request_stream#3",
    "bot__function_toolset__<agent>.call_tool:c",
    "bot__model.request_stream#4",
    "bot__model.request_stream#5",
]


async def test_a_killed_workers_agent_run_is_finished_by_the_takeover_sending_nothing_twice(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The victim records three streamed model requests and two tool calls, and is killed
    (SIGKILL) inside tool ``c``, before it ran; the rescuer takes the task over after the
    lease, replays the five recorded steps and sends the rest: 5 model calls in all, each
    tool once, and the agent's output."""
    client.publish("bot", "k", _params(mongo_uri, db_name, hold="victim"), options=OPTIONS)
    notes = client.db["agent_notes"]
    with worker_process(
        mongo_uri, db_name, "--worker-id", "victim", app=APP, crash_expected=True
    ) as victim:
        await wait_for(lambda: notes.find_one({"task": "k", "event": "holding"}), timeout=60)
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
    recorded = [s["name"] for s in _task(client, "k")["steps"]]
    assert recorded == BOT_STEPS[:5]
    assert _calls(client, "k") == {"model": 3, "tool:a": 1, "tool:b": 1}
    with worker_process(mongo_uri, db_name, "--worker-id", "rescuer", app=APP):
        await wait_for(lambda: _task(client, "k")["status"] == "succeeded", timeout=60)
    doc = _task(client, "k")
    assert [(r["worker_id"], r["state"]) for r in doc["runs"]] == [
        ("victim", "TIMEOUT"),
        ("rescuer", "SUCCESS"),
    ]
    assert _calls(client, "k") == {"model": 5, "tool:a": 1, "tool:b": 1, "tool:c": 1}
    first, second = (r["run_id"] for r in doc["runs"])
    assert [(s["name"], s["state"], s["attempts"], s["run_id"]) for s in doc["steps"]] == [
        (name, "done", 1, first if i < 5 else second) for i, name in enumerate(BOT_STEPS)
    ]
    assert doc["result"]["output"] == "final"
    # the rescuer's new messages hold the victim's recorded answers (the same tool call ids)
    ids = [
        p["tool_call_id"]
        for m in doc["result"]["messages"]
        for p in m["parts"]
        if p["part_kind"] == "tool-return"
    ]
    assert ids == ["call-a", "call-b", "call-c"]
    # each request charged once, by the run that sent it: the victim's three, the rescuer's two
    messages = doc["result"]["messages"]
    responses = [i for i, m in enumerate(messages) if m["kind"] == "response"]
    assert _usage(doc) == _reported(messages)
    assert _usage(doc["runs"][0]) == _reported(messages[: responses[2] + 1])
    assert _usage(doc["runs"][1]) == _reported(messages[responses[2] + 1 :])
    assert [m["model"] for m in doc["usage"]["models"]] == ["agent-model"]


async def test_a_frozen_workers_late_request_is_refused_after_the_takeover(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The zombie records two requests and two tool calls and is frozen (SIGSTOP) inside its
    third request, past its lease; the rescuer takes over, replays the four steps and
    finishes the run. Resumed (SIGCONT), the zombie's request answers, and its charge and its
    record meet the fence (``LeaseLost``): nothing of it is written, and it sends nothing more.
    The recorded requests were sent once each; the third, never recorded by the zombie, twice
    (once per run: at least once)."""
    params = _params(mongo_uri, db_name, freeze="zombie")
    client.publish("bot_noted", "z", params, options=OPTIONS)
    notes = client.db["agent_notes"]
    with worker_process(mongo_uri, db_name, "--worker-id", "zombie", app=APP) as zombie:
        await wait_for(lambda: notes.find_one({"task": "z", "event": "blocked"}), timeout=60)
        zombie.send_signal(signal.SIGSTOP)
        try:
            with worker_process(mongo_uri, db_name, "--worker-id", "rescuer", app=APP):
                await wait_for(lambda: _task(client, "z")["status"] == "succeeded", timeout=60)
            finished = _task(client, "z")
        finally:
            zombie.send_signal(signal.SIGCONT)
        first, second = (r["run_id"] for r in finished["runs"])
        ended = {"task": "z", "event": "ended", "run_id": first}
        noted = await wait_for(lambda: notes.find_one(ended), timeout=30)
    assert noted["error"] == "LeaseLost"
    doc = _task(client, "z")
    assert [(r["worker_id"], r["state"]) for r in doc["runs"]] == [
        ("zombie", "TIMEOUT"),
        ("rescuer", "SUCCESS"),
    ]
    # the zombie wrote nothing after the takeover: no step, no run's change, no charge
    assert doc["steps"] == finished["steps"] and doc["runs"] == finished["runs"]
    assert doc["usage"] == finished["usage"]
    assert [(s["name"], s["run_id"]) for s in doc["steps"]] == [
        (name, first if i < 4 else second) for i, name in enumerate(BOT_STEPS)
    ]
    assert _usage(doc) == _reported(doc["result"]["messages"])
    assert doc["runs"][0]["usage"]["requests"] == 2
    by_run = Counter((d["run_id"], d["what"]) for d in client.db["agent_calls"].find({"task": "z"}))
    assert by_run == {
        (first, "model"): 3,
        (first, "tool:a"): 1,
        (first, "tool:b"): 1,
        (second, "model"): 3,
        (second, "tool:c"): 1,
    }
    assert doc["result"]["output"] == "final"


async def test_plain_model_requests_are_steps_too(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """Without the output stream the agent makes plain (not streamed) requests: each is a step
    named ``<agent>__model.request``."""
    client.publish("bot_plain", "p", _params(mongo_uri, db_name), options=OPTIONS)
    with worker_process(mongo_uri, db_name, app=APP):
        await wait_for(lambda: _task(client, "p")["status"] == "succeeded", timeout=60)
    doc = _task(client, "p")
    names = [s["name"] for s in doc["steps"]]
    assert names == [n.replace("bot__model.request_stream", "quiet__model.request").replace(
        "bot__", "quiet__") for n in BOT_STEPS]  # fmt: skip
    assert _calls(client, "p") == {"model": 5, "tool:a": 1, "tool:b": 1, "tool:c": 1}
    assert doc["result"]["output"] == "final"


async def test_each_model_request_charges_what_it_reported_priced(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """Request n reports ``100 n`` tokens in (``20 (n - 1)`` cached) and ``10 n`` out: the
    task's usage is their sum, 5 requests, under the model's name, priced from
    ``registry.price`` (1 per million in, 0.5 cached, 2 out)."""
    client.publish("bot_plain", "u", _params(mongo_uri, db_name), options=OPTIONS)
    with worker_process(mongo_uri, db_name, app=APP):
        await wait_for(lambda: _task(client, "u")["status"] == "succeeded", timeout=60)
    doc = _task(client, "u")
    fresh, cached, out = 1500 - 200, 200, 150  # n = 1..5
    assert _usage(doc) == {
        "input_tokens": 1500,
        "output_tokens": 150,
        "cached_tokens": 200,
        "requests": 5,
        "cost_nanos": 1000 * fresh + 500 * cached + 2000 * out,
    }
    assert _usage(doc) == _reported(doc["result"]["messages"])
    assert [(m["model"], m["requests"]) for m in doc["usage"]["models"]] == [("agent-model", 5)]
    assert client.get("u").usage.cost == Decimal("0.0017")


async def test_a_task_budget_stops_the_agent_before_the_next_model_request(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A budget of 1,000 tokens: requests 1-3 spend 660 (110 n each), request 4 is sent whole
    and charged (1,100 in all: a request in flight is never stopped), then request 5 does not
    start: the task fails with ``BudgetExceeded`` naming the budget, the model called 4 times."""
    options = {**OPTIONS, "budget": {"tokens": 1000}}
    client.publish("bot_plain", "b", _params(mongo_uri, db_name), options=options)
    with worker_process(mongo_uri, db_name, app=APP):
        await wait_for(lambda: _task(client, "b")["status"] == "failed", timeout=60)
    doc = _task(client, "b")
    assert _calls(client, "b") == {"model": 4, "tool:a": 1, "tool:b": 1, "tool:c": 1}
    assert doc["usage"]["input_tokens"] + doc["usage"]["output_tokens"] == 1100
    assert doc["usage"]["requests"] == 4
    names = [s["name"] for s in doc["steps"]]
    assert names[-1] == "quiet__model.request#4" and len(names) == 7
    assert len(doc["runs"]) == 1  # failed for good, no retry
    assert client.get("b").error == (
        "failed: budget exceeded: the task budget of 1000 tokens (1100 tokens spent)"
    )


async def test_the_streamed_events_reach_the_tasks_output_in_order(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """Every model event (the text's deltas among them) and every tool event is a chunk of
    the task's output, in the order the agent saw them."""
    client.publish("bot", "s", _params(mongo_uri, db_name), options=OPTIONS)
    with worker_process(mongo_uri, db_name, app=APP):
        await wait_for(lambda: _task(client, "s")["status"] == "succeeded", timeout=60)
    chunks = [e.data for e in client.stream("s") if e.kind == "chunk"]
    assert all(c["agent"] == "bot" for c in chunks)
    kinds = [c["event"]["event_kind"] for c in chunks]
    assert kinds.count("function_tool_call") == 3 and kinds.count("function_tool_result") == 3
    texts = [
        c["event"]["delta"]["content_delta"]
        for c in chunks
        if c["event"]["event_kind"] == "part_delta" and "content_delta" in c["event"]["delta"]
    ]
    starts = [
        c["event"]["part"]["content"]
        for c in chunks
        if c["event"]["event_kind"] == "part_start" and c["event"]["part"]["part_kind"] == "text"
    ]
    assert "".join(s + t for s, t in zip(starts, texts, strict=True)) == "draftfinal"
    called = [c["event"]["part"]["tool_name"] for c in chunks if kinds and
              c["event"]["event_kind"] == "function_tool_call"]  # fmt: skip
    assert called == ["a", "b", "c"]


async def _approval_asked(client: TaskClient, key: str) -> dict[str, Any]:
    def waiting() -> dict[str, Any] | None:
        doc = _task(client, key)
        return doc if doc.get("waiting", {}).get("signal") == "approval:pay-1" else None

    doc: dict[str, Any] = await wait_for(waiting, timeout=60)
    return doc


@pytest.mark.parametrize(
    ("payload", "output", "paid"),
    [
        ({"approved": True}, "after pay: paid 42", 1),
        ({"approved": False, "message": "over budget"}, "after pay: over budget", 0),
    ],
)
async def test_an_approval_waits_without_a_slot_and_a_signal_resumes_it(
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
    payload: dict[str, Any],
    output: str,
    paid: int,
) -> None:
    """The tool ``pay`` needs approval: the run ends WAITING on signal ``approval:pay-1`` (the
    task pending, no run holding it), and a worker of concurrency 1 runs another task
    meanwhile; the signal resumes it: approved, the tool runs once; refused, the model gets
    the refusal's message (Pydantic AI's ``ToolDenied``) and the tool never runs."""
    client.publish("gated", "g", _params(mongo_uri, db_name), options=OPTIONS)
    with worker_process(mongo_uri, db_name, "--concurrency", "1", app=APP):
        doc = await _approval_asked(client, "g")
        assert doc["status"] == "pending"
        assert [r["state"] for r in doc["runs"]] == ["WAITING"]
        client.publish("bot_plain", "other", _params(mongo_uri, db_name), options=OPTIONS)
        await wait_for(lambda: _task(client, "other")["status"] == "succeeded", timeout=60)
        assert _task(client, "g")["status"] == "pending"
        client.signal("g", "approval:pay-1", payload)
        await wait_for(lambda: _task(client, "g")["status"] == "succeeded", timeout=60)
    doc = _task(client, "g")
    assert doc["result"]["output"] == output
    assert _calls(client, "g") == {"model": 2, **({"tool:pay": 1} if paid else {})}
    names = [s["name"] for s in doc["steps"]]
    assert names[:3] == ["gated__model.request", "gated__ask:pay-1", "wait:approval:pay-1"]


async def test_a_reader_sees_the_models_tokens_before_the_request_is_recorded(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The last answer stops after its first delta (``fi``), its step unrecorded: a reader
    that joins then already has every event so far, in order, that delta among them; once
    released, the stream goes on from there (``nal``), each event once."""
    client.publish("bot", "r", _params(mongo_uri, db_name, pause=True), options=OPTIONS)
    notes = client.db["agent_notes"]
    with worker_process(mongo_uri, db_name, app=APP):
        await wait_for(lambda: notes.find_one({"task": "r", "event": "paused"}), timeout=60)

        def seen() -> list[dict[str, Any]] | None:
            doc = _task(client, "r")
            names = [s["name"] for s in doc.get("steps", [])]
            assert "bot__model.request_stream#5" not in names  # still in the request
            chunks = _written(client, "r")
            starts = [c["event"].get("part", {}).get("content") for c in chunks]
            return chunks if "fi" in starts else None

        early: list[dict[str, Any]] = await wait_for(seen, timeout=30)
        client.db["agent_control"].insert_one({"_id": "r"})
        await wait_for(lambda: _task(client, "r")["status"] == "succeeded", timeout=60)
    every = [e.data for e in client.stream("r") if e.kind == "chunk"]
    assert every[: len(early)] == early
    seqs = [e.seq for e in client.stream("r")]
    assert seqs == sorted(set(seqs))
    later = [c["event"] for c in every[len(early) :] if c["event"]["event_kind"] == "part_delta"]
    assert later[0]["delta"]["content_delta"] == "nal"


async def test_an_mcp_tool_call_is_a_step_replayed_after_a_takeover(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """``mcpbot`` calls the tool ``note`` of a stdio MCP server (``tests/mcpserver.py``, which
    counts its calls), and its worker is killed (SIGKILL) in the next model request; the
    rescuer replays the MCP call from the record (the server is not asked again) and finishes
    with what the victim's call answered. A longer lease: the MCP client's first connection
    in a worker may hold its event loop a while on a loaded machine."""
    try:
        import pydantic_ai.mcp  # noqa: F401
    except ImportError:
        missing("the MCP client is not installed (pip install 'mtask[pydantic-ai]')")
    client.publish("mcpbot", "m", _params(mongo_uri, db_name, hold="victim"), options=MCP_OPTIONS)
    notes = client.db["agent_notes"]
    with worker_process(
        mongo_uri, db_name, "--worker-id", "victim", app=APP, crash_expected=True
    ) as victim:
        await wait_for(lambda: notes.find_one({"task": "m", "event": "holding"}), timeout=60)
        victim.send_signal(signal.SIGKILL)
        await asyncio.to_thread(victim.wait, 10)
    assert _calls(client, "m") == {"model": 2, "mcp:note": 1}
    with worker_process(mongo_uri, db_name, "--worker-id", "rescuer", app=APP):
        await wait_for(lambda: _task(client, "m")["status"] == "succeeded", timeout=60)
    doc = _task(client, "m")
    assert _calls(client, "m") == {"model": 3, "mcp:note": 1}
    assert [(r["worker_id"], r["state"]) for r in doc["runs"]] == [
        ("victim", "TIMEOUT"),
        ("rescuer", "SUCCESS"),
    ], [(r["worker_id"], r["state"], r.get("error")) for r in doc["runs"]]
    first = doc["runs"][0]["run_id"]
    calls = [s for s in doc["steps"] if s["name"].startswith("mcpbot__mcp_server__notes.call_tool")]
    assert [(s["state"], s["attempts"], s["run_id"]) for s in calls] == [("done", 1, first)]
    assert doc["result"]["output"] == "mcp said: noted 1"
