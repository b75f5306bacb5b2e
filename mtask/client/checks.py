"""A client's checks of what its caller passes, made before anything is sent: each raises
``InvalidTask`` naming the field (shared by the parts and by the clients' own methods)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtask import store
from mtask.errors import InvalidTask
from mtask.store import debounce as debounce_store
from mtask.store import output as store_output
from mtask.store import supersede as supersede_store
from mtask.vocabulary import MAX_AGE_SECONDS, ON_CONFLICT_CHOICES, TaskStatus, in_range


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


def check_wait(key: object, timeout: object) -> None:
    """A ``wait``'s key and its ``timeout`` (``None``: no limit; else seconds from 0 to
    ``MAX_AGE_SECONDS``)."""
    check_key(key)
    if timeout is not None:
        check_number(timeout, "timeout", 0, MAX_AGE_SECONDS)


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


def check_debounce(
    debounce: object,
    debounce_max: object,
    on_conflict: str,
    session: Any,
    depends_on: Sequence[str] | None,
) -> debounce_store.Quiet:
    """A debounce, alone: as ``check_supersede``."""
    if debounce is None:
        raise InvalidTask("debounce_max needs debounce", field="debounce")
    quiet = debounce_store.Quiet.build(debounce, debounce_max)
    if session is not None or on_conflict != "ignore" or depends_on:
        raise InvalidTask(
            "cannot be used in a session, with on_conflict or depends_on", field="debounce"
        )
    return quiet


def check_supersede(
    policy: str, on_conflict: str, session: Any, depends_on: Sequence[str] | None
) -> supersede_store.Policy:
    """A supersede policy, alone: not in a caller's session (a refused insert would abort its
    transaction), nor with an ``on_conflict`` other than ``ignore`` or dependencies."""
    checked = supersede_store.check_policy(policy)
    if depends_on:
        raise InvalidTask("cannot be used with depends_on", field="supersede")
    if session is not None:
        raise InvalidTask("cannot be used in a session", field="supersede")
    if on_conflict != "ignore":
        raise InvalidTask("cannot be used with on_conflict", field="supersede")
    return checked
