"""A Pydantic AI agent as a durable mtask task (docs/agents.md): a tool, a tool that needs a
person's approval, and the model's streamed answer followed live. The model is a
``FunctionModel`` (no network, no key): put ``"openai:gpt-5"`` or any model there instead.
Run as a script (``MTASK_MONGODB_URI`` set) it starts a worker of its own, publishes a run,
follows its output, approves the refund and prints the agent's answer."""

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from mtask import AsyncTaskClient, Registry, Worker
from mtask.contrib.pydantic_ai import MtaskAgent


async def model(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[Any]:
    """A scripted model, streamed: look the order up, refund it, then say how it went."""
    answered = sum(isinstance(m, ModelResponse) for m in messages)
    if answered < 2:
        name, args = [("lookup_order", {"order": "o-17"}), ("refund", {"order": "o-17"})][answered]
        yield {0: DeltaToolCall(name=name, json_args=json.dumps(args), tool_call_id=name)}
        return
    result = next(
        p.content for m in messages for p in m.parts if isinstance(p, ToolReturnPart)
        and p.tool_name == "refund"
    )  # fmt: skip
    for word in f"Done: {result}.".split(" "):
        yield word + " "


support = Agent(
    FunctionModel(stream_function=model),
    name="support",
    output_type=[str, DeferredToolRequests],  # approvals are deferred tool calls
)


@support.tool_plain
def lookup_order(order: str) -> dict[str, Any]:
    return {"order": order, "total": 42}


@support.tool_plain(requires_approval=True)
def refund(order: str) -> str:
    return f"refunded {order}"


registry = Registry()
agent = MtaskAgent(support)  # its steps: support__model.request_stream, …
agent.register(registry)  # the task "support": params {"prompt": …}


async def main() -> None:
    database = os.environ.get("EXAMPLE_DATABASE", "mtask")
    worker = Worker(registry, database=database)
    running = asyncio.create_task(worker.run())
    async with AsyncTaskClient(database=database) as client:
        await client.publish("support", "ticket-1", MtaskAgent.params("Refund order o-17"))
        async for entry in client.stream("ticket-1"):  # follows the run live
            if entry.kind != "chunk":
                continue
            data = entry.data
            if "approval" in data:  # the run now waits, holding no worker slot
                print("asked:", data["approval"]["tool"], data["approval"]["args"])
                await client.signal("ticket-1", data["approval"]["signal"], {"approved": True})
            elif data["event"]["event_kind"] == "function_tool_call":
                print("tool:", data["event"]["part"]["tool_name"])
        task = await client.wait("ticket-1")
    worker.stop()
    await running
    print("answer:", task.result["output"])


if __name__ == "__main__":
    asyncio.run(main())
