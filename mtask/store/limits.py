"""The limits documents written and read: a name's, a group's and a shared resource's limit set
or cleared, in one update each, and the slots' runs settled after a change (the rules are
mtask.limits.rules)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from pymongo import ReturnDocument

from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask
from mtask.limits import measured
from mtask.limits.rules import (
    CONFIG_FIELDS,
    GROUP_SEPARATOR,
    LOCK_RUNS,
    MAX_OVERRIDES,
    NAME_LIMITS,
    OVERRIDES,
    OVERRIDES_AT,
    READ_FIELDS,
    RESOURCE_USERS,
    SLOT_RUNS,
    GroupOverride,
    Limit,
    _validate_one,
    group_limit,
    group_override,
    is_sequence,
    resource_slot,
    validate_group,
    validate_limit,
    validate_overflow,
    validate_override,
    validate_resource,
    validate_users,
)
from mtask.vocabulary import validate_name


def set_resource_limit(
    resource: str,
    own: Limit,
    now: dt.datetime,
    overflow: str | None = None,
    names: Sequence[str] | None = None,
    tokens_per: object = None,
) -> Op[Doc]:
    """Create or change the limit of the shared resource ``resource``: every task
    whose name uses it (``@registry.task(uses=[...])``, or ``names`` here) takes a slot of it
    too, exactly as of a name's own limit, in the same bulk write. A resource has no groups.
    ``names``: its declared users from now on (``None``: as they were). ``tokens_per``: ``(N,
    seconds)``, at most ``N`` tokens charged a window (``mtask.limits.measured``); ``None``:
    none (the current window's count is kept)."""
    resource = validate_resource(resource)
    users_now = None if names is None else validate_users(names)
    per = None if tokens_per is None else measured.validate(tokens_per)
    if not own.set and per is None:
        raise InvalidTask("give concurrency, rate or tokens_per", field="limit")
    slot = resource_slot(resource)
    doc: Doc = yield from set_limit(
        slot, own, Limit(), now, resource=resource, overflow=overflow, users=users_now, per=per
    )
    return doc


def set_limit(
    name: str,
    own: Limit,
    group: Limit,
    now: dt.datetime,
    resource: str | None = None,
    overflow: str | None = None,
    users: list[str] | None = None,
    per: tuple[int, int] | None = None,
) -> Op[Doc]:
    """Create or change the limit of ``name`` (and of each of its groups). Slots held and
    tokens left are kept; a new bucket starts full. The groups' documents take the new
    group limit at their next claim. No run in flight is stopped: each worker counts its runs
    in towards the new limit when it hears of it (``slots.join``). A limit that makes the groups
    sequences notes when (``SLOT_RUNS``). ``resource``: ``name`` is the ``_id`` of that shared
    resource's document (``set_resource_limit`` checked it), which says its name; ``users``:
    its declared users (``RESOURCE_USERS``), if given; ``per``: its limit in tokens (``N``,
    window in milliseconds), if any."""
    extra: Doc = {"overflow": validate_overflow(overflow)}
    if resource is not None:
        own = _validate_one(own, "")
        extra["resource"] = {"$literal": resource}
        extra[measured.LIMIT] = None if per is None else per[0]
        extra[measured.WINDOW] = None if per is None else per[1]
        if users is not None:
            extra[RESOURCE_USERS] = {"$literal": users}
    else:
        name, own, group = validate_limit(name, own, group)
    full = own.full()
    doc: Doc = yield Call(
        "find_one_and_update",
        (
            {"_id": name},
            [
                {
                    "$set": {
                        "concurrency": own.concurrency,
                        "rate": own.rate,
                        "burst": None if own.rate is None else full,
                        "group_concurrency": group.concurrency,
                        "group_rate": group.rate,
                        "group_burst": None if group.rate is None else group.full(),
                        "holders": {"$cond": [{"$isArray": "$holders"}, "$holders", []]},
                        "tokens": {"$min": [full, {"$ifNull": ["$tokens", full]}]},
                        "refilled_at": {"$ifNull": ["$refilled_at", now]},
                        "updated_at": now,
                        SLOT_RUNS: now if is_sequence(group) else None,
                        LOCK_RUNS: _lock_runs(group, now),
                        **extra,
                    }
                }
            ],
        ),
        {"upsert": True, "return_document": ReturnDocument.AFTER},
        collection="limits",
    )
    return doc


def _lock_runs(group: Limit, now: dt.datetime) -> Doc | dt.datetime | None:
    """``LOCK_RUNS`` as ``set_limit`` writes it: ``now`` if the groups were sequences (the
    stored ``group_concurrency`` admits one run, with no group rate) and the new group limit
    counts runs at once in slot documents; kept if it still does; else none."""
    if group.concurrency is None or is_sequence(group):
        return None
    was_sequence = {
        "$and": [
            {"$isNumber": "$group_concurrency"},
            {"$gt": ["$group_concurrency", 0]},
            {"$lte": ["$group_concurrency", 1]},
            {"$not": [{"$isNumber": "$group_rate"}]},
        ]
    }
    return {"$cond": [was_sequence, now, {"$ifNull": [f"${LOCK_RUNS}", None]}]}


def settle_slot_runs(name: str, since: dt.datetime, now: dt.datetime) -> Op[bool]:
    """Clear ``name``'s ``SLOT_RUNS`` (as ``since``) if no slot of its groups holds a live run at
    ``now``: one read of their documents' range of ``_id``s, then one update whose filter
    matches only that same value (a ``set_limit`` since leaves it alone). Returns whether it
    was cleared."""
    prefix = name + GROUP_SEPARATOR
    held = yield Call(
        "find_one",
        (
            {
                "_id": {"$gt": prefix, "$lt": name + chr(ord(GROUP_SEPARATOR) + 1)},
                "holders": {"$elemMatch": {"expires": {"$gt": now}}},
            },
            {"_id": 1},
        ),
        collection="limits",
    )
    if held is not None:
        return False
    result = yield Call(
        "update_one",
        ({"_id": name, SLOT_RUNS: since}, {"$set": {SLOT_RUNS: None}}),
        collection="limits",
    )
    return bool(result.modified_count)


def clear_resource_limit(resource: str) -> Op[bool]:
    """Remove the limit of the shared resource ``resource``: its users run unlimited by it."""
    found: bool = yield from clear_limit(resource_slot(validate_resource(resource)))
    return found


def clear_limit(name: str) -> Op[bool]:
    """Remove the limit of ``name`` (its groups' documents run out: ``slots.GROUP_TTL``)."""
    result = yield Call("delete_one", ({"_id": name},), collection="limits")
    return bool(result.deleted_count)


def all_limits() -> Op[list[Doc]]:
    docs: list[Doc] = yield Call("find", (NAME_LIMITS, READ_FIELDS), collection="limits")
    return docs


def limits_of(names: Sequence[str]) -> Op[list[Doc]]:
    """The documents of ``names``' limits (those that have one): a worker's read after a change
    event, by ``_id``."""
    docs: list[Doc] = yield Call(
        "find", ({"_id": {"$in": sorted(names)}, **NAME_LIMITS}, READ_FIELDS), collection="limits"
    )
    return docs


def _entry(group: str, override: GroupOverride) -> Doc:
    rate = None if override.rate is None else float(override.rate)
    burst = override.burst
    if rate is not None and burst is None:
        burst = int(Limit(rate=rate).full())
    return {
        "group": group,
        "concurrency": override.concurrency,
        "rate": rate,
        "burst": burst,
        "weight": None if override.weight is None else float(override.weight),
    }


def set_group_limit(name: str, group: str, override: GroupOverride, now: dt.datetime) -> Op[Doc]:
    """Give ``group`` of ``name`` its own limit and/or weight (replacing its override, if it had
    one), in one update of the name's document (made if the name has no limit yet: its other
    groups and the name stay unlimited). Applies within a second, as ``set_limit`` does: each
    worker reads the name's document again on its change event, the group's slot takes the new
    limit at its next claim, and runs in flight count towards it."""
    name, group = validate_override(name, group, override)
    if override.limits:
        doc = yield Call("find_one", ({"_id": name}, CONFIG_FIELDS), collection="limits")
        if doc is not None and group_limit(doc).concurrency == 1:
            raise InvalidTask(
                "the name's groups are sequences (group_concurrency 1): an override may give "
                "them a weight only",
                field="group",
            )
    others = {
        "$filter": {
            "input": {"$ifNull": [f"${OVERRIDES}", []]},
            "as": "o",
            "cond": {"$ne": ["$$o.group", {"$literal": group}]},
        }
    }
    kept = {"$lt": [{"$size": others}, MAX_OVERRIDES]}
    entry = {"$literal": _entry(group, override)}
    doc = yield Call(
        "find_one_and_update",
        (
            {"_id": name},
            [
                {
                    "$set": {
                        OVERRIDES: {
                            "$cond": [
                                kept,
                                {"$concatArrays": [others, [entry]]},
                                f"${OVERRIDES}",
                            ]
                        },
                        "holders": {"$cond": [{"$isArray": "$holders"}, "$holders", []]},
                        OVERRIDES_AT: now,
                        "updated_at": now,
                    }
                }
            ],
        ),
        {"upsert": True, "return_document": ReturnDocument.AFTER},
        collection="limits",
    )
    if group_override(doc, group) is None:
        raise InvalidTask(f"{name!r} has {MAX_OVERRIDES} overrides already", field="group")
    return dict(doc)


def clear_group_limit(name: str, group: str) -> Op[bool]:
    """Remove ``group``'s override: it takes the name's group limit and weight 1 again."""
    name, group = validate_name(name), validate_group(group)
    result = yield Call(
        "update_one",
        (
            {"_id": name, f"{OVERRIDES}.group": group},
            [
                {
                    "$set": {
                        OVERRIDES: {
                            "$filter": {
                                "input": f"${OVERRIDES}",
                                "as": "o",
                                "cond": {"$ne": ["$$o.group", {"$literal": group}]},
                            }
                        },
                        OVERRIDES_AT: "$$NOW",
                    }
                }
            ],
        ),
        collection="limits",
    )
    return bool(result.modified_count)
