"""Running store operations on MongoDB.

An operation (see ``mtask.store`` and ``mtask.store.controls``) is written once, as a generator that
yields ``Call``\\ s — one collection method call each — and returns its result. ``SyncDriver``
runs it on pymongo's ``MongoClient``, ``AsyncDriver`` on its native ``AsyncMongoClient``, so the
sync and async clients share one definition and the filters and pipelines stay free of I/O.
Driver errors become ``StorageError`` with a short message and a ``transient`` flag.

``run(op, session=s)`` runs every call of the operation in the caller's pymongo session (and so in
its transaction, if one is open). Inside a transaction, an error the transaction itself must
answer (labelled ``TransientTransactionError`` or ``UnknownTransactionCommitResult``) is raised
as pymongo's own exception, unchanged, so that ``ClientSession.with_transaction`` retries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Generator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pymongo
from pymongo.errors import (
    ConnectionFailure,
    OperationFailure,
    PyMongoError,
    ServerSelectionTimeoutError,
    WriteConcernError,
    WriteError,
)

from mtask.errors import StorageError

Doc = dict[str, Any]
"""A MongoDB document as the drivers return it (and as operations build them)."""

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One call of a collection method. ``find`` and ``aggregate`` return lists; ``command``
    is a command on the collection's database; ``count`` is the ``count`` command on the
    collection (``args[0]`` the query, the keyword arguments its fields), returning ``n``."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    collection: str = "tasks"
    timeout: float | None = None
    """Seconds the call may take, run under ``pymongo.timeout`` (which sends ``maxTimeMS``)."""


Op = Generator[Call, Any, T]

GATHER = "gather"

MODIFY_ONCE = "find_and_modify_once"
"""A ``findAndModify`` that is not a retryable write: ``args`` the filter and the update,
``kwargs`` the command's own fields (``new``, ``fields``, ``upsert``; ``writeConcern``, else
the collection's); the result is the document, or ``None``. Sent as a plain command, so the
server keeps no image of it in ``config.image_collection`` and no record in
``config.transactions`` (two writes fewer on the server), and the driver does not send it
again after a network error: for callers that recover what such a call did themselves (a
claim: ``ClaimCalls.adopt``) or send it again anyway (a ping, a heartbeat)."""


def gather(*calls: Call) -> Call:
    """Independent calls the driver may send at once (``args``: the calls); the result is
    the list of their results, in order. In a session (a transaction) they run one by one."""
    return Call(GATHER, calls)


_GATHER_POOL: ThreadPoolExecutor | None = None
_GATHER_LOCK = threading.Lock()


def _gather_pool() -> ThreadPoolExecutor:
    """The sync driver's threads for ``gather`` (pymongo's clients are thread-safe)."""
    global _GATHER_POOL
    with _GATHER_LOCK:
        if _GATHER_POOL is None:
            _GATHER_POOL = ThreadPoolExecutor(4, thread_name_prefix="mtask-gather")
        return _GATHER_POOL


INBOX_SUFFIX = "_inbox"


def inbox_database(database: str) -> str:
    """The database of the shared stream's inboxes (``<database>_inbox``): capped collections
    named at run time, made, written and dropped by the workers, kept out of mtask's database
    so that the privileges that takes are granted on this one only."""
    return f"{database}{INBOX_SUFFIX}"


def collections(db: Any, tasks: str = "tasks") -> dict[str, Any]:
    """The collections the operations use, from a (sync or async) database: the tasks
    collection as named, and the database's ``workers``, ``controls``, ``limits``,
    ``schedules``, ``retention``, ``throughput``, ``relays``, ``triggers`` and ``audit``;
    ``output``, ``steps`` and ``usage`` are the tasks' side collections ``<tasks>.output``
    (``store.output``), ``<tasks>.steps`` (``store.steps``: results too large for the task
    document) and ``<tasks>.usage`` (``store.usage``: totals and budgets per name and group).
    ``inboxes`` is the relay's reports collection, in the inbox database
    (``inbox_database``): a ``command`` there runs in that database."""
    names = (
        "workers", "controls", "limits", "schedules", "retention", "throughput", "relays",
        "triggers", "audit",
    )  # fmt: skip
    return {
        "tasks": db[tasks],
        "output": db[f"{tasks}.output"],
        "steps": db[f"{tasks}.steps"],
        "usage": db[f"{tasks}.usage"],
        **{name: db[name] for name in names},
        "inboxes": db.client[inbox_database(db.name)][f"{tasks}.reports"],
    }


# Server errors after which the same operation may succeed later: no primary, shutting down,
# network trouble on the server's side.
DUPLICATE_KEY = 11000
"""A unique index refused the write: a full slot's upsert, a held group lock's claim."""
TRANSIENT_CODES = frozenset({6, 7, 89, 91, 189, 262, 9001, 10107, 11600, 11602, 13435, 13436})


def is_transient(exc: PyMongoError) -> bool:
    if isinstance(exc, ConnectionFailure):  # includes AutoReconnect, timeouts, no server
        return True
    if exc.has_error_label("RetryableWriteError") or exc.has_error_label(
        "TransientTransactionError"
    ):
        return True
    return isinstance(exc, OperationFailure) and exc.code in TRANSIENT_CODES


TRANSACTION_LABELS = ("TransientTransactionError", "UnknownTransactionCommitResult")


def for_transaction(exc: PyMongoError, session: Any) -> bool:
    """The error belongs to the caller's transaction: raise it as is (``with_transaction``
    retries on its labels)."""
    in_transaction = session is not None and bool(getattr(session, "in_transaction", False))
    return in_transaction and any(exc.has_error_label(label) for label in TRANSACTION_LABELS)


TOO_LARGE_CODES = frozenset({10334, 17419})
"""The server's codes for a document past 16 MiB: ``BSONObjectTooLarge``, and "Resulting
document after update is larger than 16777216"."""


UNAUTHORIZED = 13
"""The server's code for an operation the user's roles do not allow."""


# -- the privileges a call needs ---------------------------------------------------------------
# What a Call needs of the user's role, by method: the roles (``mtask.security.roles``) grant
# these, and a refused call is worded with them.


READS = {
    "find": ("find",),
    "find_one": ("find",),
    "count": ("find",),
    "count_documents": ("find",),
    "distinct": ("find",),
    "aggregate": ("find",),
    "index_information": ("listIndexes",),
    "watch": ("find", "changeStream"),
}
WRITES = {
    "insert_one": ("insert",),
    "insert_many": ("insert",),
    "update_one": ("update",),
    "update_many": ("update",),
    "replace_one": ("update",),
    "find_one_and_update": ("find", "update"),
    MODIFY_ONCE: ("find", "update"),
    "delete_one": ("remove",),
    "delete_many": ("remove",),
    "create_index": ("createIndex",),
    "create_indexes": ("createIndex",),
    "drop_index": ("dropIndex",),
}
COMMANDS = {
    "create": "createCollection",
    "collMod": "collMod",
    "listCollections": "listCollections",
    "convertToCapped": "convertToCapped",
    "drop": "dropCollection",
    "createIndexes": "createIndex",
    "createRole": "createRole",
    "updateRole": "createRole",
}
NO_PRIVILEGE = frozenset(
    {"hello", "ping", "killSessions", "endSessions", "buildInfo", "connectionStatus"}
)
BULK = {"InsertOne": "insert", "DeleteOne": "remove", "DeleteMany": "remove"}


def _command_actions(call: Call) -> tuple[str, ...]:
    first = call.args[0] if call.args else ""
    name = first if isinstance(first, str) else next(iter(first), "")
    if name in NO_PRIVILEGE:
        return ()
    return (COMMANDS.get(name, name),)


def _bulk_actions(call: Call) -> tuple[str, ...]:
    requests: Iterable[Any] = call.args[0] if call.args else ()
    found = {BULK.get(type(r).__name__, "update") for r in requests}
    if any(getattr(r, "_upsert", False) for r in requests):
        found.add("insert")
    return tuple(sorted(found))


def actions_of(call: Call) -> tuple[str, ...]:
    """The privilege actions a call needs on its collection. An upsert needs ``insert`` too;
    an aggregation with ``$out``/``$merge`` is not one mtask runs."""
    if call.method == "command":
        return _command_actions(call)
    if call.method == "bulk_write":
        return _bulk_actions(call)
    actions = READS.get(call.method) or WRITES.get(call.method) or (call.method,)
    if call.kwargs.get("upsert"):
        actions = (*actions, "insert")
    return actions


def call_collection(call: Call, tasks: str = "tasks") -> str:
    """The collection name a ``Call`` reaches (``driver.collections``' keys resolved)."""
    if call.collection == "tasks":
        return tasks
    if call.collection in ("output", "steps", "usage"):
        return f"{tasks}.{call.collection}"
    return call.collection


def unauthorized(exc: OperationFailure, call: Call | None, where: str | None) -> str:
    """A refused operation in words: which privileges it needs, on which collection. The
    server's message is cut before the command it quotes (which may hold a task's params)."""
    said = str((exc.details or {}).get("errmsg", exc)).split(" to execute command")[0][:200]
    if call is None:
        return f"MongoDB refused the operation (Unauthorized: {said})"
    actions = " and ".join(actions_of(call)) or call.method
    return (
        f"MongoDB refused {call.method} on {where or call_collection(call)} "
        f"(Unauthorized: {said}): the user's role lacks the privilege {actions} there "
        "(mtask collection roles; docs/deploy.md)"
    )


def storage_error(
    exc: PyMongoError, call: Call | None = None, where: str | None = None
) -> StorageError:
    """A short, plain message for a driver error (no topology dumps); ``call`` the call that
    failed and ``where`` its collection's full name, to name what a refused one lacked."""
    transient = is_transient(exc)
    if isinstance(exc, ServerSelectionTimeoutError):
        text = f"cannot reach MongoDB: {str(exc).split(' (configured timeouts')[0]}"
    elif isinstance(exc, OperationFailure) and exc.code == UNAUTHORIZED:
        text = unauthorized(exc, call, where)
    elif isinstance(exc, OperationFailure) and exc.code == 18:
        details = exc.details or {}
        reason = f"{details.get('errmsg', exc)} ({details.get('codeName', exc.code)})"
        text = f"MongoDB refused the credentials: {reason}"
    else:
        # the server's message, without pymongo's dump of its whole reply
        text = f"MongoDB: {type(exc).__name__}: {str(exc).split(', full error: ')[0][:500]}"
    # A write error names one document; one that is transient (the server shutting down or
    # stepping down mid-write) says nothing about the document. A command's own failure names
    # it too when the document would outgrow 16 MiB (a findAndModify's, e.g. a claim's).
    document = not transient and (
        isinstance(exc, WriteError)
        or (isinstance(exc, OperationFailure) and exc.code in TOO_LARGE_CODES)
    )
    # it ran out of its time limit (Call.timeout: pymongo.timeout), on the server (maxTimeMS)
    # or waiting for the reply: e.g. a write waiting for a transaction; not finding a server
    timed_out = exc.timeout and not isinstance(exc, ServerSelectionTimeoutError)
    return StorageError(text, transient=transient, document=document, timed_out=timed_out)


def cancel_requests() -> int:
    """The current task's pending cancellation requests (0 outside a task)."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def raise_if_cancelled(before: int) -> None:
    """Raise the cancellation an await swallowed. On Python 3.11 ``asyncio.wait_for``, which
    pymongo's async driver sends with, can return its result and drop a cancellation requested
    in the same turn (fixed in 3.12: gh-86296); the task then runs on with the request pending,
    and a worker stopping waits for it for ever. ``before`` is ``cancel_requests()`` from
    before the await: a request that arrived during it and raised nothing was swallowed."""
    if cancel_requests() > before:
        raise asyncio.CancelledError


def _limit(call: Call) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext() if call.timeout is None else pymongo.timeout(call.timeout)


def _modify_once(collection: Any) -> Any:
    def call(query: Doc, update: Any, session: Any = None, **fields: Any) -> Any:
        command = {"findAndModify": collection.name, "query": query, "update": update, **fields}
        if session is not None and session.in_transaction:
            command.pop("writeConcern", None)  # the transaction's, at its commit
        elif "writeConcern" not in command and collection.write_concern.document:
            command["writeConcern"] = collection.write_concern.document
        return collection.database.command(
            command, session=session, codec_options=collection.codec_options
        )

    return call


def _modified(reply: Mapping[str, Any]) -> Any:
    """The document of a ``MODIFY_ONCE`` reply; its write concern's failure raised, as the
    collection's own methods raise it."""
    error = reply.get("writeConcernError")
    if error:
        message = error.get("errmsg", "write concern failed")
        raise WriteConcernError(message, error.get("code"), reply)
    return reply.get("value")


def _method(collection: Any, name: str) -> Any:
    if name == MODIFY_ONCE:
        return _modify_once(collection)
    if name == "count":
        return lambda query, session=None, **kwargs: collection.database.command(
            {"count": collection.name, "query": query, **kwargs}, session=session
        )
    return collection.database.command if name == "command" else getattr(collection, name)


def _where(collections: Mapping[str, Any], call: Call) -> str | None:
    target = collections.get(call.collection)
    return getattr(target, "full_name", None)


class SyncDriver:
    """Runs operations on pymongo's synchronous ``Collection``\\ s."""

    def __init__(self, collections: Mapping[str, Any]) -> None:
        self.collections = collections

    def _call(self, call: Call, session: Any) -> Any:
        if call.method == GATHER:
            if session is not None or len(call.args) < 2:
                return [self._call(c, session) for c in call.args]
            return list(_gather_pool().map(lambda c: self._call(c, None), call.args))
        method = _method(self.collections[call.collection], call.method)
        kwargs = call.kwargs if session is None else {**call.kwargs, "session": session}
        with _limit(call):
            result = method(*call.args, **kwargs)
        if call.method in ("find", "aggregate"):
            return list(result)
        if call.method == "count":
            return int(result["n"])
        if call.method == MODIFY_ONCE:
            return _modified(result)
        return result

    def run(self, op: Op[T], session: Any = None) -> T:
        """Run ``op``; every call in ``session`` (a ``ClientSession``) if given."""
        call: Call | None = None
        try:
            call = next(op)
            while True:
                try:
                    result = self._call(call, session)
                except PyMongoError as exc:
                    call = op.throw(exc)
                else:
                    call = op.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except PyMongoError as exc:
            if for_transaction(exc, session):
                raise
            where = None if call is None else _where(self.collections, call)
            raise storage_error(exc, call, where) from exc


class AsyncDriver:
    """Runs operations on pymongo's native asyncio ``AsyncCollection``\\ s."""

    def __init__(self, collections: Mapping[str, Any]) -> None:
        self.collections = collections

    async def _call(self, call: Call, session: Any) -> Any:
        if call.method == GATHER:
            if session is not None:
                return [await self._call(c, session) for c in call.args]
            return list(await asyncio.gather(*(self._call(c, None) for c in call.args)))
        method = _method(self.collections[call.collection], call.method)
        kwargs = call.kwargs if session is None else {**call.kwargs, "session": session}
        with _limit(call):
            if call.method == "find":
                return await method(*call.args, **kwargs).to_list()
            result = await method(*call.args, **kwargs)
            if call.method == "aggregate":
                return await result.to_list()
            if call.method == "count":
                return int(result["n"])
            if call.method == MODIFY_ONCE:
                return _modified(result)
            return result

    async def run(self, op: Op[T], session: Any = None) -> T:
        """Run ``op``; every call in ``session`` (an ``AsyncClientSession``) if given."""
        call: Call | None = None
        try:
            call = next(op)
            while True:
                before = cancel_requests()
                try:
                    result = await self._call(call, session)
                except PyMongoError as exc:
                    call = op.throw(exc)
                else:
                    raise_if_cancelled(before)
                    call = op.send(result)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except PyMongoError as exc:
            if for_transaction(exc, session):
                raise
            where = None if call is None else _where(self.collections, call)
            raise storage_error(exc, call, where) from exc
