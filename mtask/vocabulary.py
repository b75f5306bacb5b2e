"""The task's words and bounds, without pydantic: its statuses and run states, the limits on
keys, names, params and options, each option's default, and the checks of a key, a name and a
list of dependencies.

``mtask.models`` builds the pydantic models on these; the store, the worker and the commands
that only read import them from here, so that neither a worker's start nor ``mtask get``
imports pydantic (``tests/unit/test_lazy_imports.py``).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from enum import StrEnum
from typing import Any, Literal, TypeGuard

import bson
from bson import json_util

from mtask.errors import InvalidTask

MAX_KEY_LENGTH = 512
MAX_NAME_LENGTH = 200
NO_NUL = "^[^\\x00]*$"
"""The pattern of a key and of a name: no NUL character (a C string ends there; the server
refuses one in a regular expression, and no worker can register such a name)."""
DEFAULT_MAX_PARAMS_BYTES = 1024 * 1024
PARAMS_BYTES_CEILING = 12 * 1024 * 1024
"""Params are refused above this size whatever ``max_params_bytes`` allows: with the longest
key, name and ``depends_on`` the task document stays below MongoDB's 16 MiB, so a validated
task is always written (``publish_many`` never fails half-way on one document)."""
MAX_PARAMS_DEPTH = 64
"""Nesting levels allowed in params (MongoDB refuses documents nested past 100 levels, and a
task document holds params a level down, plus room for the stored result)."""
MAX_STORED_DEPTH = 97
"""Nesting levels allowed in a value stored three levels down in a task document (a run's
result in ``runs.<i>.result``, a step's in ``steps.<i>.result``): MongoDB holds no document
nested past 100 levels, and refuses the update that would make one."""
NESTED_BYTES = 7
"""The fewest BSON bytes one level of nesting takes (an object under an empty name): a value
of fewer than ``NESTED_BYTES * MAX_STORED_DEPTH`` bytes cannot nest too deep."""


def storable_depth(value: object, size: int) -> bool:
    """Whether ``value`` (``size`` BSON bytes) nests at most ``MAX_STORED_DEPTH`` levels;
    walked only if it is large enough not to."""
    if size <= NESTED_BYTES * MAX_STORED_DEPTH:
        return True
    try:
        check_depth(value, MAX_STORED_DEPTH)
    except InvalidTask:
        return False
    return True


MAX_RUNS_KEPT = 20
"""Finished runs beyond this many are folded into ``runs_folded``; RUNNING runs are always kept."""
MAX_CONCURRENCY = 1000
FOREVER = -1
"""A retention (``keep_*_ms``) that never expires the finished task."""
MAX_KEEP_MS = 100 * 365 * 86_400_000
MAX_AGE_SECONDS = MAX_KEEP_MS // 1000
"""The longest age a filter compares (``older_than``: 100 years, as long as a retention)."""
DAY_MS = 86_400_000
PING_INTERVAL_MS = (50, 3_600_000)
WORKER_TIMEOUT_MS = (100, DAY_MS)
"""The ranges of ``ping_interval_ms`` and ``worker_timeout_ms``: the worker computes each run's
lease and pings from them, so a document holding another value is not claimed
(``store.schema.WELL_FORMED``)."""


UNENCODABLE = "must be valid Unicode: a lone surrogate (such as '\\ud800') has no UTF-8 form"


def encodable(text: str) -> bool:
    """Whether ``text`` can be stored (BSON strings are UTF-8; a lone surrogate is not)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def in_range(value: object, bounds: tuple[int, int]) -> TypeGuard[int]:
    """``value`` is an int (not a bool) within ``bounds``: a stored option the worker may
    compute with (a lease's end from ``worker_timeout_ms``), whatever a document holds."""
    return (
        isinstance(value, int) and not isinstance(value, bool) and bounds[0] <= value <= bounds[1]
    )


MAX_RETRY_DELAY_MS = 30 * DAY_MS
"""The longest wait before a retry: ``max_retry_delay_ms``'s ceiling, and ``Retry``'s."""


def delay_ms(value: object) -> int | None:
    """``value`` seconds (a number or a timedelta) from 0 to ``MAX_RETRY_DELAY_MS`` (30 days)
    in milliseconds, or ``None`` if it is not such a delay (the caller's error names it): a
    ``Retry``'s delay, a snooze's, a debounce's."""
    seconds = value.total_seconds() if isinstance(value, dt.timedelta) else value
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 0 <= seconds <= MAX_RETRY_DELAY_MS / 1000
    ):
        return None
    return round(seconds * 1000)


DEFAULT_KEEP_MS: dict[str, int] = {
    "succeeded": 7 * DAY_MS,
    "failed": 30 * DAY_MS,
    "cancelled": 7 * DAY_MS,
}
"""Built-in retention per finished status, used when neither the task, its name nor the global
default (``mtask.store.retention``) sets one. ``invalid`` tasks are kept until purged."""
KEEP_FIELDS = {status: f"keep_{status}_ms" for status in DEFAULT_KEEP_MS}
"""The option (under ``options``) holding each finished status's retention."""


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
    WAITING = "WAITING"
    """The handler slept or waits for a signal (``ctx.sleep``, ``ctx.wait_for``): the run
    ended, the task is claimed again when the wait is over (docs/steps.md)."""
    SNOOZED = "SNOOZED"
    """The handler raised ``Snooze(seconds)``: the run ended without spending a retry, the
    task is claimed again after those seconds (``mtask.limits.snooze``)."""
    CONTINUED = "CONTINUED"
    """The handler called ``ctx.continue_as_new(params)``: the run ended, the task starts
    afresh at once with those params and a new journal (docs/steps.md)."""


MAX_TOKENS = 10**15
"""The most tokens one charge or one budget counts."""
MAX_COST = 10**9
"""The most one charge or one budget costs, in the currency (in nano-units, 10¹⁸: an int64)."""

Period = Literal["hour", "day", "week", "month"] | float
"""A budget's period: a named one, or a number of seconds (``mtask.usage.rules``)."""


OnConflict = Literal["ignore", "update_params", "reset"]
ON_CONFLICT_CHOICES: tuple[str, ...] = ("ignore", "update_params", "reset")


def bson_size(params: dict[str, Any]) -> int:
    try:
        return len(bson.encode(params))
    except (bson.errors.InvalidDocument, TypeError, OverflowError, ValueError) as exc:
        # ValueError: a lone surrogate (UnicodeEncodeError), a date out of range in UTC
        raise InvalidTask(f"not BSON-encodable: {exc}", field="params") from None


def check_depth(value: object, limit: int, field: str = "params") -> None:
    """Refuse a value nested more than ``limit`` levels of mappings and lists (``{}`` is one
    level), iteratively so that no depth makes Python recurse."""
    if not isinstance(value, dict | list | tuple):
        return
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise InvalidTask(f"is nested more than {limit} levels deep", field=field)
        children = item.values() if isinstance(item, dict) else item
        assert isinstance(children, Iterable)
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | tuple))


def _text(value: object, field: str, most: int) -> str:
    """``value`` if a key or a name may be it: a string, not blank, at most ``most``
    characters, without NUL, valid Unicode; else ``InvalidTask`` naming ``field``."""
    if not isinstance(value, str):
        raise InvalidTask(f"must be a string, not {type(value).__name__}", field=field)
    if not value.strip():
        raise InvalidTask("must not be empty", field=field)
    if len(value) > most:
        raise InvalidTask(f"is {len(value)} characters; at most {most}", field=field)
    if "\x00" in value:
        raise InvalidTask("must not contain NUL characters", field=field)
    if not encodable(value):
        raise InvalidTask(UNENCODABLE, field=field)
    return value


def validate_key(key: object) -> str:
    return _text(key, "key", MAX_KEY_LENGTH)


def validate_name(name: object) -> str:
    return _text(name, "name", MAX_NAME_LENGTH)


MAX_PROGRESS_LABEL = 200
"""The longest label a progress report keeps (``ctx.progress``)."""
MAX_JOURNALS_KEPT = 10
"""The journals a task that continues as new keeps summarised (``continued.journals``)."""


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


OPTION_FIELD_DEFAULTS: dict[str, Any] = {
    "priority": 0,
    "group": None,
    "concurrency": 1,
    "ping_interval_ms": 5_000,
    "worker_timeout_ms": 30_000,
    "specific_worker_ids": (),
    "max_retries": 3,
    "retry_delay_ms": 1_000,
    "retry_backoff": 2.0,
    "max_retry_delay_ms": 3_600_000,
    "max_backoffs": 100,
    "run_at": None,
    "keep_succeeded_ms": None,
    "keep_failed_ms": None,
    "keep_cancelled_ms": None,
    "deadline": None,
    "budget": None,
}
"""Each option's default as ``TaskOptions`` holds it: the one definition of the defaults
(each of ``TaskOptions``' fields takes its own from here)."""
OPTION_NAMES: tuple[str, ...] = tuple(OPTION_FIELD_DEFAULTS)


def options_document(doc: dict[str, Any]) -> dict[str, Any]:
    """The options (``TaskOptions.model_dump``'s) as stored."""
    doc["specific_worker_ids"] = list(doc["specific_worker_ids"])
    if doc["group"] is None:
        del doc["group"]  # an option nobody set costs no bytes
    if doc["deadline"] is None:
        del doc["deadline"]
    if doc.get("budget") is None:
        doc.pop("budget", None)
    else:
        doc["budget"] = {k: v for k, v in doc["budget"].items() if v is not None}
    return doc


OPTION_DEFAULTS: dict[str, Any] = options_document(dict(OPTION_FIELD_DEFAULTS))
"""Every option's default as stored: what ``publish`` writes and what the worker completes a
published document with (``mtask.store.complete``)."""


def bson_json(value: Any) -> Any:
    """A value read from a document, as JSON: MongoDB Extended JSON, relaxed (``bson.json_util``)
    — an ObjectId is ``{"$oid": …}``, bytes ``{"$binary": …}``, a date ``{"$date": …}``, NaN
    ``{"$numberDouble": "NaN"}``, a Decimal128 ``{"$numberDecimal": …}``; strings, numbers, bools,
    arrays and objects as themselves. The one way the API writes what a document holds."""
    return json.loads(json_util.dumps(value, json_options=json_util.RELAXED_JSON_OPTIONS))
