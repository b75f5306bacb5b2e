"""A schedule's definition, validated (pydantic): a cron expression or an interval, its time
zone, the task it publishes, how it catches up and overlaps (the package's docstring says how
schedules fire). Loaded by the first schedule a registry declares or a worker fires."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mtask.errors import InvalidTask
from mtask.models import describe_validation_error, validate_options, validate_params
from mtask.schedules.ticks import Overlap
from mtask.vocabulary import MAX_KEY_LENGTH, validate_key, validate_name

if TYPE_CHECKING:
    from apscheduler.triggers.base import BaseTrigger

log = logging.getLogger("mtask.schedules")

CatchUp = Literal["none", "latest", "all"]
CATCH_UP_CHOICES = ("none", "latest", "all")
OVERLAP_CHOICES = ("all", "skip", "buffer")
CHOICES = {"catch_up": CATCH_UP_CHOICES, "overlap": OVERLAP_CHOICES}
"""The values each of a schedule's choice fields may take."""
VALIDATION_ANCHOR = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
"""Any instant: building a trigger checks its definition; no time is decided by it."""


MAX_ID_LENGTH = MAX_KEY_LENGTH - len("@YYYY-MM-DDTHH:MM:SS.mmmZ")
"""A schedule's id and its tick make a task key (``tick_key``): the key is at most 512."""
MIN_EVERY_S = 0.05
MAX_EVERY_S = 366 * 86400.0
"""An interval is from 50 ms to a year."""


class Schedule(BaseModel):
    """A validated schedule definition. The model itself holds every check (its validators
    raise ``InvalidTask`` naming the field), so a stored document read back (``read``) is held
    to what ``build`` accepts: a hand-edited ``every_s`` of ``Infinity``, ``-5`` or ``1e-6``
    is refused there, never handed to a trigger."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    id: str
    task: str
    cron: str | None = None
    every_s: float | None = None
    timezone: str = "UTC"
    params: dict[str, Any] = Field(default_factory=dict)
    options: dict[str, Any] = Field(default_factory=dict)
    catch_up: CatchUp = "latest"
    misfire_grace_s: float = 60.0
    overlap: Overlap = "all"

    @field_validator("id", mode="before")
    @classmethod
    def _check_id(cls, value: object) -> str:
        try:
            sid = validate_key(value)
        except InvalidTask as exc:
            raise InvalidTask(exc.message.removeprefix("key: "), field="id") from None
        if "@" in sid:
            raise InvalidTask("must not contain '@' (task keys are '<id>@<tick>')", field="id")
        if len(sid) > MAX_ID_LENGTH:
            raise InvalidTask(
                f"is {len(sid)} characters; at most {MAX_ID_LENGTH} (task keys are "
                f"'<id>@<tick>', at most {MAX_KEY_LENGTH})",
                field="id",
            )
        return sid

    @field_validator("task", mode="before")
    @classmethod
    def _check_task(cls, value: object) -> str:
        return validate_name(value)

    @field_validator("every_s")
    @classmethod
    def _check_every(cls, value: float | None) -> float | None:
        if value is not None and (
            not math.isfinite(value) or not MIN_EVERY_S <= value <= MAX_EVERY_S
        ):
            raise InvalidTask("must be from 0.05 seconds to a year", field="every")
        return value

    @field_validator("params", mode="before")
    @classmethod
    def _check_params(cls, value: object) -> dict[str, Any]:
        return validate_params(value)

    @field_validator("options", mode="before")
    @classmethod
    def _check_options(cls, value: object) -> dict[str, Any]:
        task_options = validate_options(value)
        if task_options.run_at is not None:
            raise InvalidTask("run_at cannot be set on a schedule's tasks", field="options.run_at")
        dumped: dict[str, Any] = task_options.model_dump(exclude_defaults=True, mode="json")
        return dumped

    @field_validator("catch_up", "overlap", mode="before")
    @classmethod
    def _check_choice(cls, value: object, info: ValidationInfo) -> object:
        choices = CHOICES[info.field_name or ""]
        if value not in choices:
            raise InvalidTask(f"must be one of {', '.join(choices)}", field=info.field_name)
        return value

    @field_validator("misfire_grace_s")
    @classmethod
    def _check_grace(cls, value: float) -> float:
        if not math.isfinite(value) or value < 0:
            raise InvalidTask("must be a number of seconds, at least 0", field="misfire_grace_s")
        return value

    @model_validator(mode="after")
    def _check_one_trigger(self) -> Schedule:
        if (self.cron is None) == (self.every_s is None):
            raise InvalidTask("give exactly one of cron or every", field="schedule")
        return self

    @classmethod
    def build(
        cls,
        id: object,
        task: object,
        *,
        cron: str | None = None,
        every: float | dt.timedelta | None = None,
        timezone: str = "UTC",
        params: object = None,
        options: object = None,
        catch_up: str = "latest",
        misfire_grace_s: float = 60.0,
        overlap: str = "all",
    ) -> Schedule:
        """Check everything before anything is written; the error names the bad field."""
        schedule = cls.read(
            {
                "id": id,
                "task": task,
                "cron": cron,
                "every_s": every.total_seconds() if isinstance(every, dt.timedelta) else every,
                "timezone": timezone,
                "params": params,
                "options": options,
                "catch_up": catch_up,
                "misfire_grace_s": misfire_grace_s,
                "overlap": overlap,
            }
        )
        schedule.trigger(VALIDATION_ANCHOR)  # refuses a bad cron expression or zone
        return schedule

    @classmethod
    def read(cls, values: Mapping[str, Any]) -> Schedule:
        """The schedule these values describe, or ``InvalidTask`` naming the bad field."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise InvalidTask(describe_validation_error(exc)) from None

    def trigger(self, start: dt.datetime) -> BaseTrigger:
        # APScheduler's triggers (and tzlocal) are imported by the first schedule, not by every
        # process that imports the registry (a worker's start-up)
        from apscheduler.triggers.cron import CronTrigger
        from apscheduler.triggers.interval import IntervalTrigger

        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise InvalidTask(f"unknown time zone {self.timezone!r}", field="timezone") from None
        if self.cron is not None:
            try:
                return CronTrigger.from_crontab(self.cron, timezone=zone)
            except ValueError as exc:
                raise InvalidTask(
                    f"{self.cron!r} is not a cron expression: {exc}", field="cron"
                ) from None
        assert self.every_s is not None
        return IntervalTrigger(seconds=self.every_s, start_date=start, timezone=zone)

    def definition(self) -> str:
        """A hash of everything that decides the ticks and the tasks."""
        # the default overlap leaves the hash as it was before overlap existed, so
        # an upgrade does not count as every schedule's change
        text = json.dumps(
            self.model_dump(mode="json", exclude={"overlap"} if self.overlap == "all" else None),
            sort_keys=True,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]
