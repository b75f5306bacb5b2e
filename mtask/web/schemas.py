"""The response models of the REST API, so the OpenAPI spec is typed (generated Go, Java or
TypeScript clients get structs, not maps). A task is ``mtask.models.Task`` itself, with its key
under ``key``; the other collections' documents are described here as they are read, with any
extra fields passed through."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mtask.models import Task


class TaskView(Task):
    """A task as the API returns it (``key``, not MongoDB's ``_id``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    key: str = Field(description="the task's key")

    @classmethod
    def of(cls, task: Task) -> TaskView:
        return cls.model_validate(task.model_dump())


class PublishView(BaseModel):
    created: bool
    updated: bool
    task: TaskView


class SignalView(BaseModel):
    key: str
    signal: str
    woke: bool = Field(description="it was waiting for this signal, and may run again now")


class BatchView(BaseModel):
    created: int
    given: int


class TaskPage(BaseModel):
    tasks: list[TaskView]
    next_after: str | None = Field(description="pass as `after` for the next page")


class Open(BaseModel):
    """A document of a small collection: the fields named are always there, others may be."""

    model_config = ConfigDict(extra="allow")


class RunningRun(BaseModel):
    model_config = ConfigDict(extra="allow")
    key: str
    run_id: str


class PoolChildView(Open):
    pid: int
    state: str
    """``busy`` or ``idle``."""
    tasks: int = 0
    """Runs this child has done."""
    rss: int | None = None
    """Resident bytes the child reported after its last run."""
    busy_since: dt.datetime | None = None


class PoolView(Open):
    """A worker's process pool (issue 18): children started, recycled (max tasks or memory),
    killed (time limit, cancel, lost lease, stop), died on their own, runs ended by their hard
    time limit or memory limit, and the live children."""

    started: int = 0
    recycled: int = 0
    killed: int = 0
    died: int = 0
    time_limit_kills: int = 0
    memory_kills: int = 0
    """Children killed for passing ``memory_limit_per_child`` (issue 27)."""
    max_tasks_per_child: int | None = None
    max_memory_per_child: int | None = None
    memory_limit_per_child: int | None = None
    children: list[PoolChildView] = Field(default_factory=list)


class WorkerView(Open):
    id: str = Field(alias="_id")
    host: str | None = None
    pid: int | None = None
    version: str | None = None
    names: list[str] | None = None
    concurrency: int | None = None
    in_flight: int | None = None
    state: str | None = None
    running: list[RunningRun] = Field(default_factory=list)
    waiting: int | None = None
    """Runs claimed ahead (``--prefetch``) and waiting for a slot."""
    pool: PoolView | None = None
    started_at: dt.datetime | None = None
    last_seen: dt.datetime | None = None
    stop_requested: bool = False


class LimitView(Open):
    name: str = Field(alias="_id")
    concurrency: int | None = None
    rate: float | None = None
    burst: float | None = None
    group_concurrency: int | None = None
    group_rate: float | None = None
    group_burst: float | None = None
    tokens: float | None = None
    refilled_at: dt.datetime | None = None
    holders: list[dict[str, Any]] = Field(default_factory=list)


class GroupView(BaseModel):
    name: str
    group: str
    open: int
    running: int


class ScheduleView(Open):
    id: str = Field(alias="_id")
    task: str | None = None
    cron: str | None = None
    every_s: float | None = None
    timezone: str | None = None
    paused: bool = False
    next_tick_at: dt.datetime | None = None
    last_tick_at: dt.datetime | None = None
    last_key: str | None = None
    error: str | None = None


class StopView(BaseModel):
    stop_requested: str


class NameView(BaseModel):
    name: str
    paused: bool


class PausedView(BaseModel):
    paused: list[str]


class BulkView(BaseModel):
    """What a bulk action matched and did (``dry_run``: counted only)."""

    action: Literal["retry", "cancel", "purge"]
    dry_run: bool
    matched: int = Field(description="tasks the filter matched (and the action applies to)")
    changed: int = Field(description="tasks the action changed (0 on a dry run)")
    truncated: bool = Field(
        False, description="more tasks matched than one call handles; call again"
    )
