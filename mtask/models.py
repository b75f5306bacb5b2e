"""The task document, its options and runs, as pydantic models.

The document stored in MongoDB is the source of truth; these models validate what goes in
(``TaskOptions``, ``NewTask``) and give a typed view of what comes out (``Task``). The hot
paths of the worker use plain dicts; these models are for the API surface.
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Any, Literal

import bson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mtask.errors import InvalidTask

MAX_KEY_LENGTH = 512
MAX_NAME_LENGTH = 200
DEFAULT_MAX_PARAMS_BYTES = 1024 * 1024
MAX_RUNS_KEPT = 20
"""Finished runs beyond this many are folded into ``runs_folded``; RUNNING runs are always kept."""
MAX_CONCURRENCY = 1000


class TaskStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INVALID = "invalid"
    """Set by a worker on a document no claim can match (inserted by hand with missing or
    mistyped fields); ``invalid_reason`` says why. Never claimed again."""

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset(
    {TaskStatus.SUCCEEDED, TaskStatus.FAILED, TaskStatus.CANCELLED, TaskStatus.INVALID}
)
OPEN_STATUSES = (TaskStatus.PENDING.value, TaskStatus.RUNNING.value)


class RunState(StrEnum):
    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAIL = "FAIL"
    TIMEOUT = "TIMEOUT"
    RELEASED = "RELEASED"
    CANCELLED = "CANCELLED"


class TaskOptions(BaseModel):
    """How a task is run. Unknown options are refused, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    priority: int = Field(0, ge=-1_000_000, le=1_000_000, description="Higher runs first.")
    concurrency: int = Field(
        1,
        ge=1,
        le=MAX_CONCURRENCY,
        description="How many distinct workers must run the task successfully; at most this "
        "many run it at once.",
    )
    ping_interval_ms: int = Field(5_000, ge=50, le=3_600_000)
    worker_timeout_ms: int = Field(30_000, ge=100, le=86_400_000)
    specific_worker_ids: tuple[str, ...] = Field(
        (), description="If not empty, only these workers may run the task."
    )
    max_retries: int = Field(3, ge=0, le=1_000_000)
    retry_delay_ms: int = Field(1_000, ge=0, le=86_400_000)
    retry_backoff: float = Field(2.0, ge=1.0, le=100.0)
    max_retry_delay_ms: int = Field(3_600_000, ge=0, le=30 * 86_400_000)
    run_at: dt.datetime | None = Field(None, description="Not claimed before this time.")

    @field_validator("run_at")
    @classmethod
    def _aware(cls, value: dt.datetime | None) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("must be timezone-aware (e.g. datetime.now(timezone.utc))")
        return value

    @field_validator("specific_worker_ids")
    @classmethod
    def _ids(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not w or len(w) > 255 for w in value):
            raise ValueError("worker ids must be 1 to 255 characters")
        return value

    def to_document(self) -> dict[str, Any]:
        doc = self.model_dump()
        doc["specific_worker_ids"] = list(self.specific_worker_ids)
        return doc


class Run(BaseModel):
    """One worker's run of a task."""

    model_config = ConfigDict(extra="ignore")

    run_id: str
    worker_id: str
    state: RunState
    claimed_at: dt.datetime
    lease_expires_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    error: str | None = None
    result: Any = None


class Task(BaseModel):
    """A typed view of one task document."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    key: str = Field(alias="_id")
    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    options: TaskOptions
    status: TaskStatus
    next_claim_at: dt.datetime | None = None
    available_at: dt.datetime | None = None
    attempts: int = 0
    successes: int = 0
    failures: int = 0
    runs: list[Run] = Field(default_factory=list)
    runs_folded: int = 0
    result: Any = None
    error: str | None = None
    failed_permanently: bool = False
    created_at: dt.datetime
    updated_at: dt.datetime
    finished_at: dt.datetime | None = None
    invalid_reason: str | None = None
    """Why a worker marked this document ``invalid`` (or why it cannot be read as a task)."""
    parent: str | None = None
    """The task whose handler returned this one as a next step (``mtask.Next``)."""
    children: list[str] = Field(default_factory=list)
    """The next steps this task's handler returned (published once its SUCCESS was recorded)."""
    depends_on: list[str] = Field(default_factory=list)
    waiting_on: list[str] = Field(default_factory=list)
    """The dependencies that have not succeeded yet; the task is not claimable while any are."""

    @classmethod
    def from_document(cls, doc: dict[str, Any]) -> Task:
        """The task a document holds. A malformed document (inserted by hand) never raises:
        it reads as an ``invalid`` task whose ``invalid_reason`` names the bad field."""
        try:
            return cls.model_validate(doc)
        except ValidationError as exc:
            return cls._unreadable(doc, exc)

    @classmethod
    def _unreadable(cls, doc: dict[str, Any], exc: ValidationError) -> Task:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "document"
        reason = doc.get("invalid_reason")
        stamp = doc.get("updated_at")
        when = stamp if isinstance(stamp, dt.datetime) else dt.datetime.fromtimestamp(0, dt.UTC)
        name = doc.get("name")
        status = doc.get("status")
        return cls(
            key=str(doc.get("_id")),
            name=name if isinstance(name, str) else "?",
            options=TaskOptions(),
            status=status if status in TaskStatus.__members__.values() else TaskStatus.INVALID,
            created_at=when,
            updated_at=when,
            invalid_reason=reason
            if isinstance(reason, str)
            else f"malformed task document: {field}: {first['msg']}",
        )


class PublishResult(BaseModel):
    """What ``publish`` did: ``created`` is True for exactly one of any number of concurrent
    publishers of one key; ``updated`` is True when ``on_conflict`` changed an existing task."""

    created: bool
    updated: bool = False
    task: Task


OnConflict = Literal["ignore", "update_params", "reset"]
ON_CONFLICT_CHOICES: tuple[str, ...] = ("ignore", "update_params", "reset")


def _bson_size(params: dict[str, Any]) -> int:
    try:
        return len(bson.encode(params))
    except (bson.errors.InvalidDocument, TypeError, OverflowError) as exc:
        raise InvalidTask(f"not BSON-encodable: {exc}", field="params") from None


def validate_key(key: object) -> str:
    if not isinstance(key, str):
        raise InvalidTask(f"must be a string, not {type(key).__name__}", field="key")
    if not key.strip():
        raise InvalidTask("must not be empty", field="key")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidTask(f"is {len(key)} characters; at most {MAX_KEY_LENGTH}", field="key")
    if "\x00" in key:
        raise InvalidTask("must not contain NUL characters", field="key")
    return key


def validate_name(name: object) -> str:
    if not isinstance(name, str):
        raise InvalidTask(f"must be a string, not {type(name).__name__}", field="name")
    if not name.strip():
        raise InvalidTask("must not be empty", field="name")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidTask(f"is {len(name)} characters; at most {MAX_NAME_LENGTH}", field="name")
    return name


def validate_params(params: object, max_bytes: int = DEFAULT_MAX_PARAMS_BYTES) -> dict[str, Any]:
    if params is None:
        return {}
    if isinstance(params, BaseModel):
        params = params.model_dump(mode="json")
    if not isinstance(params, dict):
        raise InvalidTask(f"must be a mapping, not {type(params).__name__}", field="params")
    size = _bson_size(params)
    if size > max_bytes:
        raise InvalidTask(f"is {size} bytes as BSON; the limit is {max_bytes}", field="params")
    return params


def validate_options(options: object) -> TaskOptions:
    if options is None:
        return TaskOptions()
    if isinstance(options, TaskOptions):
        return options
    if not isinstance(options, dict):
        raise InvalidTask(f"must be a mapping, not {type(options).__name__}", field="options")
    try:
        return TaskOptions.model_validate(options)
    except ValidationError as exc:
        raise InvalidTask(describe_validation_error(exc, prefix="options")) from None


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem, each naming its field: ``options.max_retries: Input should be …``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or "value")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown option"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


class NewTask(BaseModel):
    """A validated publish request."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    name: str
    key: str
    params: dict[str, Any]
    options: TaskOptions
    parent: str | None = None
    """The task whose handler returned this one as a ``Next`` step."""
    depends_on: tuple[str, ...] = ()
    """Claimable only once every one of these tasks succeeded; failed if one fails for good."""

    @classmethod
    def build(
        cls,
        name: object,
        key: object,
        params: object = None,
        options: object = None,
        *,
        max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
        depends_on: object = None,
        parent: str | None = None,
    ) -> NewTask:
        key = validate_key(key)
        return cls(
            name=validate_name(name),
            key=key,
            params=validate_params(params, max_params_bytes),
            options=validate_options(options),
            parent=parent,
            depends_on=validate_depends_on(depends_on, key),
        )


MAX_DEPENDENCIES = 1000


def validate_depends_on(value: object, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise InvalidTask("must be a list of task keys", field="depends_on")
    if len(value) > MAX_DEPENDENCIES:
        raise InvalidTask(f"has {len(value)} keys; at most {MAX_DEPENDENCIES}", field="depends_on")
    keys: list[str] = []
    for index, dep in enumerate(value):
        try:
            dep = validate_key(dep)
        except InvalidTask as exc:
            raise InvalidTask(f"depends_on[{index}]: {exc.message.removeprefix('key: ')}") from None
        if dep == key:
            raise InvalidTask("a task cannot depend on itself", field="depends_on")
        if dep not in keys:
            keys.append(dep)
    return tuple(keys)
