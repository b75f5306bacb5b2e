"""``mtask.contrib.pydantic_ai`` with the test double of the steps (``MemorySteps``): a
capability's ``@durable_operation`` is a step like a model request, and a second run of the
task replays them all, calling neither again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from needs import missing

from mtask import Registry
from mtask.steps import MemorySteps
from mtask.testing import run_handler

try:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.capabilities import AbstractCapability, durable_operation
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from mtask.contrib.pydantic_ai import MtaskAgent
except ImportError:  # pragma: no cover - CI installs the extra
    Agent = None  # type: ignore[assignment,misc]


def test_a_durable_operation_is_a_step_and_a_replay_calls_nothing_again() -> None:
    if Agent is None:
        missing("pydantic-ai-slim is not installed (pip install 'mtask[pydantic-ai]')")
    audited: list[str] = []
    asked: list[int] = []

    @dataclass
    class Audit(AbstractCapability[Any]):
        async def before_run(self, ctx: RunContext[Any]) -> None:
            await self.record(ctx, "start")

        @durable_operation(name="record")
        async def record(self, ctx: RunContext[Any], message: str) -> bool:
            audited.append(message)
            return True

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked.append(len(messages))
        return ModelResponse(parts=[TextPart("ok")])

    agent = Agent(FunctionModel(model), name="aud", capabilities=[Audit(id="audit")])
    registry = Registry()
    MtaskAgent(agent, emit=False).register(registry)
    steps = MemorySteps()
    for _ in range(2):
        out = run_handler(registry, "aud", MtaskAgent.params("hi"), steps=steps)
        assert out.result["output"] == "ok"
    assert [e["name"] for e in steps.recorded] == [
        "aud__capability__audit.record",
        "aud__model.request",
    ]
    assert audited == ["start"] and asked == [1]
