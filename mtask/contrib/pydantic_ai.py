"""Pydantic AI agents as durable mtask tasks (docs/agents.md).

``MtaskAgent(agent)`` runs a Pydantic AI agent inside an mtask handler, each model request
(plain or streamed), each tool call, each MCP call and each ``@durable_operation`` of a
capability as a durable step (``ctx.step``) named by Pydantic AI's journal convention
(``<agent>__model.request_stream``, ``<agent>__function_toolset__<id>.call_tool:<tool>``, …; a
name asked again is numbered ``#2``, ``#3``): a retry or a takeover replays the recorded steps
and sends none of them again. It is built on Pydantic AI's public engine surface
(``pydantic_ai.durable_exec``: ``BaseDurabilityCapability`` and a ``CallableOperationBackend``),
as its Temporal, DBOS and Prefect integrations are.

The model's streamed events go to the run's output as they come (``ctx.emit``, under
``mtask.follow.output.live``); a tool that needs approval (``requires_approval=True``) ends the
run ``WAITING`` (``ctx.wait_for``: no slot held) until ``client.signal(key,
"approval:<tool_call_id>", {"approved": bool, "message": str})``; a refusal reaches the agent as
Pydantic AI's ``ToolDenied``. Each model request charges its response's usage to the task in
its step (``ctx.record_usage``, under the model's name: ``registry.price`` prices it; a replay
charges nothing), and a budget stops the agent before its next step. Needs ``pip install
'mtask[pydantic-ai]'``.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
from collections.abc import AsyncIterable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter
from pydantic_ai import (
    DeferredToolRequests,
    DeferredToolResults,
    RunContext,
    ToolDenied,
)
from pydantic_ai.agent import AbstractAgent, AgentRunResult, EventStreamHandler
from pydantic_ai.durable_exec import (
    JSON_CODEC,
    BaseDurabilityCapability,
    DurabilityEngineSpec,
    DurableOperationId,
    EventStreamHandlerId,
    JournalCallableOperationBackend,
    ModelCompactMessagesId,
    ModelRequestId,
    RoleBasedOperationConfig,
    ToolsetKind,
    conversation_id_from_run_id,
)
from pydantic_ai.messages import AgentStreamEvent, ModelMessage, ModelMessagesTypeAdapter
from pydantic_ai.models import Model
from pydantic_core import to_jsonable_python

from mtask import StepPolicy
from mtask.follow.output import live
from mtask.registry import Fail, Registry, TaskContext

DepsT = TypeVar("DepsT")
OutputT = TypeVar("OutputT")

StepConfig = dict[str, Any]
"""A durable unit's config: ``StepPolicy``'s fields (``retries``, ``backoff``, ``timeout``…);
a tool's own comes from its metadata ``{"mtask": {...}}`` (``False``: not a step)."""

APPROVAL = "approval:"
"""The signal that answers an approval is ``approval:<tool_call_id>``."""


@functools.cache
def _events() -> TypeAdapter[Any]:
    return TypeAdapter(AgentStreamEvent)  # built on first use: it takes a while


@dataclasses.dataclass
class _Current:
    """The handler run an agent runs in: its context and how many agent runs it began."""

    ctx: TaskContext
    agent_runs: int = 0
    last_replayed: bool = False
    """Whether the newest durable unit came from the record (its events were said then)."""


_CURRENT: contextvars.ContextVar[_Current | None] = contextvars.ContextVar(
    "mtask_pydantic_ai_run", default=None
)


def _policy(config: Any) -> StepPolicy | None:
    return StepPolicy(**config) if config else None


class _Backend(JournalCallableOperationBackend[Any]):
    """Each durable unit is one ``ctx.step`` under its journal name; its result is recorded as
    the JSON text of what Pydantic AI's JSON codec made of it (BSON would take a ``$defs`` key
    of a tool's schema for an operator)."""

    async def execute(
        self,
        *,
        operation_id: DurableOperationId,
        name: str,
        body: Callable[[], Any],
        cache_key: tuple[object, ...],
        config: Any,
    ) -> object:
        current = _CURRENT.get()
        if current is None or isinstance(operation_id, EventStreamHandlerId):
            # the run's tool events: said in the handler's own code, as they come (a unit
            # replayed from the record says none again: the events after it are skipped)
            if current is not None and current.last_replayed:
                return None
            return await body()
        called = False

        async def call() -> str:
            nonlocal called
            called = True
            result = await body()
            if isinstance(operation_id, ModelRequestId | ModelCompactMessagesId):
                await _charge(current.ctx, result, operation_id.model_name)
            return json.dumps(result, separators=(",", ":"))

        text = await current.ctx.step(name, call, policy=_policy(config))
        current.last_replayed = not called
        return json.loads(text)


@dataclasses.dataclass(init=False, kw_only=True)
class MtaskDurability(BaseDurabilityCapability[DepsT]):
    """The capability that makes an agent's units mtask steps (``MtaskAgent`` attaches it)."""

    engine_spec = DurabilityEngineSpec(
        engine_name="mtask",
        durable_unit_noun="step",
        durable_container_noun="task",
        codec=JSON_CODEC,
        serialization_failure=lambda exc: Fail(f"an agent's step cannot be recorded: {exc}"),
        unsupported_runtime_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        wrapped_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        toolset_lifecycles={
            "function": "enter-always",
            "mcp": "enter-in-durable-unit",
            "dynamic": "enter-never",
        },
        journal_discovery=True,
        # steps are matched in the order asked: tool calls one after another
        sequential_tools_in_durable_context=True,
        tool_config_key="mtask",
    )

    def __init__(
        self,
        *,
        models: Mapping[str, Model] | None = None,
        event_stream_handler: EventStreamHandler[DepsT] | None = None,
        name: str | None = None,
        model_policy: StepConfig | None = None,
        tool_policy: StepConfig | None = None,
    ) -> None:
        super().__init__(models=models, event_stream_handler=event_stream_handler, name=name)
        self._model_policy = dict(model_policy or {})
        self._tool_policy = dict(tool_policy or {})

    @property
    def in_durable_context(self) -> bool:
        return _CURRENT.get() is not None

    def get_default_run_id(self) -> str | None:
        current = _CURRENT.get()
        if current is None:
            return None
        current.agent_runs += 1  # the same count on every run of the handler
        return f"{current.ctx.key}:{current.agent_runs}"

    def get_default_conversation_id(self, run_id: str) -> str | None:
        return conversation_id_from_run_id(run_id) if self.in_durable_context else None

    def get_durable_operation_backend(self) -> _Backend:
        def tool_config(operation_id: DurableOperationId, tool: Any, tool_name: str) -> Any:
            kind: ToolsetKind = operation_id.toolset_kind  # type: ignore[union-attr]
            return self._build_resolve_tool_config(self._toolset_base_config(kind))(tool, tool_name)

        return _Backend(
            agent_name=self.name,
            default_model_id=self.default_model_id,
            config=RoleBasedOperationConfig[Any](
                model=self._model_policy,
                event={},
                capability={},
                tool=self._tool_policy,
                resolve_tool=tool_config,
            ),
        )

    def _toolset_base_config(self, kind: ToolsetKind) -> Any:
        return self._tool_policy


def _event(agent: str, event: AgentStreamEvent) -> dict[str, Any]:
    return {"agent": agent, "event": _events().dump_python(event, mode="json")}


class MtaskAgent(Generic[DepsT, OutputT]):
    """``agent`` run as durable mtask steps: ``await MtaskAgent(agent).run(prompt, ctx=ctx)``
    in a handler, ``register(registry)`` for a task of its own (``publish`` from anywhere).

    ``name``: the steps' prefix (default: the agent's ``name``, which it then must have);
    ``emit``: the model's streamed events and the tools' events to the run's output;
    ``approval_timeout``: seconds an approval may wait (``None``: no limit), after which
    ``SignalTimeout``; ``model_policy`` / ``tool_policy``: ``StepPolicy`` fields for the
    model's and the tools' steps; ``models``: other models a run may pick by key."""

    def __init__(
        self,
        agent: AbstractAgent[DepsT, OutputT],
        *,
        name: str | None = None,
        emit: bool = True,
        approval_timeout: float | None = None,
        model_policy: StepConfig | None = None,
        tool_policy: StepConfig | None = None,
        models: Mapping[str, Model] | None = None,
    ) -> None:
        self.agent = agent
        self.name = name or agent.name or ""
        if not self.name:
            raise ValueError("MtaskAgent needs a name: give the agent one or pass name=")
        self.approval_timeout = approval_timeout
        self.durability: MtaskDurability[DepsT] = MtaskDurability(
            models=models,
            event_stream_handler=self._emitter() if emit else None,
            name=self.name,
            model_policy=model_policy,
            tool_policy=tool_policy,
        )

    def _emitter(self) -> EventStreamHandler[DepsT]:
        name = self.name

        async def emit(run: RunContext[DepsT], events: AsyncIterable[AgentStreamEvent]) -> None:
            current = _CURRENT.get()
            async for event in events:
                if current is not None:
                    with live():  # a streamed token is followed as it comes, not at the record
                        current.ctx.emit(_event(name, event))

        return emit

    async def run(
        self,
        user_prompt: str | None = None,
        *,
        ctx: TaskContext,
        message_history: Sequence[ModelMessage] | None = None,
        **kwargs: Any,
    ) -> AgentRunResult[Any]:
        """``agent.run`` as durable steps of ``ctx``'s task: on a later run of the task the
        recorded requests and tool calls are replayed, not sent again. Approvals are waited
        for (no slot held), then the agent goes on with them (``ToolDenied`` for a refusal);
        its output is a ``DeferredToolRequests`` only for deferred ``calls`` (external tools)."""
        token = _CURRENT.set(_Current(ctx))
        try:
            history = list(message_history) if message_history is not None else None
            results: DeferredToolResults | None = kwargs.pop("deferred_tool_results", None)
            prompt = user_prompt
            while True:
                result: AgentRunResult[Any] = await self.agent.run(
                    prompt,
                    message_history=history,
                    deferred_tool_results=results,
                    capabilities=[self.durability],
                    **kwargs,
                )
                out = result.output
                if not isinstance(out, DeferredToolRequests) or not out.approvals or out.calls:
                    return result
                results = await self._approvals(ctx, out)
                history, prompt = result.all_messages(), None
        finally:
            _CURRENT.reset(token)

    async def _approvals(self, ctx: TaskContext, out: DeferredToolRequests) -> DeferredToolResults:
        results = DeferredToolResults()
        for call in out.approvals:
            signal = APPROVAL + call.tool_call_id
            asked = {
                "agent": self.name,
                "approval": {"tool": call.tool_name, "args": call.args_as_dict(), "signal": signal},
            }
            await ctx.step(f"{self.name}__ask:{call.tool_call_id}", _say, ctx, asked)
            payload = await ctx.wait_for(signal, timeout=self.approval_timeout)
            results.approvals[call.tool_call_id] = _decision(payload)
        return results

    # -- a task of its own ------------------------------------------------------------------

    def register(
        self,
        registry: Registry,
        task: str | None = None,
        *,
        deps: Callable[[dict[str, Any], TaskContext], DepsT] | None = None,
    ) -> str:
        """Register a handler that runs the agent, under ``task`` (default: the agent's name).
        Its params: ``prompt`` and, optionally, ``message_history`` (Pydantic AI's messages as
        JSON); its result: ``{"output", "messages"}`` (this run's new messages, as JSON).
        ``deps(params, ctx)`` makes the run's deps."""
        name = task or self.name

        async def handler(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
            history = params.get("message_history")
            messages = ModelMessagesTypeAdapter.validate_python(history) if history else None
            more: dict[str, Any] = {} if deps is None else {"deps": deps(params, ctx)}
            result = await self.run(params.get("prompt"), ctx=ctx, message_history=messages, **more)
            return {
                "output": to_jsonable_python(result.output),
                "messages": ModelMessagesTypeAdapter.dump_python(
                    result.new_messages(), mode="json"
                ),
            }

        registry.task(name)(handler)
        return name

    @staticmethod
    def params(
        prompt: str, message_history: Sequence[ModelMessage] | None = None
    ) -> dict[str, Any]:
        """The params of a task ``register`` made: ``client.publish(name, key,
        MtaskAgent.params("…"))`` from anywhere."""
        params: dict[str, Any] = {"prompt": prompt}
        if message_history:
            params["message_history"] = json.loads(
                ModelMessagesTypeAdapter.dump_json(list(message_history))
            )
        return params


def _decision(payload: Any) -> bool | ToolDenied:
    """An approval's signal payload: ``{"approved": true}`` (or ``true``) lets the call run;
    anything else refuses it, with ``message`` for the model when given."""
    if payload is True or (isinstance(payload, dict) and payload.get("approved") is True):
        return True
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return ToolDenied(payload["message"])
    return ToolDenied()


def _say(ctx: TaskContext, data: Any) -> None:
    ctx.emit(data)


async def _charge(ctx: TaskContext, response: Any, model: str) -> None:
    """A model response's usage (``ModelResponse.usage``, as the JSON codec wrote it) charged
    to the task (``ctx.record_usage``, docs/usage.md) under the response's model name (else the
    request's model's), priced from ``registry.price``. Called in the request's step, before its
    record: a replayed request is not called, so it charges nothing again."""
    fields: dict[str, Any] = response if isinstance(response, dict) else {}
    usage = fields.get("usage") or {}
    await ctx.record_usage(
        fields.get("model_name") or model or None,
        input_tokens=int(usage.get("input_tokens") or 0),
        output_tokens=int(usage.get("output_tokens") or 0),
        cached_tokens=int(usage.get("cache_read_tokens") or 0),
    )
