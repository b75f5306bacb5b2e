"""The task document's shape: indexes, the fields a claim computes with (and how a
malformed document is recognised), the projections the worker reads, and new documents."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pymongo import ASCENDING, DESCENDING, IndexModel
from pymongo.errors import OperationFailure

from mtask.driver import UNAUTHORIZED, Call, Doc, Op
from mtask.vocabulary import (
    OPEN_STATUSES,
    OPTION_NAMES,
    PING_INTERVAL_MS,
    WORKER_TIMEOUT_MS,
    TaskStatus,
)

if TYPE_CHECKING:
    from mtask.models import NewTask

GROUP_LOCK = "group_lock"
"""``true`` on the task that holds its group's lock (a sequence's: set by its claim, in the
same update); the ``sequence_lock`` index admits one per group. The task keeps it while it is
open, or while a run of it still runs on a live lease (a cancelled task whose handler has not
stopped yet), and gives it up with the write that ends the last of them
(``statemachine.lock_kept_expr``); a reopened task loses it."""
LOCK_STATUSES = [TaskStatus.PENDING.value, TaskStatus.RUNNING.value, TaskStatus.CANCELLED.value]
"""The statuses of a task whose ``group_lock`` counts: open, or cancelled while its run still
stops (a cancelled task gives its mark up with the write that records that its run stopped;
a succeeded, failed or invalid one holds nothing whatever it kept)."""
SEQUENCE_LOCK = "sequence_lock"
"""The unique index of the sequences' locks (it replaces ``group_lock``, which admitted one
*open* holder per group, so a cancel gave the lock up while the run still ran)."""
OPEN_LIST = [TaskStatus.PENDING.value, TaskStatus.RUNNING.value]
"""The open statuses as the ``group_open`` index and its queries spell them (the same list:
the server uses a partial index only for a query that names its filter)."""

INDEXES: dict[str, list[IndexModel]] = {
    "tasks": [
        # Claims, scans and the safety sweep: open tasks only (finished ones have no
        # next_claim_at), so the index stays small however many finished tasks there are.
        IndexModel(
            [("name", ASCENDING), ("next_claim_at", ASCENDING), ("_id", ASCENDING)],
            name="claim",
            partialFilterExpression={"next_claim_at": {"$type": "date"}},
        ),
        IndexModel([("created_at", DESCENDING), ("_id", DESCENDING)], name="newest"),
        # Lists, counts and searches by status; across names they name every name present
        # (``store.across``). A status alone has no index: it would cost every task five more
        # key writes (its insert, then a delete and an insert at each status change).
        IndexModel(
            [
                ("name", ASCENDING),
                ("status", ASCENDING),
                ("created_at", DESCENDING),
                ("_id", DESCENDING),
            ],
            name="name_status_newest",
        ),
        # Flows: a task's steps, tasks waiting for dependencies, outboxes left by a crash.
        IndexModel(
            [("parent", ASCENDING), ("created_at", ASCENDING), ("_id", ASCENDING)],
            name="parent",
            partialFilterExpression={"parent": {"$exists": True}},
        ),
        IndexModel(
            [("waiting_on", ASCENDING)],
            name="waiting_on",
            partialFilterExpression={"waiting_on": {"$exists": True}},
        ),
        IndexModel(
            [("updated_at", ASCENDING)],
            name="outbox",
            partialFilterExpression={"outbox": {"$exists": True}},
        ),
        # Children awaited (store/children.py): the parents waiting for theirs, for
        # the sweep that makes a lost wake-up impossible. No other task has a key in it.
        IndexModel(
            [("waiting.children", ASCENDING)],
            name="children_wait",
            partialFilterExpression={"waiting.children": {"$exists": True}},
        ),
        # Children of a task cancelled while its run may still publish them: cancelled by
        # the flow sweep once that run's lease has ended (store/children.py). Only such tasks
        # have a key, until the sweep has been.
        IndexModel(
            [("cancel_children_at", ASCENDING)],
            name="cancel_children",
            partialFilterExpression={"cancel_children_at": {"$exists": True}},
        ),
        # Retention (store/retention.py): MongoDB's TTL monitor removes a finished task once
        # its expire_at has passed; flow parents held for their open steps.
        IndexModel(
            [("expire_at", ASCENDING)],
            name="expire",
            expireAfterSeconds=0,
            partialFilterExpression={"expire_at": {"$type": "date"}},
        ),
        IndexModel(
            [("expire_held", ASCENDING)],
            name="expire_held",
            partialFilterExpression={"expire_held": True},
        ),
        # Finished tasks, newest first: ``mtask top``'s rate and operators' "recently finished"
        # (store/queries.py; scale.md, "Indexes for operators").
        IndexModel(
            [("finished_at", DESCENDING), ("_id", DESCENDING)],
            name="finished",
            partialFilterExpression={"finished_at": {"$type": "date"}},
        ),
        # Groups (docs/flow-control.md): the open tasks of each group in publish order, for a
        # sequence's next task and the largest groups. Tasks without a group have no key.
        IndexModel(
            [
                ("name", ASCENDING),
                ("options.group", ASCENDING),
                ("publish_seq", ASCENDING),
                ("_id", ASCENDING),
            ],
            name="group_open",
            partialFilterExpression={
                "options.group": {"$type": "string"},
                "status": {"$in": OPEN_LIST},
            },
        ),
        # Sequences (docs/flow-control.md): one task of a group holds its lock, taken by the
        # claim, and gives it up with the write that ends it (``group_lock`` removed: its
        # outcome, or a cancel once its run has really stopped); others have no key.
        IndexModel(
            [("name", ASCENDING), ("options.group", ASCENDING)],
            name=SEQUENCE_LOCK,
            unique=True,
            partialFilterExpression={
                GROUP_LOCK: True,
                "options.group": {"$type": "string"},
                "status": {"$in": LOCK_STATUSES},
            },
        ),
        # Supersede (store/supersede.py): one open task of a name and group among
        # those published with a policy; others have no key.
        IndexModel(
            [("name", ASCENDING), ("options.group", ASCENDING)],
            name="supersede",
            unique=True,  # of racing publishers, one holds it
            partialFilterExpression={
                "supersede": {"$type": "string"},
                "status": {"$in": OPEN_LIST},
            },
        ),
        # Debounce (store/debounce.py): a key's open window, pending and never
        # claimed; a claim takes it out (attempts 1), nothing puts it back. Others have no key.
        IndexModel(
            [("name", ASCENDING), ("debounce.key", ASCENDING)],
            name="debounce",
            unique=True,  # of racing publishers of a key, one opens its window
            partialFilterExpression={
                "debounce.key": {"$type": "string"},
                "status": TaskStatus.PENDING.value,
                "attempts": 0,
            },
        ),
    ],
    "workers": [IndexModel([("last_seen", ASCENDING)], name="last_seen")],
    # A group's limit document (mtask.limits.slots) is removed once unused for slots.GROUP_TTL.
    "limits": [
        IndexModel(
            [("expire_at", ASCENDING)],
            name="group_expire",
            expireAfterSeconds=0,
            partialFilterExpression={"group": {"$exists": True}},
        )
    ],
}


OPERATOR_INDEXES: list[IndexModel] = [
    # All runs by a worker (``store.queries.runs_by_worker``). A task without runs has no key
    # (a multikey index would hold one for its empty array, replaced at its first claim).
    IndexModel(
        [("runs.worker_id", ASCENDING)],
        name="runs_worker",
        partialFilterExpression={"runs.worker_id": {"$exists": True}},
    ),
]
"""Indexes for an operator's own questions, which no command, route or page asks: made only on
request (``mtask collection init --operator-indexes``, ``collection_init``). Every index of the
tasks collection costs each claim and outcome its key generation, whether or not the task has a
key in it (docs/scale.md, "Indexes for operators"), so one nobody reads is not made for them.
``ensure_indexes`` neither makes nor drops them."""

SPECIFIC = "options.specific_worker_ids"
WELL_FORMED: dict[str, Any] = {
    # The fields the claim's expressions compute with. A document inserted by hand without
    # them never matches a claim or a scan, so it cannot make a claim fail for its batch.
    "runs": {"$type": "array"},
    "successes": {"$type": "number"},
    "failures": {"$type": "number"},
    "attempts": {"$type": "number"},
    "available_at": {"$type": "date"},
    "options.concurrency": {"$type": "number"},
    "options.max_retries": {"$type": "number"},
    # the lease and the pings, computed in Python too: in the publisher's range, not a
    # decimal (no arithmetic with floats), not NaN or infinite (which no $gte/$lte pair holds)
    "options.worker_timeout_ms": {
        "$type": ["int", "long", "double"],
        "$gte": WORKER_TIMEOUT_MS[0],
        "$lte": WORKER_TIMEOUT_MS[1],
    },
    "options.ping_interval_ms": {
        "$type": ["int", "long", "double"],
        "$gte": PING_INTERVAL_MS[0],
        "$lte": PING_INTERVAL_MS[1],
    },
    SPECIFIC: {"$type": "array"},
}
KNOWN_STATUSES = [status.value for status in TaskStatus]
FIRST_DATE = dt.datetime.min.replace(tzinfo=dt.UTC)
LAST_DATE = dt.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=dt.UTC)
"""The first and last dates a worker reads: a date beyond them, valid BSON, reads as one of
them (``connection.WORKER_CLIENT_OPTIONS``)."""


def keys_in(keys: Sequence[Any]) -> Doc:
    """Documents whose ``_id`` is among ``keys``, as a worker read them: a date key at the first
    or last date stands for every date key beyond it too (it read them all so), so that a
    document keyed by such a date can be settled (``quarantine``)."""
    beyond: list[Doc] = []
    if any(isinstance(k, dt.datetime) and k <= FIRST_DATE for k in keys):
        beyond.append({"_id": {"$type": "date", "$lte": FIRST_DATE}})
    if any(isinstance(k, dt.datetime) and k >= LAST_DATE for k in keys):
        beyond.append({"_id": {"$type": "date", "$gte": LAST_DATE}})
    listed = {"_id": {"$in": list(keys)}}
    return {"$or": [listed, *beyond]} if beyond else listed


def well_formed_expr() -> Doc:
    """``WELL_FORMED`` (plus a string key, a known status, a claim time unless waiting for
    dependencies, and only known options) as an aggregation expression."""
    return {
        "$and": [
            {"$eq": [{"$type": "$_id"}, "string"]},
            {"$in": ["$status", KNOWN_STATUSES]},
            {"$eq": [{"$type": "$name"}, "string"]},
            {"$ne": ["$name", ""]},
            {"$not": [_NUL_NAME]},
            *(_holds(field, spec) for field, spec in WELL_FORMED.items()),
            {"$not": [_UNREACHABLE]},
            {"$eq": [{"$size": _unknown_options()}, 0]},
        ]
    }


_NUL_NAME: Doc = {
    "$regexMatch": {
        "input": {"$cond": [{"$eq": [{"$type": "$name"}, "string"]}, "$name", ""]},
        "regex": "\\x00",
    }
}
"""A name no worker can have: it holds a NUL character (``vocabulary.NO_NUL``)."""

_UNREACHABLE: Doc = {  # open, no date to be claimed at, not waiting for dependencies
    "$and": [
        {"$in": ["$status", ["pending", "running"]]},
        {"$ne": [{"$type": "$next_claim_at"}, "date"]},
        {"$eq": [{"$size": {"$cond": [{"$isArray": "$waiting_on"}, "$waiting_on", []]}}, 0]},
    ]
}


def _unknown_options() -> Doc:
    """The option keys the document holds that are not options (typos such as max_retry)."""
    options = {"$cond": [{"$eq": [{"$type": "$options"}, "object"]}, "$options", {"$literal": {}}]}
    keys = {"$map": {"input": {"$objectToArray": options}, "as": "o", "in": "$$o.k"}}
    return {"$setDifference": [keys, list(OPTION_NAMES)]}


def unknown_option_check() -> tuple[Doc, Doc]:
    """(true when the document holds an unknown option key, the reason naming the first)."""
    unknown = _unknown_options()
    return (
        {"$gt": [{"$size": unknown}, 0]},
        {
            "$concat": [
                "'options.",
                {"$arrayElemAt": [unknown, 0]},
                f"' is not an option (options: {', '.join(OPTION_NAMES)})",
            ]
        },
    )


def placeable(doc: Mapping[str, Any]) -> bool:
    """Whether a worker may queue a document it read (scan, event, lookup): it has a status, a
    claim time if it is open (unless it waits for dependencies) and no unknown option.
    Otherwise the worker notes it, to complete it (a publisher's document) or mark it invalid
    (``store.quarantine``)."""
    status = doc.get("status")
    if status is None:
        return False
    waiting = doc.get("waiting_on")
    if status in OPEN_STATUSES and not isinstance(doc.get("next_claim_at"), dt.datetime):
        return isinstance(waiting, list) and bool(waiting)  # else no claim can reach it
    options = doc.get("options")
    return not isinstance(options, dict) or _OPTION_SET.issuperset(options)


_OPTION_SET = frozenset(OPTION_NAMES)


_TYPE_ALIASES = {
    "array": ["array"],
    "date": ["date"],
    "number": ["int", "long", "double", "decimal"],
}


def _holds(field: str, spec: Doc) -> Doc:
    """A ``WELL_FORMED`` entry as an aggregation expression: its types, then its range (``$and``
    stops at the first false, so a range is only compared with a number)."""
    types = spec["$type"]
    tests: list[Doc] = [
        {
            "$in": [
                {"$type": f"${field}"},
                types if isinstance(types, list) else _TYPE_ALIASES[types],
            ]
        }
    ]
    if "$gte" in spec:
        tests += [{"$gte": [f"${field}", spec["$gte"]]}, {"$lte": [f"${field}", spec["$lte"]]}]
    return tests[0] if len(tests) == 1 else {"$and": tests}


def _wanted(spec: Doc) -> str:
    """What a ``WELL_FORMED`` entry asks for, in words."""
    types = spec["$type"]
    if isinstance(types, list):
        return f"a number from {spec['$gte']} to {spec['$lte']}"
    return f"{'an' if types[0] in 'aeiou' else 'a'} {types}"


def marked_invalid(reason: Any, now: dt.datetime) -> Doc:
    """The ``$set`` stage that marks an open task ``invalid``: ``reason`` (a value or an
    expression), the status it had, and out of the claim index (``next_claim_at`` kept, as
    ``None``: the validator asks for it)."""
    return {
        "$set": {
            "invalid_reason": reason,
            "invalid_status": "$status",
            "status": TaskStatus.INVALID.value,
            "updated_at": now,
            "next_claim_at": None,
        }
    }


def invalid_reason_expr() -> Doc:
    """Names the first field that makes a document malformed, and what it holds instead."""
    checks: list[tuple[Doc, str, str]] = [
        ({"$ne": [{"$type": "$_id"}, "string"]}, "_id", "a string"),
        ({"$not": [{"$in": ["$status", KNOWN_STATUSES]}]}, "status", "a known status"),
        ({"$ne": [{"$type": "$name"}, "string"]}, "name", "a string"),
        ({"$eq": ["$name", ""]}, "name", "a task name, not empty"),
        (_NUL_NAME, "name", "a task name without NUL characters"),
    ]
    checks += [
        ({"$not": [_holds(field, spec)]}, field, _wanted(spec))
        for field, spec in WELL_FORMED.items()
    ]
    checks.append((_UNREACHABLE, "next_claim_at", "a date while the task is open"))
    found: dict[str, Doc] = {  # the unknown status itself, if it reads as a string
        "status": {
            "$convert": {
                "input": "$status",
                "to": "string",
                "onError": {"$type": "$status"},
                "onNull": "null",
            }
        }
    }
    for field, spec in WELL_FORMED.items():  # a number out of range: its type and its value
        if "$gte" in spec:
            value = {
                "$convert": {"input": f"${field}", "to": "string", "onError": "", "onNull": ""}
            }
            found[field] = {"$trim": {"input": {"$concat": [{"$type": f"${field}"}, " ", value]}}}
    branches = [
        {
            "case": test,
            "then": {
                "$concat": [
                    f"malformed task document: '{field}' must be {wanted}, found ",
                    found.get(field, {"$type": f"${field}"}),
                ]
            },
        }
        for test, field, wanted in checks
    ]
    unknown, reason = unknown_option_check()
    branches.append({"case": unknown, "then": {"$concat": ["malformed task document: ", reason]}})
    return {"$switch": {"branches": branches, "default": "malformed task document"}}


CLAIMED_FIELDS = {"name": 1, "params": 1, "options": 1, "attempts": 1, "has_dependents": 1}
CLAIMED_FIELDS["trace"] = 1  # the task's trace context (mtask.tracing), parent of each run span
# earlier runs' states and transaction sessions: a transactional run kills the sessions of
# runs whose lease expired (store.transactional.stale_sessions)
CLAIMED_FIELDS.update({"runs.state": 1, "runs.txn": 1, "runs.output_txn": 1})
# when it may be claimed next (its lease's end): a dispatched worker tells the host's relay
CLAIMED_FIELDS["next_claim_at"] = 1
CLAIMED_FIELDS["steps"] = 1  # durable steps to replay (docs/steps.md); absent: no bytes
CLAIMED_FIELDS["spawn"] = 1  # a spawned child's parent, counted at its end; absent: no bytes
CLAIMED_FIELDS["backoffs"] = 1  # its handler's BackOffs so far, against max_backoffs
# what its runs spent, against its budget (docs/usage.md); absent: no bytes
CLAIMED_FIELDS.update({"usage.input_tokens": 1, "usage.output_tokens": 1, "usage.cost_nanos": 1})
"""What a worker needs of a task it claimed."""
PLACEMENT_FIELDS = {
    "next_claim_at": 1,
    "available_at": 1,
    "name": 1,
    "status": 1,
    "options": 1,
    "waiting_on": 1,
}
"""What a worker reads to queue a task (``status`` and all ``options``: see ``placeable``)."""


LAST_WRITE = "last_write"
"""Set by a worker's claims and successes to ``claim:<worker id>`` / ``success:<worker id>``:
its own change stream skips these events (the worker knows what it wrote), so a draining
worker does not read back two events per task. Any other write leaves it alone, so its events
(a failure to retry, a release, a ping) reach every worker, the writer included."""


def claim_tag(worker_id: str) -> str:
    return f"claim:{worker_id}"


def success_tag(worker_id: str) -> str:
    return f"success:{worker_id}"


def literal(value: Any) -> dict[str, Any]:
    """Wrap user data placed in a pipeline so ``$``-strings are never read as expressions."""
    return {"$literal": value}


def publish_seq(now: dt.datetime, index: int = 0) -> int:
    """A grouped task's place in its group's publish order: the publish time in microseconds,
    plus its place in a ``publish_many`` call."""
    return int(now.timestamp() * 1_000_000) + index


def new_document(task: NewTask, now: dt.datetime, index: int = 0) -> Doc:
    available = task.options.run_at or now
    grouped = {} if task.options.group is None else {"publish_seq": publish_seq(now, index)}
    return {
        "_id": task.key,
        "name": task.name,
        "params": task.params,
        "options": task.options.to_document(),
        "status": TaskStatus.PENDING.value,
        "next_claim_at": available,
        "available_at": available,
        "attempts": 0,
        "successes": 0,
        "failures": 0,
        "failed_permanently": False,
        "runs": [],
        "runs_folded": 0,
        "result": None,
        "error": None,
        "created_at": now,
        "updated_at": now,
        "finished_at": None,
        **grouped,
        **_flow_fields(task),
    }


def _flow_fields(task: NewTask) -> Doc:
    """A step's parent; dependencies, and the ones still awaited (none claimable before)."""
    fields: Doc = {}
    if task.parent is not None:
        fields["parent"] = task.parent
    if task.spawn is not None:  # a spawned child's parent, step and place
        fields["spawn"] = dict(task.spawn)
    if task.triggered_by is not None:  # the trigger and the document it published it for
        fields["triggered_by"] = dict(task.triggered_by)
    if task.depends_on:
        fields["depends_on"] = list(task.depends_on)
        fields["waiting_on"] = list(task.depends_on)
        fields["next_claim_at"] = None
    return fields


# ---------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------


RETIRED_INDEXES: dict[str, tuple[str, ...]] = {
    "tasks": ("worker_runs", "status_newest", GROUP_LOCK)
}
"""Indexes earlier versions made that nothing reads any more, or that one of ``INDEXES``
replaces under another name (an index cannot change its options in place): ``ensure_indexes``
drops them. (A worker of an earlier version started later makes its index again; the next
start of this one drops it. Where the user may make indexes but not drop them, the retired one
stays: it costs its key writes only.)"""
DROP_WAIT_MS = 2_000
"""How long dropping a retired index may wait for the collection's exclusive lock, which an
open transaction on the collection holds off (for up to a minute): past it the index stays
until the next start, and the start goes on."""
DROP_REFUSALS = (27, 13, 50, 24)
"""IndexNotFound (dropped meanwhile), Unauthorized, MaxTimeMSExpired, LockTimeout."""


LOCK_MIGRATION_TRIES = 5
"""How many times the ``sequence_lock`` index's first build is tried (``migrate_locks``)."""


def migrate_locks(present: Doc) -> Op[None]:
    """Before the ``sequence_lock`` index is first made: earlier versions left ``group_lock`` on
    cancelled tasks (their index held open ones only), which the new index would count as
    held (and refuse to build on, two of a group). Those marks are removed first; a build
    that still meets two (a worker of an earlier version cancelling meanwhile) is tried
    again. Once the index is there (among the tasks' ``present`` indexes), nothing."""
    if SEQUENCE_LOCK in present:
        return
    model = next(m for m in INDEXES["tasks"] if m.document["name"] == SEQUENCE_LOCK)
    for attempt in range(LOCK_MIGRATION_TRIES):
        yield Call(
            "update_many",
            ({GROUP_LOCK: True, "status": {"$nin": OPEN_LIST}}, {"$unset": {GROUP_LOCK: ""}}),
        )
        try:
            yield Call("create_indexes", ([model],))
            return
        except OperationFailure as exc:
            if exc.code != DUPLICATE_KEY or attempt == LOCK_MIGRATION_TRIES - 1:
                raise


DUPLICATE_KEY = 11000


def ensure_indexes() -> Op[None]:
    """Make the indexes and drop the retired ones. A user whose role may not (a publisher's, a
    viewer's: ``mtask.security.roles``) leaves them to ``mtask collection init``, run by an
    admin. The tasks' indexes are read once (a start's round trips): where every one is there
    as written here, they are not asked for again; any other difference (one missing, one
    with other keys or options) asks for them all, as ever (the server's refusal of a
    conflicting one included)."""
    try:
        present: Doc = yield Call("index_information")
        yield from migrate_locks(present)
        for collection, models in INDEXES.items():
            if collection == "tasks" and all(made(model, present) for model in models):
                continue
            yield Call("create_indexes", (models,), collection=collection)
        yield from _drop_retired(present)
    except OperationFailure as exc:
        if exc.code != UNAUTHORIZED:
            raise


SERVER_FIELDS = ("v", "key", "ns")
"""What ``index_information`` tells of an index besides its options."""


def made(model: IndexModel, present: Doc) -> bool:
    """``model`` is among the ``present`` indexes (``index_information``) as written: its
    name, the same keys in the same order, and the same options, no more, no fewer."""
    spec = dict(model.document)
    info = present.get(spec.pop("name"))
    if info is None:
        return False
    keys = [(field, direction) for field, direction in spec.pop("key").items()]
    options = {k: v for k, v in info.items() if k not in SERVER_FIELDS}
    return [tuple(k) for k in info["key"]] == keys and options == spec


def _drop_retired(tasks: Doc) -> Op[None]:
    """Drop the retired indexes of ``RETIRED_INDEXES``; ``tasks``: the tasks' indexes, read."""
    for collection, names in RETIRED_INDEXES.items():
        present = tasks
        if collection != "tasks":
            present = yield Call("index_information", collection=collection)
        for name in names:
            if name not in present:  # the common case: no exclusive lock asked for
                continue
            try:
                yield Call(
                    "drop_index", (name,), {"maxTimeMS": DROP_WAIT_MS}, collection=collection
                )
            except OperationFailure as exc:
                if exc.code not in DROP_REFUSALS:
                    raise


VALIDATION_LEVEL = "moderate"
"""The validator checks inserts and updates of documents that satisfy it; a document that was
already there and does not (inserted before the validator) can still be marked ``invalid``."""


def collection_init(
    name: str, validator: bool | None = None, operator_indexes: bool | None = None
) -> Op[Doc]:
    """Create the tasks collection ``name`` (if absent) and the indexes; with ``validator``
    True install the task document's ``$jsonSchema`` (``mtask.jsonschema``) as its validator
    (action ``error``, level ``moderate``), with False remove any validator, with None leave it;
    ``operator_indexes`` likewise for ``OPERATOR_INDEXES``. Returns the collection's options as
    the server reports them."""
    from mtask.jsonschema import validator_schema  # the schema module imports models only

    try:
        yield Call("command", ("create", name))
    except OperationFailure as exc:
        if exc.code != 48:  # NamespaceExists
            raise
    if validator is not None:
        rule = {"$jsonSchema": validator_schema()} if validator else {}
        yield Call(
            "command",
            ("collMod", name),
            {"validator": rule, "validationLevel": VALIDATION_LEVEL, "validationAction": "error"},
        )
    yield from ensure_indexes()
    if operator_indexes:
        yield Call("create_indexes", (OPERATOR_INDEXES,))
    elif operator_indexes is not None:
        present = yield Call("index_information")
        for index in (str(model.document["name"]) for model in OPERATOR_INDEXES):
            if index in present:  # an open transaction may hold the lock: not for ever
                yield Call("drop_index", (index,), {"maxTimeMS": DROP_WAIT_MS})
    info = yield Call("command", ("listCollections",), {"filter": {"name": name}})
    batch = info.get("cursor", {}).get("firstBatch", [])
    options: Doc = batch[0].get("options", {}) if batch else {}
    return options


def collection_uuid(name: str) -> Op[Any]:
    """The tasks collection's UUID (``None`` if it does not exist): what tells one collection
    from another across clusters (the shared change stream's endpoint is named after it)."""
    info = yield Call("command", ("listCollections",), {"filter": {"name": name}})
    batch = info.get("cursor", {}).get("firstBatch", [])
    return batch[0].get("info", {}).get("uuid") if batch else None
