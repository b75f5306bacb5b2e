"""Completing a publisher's minimal document, and finding documents no claim can reach.

A service in any language may publish with just ``{_id, name, params}`` (optionally ``options``,
any subset, and ``run_at``), upserted with ``$setOnInsert`` (``docs/publishing.md``). Such a
document has no ``status``. The first worker (or sweep) that meets it completes it on the
server, in one update whose filter is "still without a status and completable": the options
it lacks get their defaults (``vocabulary.OPTION_DEFAULTS``), ``status``, the counters, ``runs``,
``available_at`` (``run_at``, else ``$$NOW``), ``created_at`` (``$$NOW``) are set, and the
state machine's ``recompute_stages`` derives ``next_claim_at``. A document that cannot be
completed (a field of the wrong BSON type, an ISO string where a date belongs, an unknown option
key, a bad name, params that are not an object) is marked ``invalid`` in one update with the
same fence, with ``invalid_reason`` naming the first bad field.

The checks are derived from the MongoDB validator schema (``mtask.jsonschema``), itself
generated from ``models.TaskDocument``/``PublishedDocument``: one definition (read from the shipped
file, which a test keeps equal to what they generate, so that a worker imports no pydantic).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from mtask.driver import Call, Doc, Op
from mtask.jsonschema import shipped_validator
from mtask.statemachine import OPEN, recompute_stages
from mtask.store import counts
from mtask.store.across import NOT_A_NAME, string_names
from mtask.store.schema import WELL_FORMED, keys_in, unknown_option_check
from mtask.vocabulary import (
    DEFAULT_MAX_PARAMS_BYTES,
    FINISHED_STATUSES,
    OPTION_DEFAULTS,
    TaskStatus,
)

NOW = "$$NOW"
ABSENT = ["missing", "null"]

INCOMPLETE: Doc = {"status": None}
"""A publisher's document: no status (missing, or null)."""
FLOW_FIELDS = ("depends_on", "waiting_on")
"""Dependencies are mtask's own bookkeeping (resolved by the worker that records the awaited
task's outcome): a foreign publisher cannot write them correctly, so they are refused."""


def _type(path: str) -> Doc:
    return {"$type": f"${path}"}


def _kinds(spec: Doc) -> list[str]:
    kind = spec.get("bsonType", [])
    return kind if isinstance(kind, list) else [kind]


def _field_checks(path: str, spec: Doc) -> list[tuple[Doc, Any]]:
    """(condition that is true when the field is wrong, reason expression) pairs for one
    field, from its ``$jsonSchema``. An absent (or null) field is not wrong here: it is
    completed with its default."""
    kinds = _kinds(spec)
    field = f"${path}"
    checks: list[tuple[Doc, Any]] = []
    if kinds:
        wanted = " or ".join(k for k in kinds if k != "null")
        wanted = f"an {wanted}" if wanted[0] in "aeiou" else f"a {wanted}"
        checks.append(
            (
                {"$not": [{"$in": [_type(path), [*kinds, *ABSENT]]}]},
                {"$concat": [f"'{path}' must be {wanted}, found ", {"$type": field}]},
            )
        )
    number = {"$isNumber": field}
    if "minimum" in spec:
        checks.append(
            (
                {"$and": [number, {"$lt": [field, spec["minimum"]]}]},
                {"$concat": [f"'{path}' must be at least {spec['minimum']}, found ", _text(field)]},
            )
        )
    if "maximum" in spec:
        checks.append(
            (
                {"$and": [number, {"$gt": [field, spec["maximum"]]}]},
                {"$concat": [f"'{path}' must be at most {spec['maximum']}, found ", _text(field)]},
            )
        )
    string = {"$eq": [{"$type": field}, "string"]}
    length = {"$strLenCP": {"$cond": [string, field, ""]}}
    if "minLength" in spec:
        checks.append(
            (
                {"$and": [string, {"$lt": [length, spec["minLength"]]}]},
                f"'{path}' must not be empty",
            )
        )
    if "maxLength" in spec:
        checks.append(
            (
                {"$and": [string, {"$gt": [length, spec["maxLength"]]}]},
                f"'{path}' must be at most {spec['maxLength']} characters",
            )
        )
    if "pattern" in spec:  # vocabulary.NO_NUL, the only pattern
        checks.append(
            (
                {
                    "$and": [
                        string,
                        {"$not": [{"$regexMatch": {"input": field, "regex": spec["pattern"]}}]},
                    ]
                },
                f"'{path}' must not contain NUL characters",
            )
        )
    items = _kinds(spec.get("items", {}))
    if items:
        array = {"$cond": [{"$isArray": field}, field, []]}
        bad = {"$not": [{"$in": [{"$type": "$$item"}, items]}]}
        checks.append(
            (
                {"$anyElementTrue": [{"$map": {"input": array, "as": "item", "in": bad}}]},
                f"'{path}' must hold only {' or '.join(items)} values",
            )
        )
    return checks


def _text(expr: Any) -> Doc:
    return {"$convert": {"input": expr, "to": "string", "onError": "?", "onNull": "null"}}


def _checks() -> list[tuple[Doc, Any]]:
    schema = shipped_validator()
    props: Doc = schema["properties"]
    checks: list[tuple[Doc, Any]] = [
        ({"$in": [_type("name"), ABSENT]}, "'name' is missing"),
    ]
    for field in ("_id", "name", "params", "options"):
        checks += _field_checks(field, props[field])
    checks.append(
        (
            {
                "$and": [
                    {"$eq": [_type("params"), "object"]},
                    {"$gt": [{"$bsonSize": "$params"}, DEFAULT_MAX_PARAMS_BYTES]},
                ]
            },
            f"'params' is larger than {DEFAULT_MAX_PARAMS_BYTES} bytes as BSON",
        )
    )
    checks.append(unknown_option_check())
    for option, spec in props["options"]["properties"].items():
        checks += _field_checks(f"options.{option}", spec)
    checks += [
        (
            {"$not": [{"$in": [_type(field), ["missing"]]}]},
            f"'{field}' cannot be published by hand: publish tasks with dependencies "
            "through mtask (TaskClient.publish, POST /tasks)",
        )
        for field in FLOW_FIELDS
    ]
    for field, spec in props.items():
        if field not in ("_id", "name", "params", "options", "status", *FLOW_FIELDS):
            checks += _field_checks(field, spec)
    return checks


@functools.cache
def problem_expr() -> Doc:
    """The first reason a status-less document cannot be completed, or null."""
    branches = [{"case": case, "then": then} for case, then in _checks()]
    return {"$switch": {"branches": branches, "default": None}}


def _default(path: str, default: Any) -> Doc:
    return {"$ifNull": [f"${path}", {"$literal": default}]}


def completion_stages() -> list[Doc]:
    """The pipeline that completes a completable status-less document."""
    options = {
        name: _default(f"options.{name}", default)
        for name, default in OPTION_DEFAULTS.items()
        if name != "run_at"
    }
    options["run_at"] = {"$ifNull": ["$run_at", "$options.run_at", None]}
    return [
        {
            "$set": {
                "params": _default("params", {}),
                "options": options,
                "status": TaskStatus.PENDING.value,
                "attempts": _default("attempts", 0),
                "successes": _default("successes", 0),
                "failures": _default("failures", 0),
                "failed_permanently": _default("failed_permanently", False),
                "runs": _default("runs", []),
                "runs_folded": _default("runs_folded", 0),
                "result": {"$ifNull": ["$result", None]},
                "error": {"$ifNull": ["$error", None]},
                "created_at": {"$ifNull": ["$created_at", NOW]},
                "finished_at": None,
                # only mtask's publish takes a supersede place (store.supersede) or
                # opens a debounce window (store.debounce); a
                # minimal document completed into an open one never does (the unique index
                # would refuse the whole completion)
                "supersede": "$$REMOVE",
                "debounce": "$$REMOVE",  # likewise for a debounce window (store.debounce)
            }
        },
        {
            "$set": {
                "available_at": {"$ifNull": ["$available_at", "$options.run_at", NOW]},
                # a grouped task's place in its group's publish order (microseconds)
                "publish_seq": {
                    "$cond": [
                        {"$eq": [{"$type": "$options.group"}, "string"]},
                        {"$ifNull": ["$publish_seq", {"$multiply": [{"$toLong": NOW}, 1000]}]},
                        "$$REMOVE",
                    ]
                },
            }
        },
        # group_lock: taken by a sequence's claim; a document without a status holds none
        {"$unset": ["run_at", "group_lock"]},
        *recompute_stages(NOW),
    ]


INVALID_FILL: Doc = {
    "params": {},
    "options": {},
    "attempts": 0,
    "successes": 0,
    "failures": 0,
    "runs": [],
}
"""What a status-less document marked ``invalid`` is given where it lacks it: a document with a
status holds the whole stored shape (``models.REQUIRED_FIELDS``), as the collection's validator
requires, which refused the marking of a document it had accepted (params over 1 MiB,
dependencies) and left that document without a status for ever."""


def invalid_stages(reason: Any) -> list[Doc]:
    return [
        {
            "$set": {
                "status": TaskStatus.INVALID.value,
                "invalid_reason": reason,
                "updated_at": NOW,
                "next_claim_at": None,
                **{field: _default(field, value) for field, value in INVALID_FILL.items()},
                "available_at": {"$ifNull": ["$available_at", NOW]},
                "created_at": {"$ifNull": ["$created_at", NOW]},
            }
        }
    ]


def complete(keys: list[Any]) -> Op[tuple[int, int]]:
    """Complete the status-less documents among ``keys``, or mark them ``invalid`` with the
    reason; returns (completed, marked invalid). Each document is changed by one update whose
    filter re-checks, at write time, that it still has no status (and is, or is not,
    completable), so a document another worker completed meanwhile is left alone."""
    if not keys:
        return 0, 0
    problem = problem_expr()
    done = yield Call(
        "update_many",
        (
            {**keys_in(keys), **INCOMPLETE, "$expr": {"$eq": [problem, None]}},
            completion_stages(),
        ),
    )
    marked = yield Call(
        "update_many",
        (
            {**keys_in(keys), **INCOMPLETE, "$expr": {"$ne": [problem, None]}},
            invalid_stages(problem),
        ),
    )
    return done.modified_count, marked.modified_count


def stranded_quick(names: Sequence[Any]) -> Doc:
    """Documents with no status, a null one, or one mtask does not know, open ones whose name
    no worker can handle, and unsettled ones whose key is not a string: few, and cheap to find
    through ``name_status_newest``, name by name (``names``: the names present; a name that is
    not a string is the second branch's, as ``store.across`` reads them). (An open task
    whose name no running worker handles is not stranded: it waits for a worker of its name.)"""
    return {
        "$or": [
            {"name": {"$in": string_names(names)}, "status": {"$nin": KNOWN}},
            # not a string, or "": the only names no worker can have ($gt "" is every other
            # string), unfinished (an unknown status, or open)
            {"name": NOT_A_NAME, "status": {"$nin": FINISHED}},
            # a key that is not a string (any service may insert one): no worker queues it;
            # found through the _id index, whose bounds a list of types narrows to those keys
            {
                "name": {"$in": string_names(names)},
                "status": {"$in": list(OPEN)},
                "_id": NOT_A_STRING,
            },
        ]
    }


FINISHED = sorted(s.value for s in FINISHED_STATUSES)
KNOWN = [s.value for s in TaskStatus]
NOT_A_STRING: Doc = {
    "$type": [
        "number",
        "objectId",
        "object",
        "binData",
        "bool",
        "date",
        "null",
        "regex",
        "dbPointer",
        "javascript",
        "javascriptWithScope",
        "timestamp",
        "minKey",
        "maxKey",
        "undefined",
    ]
}
"""A key of any type but a string, as a list of types: ``$not: {$type: "string"}`` has no index
bounds, so it read every open task's document; each listed type is one range of the ``_id``
index. Left out besides strings: an array (never an ``_id``) and a symbol (a deprecated type
some drivers still write), whose range is the strings': ``stranded_open`` finds those."""


def stranded_open(names: Sequence[Any]) -> Doc:
    """Open documents that no claim can reach: no date to be claimed at (and not waiting for
    dependencies), or a field the claim needs missing or mistyped (``WELL_FORMED``). mtask
    never writes one; a document written by hand may be. Finding them reads every open task's
    document (through ``name_status_newest``, name by name), so the sweep does it only every
    few rounds (``finding.scan``)."""
    return {
        "name": {"$in": string_names(names)},  # the others: stranded_quick's second branch
        "status": {"$in": list(OPEN)},
        "$or": [
            {"next_claim_at": {"$not": {"$type": "date"}}, "waiting_on.0": {"$exists": False}},
            # a claim time, but a field the claim computes with missing or of another type: the
            # scan (and the claim) skip it, so only its insert event could have brought it to a
            # worker; a worker that was down then never would
            *({field: {"$not": spec}} for field, spec in WELL_FORMED.items()),
            {"name": {"$regex": "\\x00"}},  # a name no worker can have (vocabulary.NO_NUL)
            # a key that is a symbol: read as a string, but no batch claim ($type "string")
            # matches it; NOT_A_STRING leaves it out (its bounds would be every string key)
            {"_id": {"$type": "symbol"}},
        ],
    }


def stranded(limit: int = 1000, open_too: bool = True) -> Op[list[Any]]:
    """Keys of documents no claim can reach and no change event may bring back (for the sweep,
    which then completes or marks them: ``complete`` and ``quarantine``)."""
    names: list[Any] = yield counts.names()
    quick = stranded_quick(names)
    filt = {"$or": [*quick["$or"], stranded_open(names)]} if open_too else quick
    docs: list[Doc] = yield Call("find", (filt, {"_id": 1}), {"limit": limit})
    return [d["_id"] for d in docs]
