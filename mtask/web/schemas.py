"""The response models of the REST API, so the OpenAPI spec is typed (generated Go, Java or
TypeScript clients get structs, not maps). A task is ``mtask.models.Task`` itself, with its key
under ``key``, a worker ``mtask.models.WorkerView`` (what every reader shows,
``models.read_worker``); the other collections' documents are described here as they are read,
with any extra fields passed through."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mtask.explain.states import Explained
from mtask.models import BsonAny, BsonObject, Stored, Task
from mtask.security.encryption import shown

DerivedState = Literal[
    "scheduled",
    "available",
    "running",
    "retrying",
    "waiting",
    "blocked",
    "succeeded",
    "failed",
    "cancelled",
    "invalid",
]
"""``mtask.explain.states.STATES``, spelled out for the OpenAPI spec (a test keeps them in step)."""


class TaskView(Task):
    """A task as the API returns it (``key``, not MongoDB's ``_id``), with its derived state
    (``mtask.explain.states``) where the route reads it."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    key: str = Field(description="the task's key")
    state: DerivedState | None = Field(
        None,
        description="the derived state: scheduled, available, running, retrying, waiting, "
        "blocked, or the final status (docs/web.md)",
    )
    why: str | None = Field(
        None,
        description="what a waiting task waits for (signal, sleep, data, dependencies, children, "
        "snoozed: a Snooze's end) or what blocks "
        "a blocked one (group, limit, paused, no_worker, no_key); backoff, lease_ended, …",
    )
    reason: str | None = Field(None, description="why it is not running, in one sentence")
    params: BsonObject | Literal["encrypted"] | None = Field(  # type: ignore[assignment]
        None, description='the handler\'s input; "encrypted" when serve cannot decrypt it'
    )
    result: BsonAny = Field(None, description='the result; "encrypted" likewise')

    @classmethod
    def of(cls, task: Task, said: Explained | None = None) -> TaskView:
        fields = task.model_dump()
        fields["params"], fields["result"] = shown(task.params), shown(task.result)
        view = cls.model_validate(fields)
        if said is not None:
            view.state, view.why, view.reason = said.state.value, said.why, said.reason
        return view


class PublishView(BaseModel):
    created: bool
    updated: bool
    task: TaskView
    superseded: list[str] = Field(default_factory=list, description="older tasks it cancelled")
    dropped: bool = Field(False, description="not stored: an older task kept its place")


class SignalView(BaseModel):
    key: str
    signal: str
    woke: bool = Field(description="it was waiting for this signal, and may run again now")


class ResetView(BaseModel):
    key: str
    step: str
    removed: list[str] = Field(description="the steps removed, from the one named on")
    signals: int = Field(description="signals removed with the waits that had taken them")
    woke: bool = Field(description="it waited in a removed step, and may run again now")


class RemarkView(BaseModel):
    """What a rename or a drop of a recorded step did."""

    key: str
    step: str
    to: str | None = Field(description="its new name; null: it was dropped")
    index: int = Field(description="its place in the journal (0 is the first)")
    woke: bool = Field(description="it waited in the dropped step, and may run again now")


class BatchView(BaseModel):
    created: int
    given: int


class TaskPage(BaseModel):
    tasks: list[TaskView]
    next_after: str | None = Field(description="pass as `after` for the next page")


class Open(Stored):
    """A document of a small collection: the fields named are always there, others may be (as
    stored, written as JSON with ``vocabulary.bson_json``)."""


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
    resource: str | None = Field(None, description="a shared resource's name (its limit's)")
    names: list[str] = Field(
        default_factory=list,
        description="a resource's declared users: names whose runs take a slot of it",
    )

    @field_validator("names", mode="before")
    @classmethod
    def _users(cls, value: object) -> list[str]:
        """As the workers read it (``limits.users``): a hand's ``names`` of any shape shows
        only the names a worker takes."""
        from mtask.limits.rules import users

        return list(users({"names": value}))

    group_overrides: list[dict[str, Any]] = Field(
        default_factory=list,
        description="groups with a limit or weight of their own: "
        "{group, concurrency, rate, burst, weight}",
    )


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
    overlap: str | None = None
    """All, skip or buffer (a tick while the previous task is open)."""
    skipped: int | None = None
    buffered_tick: dt.datetime | None = None


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


class AuditView(Open):
    """One action of ``mtask serve``'s audit (``store.audit``)."""

    id: str
    at: dt.datetime | None = None
    who: str | None = None
    role: str | None = None
    action: str | None = None
    target: str | None = None
    method: str | None = None
    path: str | None = None
    status: int | None = None
    from_: str | None = Field(None, alias="from")
    via: str | None = None
