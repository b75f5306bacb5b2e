"""Usage and budgets in MongoDB (docs/usage.md): a run's charges on its task document, fenced by
the run, and on the totals of its name and its group in ``<tasks>.usage``; the budgets there.

The task document's ``usage`` (and its run's ``runs.N.usage``) holds ``{input_tokens,
output_tokens, cached_tokens, requests, cost_nanos}`` (``cost_nanos``, the cost in integer
nano-units of the currency, only once a charge had one), the
task's also ``models: [{model, …}]``; both absent until a run records usage. One document per
scope in ``<tasks>.usage``::

    {_id: {scope: "name" | "group", id: <name or group>},
     input_tokens, output_tokens, cached_tokens, requests, cost_nanos, updated_at,
     budget: {tokens, cost, cost_nanos, period},       # set_budget; absent: none
     window: {start, input_tokens, output_tokens, cost_nanos}}  # the budget's current period

A charge is one update of each (``$inc``-like pipelines, on the server's clock): charges that
race add up, none is lost. A budget's check is one read whose filter the server computes
(``over_filter``): spent (in the current period, for a budget that has one) at or past the
budget. Steps that passed the check before the total reached the budget still charge what
they spend: the overshoot is bounded by the steps in flight (docs/usage.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pymongo import ASCENDING, IndexModel, ReturnDocument

from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask
from mtask.store.steps import fence
from mtask.usage.rules import Usage

if TYPE_CHECKING:
    from mtask.models import Budget

COLLECTION = "usage"
"""The key of the side collection in ``driver.collections``: ``<tasks>.usage``."""
BUDGETED = IndexModel(
    [("budget", ASCENDING)], name="budgeted", partialFilterExpression={"budget": {"$exists": True}}
)
"""The scopes that have a budget, alone: whether any has one is one index key read (none: an
empty index), however many names and groups were charged."""
SCOPES = ("name", "group")
COUNTS = ("input_tokens", "output_tokens", "cached_tokens", "requests", "cost_nanos")


def collection_name(tasks: str) -> str:
    return f"{tasks}.usage"


def scope_id(scope: str, value: str) -> Doc:
    """A scope's ``_id`` (its fields always in this order: the equality of an embedded
    document is by field and order)."""
    if scope not in SCOPES:
        raise InvalidTask(f"a scope is one of {', '.join(SCOPES)}, not {scope!r}", field="scope")
    if not isinstance(value, str) or not value or "\x00" in value or len(value) > 200:
        raise InvalidTask(f"a {scope} is 1 to 200 characters without NUL", field=scope)
    return {"scope": scope, "id": value}


def _added(path: str, counts: Mapping[str, Any]) -> Doc:
    """The totals at ``path`` (``$usage``, ``$$this.usage``) plus ``counts``; a cost only
    if there was one or this charge has one (``$$REMOVE`` otherwise)."""
    added: Doc = {}
    for field in COUNTS:
        if field in counts:
            added[field] = {"$add": [{"$ifNull": [f"{path}.{field}", 0]}, counts[field]]}
        else:
            added[field] = {"$ifNull": [f"{path}.{field}", "$$REMOVE"]}
    return added


def _models(model: str, counts: Mapping[str, Any]) -> Doc:
    """The task's ``usage.models`` with this charge added to ``model``'s entry (made if new)."""
    mine = {"$eq": ["$$this.model", {"$literal": model}]}
    listed = {"$ifNull": ["$usage.models", []]}
    return {
        "$cond": [
            {"$in": [{"$literal": model}, {"$ifNull": ["$usage.models.model", []]}]},
            {
                "$map": {
                    "input": listed,
                    "in": {
                        "$cond": [
                            mine,
                            {"$mergeObjects": ["$$this", _added("$$this", counts)]},
                            "$$this",
                        ]
                    },
                }
            },
            {
                "$concatArrays": [
                    listed,
                    [{"model": {"$literal": model}, **{k: v for k, v in counts.items()}}],
                ]
            },
        ]
    }


def charge_task_pipeline(run_id: str, usage: Usage) -> list[Doc]:
    """The task's and its run's totals with ``usage`` added."""
    counts = usage.counts()
    total = _added("$usage", counts)
    if usage.model is not None:
        total["models"] = _models(usage.model, counts)
    else:
        total["models"] = {"$ifNull": ["$usage.models", "$$REMOVE"]}
    run = {
        "$map": {
            "input": "$runs",
            "in": {
                "$cond": [
                    {"$eq": ["$$this.run_id", run_id]},
                    {"$mergeObjects": ["$$this", {"usage": _added("$$this.usage", counts)}]},
                    "$$this",
                ]
            },
        }
    }
    return [{"$set": {"usage": total, "runs": run}}]


def charge_task(key: str, run_id: str, usage: Usage) -> Op[None]:
    """Charge ``usage`` to task ``key`` and its run, if the run still owns it (``LeaseLost``
    if not: a late result of a run that lost its task charges nothing)."""
    from mtask.errors import LeaseLost

    result = yield Call("update_one", (fence(key, run_id), charge_task_pipeline(run_id, usage)))
    if not result.matched_count:
        raise LeaseLost(f"run {run_id} of {key!r} no longer owns the task: usage not recorded")


def period_start_expr(period: Any) -> Any:
    """The server's start of the current period of a budget's ``period`` (an expression)."""
    return {
        "$switch": {
            "branches": [
                {
                    "case": {"$eq": [{"$type": period}, "string"]},
                    "then": {"$dateTrunc": {"date": "$$NOW", "unit": period}},
                },
                {
                    "case": {"$isNumber": period},
                    "then": {
                        "$subtract": [
                            "$$NOW",
                            {
                                "$mod": [
                                    {"$toLong": "$$NOW"},
                                    {"$toLong": {"$multiply": [period, 1000]}},
                                ]
                            },
                        ]
                    },
                },
            ],
            "default": None,
        }
    }


def charge_scope_pipeline(usage: Usage) -> list[Doc]:
    """A scope's totals with ``usage`` added, and its budget's window (the current period's
    spending: begun again when the period changed)."""
    counts = usage.counts()
    window_counts = {k: v for k, v in counts.items() if k in ("input_tokens", "output_tokens")}
    if "cost_nanos" in counts:
        window_counts["cost_nanos"] = counts["cost_nanos"]
    same = {"$eq": ["$window.start", "$$start"]}
    window = {
        "$cond": [
            {"$eq": ["$$start", None]},
            "$$REMOVE",
            {
                "$cond": [
                    same,
                    {"$mergeObjects": [{"start": "$$start"}, _added("$window", window_counts)]},
                    {"start": "$$start", **window_counts},
                ]
            },
        ]
    }
    return [
        {
            "$set": {
                **_added("$$ROOT", counts),
                "window": {
                    "$let": {"vars": {"start": period_start_expr("$budget.period")}, "in": window}
                },
                "updated_at": "$$NOW",
            }
        }
    ]


def charge_scopes(scopes: Sequence[Doc], usage: Usage) -> Op[None]:
    """Add ``usage`` to each scope's totals (made by its first charge)."""
    pipeline = charge_scope_pipeline(usage)
    for scope in scopes:
        yield Call(
            "update_one", ({"_id": scope}, pipeline), {"upsert": True}, collection=COLLECTION
        )


def over_expr() -> Doc:
    """True for a scope whose spending is at or past its budget (in the current period, for a
    budget that has one; a window of an earlier period spent nothing of this one)."""
    current = {
        "$cond": [
            {"$eq": [{"$ifNull": ["$budget.period", None]}, None]},
            "$$ROOT",
            {
                "$cond": [
                    {"$eq": ["$window.start", period_start_expr("$budget.period")]},
                    "$window",
                    {},
                ]
            },
        ]
    }
    tokens = {
        "$add": [
            {"$ifNull": ["$$spent.input_tokens", 0]},
            {"$ifNull": ["$$spent.output_tokens", 0]},
        ]
    }
    over = {
        "$or": [
            {
                "$and": [
                    {"$isNumber": "$budget.tokens"},
                    {"$gte": [tokens, "$budget.tokens"]},
                ]
            },
            {
                "$and": [
                    {"$isNumber": "$budget.cost_nanos"},
                    {"$gte": [{"$ifNull": ["$$spent.cost_nanos", 0]}, "$budget.cost_nanos"]},
                ]
            },
        ]
    }
    return {"$let": {"vars": {"spent": current}, "in": over}}


def over_budget(scopes: Sequence[Doc]) -> Op[list[Doc]]:
    """The scopes among ``scopes`` at or past their budget now (the server decides, on its
    clock): their ``_id``, budget, window and totals."""
    found: list[Doc] = yield Call(
        "find",
        ({"_id": {"$in": list(scopes)}, "budget": {"$exists": True}, "$expr": over_expr()},),
        collection=COLLECTION,
    )
    return found


def ensure_indexes() -> Op[None]:
    """The side collection's index of budgets (a worker creates it before its first read of
    them)."""
    yield Call("create_indexes", ([BUDGETED],), collection=COLLECTION)


def any_budget() -> Op[bool]:
    """Whether any name or group has a budget: one read of the ``budgeted`` index (one key at
    most; none without budgets)."""
    found: Doc | None = yield Call(
        "find_one",
        ({"budget": {"$exists": True}}, {"_id": 1}),
        {"hint": BUDGETED.document["name"]},
        collection=COLLECTION,
    )
    return found is not None


def budgets_of(scopes: Sequence[Doc]) -> Op[list[Doc]]:
    """Which of ``scopes`` have a budget (their ``_id`` and ``budget``)."""
    found: list[Doc] = yield Call(
        "find",
        ({"_id": {"$in": list(scopes)}, "budget": {"$exists": True}}, {"budget": 1}),
        collection=COLLECTION,
    )
    return found


def set_budget(scope: Doc, budget: Budget) -> Op[Doc | None]:
    """Set a scope's budget (its totals are kept; a scope nobody charged yet is made): the
    scope's document as it is now."""
    stored = budget.to_document()
    if budget.cost is not None:
        stored["cost_nanos"] = budget.cost_nanos()
    doc: Doc | None = yield Call(
        "find_one_and_update",
        ({"_id": scope}, [{"$set": {"budget": {"$literal": stored}, "updated_at": "$$NOW"}}]),
        {"upsert": True, "return_document": ReturnDocument.AFTER},
        collection=COLLECTION,
    )
    return doc


def clear_budget(scope: Doc) -> Op[bool]:
    """Remove a scope's budget and its period's window (its totals are kept); ``False`` if it
    had none. An ``update_one``: whether it matched is all the caller needs (a
    ``findAndModify`` would send the document back and, as a retryable write, keep an image
    of it on the server)."""
    result = yield Call(
        "update_one",
        ({"_id": scope, "budget": {"$exists": True}}, [{"$unset": ["budget", "window"]}]),
        collection=COLLECTION,
    )
    return bool(result.matched_count)


def totals(scopes: Sequence[Doc] | None = None) -> Op[list[Doc]]:
    """The scopes' documents (all of them without ``scopes``), by scope and id."""
    query: Doc = {} if scopes is None else {"_id": {"$in": list(scopes)}}
    found: list[Doc] = yield Call("find", (query,), {"sort": [("_id", 1)]}, collection=COLLECTION)
    return found
