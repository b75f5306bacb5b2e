"""A client's checks of what its caller passes, made before anything is sent: each raises
``InvalidTask`` naming the field (shared by the parts and by the clients' own methods)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtask import store
from mtask.errors import InvalidTask
from mtask.models import ON_CONFLICT_CHOICES, TaskStatus, in_range
from mtask.store import output as store_output


def check_on_conflict(on_conflict: str) -> None:
    if on_conflict not in ON_CONFLICT_CHOICES:
        raise InvalidTask(
            f"must be ignore, update_params or reset, not {on_conflict!r}", field="on_conflict"
        )


def check_kinds(kinds: Sequence[str] | None) -> None:
    unknown = sorted(set(kinds or ()) - set(store_output.KINDS))
    if unknown:
        raise InvalidTask(
            f"unknown output kind {unknown[0]!r}; one of {', '.join(store_output.KINDS)}",
            field="kinds",
        )


def check_key(key: object, field: str = "key") -> None:
    """A key to look up is a string: a mapping, a regex or a number would be read as a query
    (``{"$gt": ""}`` matches whichever task comes first) or could never name a task."""
    if not isinstance(key, str):
        raise InvalidTask(f"must be a string, not {type(key).__name__}", field=field)


def check_number(
    value: object, field: str, low: float, high: float, *, integer: bool = False
) -> None:
    """``value`` is a number from ``low`` to ``high`` (an int if ``integer``; never a bool or
    NaN): ``InvalidTask`` naming ``field`` otherwise, not a ``TypeError`` or an
    ``OverflowError`` from the date arithmetic it goes into."""
    if integer:
        ok = in_range(value, (int(low), int(high)))
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high
    if not ok:
        kind = "an integer" if integer else "a number"
        raise InvalidTask(f"must be {kind} from {low:g} to {high:g}, not {value!r}", field=field)


def check_list_args(status: str | None, limit: int, order: str) -> None:
    if status is not None and (
        not isinstance(status, str) or status not in {s.value for s in TaskStatus}
    ):
        raise InvalidTask(
            f"unknown status {status!r}; one of {', '.join(s.value for s in TaskStatus)}",
            field="status",
        )
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
        raise InvalidTask("must be an integer between 1 and 10000", field="limit")
    if not isinstance(order, str) or order not in store.LIST_ORDERS:
        raise InvalidTask(f"must be one of {', '.join(store.LIST_ORDERS)}", field="order")


def check_session(session: Any, mongo: Any) -> None:
    """A session belongs to the MongoClient that started it; say so before pymongo does."""
    if session is not None and session.client is not mongo:
        raise InvalidTask(
            "the session was started by another MongoClient: start it from client.mongo, or "
            "build the client with mongo_client= (the MongoClient that starts your sessions)",
            field="session",
        )
