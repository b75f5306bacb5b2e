"""The task document, its options and runs, as pydantic models.

The document stored in MongoDB is the source of truth. ``TaskDocument`` is the one definition
of its shape (``PublishedDocument`` the least a publisher in another language writes); the
others validate what goes in (``TaskOptions``, ``NewTask``) and give a typed view of what
comes out (``Task``, tolerant of any document). The words and bounds they are built on (the
statuses, the limits, each option's default) are ``mtask.vocabulary``'s, without pydantic: the
worker and the store import those alone, and work on plain dicts. The JSON Schema
(``mtask.jsonschema``) is derived from these models. Every model is built on its first use
(``defer_build``): a command builds none it does not use, and a worker's start imports no
pydantic at all (``tests/unit/test_lazy_imports.py``).
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Callable, Mapping
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    Strict,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from mtask.errors import InvalidTask
from mtask.vocabulary import (
    DEFAULT_KEEP_MS,
    DEFAULT_MAX_PARAMS_BYTES,
    FOREVER,
    KEEP_FIELDS,
    MAX_CONCURRENCY,
    MAX_COST,
    MAX_KEEP_MS,
    MAX_KEY_LENGTH,
    MAX_NAME_LENGTH,
    MAX_PARAMS_DEPTH,
    MAX_PROGRESS_LABEL,
    MAX_RETRY_DELAY_MS,
    MAX_TOKENS,
    NO_NUL,
    OPTION_DEFAULTS,
    OPTION_FIELD_DEFAULTS,
    OPTION_NAMES,
    PARAMS_BYTES_CEILING,
    PING_INTERVAL_MS,
    UNENCODABLE,
    WORKER_TIMEOUT_MS,
    Period,
    RunState,
    TaskStatus,
    bson_json,
    bson_size,
    check_depth,
    encodable,
    options_document,
    validate_depends_on,
    validate_key,
    validate_name,
)


class Budget(BaseModel):
    """At most ``tokens`` (input + output) and/or ``cost`` (in the prices' currency); with
    ``period``, per period of the server's clock (``"hour"``, ``"day"``, ``"week"``,
    ``"month"``, in UTC, or a number of seconds). Past it, a step does not start: the task
    fails with ``BudgetExceeded``, or, with a period, waits for the next one holding no slot."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    cost: float | None = Field(None, ge=0, le=MAX_COST)
    period: Period | None = None

    @field_validator("period")
    @classmethod
    def _period(cls, value: Period | None) -> Period | None:
        if (
            isinstance(value, float | int)
            and not isinstance(value, bool)
            and (math.isnan(value) or not 1 <= value <= 366 * 86400)
        ):
            raise ValueError("a period in seconds is from 1 to 31,622,400 (366 days)")
        return value

    def model_post_init(self, context: Any) -> None:
        if self.tokens is None and self.cost is None:
            raise ValueError("a budget limits tokens, cost or both: give at least one")

    def to_document(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None}

    def cost_nanos(self) -> int | None:
        """The budget's cost in nano-units of the currency (what totals count: integers)."""
        if self.cost is None:
            return None
        return int((Decimal(str(self.cost)) * 10**9).to_integral_value(ROUND_HALF_EVEN))

    def describe(self) -> str:
        parts = []
        if self.tokens is not None:
            parts.append(f"{self.tokens} tokens")
        if self.cost is not None:
            parts.append(f"a cost of {self.cost:g}")
        text = " and ".join(parts)
        if self.period is None:
            return text
        if isinstance(self.period, str):
            return f"{text} a {self.period}"
        return f"{text} per {self.period:g} s"


class TaskOptions(BaseModel):
    """How a task is run. Unknown options are refused, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    priority: int = Field(
        OPTION_FIELD_DEFAULTS["priority"],
        ge=-1_000_000,
        le=1_000_000,
        description="Higher runs first.",
    )
    group: str | None = Field(
        OPTION_FIELD_DEFAULTS["group"],
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=NO_NUL,
        description="Its fairness group (a tenant, a customer): the groups of a name take "
        "turns at being claimed, so one group's backlog does not starve another's tasks.",
    )
    concurrency: int = Field(
        OPTION_FIELD_DEFAULTS["concurrency"],
        ge=1,
        le=MAX_CONCURRENCY,
        description="How many distinct workers must run the task successfully; at most this "
        "many run it at once.",
    )
    ping_interval_ms: int = Field(
        OPTION_FIELD_DEFAULTS["ping_interval_ms"], ge=PING_INTERVAL_MS[0], le=PING_INTERVAL_MS[1]
    )
    worker_timeout_ms: int = Field(
        OPTION_FIELD_DEFAULTS["worker_timeout_ms"], ge=WORKER_TIMEOUT_MS[0], le=WORKER_TIMEOUT_MS[1]
    )
    specific_worker_ids: tuple[str, ...] = Field(
        OPTION_FIELD_DEFAULTS["specific_worker_ids"],
        description="If not empty, only these workers may run the task.",
    )
    max_retries: int = Field(OPTION_FIELD_DEFAULTS["max_retries"], ge=0, le=1_000_000)
    retry_delay_ms: int = Field(OPTION_FIELD_DEFAULTS["retry_delay_ms"], ge=0, le=86_400_000)
    retry_backoff: float = Field(OPTION_FIELD_DEFAULTS["retry_backoff"], ge=1.0, le=100.0)
    max_retry_delay_ms: int = Field(
        OPTION_FIELD_DEFAULTS["max_retry_delay_ms"], ge=0, le=MAX_RETRY_DELAY_MS
    )
    max_backoffs: int = Field(
        OPTION_FIELD_DEFAULTS["max_backoffs"],
        ge=0,
        le=1_000_000,
        description="How many times its handler may raise BackOff (each releases the run, no "
        "retry spent) before the task fails for good, saying so: a handler that always answers "
        "a 429 does not back off forever.",
    )
    run_at: dt.datetime | None = Field(
        OPTION_FIELD_DEFAULTS["run_at"], description="Not claimed before this time."
    )
    keep_succeeded_ms: int | None = Field(
        OPTION_FIELD_DEFAULTS["keep_succeeded_ms"],
        ge=FOREVER,
        le=MAX_KEEP_MS,
        description="How long a succeeded task is kept after it finished (-1: forever; unset: "
        "the name's or the global default, resolved at publish).",
    )
    keep_failed_ms: int | None = Field(
        OPTION_FIELD_DEFAULTS["keep_failed_ms"], ge=FOREVER, le=MAX_KEEP_MS
    )
    keep_cancelled_ms: int | None = Field(
        OPTION_FIELD_DEFAULTS["keep_cancelled_ms"], ge=FOREVER, le=MAX_KEEP_MS
    )
    deadline: dt.datetime | None = Field(
        OPTION_FIELD_DEFAULTS["deadline"],
        description="The whole task's deadline, across its runs, retries, sleeps and waits: "
        "past it the task fails for good, saying so.",
    )
    budget: Budget | None = Field(
        OPTION_FIELD_DEFAULTS["budget"],
        description="The most tokens (input + output) and/or cost its runs may spend: a step "
        "that would start past it does not, and the task fails with BudgetExceeded.",
    )

    @field_validator("budget")
    @classmethod
    def _task_budget(cls, value: Budget | None) -> Budget | None:
        if value is not None and value.period is not None:
            raise ValueError("a task's budget has no period (a name's or a group's may)")
        return value

    @field_validator("run_at", "deadline")
    @classmethod
    def _aware(cls, value: dt.datetime | None) -> dt.datetime | None:
        if value is None:
            return value
        if value.tzinfo is None:
            raise ValueError("must be timezone-aware (e.g. datetime.now(timezone.utc))")
        try:  # BSON stores UTC: 0001-01-01T00:00+14:00 is before the year 1 there
            value.astimezone(dt.UTC)
        except OverflowError:
            raise ValueError("is out of range once converted to UTC") from None
        return value

    @field_validator("specific_worker_ids")
    @classmethod
    def _ids(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not w or len(w) > 255 for w in value):
            raise ValueError("worker ids must be 1 to 255 characters")
        if not all(encodable(w) for w in value):
            raise ValueError(f"worker ids {UNENCODABLE}")
        return value

    def to_document(self) -> dict[str, Any]:
        return options_document(self.model_dump())


BsonDate = Annotated[dt.datetime, Strict()]
"""A BSON date: an ISO string where a date belongs is a mistake, not a date."""


BsonAny = Annotated[Any, PlainSerializer(bson_json, when_used="json")]
"""Any value a document may hold (a foreign publisher's ObjectId, Buffer, Decimal128, …),
written as JSON with ``bson_json`` (a Python dump keeps it as stored)."""
BsonObject = Annotated[
    dict[str, Any], PlainSerializer(bson_json, return_type=dict[str, Any], when_used="json")
]
"""An object a document holds, written as JSON with ``bson_json`` (typed as an object in the
OpenAPI spec)."""


class Stored(BaseModel):
    """A (sub-)document as stored: the fields named are typed, any others are kept as they are,
    and written as JSON with ``bson_json``."""

    model_config = ConfigDict(
        extra="allow", json_schema_extra={"additionalProperties": True}, defer_build=True
    )
    __pydantic_extra__: dict[str, BsonAny] = Field(init=False)


class Progress(Stored):
    """How far the newest run that reported got (``ctx.progress``; docs/output.md)."""

    fraction: float | None = Field(None, ge=0.0, le=1.0)
    label: str | None = Field(None, max_length=MAX_PROGRESS_LABEL)
    run_id: str
    attempt: int | None = None
    at: BsonDate


class OutputCounts(Stored):
    """A run's live output (docs/output.md): what it wrote, and what the caps dropped."""

    logs: int = Field(0, ge=0)
    chunks: int = Field(0, ge=0)
    logs_dropped: int = Field(0, ge=0)
    chunks_dropped: int = Field(0, ge=0)


class UsageCounts(Stored):
    """What was spent (``ctx.record_usage``; docs/usage.md): tokens, requests and, where a
    price was known, the cost. The fields of a run's or a task's ``usage`` and of each of its
    models'."""

    input_tokens: int = Field(0, ge=0)
    output_tokens: int = Field(0, ge=0)
    cached_tokens: int = Field(0, ge=0)
    requests: int = Field(0, ge=0)
    cost_nanos: int | None = Field(None, ge=0)
    """The cost in nano-units of the currency (an integer: exact), ``None`` if no charge had
    a price."""

    @property
    def cost(self) -> Decimal | None:
        """The cost in the currency, exactly."""
        return None if self.cost_nanos is None else Decimal(self.cost_nanos).scaleb(-9)


class UsageTotals(UsageCounts):
    """What a run or a task spent (``ctx.record_usage``; docs/usage.md): tokens, requests and,
    where a price was known, the cost; a task's also per model."""

    models: list[ModelUsage] | None = None


class ModelUsage(UsageCounts):
    """A task's usage of one model."""

    model: str


class Run(Stored):
    """One worker's run of a task."""

    run_id: str
    worker_id: str
    state: RunState
    claimed_at: BsonDate
    lease_expires_at: BsonDate | None = None
    finished_at: BsonDate | None = None
    error: str | None = None
    error_class: str | None = None
    """A FAIL's exception class, importable (``builtins.ValueError``); None: the run raised
    none (a time limit, a lost lease, a result that cannot be stored) or it was not a FAIL."""
    result: BsonAny = None
    output: OutputCounts | None = None
    """Set by the run's first output write (``ctx.log``, ``ctx.emit``)."""
    output_batch: int | None = Field(None, ge=0)
    """The number of the run's newest output write: one sent again is not applied twice."""
    usage: UsageTotals | None = None
    """What the run spent (``ctx.record_usage``), absent until it records some."""


class StepTry(Stored):
    """One call of a durable step (its newest ten are kept)."""

    run_id: str
    attempt: int | None = None
    at: BsonDate
    ms: int = Field(ge=0)
    error: str | None = None


class Step(Stored):
    """A durable step of the task's handler (``ctx.step``, ``ctx.sleep``, ``ctx.wait_for``;
    docs/steps.md), in the order the handler asked for them. A later run gets a ``done`` step's
    result back instead of calling it again."""

    name: str = Field(min_length=1, max_length=200)
    kind: Literal["call", "sleep", "signal", "data", "children", "value", "patch"]
    state: Literal["done", "failed", "waiting", "timed_out"]
    attempts: int = Field(0, ge=0)
    run_id: str
    attempt: int | None = None
    started_at: BsonDate
    finished_at: BsonDate | None = None
    ms: int | None = Field(None, ge=0)
    result: BsonAny = None
    spill: BsonObject | None = None
    """A result too large for the document: where it is (``<tasks>.steps``)."""
    error: str | None = None
    until: BsonDate | None = None
    """A sleep's end, or a signal wait's or a data wait's deadline."""
    signal: str | None = None
    nth: int | None = Field(None, ge=0)
    collection: str | None = None
    """A data wait's collection (``ctx.wait_until``; docs/triggers.md)."""
    transactional: bool | None = None
    tries: list[StepTry] = Field(default_factory=list)
    # -- workflows --
    group: str | None = None
    """The ``ctx.gather`` it ran in (``gather#1``): its steps ran concurrently."""
    total: int | None = Field(None, ge=0)
    """A ``children`` step's count of children."""
    failed: int | None = Field(None, ge=0)
    """A ``children`` step's count of children that failed for good."""
    failures: list[BsonObject] = Field(default_factory=list)
    """A ``children`` step's failed children (the first 20): ``index``, ``key``, ``name``,
    ``status``, ``error``."""


class SignalSent(Stored):
    """A signal sent to the task (``client.signal``; docs/steps.md)."""

    name: str = Field(min_length=1, max_length=200)
    payload: BsonAny = None
    at: BsonDate


class WaitingData(Stored):
    """A data wait (``ctx.wait_until``; docs/triggers.md): the documents it watches and the
    find filter that settles it; ``woke``: when a change woke it while its run was deciding."""

    collection: str
    ids: list[BsonAny]
    filter: BsonObject
    woke: BsonDate | None = None


class Waiting(Stored):
    """What the task's last run waits for: until when, and for which signal or document."""

    until: BsonDate
    index: int = Field(ge=0)
    step: str | None = None
    signal: str | None = None
    nth: int | None = Field(None, ge=0)
    data: WaitingData | None = None
    children: str | None = None
    """The step whose spawned children it waits for."""


class Spawned(Stored):
    """A parent's counter of the children its step spawned (``mtask.steps.children``): how
    many, how many finished (``failed``: of them, how many for good), each one's bit."""

    step: str
    index: int = Field(ge=0)
    total: int = Field(ge=0)
    done: int = Field(0, ge=0)
    failed: int = Field(0, ge=0)
    bits: list[int] = Field(default_factory=list)
    checked_at: BsonDate | None = None
    """When the flow sweep last counted its children (a wake-up it may have lost)."""


class TriggeredBy(Stored):
    """The trigger that published a task (docs/triggers.md): its name, the collection it
    follows and the ``_id`` of the document whose change (or scan) made the task."""

    trigger: str
    collection: str
    document: BsonAny = None
    """The changed document's ``_id``, as stored (any BSON value)."""

    def said(self) -> str:
        """``published by trigger `fulfil` for `orders/o-1002```."""
        return f"published by trigger `{self.trigger}` for `{self.collection}/{self.document}`"


class Journaled(Stored):
    """A journal the task left behind when it continued as new: which (``n``, from 1), the
    run that ended it and when, how many steps it held and its last one's name."""

    n: int = Field(ge=1)
    run_id: str
    at: BsonDate
    steps: int = Field(0, ge=0)
    last: str | None = None


class Continued(Stored):
    """How often the task continued as new (``ctx.continue_as_new``), and the newest
    ``MAX_JOURNALS_KEPT`` of the journals it left behind, oldest first."""

    n: int = Field(ge=0)
    at: BsonDate
    journals: list[Journaled] = Field(default_factory=list)


class SpawnedBy(Stored):
    """A spawned child's parent, the step that spawned it and its place among its siblings."""

    parent: str
    step: str
    index: int = Field(ge=0)


class Debounce(Stored):
    """A debounced publish's window (``mtask.store.debounce``): publishes of ``key``
    collapse into this task while it is pending and never claimed."""

    key: str = Field(min_length=1, max_length=MAX_KEY_LENGTH)
    first_at: BsonDate
    last_at: BsonDate
    count: int = Field(ge=1)
    max_at: BsonDate | None = None
    """Never due later than this (``debounce_max`` after the first publish)."""


class TaskDocument(BaseModel):
    """The task document as mtask stores it: the one definition of its shape.

    Publishers build it (``store.new_document``), the worker completes a foreign publisher's
    minimal document into it (``store.complete``), the claim computes with it, the JSON Schema
    (``mtask/schema/task.v1.json``) and the MongoDB validator are generated from it, and
    ``Task`` reads it. Other top-level fields are allowed (and kept)."""

    model_config = ConfigDict(
        extra="allow", populate_by_name=True, title="mtask task document", defer_build=True
    )

    key: str = Field(
        alias="_id",
        min_length=1,
        max_length=MAX_KEY_LENGTH,
        pattern=NO_NUL,
        description="The task's key: publishing it again changes nothing.",
    )
    name: str = Field(
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        pattern=NO_NUL,
        description="Which handler runs it.",
    )
    params: dict[str, Any] = Field(description="The handler's input.")
    options: TaskOptions
    status: TaskStatus
    next_claim_at: BsonDate | None = Field(
        description="When the task may next be claimed; null once finished or while waiting."
    )
    available_at: BsonDate
    attempts: int = Field(ge=0, description="Runs started.")
    successes: int = Field(ge=0)
    failures: int = Field(ge=0)
    failed_permanently: bool = False
    runs: list[Run] = Field(description="One entry per worker run, newest last, bounded.")
    runs_folded: int = Field(0, ge=0)
    result: Any = None
    error: str | None = None
    created_at: BsonDate
    updated_at: BsonDate
    finished_at: BsonDate | None = None
    expire_at: BsonDate | None = None
    """When MongoDB's TTL monitor removes the finished task (retention)."""
    expire_held: bool | None = None
    """A finished flow parent whose removal waits for its open steps."""
    invalid_reason: str | None = None
    invalid_status: Any = None
    parent: str | None = None
    children: list[str] = Field(default_factory=list)
    depends_on: list[str] = Field(default_factory=list)
    waiting_on: list[str] = Field(default_factory=list)
    has_dependents: bool = False
    outbox: list[dict[str, Any]] = Field(default_factory=list)
    outbox_rejected: list[dict[str, Any]] = Field(default_factory=list)
    """Outbox entries no step could be built from (a hand edit, another version's shape), each
    ``{"entry", "reason"}``, kept instead of published (``flows.read_outbox``)."""
    last_write: str | None = None
    publish_seq: int | None = None
    """A grouped task's place in its group's publish order (microseconds since the epoch,
    plus its place in a ``publish_many`` call); a sequence runs its group in this order."""
    group_lock: bool | None = None
    """``True`` while this task holds its sequence's lock, taken by its claim (the unique
    ``group_lock`` index admits one open holder per group); left on a finished task, where it
    holds nothing, and removed when the task is reopened."""
    progress: Progress | None = None
    """The newest progress a run reported (``ctx.progress``); written only by runs that do."""
    output_seq: int | None = Field(None, ge=0)
    """The sequence number of the task's newest log line or output chunk (docs/output.md)."""
    steps: list[Step] = Field(default_factory=list)
    """The handler's durable steps, in order (docs/steps.md)."""
    signals: list[SignalSent] = Field(default_factory=list)
    """Signals sent to the task, oldest first (``client.signal``)."""
    waiting: Waiting | None = None
    """Set while the task waits (a sleep, a signal), cleared by its next run's step write."""
    spawned: Spawned | None = None
    """Its newest ``spawn_and_wait``'s counter of children."""
    spawn: SpawnedBy | None = None
    """A spawned child's parent and place; its ``parent`` field names it too."""
    triggered_by: TriggeredBy | None = None
    """The trigger that published it, and the document it was published for."""
    continued: Continued | None = None
    """Set once the task continued as new: how often, and the journals it left behind."""
    snoozes: int | None = Field(None, ge=0)
    """How many runs ended ``SNOOZED`` (``raise mtask.Snooze``); absent until one
    does. Never reset: a snooze spends no retry, and the count says how often it was put off."""
    backoffs: int | None = Field(None, ge=0)
    """How many runs its handler ended with ``raise mtask.BackOff`` (released, no retry spent);
    absent until one does. Past ``options.max_backoffs`` the task fails for good."""
    supersede: Literal["drop_newer", "cancel_queued", "cancel_running"] | None = None
    """Published with a supersede policy (``store.supersede``): one open task of its
    name and group among those that were (the unique ``supersede`` index)."""
    superseded_by: str | None = None
    """The newer task whose publish cancelled this one."""
    debounce: Debounce | None = None
    """A debounced publish's window (``store.debounce``)."""
    usage: UsageTotals | None = None
    """What its runs spent (``ctx.record_usage``; docs/usage.md), absent until one records."""


class PublishedDocument(BaseModel):
    """What a publisher in any language writes, at least (``docs/publishing.md``): the key,
    the name, the params, optionally any subset of the options and ``run_at``. mtask completes
    the rest the first time a worker or the sweep meets it (``store.complete``)."""

    model_config = ConfigDict(
        extra="allow",
        populate_by_name=True,
        title="mtask task document, as published",
        defer_build=True,
    )

    key: str = Field(alias="_id", min_length=1, max_length=MAX_KEY_LENGTH, pattern=NO_NUL)
    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NO_NUL)
    params: dict[str, Any] = Field(default_factory=dict)
    options: TaskOptions = Field(
        default_factory=TaskOptions, description="Any subset; the rest are defaults."
    )
    run_at: BsonDate | None = Field(None, description="Not claimed before this (a BSON date).")


REQUIRED_FIELDS: tuple[str, ...] = tuple(
    (f.alias or n) for n, f in TaskDocument.model_fields.items() if f.is_required()
)
"""The fields every stored task document holds."""


class StoredOptions(BaseModel):
    """The options a document holds: each one as stored, ``None`` where absent (or unreadable,
    see ``Task.problems``). A test keeps its fields equal to ``TaskOptions``'s."""

    model_config = ConfigDict(frozen=True, defer_build=True)

    priority: int | None = None
    group: str | None = None
    concurrency: int | None = None
    ping_interval_ms: int | None = None
    worker_timeout_ms: int | None = None
    specific_worker_ids: tuple[str, ...] | None = None
    max_retries: int | None = None
    retry_delay_ms: int | None = None
    retry_backoff: float | None = None
    max_retry_delay_ms: int | None = None
    max_backoffs: int | None = None
    run_at: dt.datetime | None = None
    keep_succeeded_ms: int | None = None
    keep_failed_ms: int | None = None
    keep_cancelled_ms: int | None = None
    deadline: dt.datetime | None = None
    budget: Budget | None = None

    def changed(self) -> dict[str, Any]:
        """The options that differ from their defaults (``OPTION_DEFAULTS``; a retention from
        the built-in ``DEFAULT_KEEP_MS``, which ``publish`` writes when nothing else sets one),
        as stored: what a page shows instead of every option."""
        defaults = {**OPTION_DEFAULTS, **{KEEP_FIELDS[s]: ms for s, ms in DEFAULT_KEEP_MS.items()}}
        found = {}
        for name in OPTION_NAMES:
            value = getattr(self, name)
            shown = list(value) if isinstance(value, tuple) else value
            if isinstance(value, Budget):
                shown = value.to_document()
            if value is not None and shown != defaults.get(name):
                found[name] = shown
        return found


class Task(BaseModel):
    """A typed view of one task document, as it is: a field the document lacks is ``None``
    (and named in ``missing``), a field it holds in a shape ``TaskDocument`` refuses is
    ``None`` too and named in ``problems``, fields ``TaskDocument`` does not know are kept
    in ``extra``. Readers (client, CLI, REST, dashboard) never see invented values."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, defer_build=True)

    key: str = Field(alias="_id")
    name: str | None = None
    params: BsonObject | None = None
    options: StoredOptions = Field(default_factory=StoredOptions)
    status: TaskStatus | None = None
    next_claim_at: dt.datetime | None = None
    available_at: dt.datetime | None = None
    attempts: int | None = None
    successes: int | None = None
    failures: int | None = None
    runs: list[Run] = Field(default_factory=list)
    """The runs the document holds (none if it holds none; see ``missing``)."""
    runs_folded: int | None = None
    result: BsonAny = None
    error: str | None = None
    failed_permanently: bool | None = None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    expire_at: dt.datetime | None = None
    """When MongoDB's TTL monitor removes the finished task (``finished_at`` + its retention);
    ``None`` while open, kept forever, or held for a flow's open steps."""
    invalid_reason: str | None = None
    """Why a worker marked this document ``invalid``."""
    parent: str | None = None
    """The task whose handler returned this one as a next step (``mtask.Next``)."""
    children: list[str] = Field(default_factory=list)
    """The next steps this task's handler returned (published once its SUCCESS was recorded)."""
    outbox_rejected: list[BsonObject] = Field(default_factory=list)
    """Next steps in its outbox that were not published because no task could be built from
    them (a hand edit, another version's shape), each ``{"entry", "reason"}``."""
    depends_on: list[str] = Field(default_factory=list)
    waiting_on: list[str] = Field(default_factory=list)
    """The dependencies that have not succeeded yet; the task is not claimable while any are."""
    publish_seq: int | None = None
    """A grouped task's place in its group's publish order (``None`` without a group)."""
    group_lock: bool | None = None
    """``True`` on a sequence's task that took its group's lock (it holds it while open)."""
    progress: Progress | None = None
    """The newest progress a run reported (``ctx.progress``), or ``None``."""
    output_seq: int | None = None
    """The sequence number of the newest log line or chunk (``None``: no output)."""
    steps: list[Step] = Field(default_factory=list)
    """The handler's durable steps, in the order it asked for them (docs/steps.md)."""
    signals: list[SignalSent] = Field(default_factory=list)
    """Signals sent to the task, oldest first."""
    waiting: Waiting | None = None
    """What the task waits for (a sleep's end, a signal), if it waits."""
    spawned: Spawned | None = None
    """Its newest ``spawn_and_wait``'s children: how many, how many finished."""
    spawn: SpawnedBy | None = None
    """A spawned child's parent, step and place."""
    triggered_by: TriggeredBy | None = None
    """The trigger that published it (its name, collection and the document's ``_id``), or
    ``None``."""
    continued: Continued | None = None
    """How often it continued as new, and the journals it left behind (``None``: never)."""
    snoozes: int | None = None
    """How many of its runs ended ``SNOOZED`` (``raise mtask.Snooze``; ``None``: none)."""
    backoffs: int | None = None
    """How many of its runs its handler ended with ``raise mtask.BackOff`` (``None``: none)."""
    supersede: str | None = None
    """The supersede policy it was published with, if any."""
    superseded_by: str | None = None
    """The newer task whose publish cancelled it, if one did."""
    debounce: Debounce | None = None
    """Its debounce window: the key, first and last publish, how many, the latest
    start."""
    usage: UsageTotals | None = None
    """What its runs spent (tokens, requests, cost), or ``None`` if none recorded any."""
    missing: list[str] = Field(default_factory=list)
    """Fields every stored task document holds that this one lacks (a publisher's minimal
    document that no worker has completed yet lacks most of them)."""
    problems: list[str] = Field(default_factory=list)
    """What is wrong where: ``'options.max_retry': unknown option``, one line per field."""
    extra: BsonObject = Field(default_factory=dict)
    """Top-level fields the task document's definition does not name, as stored."""

    @property
    def complete(self) -> bool:
        """Whether the document holds every field of ``TaskDocument``, each readable."""
        return not self.missing and not self.problems

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Task:
        """The task a document holds, field by field against ``TaskDocument``. Never raises,
        whatever the document holds."""
        raw_key = doc.get("_id")
        problems: list[str] = []
        if not isinstance(raw_key, str):
            problems.append(f"'_id': must be a string, found {type(raw_key).__name__}")
        values: dict[str, Any] = {"key": raw_key if isinstance(raw_key, str) else str(raw_key)}
        missing = [f for f in REQUIRED_FIELDS if f not in doc and f != "_id"]
        extra = {k: v for k, v in doc.items() if k not in _DOCUMENT_FIELDS}
        for name in _READ_FIELDS:
            if name not in doc:
                continue
            value, problem = _read_field(name, doc[name])
            if problem:
                problems.append(problem)
            else:
                values[name] = value
        if "options" in doc:
            values["options"] = _read_options(doc["options"], problems)
        if "runs" in doc:
            values["runs"] = _read_runs(doc["runs"], problems)
        return cls(**values, missing=missing, problems=problems, extra=extra)


_DOCUMENT_FIELDS = frozenset((f.alias or n) for n, f in TaskDocument.model_fields.items())
_READ_FIELDS = tuple(
    n
    for n in Task.model_fields
    if n in TaskDocument.model_fields and n not in ("key", "options", "runs")
)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    return f"{loc}: {err['msg']}" if loc else str(err["msg"])


def _read_field(name: str, value: Any) -> tuple[Any, str | None]:
    """One top-level field, validated as ``TaskDocument`` declares it."""
    try:
        return _field_adapter(name).validate_python(value), None
    except ValidationError as exc:
        return None, f"'{name}': {_first_error(exc)}"


def _adapter(field: FieldInfo) -> TypeAdapter[Any]:
    kind: Any = field.annotation
    if field.metadata:
        kind = Annotated[(kind, *field.metadata)]
    return TypeAdapter(kind)


@functools.cache
def _field_adapter(name: str) -> TypeAdapter[Any]:
    """A top-level field's validator, made on its first read (a process that reads no task
    makes none: a worker's start-up)."""
    return _adapter(TaskDocument.model_fields[name])


def _read_options(value: Any, problems: list[str]) -> StoredOptions:
    if not isinstance(value, Mapping):
        problems.append(f"'options': must be an object, found {type(value).__name__}")
        return StoredOptions()
    present = {k: v for k, v in value.items() if v is not None or k == "run_at"}
    run_at = present.get("run_at")
    if value.keys() <= TaskOptions.model_fields.keys() and (
        run_at is None or isinstance(run_at, dt.datetime)
    ):
        # the usual document, in one validation (each option's own validators are per field,
        # so this is the loop below's result when it passes); the loop names every problem
        try:
            model = TaskOptions.model_validate(present)
        except ValidationError:
            pass
        else:
            return StoredOptions(**{k: getattr(model, k) for k in present})
    return _read_each_option(value, problems)


def _read_each_option(value: Mapping[str, Any], problems: list[str]) -> StoredOptions:
    """The options one by one, each problem named."""
    found: dict[str, Any] = {}
    for key, option in value.items():
        if key not in TaskOptions.model_fields:
            problems.append(f"'options.{key}': unknown option")
            continue
        if option is None and key != "run_at":
            continue
        if key == "run_at" and option is not None and not isinstance(option, dt.datetime):
            problems.append(f"'options.run_at': must be a date, found {type(option).__name__}")
            continue
        try:
            found[key] = getattr(TaskOptions.model_validate({key: option}), key)
        except ValidationError as exc:
            problems.append(f"'options.{key}': {_first_error(exc).split(': ', 1)[-1]}")
    return StoredOptions(**found)


def _read_runs(value: Any, problems: list[str]) -> list[Run]:
    if not isinstance(value, list):
        problems.append(f"'runs': must be an array, found {type(value).__name__}")
        return []
    runs = []
    for index, run in enumerate(value):
        try:
            runs.append(Run.model_validate(run))
        except ValidationError as exc:
            problems.append(f"'runs.{index}': {_first_error(exc)}")
    return runs


class RunningRun(Stored):
    model_config = ConfigDict(defer_build=True)

    key: str
    run_id: str


class PoolChildView(Stored):
    model_config = ConfigDict(defer_build=True)

    pid: int
    state: str
    """``busy`` or ``idle``."""
    tasks: int = 0
    """Runs this child has done."""
    rss: int | None = None
    """Resident bytes the child reported after its last run."""
    busy_since: BsonDate | None = None


class PoolView(Stored):
    """A worker's process pool: children started, recycled (max tasks or memory),
    killed (time limit, cancel, lost lease, stop), died on their own, runs ended by their hard
    time limit or memory limit, and the live children."""

    model_config = ConfigDict(defer_build=True)

    started: int = 0
    recycled: int = 0
    killed: int = 0
    died: int = 0
    time_limit_kills: int = 0
    memory_kills: int = 0
    """Children killed for passing ``memory_limit_per_child``."""
    max_tasks_per_child: int | None = None
    max_memory_per_child: int | None = None
    memory_limit_per_child: int | None = None
    children: list[PoolChildView] = Field(default_factory=list)


class WorkerView(Stored):
    """A worker's heartbeat document (``control.heartbeat``), as ``read_worker`` reads it."""

    model_config = ConfigDict(defer_build=True)

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
    started_at: BsonDate | None = None
    last_seen: BsonDate | None = None
    beat_at: BsonDate | None = None
    """The server's time of the last heartbeat's write."""
    stop_requested: bool = False
    problems: list[str] = Field(default_factory=list)
    """Fields held in a shape mtask does not write (a hand edit, another version), one line
    each; they read as their default."""


_WORKER_FIELDS = {
    (field.alias or name): field
    for name, field in WorkerView.model_fields.items()
    if name != "problems"
}


@functools.cache
def _worker_adapter(name: str) -> TypeAdapter[Any]:
    """A heartbeat field's validator, made on its first read (as ``_field_adapter``)."""
    return _adapter(_WORKER_FIELDS[name])


def read_worker(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A worker's heartbeat document as every reader shows it (``client.workers``: the API, the
    dashboard, the CLI), whatever it holds: each field ``WorkerView`` names is read as it
    declares it, one in another shape reads as its default and is named in ``problems``, an
    ``_id`` that is not a string reads as its ``str``; other fields are kept as stored. Never
    raises."""
    problems: list[str] = []
    values: dict[str, Any] = {k: v for k, v in doc.items() if k not in _WORKER_FIELDS}
    for name in _WORKER_FIELDS:
        if name not in doc:
            continue
        try:
            values[name] = _worker_adapter(name).validate_python(doc[name])
        except ValidationError as exc:
            problems.append(f"'{name}': {_first_error(exc)}")
    if not isinstance(doc.get("_id"), str):
        values["_id"] = str(doc.get("_id"))
    values["problems"] = problems
    return WorkerView.model_validate(values).model_dump(by_alias=True)


class PublishResult(BaseModel):
    """What ``publish`` did: ``created`` is True for exactly one of any number of concurrent
    publishers of one key; ``updated`` is True when ``on_conflict`` changed an existing task."""

    model_config = ConfigDict(defer_build=True)

    created: bool
    updated: bool = False
    task: Task
    superseded: list[str] = Field(default_factory=list)
    """The older tasks this publish cancelled (``supersede``)."""
    dropped: bool = False
    """Not stored, an older task kept its place (``supersede="drop_newer"``);
    ``task`` is that older task."""
    missing_dependencies: list[str] = Field(default_factory=list)
    """The keys of ``depends_on`` no task has when it was published: it waits until one with
    each key is published and succeeds (a typo waits forever; ``mtask publish`` warns)."""


def _as_field(validate: Callable[[object], str]) -> Callable[[str], str]:
    """``validate`` for a pydantic field: its ``InvalidTask`` as the error pydantic reports
    (over HTTP, the 422 an ``InvalidTask`` is: ``type`` ``invalid_task``, the same message)."""

    def check(value: str) -> str:
        try:
            return validate(value)
        except InvalidTask as exc:
            raise PydanticCustomError(
                "invalid_task", "{message}", {"message": exc.message}
            ) from None

    return check


TaskKey = Annotated[str, AfterValidator(_as_field(validate_key))]
"""A task key as a request body holds it, checked by ``validate_key``."""
TaskName = Annotated[str, AfterValidator(_as_field(validate_name))]
"""A task name as a request body holds it, checked by ``validate_name``."""


def validate_params(params: object, max_bytes: int = DEFAULT_MAX_PARAMS_BYTES) -> dict[str, Any]:
    if params is None:
        return {}
    if isinstance(params, BaseModel):
        params = params.model_dump(mode="json")
    if not isinstance(params, dict):
        raise InvalidTask(f"must be a mapping, not {type(params).__name__}", field="params")
    check_depth(params, MAX_PARAMS_DEPTH)
    size = bson_size(params)
    limit = min(max_bytes, PARAMS_BYTES_CEILING)
    if size > limit:
        raise InvalidTask(f"is {size} bytes as BSON; the limit is {limit}", field="params")
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


def explicit_options(options: TaskOptions | Mapping[str, Any] | None) -> dict[str, Any]:
    """The options ``options`` sets itself (a ``TaskOptions``' set fields, a mapping's keys),
    checked: a handler's or a trigger's declared defaults. ``InvalidTask`` names a bad one."""
    if isinstance(options, TaskOptions):
        return options.model_dump(include=options.model_fields_set)
    given = dict(options or {})
    try:
        checked = TaskOptions.model_validate(given)
    except ValidationError as exc:
        raise InvalidTask(describe_validation_error(exc, prefix="options")) from None
    return checked.model_dump(include=set(given))


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

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True, defer_build=True)

    name: str
    key: str
    params: dict[str, Any]
    options: TaskOptions
    parent: str | None = None
    """The task whose handler returned this one as a ``Next`` step."""
    depends_on: tuple[str, ...] = ()
    """Claimable only once every one of these tasks succeeded; failed if one fails for good."""
    spawn: dict[str, Any] | None = None
    """A spawned child's ``{parent, step, index}`` (``mtask.steps.children``)."""
    triggered_by: dict[str, Any] | None = None
    """A trigger's task: ``{trigger, collection, document}`` (``mtask.triggers``)."""

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
        spawn: dict[str, Any] | None = None,
        triggered_by: dict[str, Any] | None = None,
    ) -> NewTask:
        key = validate_key(key)
        return cls(
            name=validate_name(name),
            key=key,
            params=validate_params(params, max_params_bytes),
            options=validate_options(options),
            parent=parent,
            depends_on=validate_depends_on(depends_on, key),
            spawn=spawn,
            triggered_by=triggered_by,
        )
