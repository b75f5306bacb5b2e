"""A Pydantic AI agent as an mtask task (``mtask.contrib.pydantic_ai``), for real worker
processes: ``bot`` makes 5 model requests (a ``FunctionModel``, streamed, no network) and 3
tool calls (``a``, ``b``, ``c``); ``gated`` asks a person's approval before its tool ``pay``.

Every model call and every tool call inserts a row into the test's database (``agent_calls``:
``{task, what, run_id}``) before it answers, so a test counts what was really sent. The model's
answers are decided by the conversation alone (how many responses it holds), so a takeover in
another process continues it. ``hold`` (params: a worker id): that worker's tool ``c`` notes
``holding`` and waits forever before it does anything (the test kills it there: the third
request is recorded, ``c`` is not). ``pause``: the last answer waits after its first delta.
``freeze`` (a worker id): that worker's third request notes ``blocked`` and waits until its
run is stopped (the test freezes the worker there and resumes it after a takeover), then
answers. ``bot``'s model is priced
(``MODEL``); its plain requests report known usage (``reported``)."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, DeferredToolRequests, ModelRetry, RunContext
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    TextPart,
    ToolCallPart,
)
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel
from pydantic_ai.usage import RequestUsage
from pymongo import AsyncMongoClient

from mtask import Registry, TaskContext
from mtask.contrib.pydantic_ai import MtaskAgent

registry = Registry()
MODEL = "agent-model"
"""``bot``'s model name, priced: 1 per million input tokens, 0.5 cached, 2 output."""
registry.price(MODEL, input=1, output=2, cached=0.5)


@dataclasses.dataclass
class Deps:
    db: Any
    key: str
    run_id: str
    worker: str
    hold: str | None
    pause: bool = False
    freeze: str | None = None
    ctx: TaskContext | None = None
    uri: str = ""


_DEPS: contextvars.ContextVar[Deps] = contextvars.ContextVar("agentapp_deps")


def _deps(params: dict[str, Any], ctx: TaskContext) -> Deps:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(params["uri"])
    deps = Deps(
        client[params["db"]],
        ctx.key,
        ctx.run_id,
        ctx.worker_id,
        params.get("hold"),
        bool(params.get("pause")),
        params.get("freeze"),
        ctx,
        params["uri"],
    )
    _DEPS.set(deps)  # the model function has no deps: it reads them here
    return deps


async def _count(what: str) -> None:
    deps = _DEPS.get()
    await deps.db["agent_calls"].insert_one({"task": deps.key, "what": what, "run_id": deps.run_id})


def _answered(messages: list[ModelMessage]) -> int:
    return sum(isinstance(m, ModelResponse) for m in messages)


def reported(n: int) -> RequestUsage:
    """What the ``n``-th plain request (from 1) says it used: ``100 n`` tokens in (``20 (n -
    1)`` of them from the cache), ``10 n`` out."""
    return RequestUsage(input_tokens=100 * n, output_tokens=10 * n, cache_read_tokens=20 * (n - 1))


def _plan(messages: list[ModelMessage]) -> ModelResponse:
    """Requests 1-3 call ``a``, ``b``, ``c``; the 4th answers ``draft`` (which the output
    validator sends back), the 5th ``final``; each reports its usage (``reported``)."""
    k = _answered(messages)
    if k < 3:
        tool = "abc"[k]
        parts: list[Any] = [ToolCallPart(tool, {"n": k + 1}, tool_call_id=f"call-{tool}")]
    else:
        parts = [TextPart("draft" if k == 3 else "final")]
    return ModelResponse(parts=parts, usage=reported(k + 1))


async def plain(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    await _count("model")
    return _plan(messages)


async def streamed(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[Any]:
    await _count("model")
    deps = _DEPS.get()
    if _answered(messages) == 2 and deps.freeze == deps.worker:
        await _until_stopped(deps)
    response = _plan(messages)
    part = response.parts[0]
    if isinstance(part, ToolCallPart):
        args = json.dumps(part.args)
        yield {0: DeltaToolCall(name=part.tool_name, tool_call_id=part.tool_call_id)}
        yield {0: DeltaToolCall(json_args=args)}
        return
    assert isinstance(part, TextPart)
    for i, piece in enumerate((part.content[:2], part.content[2:])):  # two deltas a text
        if i == 1 and part.content == "final" and _DEPS.get().pause:
            await _until_released(_DEPS.get())
        yield piece


async def _until_released(deps: Deps) -> None:
    """``pause``: the last answer stops after its first delta until the test releases it
    (``agent_control``), the request's step not yet recorded."""
    await deps.db["agent_notes"].insert_one({"task": deps.key, "event": "paused"})
    while await deps.db["agent_control"].find_one({"_id": deps.key}) is None:  # noqa: ASYNC110 - another process releases it
        await asyncio.sleep(0.05)


async def _until_stopped(deps: Deps) -> None:
    """``freeze``: note ``blocked``, then wait until the worker stops the run (its lease lost),
    ignoring the cancellation wherever it comes, and go on answering as if nothing happened."""

    async def blocked() -> None:
        assert deps.ctx is not None
        await deps.db["agent_notes"].insert_one({"task": deps.key, "event": "blocked"})
        async with asyncio.timeout(120):
            await deps.ctx.cancelled.wait()

    inner = asyncio.ensure_future(blocked())
    while True:
        try:
            await asyncio.shield(inner)
            return
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            if inner.done():
                inner.result()
                return


bot = Agent(
    FunctionModel(plain, stream_function=streamed, model_name=MODEL), name="bot", deps_type=Deps
)


@bot.output_validator
def _final(output: str) -> str:
    if output != "final":
        raise ModelRetry("say final")
    return output


async def _tool(ctx: RunContext[Deps], name: str, n: int) -> str:
    if name == "c" and ctx.deps.hold == ctx.deps.worker:
        await ctx.deps.db["agent_notes"].insert_one({"task": ctx.deps.key, "event": "holding"})
        await asyncio.sleep(3600)
    await _count(f"tool:{name}")
    return f"{name}{n}"


@bot.tool
async def a(ctx: RunContext[Deps], n: int) -> str:
    return await _tool(ctx, "a", n)


@bot.tool
async def b(ctx: RunContext[Deps], n: int) -> str:
    return await _tool(ctx, "b", n)


@bot.tool
async def c(ctx: RunContext[Deps], n: int) -> str:
    return await _tool(ctx, "c", n)


bot_agent = MtaskAgent(bot)
bot_agent.register(registry, deps=_deps)


@registry.task("bot_noted")
async def bot_noted(params: dict[str, Any], ctx: TaskContext) -> Any:
    """``bot`` (its steps ``bot__…``) in a handler that notes how its run ended in
        ``agent_notes`` (``event: "ended"``, ``error``: the exception's class name, or ``None``);
    its result: ``{"output", "messages"}`` (all of the run's, as JSON)."""
    deps = _deps(params, ctx)
    note = {"task": ctx.key, "event": "ended", "run_id": ctx.run_id}
    try:
        result = await bot_agent.run(params["prompt"], ctx=ctx, deps=deps)
    except BaseException as exc:
        await deps.db["agent_notes"].insert_one({**note, "error": type(exc).__name__})
        raise
    await deps.db["agent_notes"].insert_one({**note, "error": None})
    messages = ModelMessagesTypeAdapter.dump_python(result.all_messages(), mode="json")
    return {"output": result.output, "messages": messages}


MtaskAgent(bot, name="quiet", emit=False).register(registry, "bot_plain", deps=_deps)


async def gate_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Asks to pay, then says what came back: ``paid 42`` or the refusal's message."""
    await _count("model")
    if _answered(messages) == 0:
        return ModelResponse(parts=[ToolCallPart("pay", {"amount": 42}, tool_call_id="pay-1")])
    last = messages[-1].parts[-1]
    return ModelResponse(parts=[TextPart(f"after pay: {getattr(last, 'content', '')}")])


gated = Agent(
    FunctionModel(gate_model),
    name="gated",
    deps_type=Deps,
    output_type=[str, DeferredToolRequests],
)


@gated.tool(requires_approval=True)
async def pay(ctx: RunContext[Deps], amount: int) -> str:
    await _count("tool:pay")
    return f"paid {amount}"


MtaskAgent(gated, emit=False).register(registry, deps=_deps)


async def mcp_model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Calls the MCP server's ``note`` (telling it where to count), then says what came back;
    ``hold`` (a worker id): that worker's second request waits forever (the test kills it)."""
    await _count("model")
    deps = _DEPS.get()
    if _answered(messages) == 0:
        where = {"uri": deps.uri, "db": deps.db.name, "task": deps.key, "run_id": deps.run_id}
        return ModelResponse(parts=[ToolCallPart("note", {**where, "n": 1}, tool_call_id="note-1")])
    if deps.hold == deps.worker:
        await deps.db["agent_notes"].insert_one({"task": deps.key, "event": "holding"})
        await asyncio.sleep(3600)
    last = messages[-1].parts[-1]
    return ModelResponse(parts=[TextPart(f"mcp said: {getattr(last, 'content', '')}")])


try:
    from pydantic_ai.mcp import MCPToolset
except ImportError:  # pragma: no cover - pydantic-ai-slim[mcp] is not installed: no mcpbot
    pass
else:
    mcpbot = Agent(
        FunctionModel(mcp_model, model_name=MODEL),
        name="mcpbot",
        deps_type=Deps,
        # the server's start and handshake within a minute, not Pydantic AI's 5 s: a loaded
        # machine took longer to start the Python process, and the run failed before its
        # first model request
        toolsets=[
            MCPToolset(Path(__file__).with_name("mcpserver.py"), id="notes", init_timeout=60)
        ],
    )
    MtaskAgent(mcpbot, emit=False).register(registry, deps=_deps)
