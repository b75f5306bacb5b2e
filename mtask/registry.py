"""Handlers: ``registry = Registry()``, ``@registry.task("name")``, and what a handler may
raise (``Retry``, ``Fail``) or receive (``TaskContext``)."""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from mtask.errors import InvalidTask, MtaskError
from mtask.models import describe_validation_error
from mtask.schedules import Schedule

F = TypeVar("F", bound=Callable[..., Any])


class Retry(Exception):
    """Raise from a handler to run the task again later. It uses the task's retry budget, like
    any failure, but ``delay`` (seconds or a timedelta) replaces the backoff when given."""

    def __init__(
        self, reason: str = "retry requested", *, delay: float | dt.timedelta | None = None
    ):
        super().__init__(reason)
        if isinstance(delay, dt.timedelta):
            delay = delay.total_seconds()
        if delay is not None and delay < 0:
            raise ValueError("Retry delay must not be negative")
        self.delay = delay


class Fail(Exception):
    """Raise from a handler to fail the task at once, for good: no retry."""

    def __init__(self, reason: str = "failed by the handler") -> None:
        super().__init__(reason)


class InvalidParams(MtaskError):
    """The task's params do not validate against the handler's model."""


@dataclass
class TaskContext:
    """What a handler may know about its run."""

    key: str
    name: str
    attempt: int
    run_id: str
    worker_id: str
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the run must stop: cancelled, lease lost, or the worker shutting down. Thread
    handlers can poll ``cancelled.is_set()``."""
    publisher: Callable[..., Awaitable[Any]] | None = None

    async def publish(self, name: str, key: str, params: Any = None, **kwargs: Any) -> Any:
        """Publish a follow-up task (idempotent by key, like any publish)."""
        if self.publisher is None:
            raise MtaskError("this context cannot publish")
        return await self.publisher(name, key, params, **kwargs)


@dataclass(frozen=True)
class Handler:
    name: str
    fn: Callable[..., Any]
    is_async: bool
    params_model: type[BaseModel] | None
    wants_context: bool

    def parse(self, params: Mapping[str, Any]) -> Any:
        if self.params_model is None:
            return dict(params)
        try:
            return self.params_model.model_validate(params)
        except ValidationError as exc:
            raise InvalidParams(
                f"params do not match {self.params_model.__name__}: "
                + describe_validation_error(exc, prefix="params")
            ) from None

    def args(self, params: Any, ctx: TaskContext) -> tuple[Any, ...]:
        return (params, ctx) if self.wants_context else (params,)


def _inspect(fn: Callable[..., Any]) -> tuple[type[BaseModel] | None, bool]:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: treat as unannotated
        hints = {}
    params = list(inspect.signature(fn).parameters.values())
    if not params or len(params) > 2:
        raise InvalidTask(
            f"handler {fn.__qualname__} must take (params) or (params, ctx), "
            f"not {len(params)} parameters"
        )
    model = hints.get(params[0].name)
    params_model = model if isinstance(model, type) and issubclass(model, BaseModel) else None
    return params_model, len(params) == 2


class Registry:
    """Maps task names to handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}
        self.schedules: dict[str, Schedule] = {}

    def schedule(self, task: str, *, id: str | None = None, **definition: Any) -> Schedule:
        """Publish a ``task`` task on each tick of ``cron=`` or ``every=`` (and ``timezone``,
        ``params``, ``options``, ``catch_up``, ``misfire_grace_s``: see ``Schedule.build``).
        Workers running this registry create (or update) the schedule in MongoDB when they
        start; the schedule's id is ``id`` or the task name."""
        schedule = Schedule.build(id or task, task, **definition)
        if schedule.id in self.schedules:
            raise InvalidTask(f"a schedule {schedule.id!r} is already declared", field="id")
        self.schedules[schedule.id] = schedule
        return schedule

    def task(self, name: str | None = None) -> Callable[[F], F]:
        def register(fn: F) -> F:
            task_name = name or fn.__name__
            if task_name in self.handlers:
                raise InvalidTask(f"a handler for {task_name!r} is already registered")
            params_model, wants_context = _inspect(fn)
            self.handlers[task_name] = Handler(
                name=task_name,
                fn=fn,
                is_async=inspect.iscoroutinefunction(fn),
                params_model=params_model,
                wants_context=wants_context,
            )
            return fn

        return register

    @property
    def names(self) -> list[str]:
        return sorted(self.handlers)

    def __getitem__(self, name: str) -> Handler:
        return self.handlers[name]

    def __contains__(self, name: object) -> bool:
        return name in self.handlers
