"""The worker's change stream: what it asks the server for (``stream_pipeline``), how it is
followed across errors (``follow``: resumed after its last event, or reopened afresh with a
rescan when history is lost), and ``OwnStream``, a watcher's own stream (``--stream own``).
The host's shared stream (``--stream shared``) is ``shared_stream.SharedStream``; both are a
``ChangeSource`` for the ``Watcher``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pymongo.errors import OperationFailure, PyMongoError

from mtask import store
from mtask.driver import cancel_requests, raise_if_cancelled
from mtask.errors import StorageError

if TYPE_CHECKING:
    from mtask.worker.watcher import Watcher

log = logging.getLogger(__name__)

# Change stream errors after which resuming is impossible: start afresh and rescan.
FATAL_STREAM_CODES = {260, 280, 286}  # InvalidResumeToken, ChangeStreamFatalError, HistoryLost


STREAM_BATCH = 1000
"""Events per getMore at most: a worker that falls behind a busy stream (every other worker's
claims and successes, with own streams) decodes at most this many at once, not a 16 MB batch."""


def stream_pipeline(tasks: str, excluded: str | Sequence[str]) -> list[dict[str, Any]]:
    """The change stream of a worker (``excluded``: its id) or of a host's relay (the ids of
    its subscribers): task inserts, deletes and changes of ``next_claim_at``, except the
    claims and successes of the ``excluded`` workers (they know what they wrote), and the
    controls, limits and schedules."""
    changed: dict[str, Any] = {
        "operationType": "update",
        "updateDescription.updatedFields.next_claim_at": {"$exists": True},
    }
    ids = [excluded] if isinstance(excluded, str) else list(excluded)
    if ids:
        # The server applies this to the oplog entries, before it builds an event.
        changed[f"updateDescription.updatedFields.{store.LAST_WRITE}"] = {
            "$nin": [tag for worker_id in ids for tag in own_tags(worker_id)]
        }
    task_events = {
        "ns.coll": tasks,
        "$or": [{"operationType": {"$in": ["insert", "replace", "delete"]}}, changed],
    }
    projection: dict[str, Any] = {
        "operationType": 1,
        "documentKey": 1,
        "ns": 1,
        "updateDescription.updatedFields.next_claim_at": 1,
        **{f"fullDocument.{f}": 1 for f in ("_id", *store.PLACEMENT_FIELDS)},
    }
    return [
        {
            "$match": {
                "$or": [task_events, {"ns.coll": {"$in": ["controls", "limits", "schedules"]}}]
            }
        },
        {"$project": projection},
    ]


def own_tags(worker_id: str) -> list[str]:
    return [store.claim_tag(worker_id), store.success_tag(worker_id)]


class ChangeSource(Protocol):
    """Where a watcher's change events come from: its own change stream (``OwnStream``) or
    the host's shared one (``stream_relay.SharedStream``). ``run`` calls ``watcher.opened()``
    each time the stream (re)opens, ``watcher.on_change`` for each event and
    ``watcher.settle()`` after it; it runs until cancelled."""

    async def run(self, watcher: Watcher) -> None: ...

    def claimed(self, key: str, claim_at: Any) -> None:
        """A dispatched worker claimed ``key`` (next claimable at ``claim_at``: its lease)."""

    def held(self, key: str) -> None:
        """A dispatched worker keeps ``key`` for later (a cluster-wide limit holds it back)."""

    def succeeded(self, key: str) -> None:
        """A dispatched worker recorded a success of ``key``."""

    def missed(self, key: str) -> None:
        """A dispatched worker's claim of ``key`` missed although it was due."""

    def gone(self, key: str) -> None:
        """A dispatched worker found ``key`` finished or deleted."""


class Reopen(Exception):
    """Raised by a ``follow`` callback: reopen the stream after the last event (resume)."""


async def follow(
    database: Any,
    pipeline: Callable[[], list[dict[str, Any]]],
    *,
    opened: Callable[[], Awaitable[None]],
    changed: Callable[[Mapping[str, Any] | None], Awaitable[None]],
    restarted: Callable[[], None] = lambda: None,
) -> None:
    """Follow a change stream on ``database`` forever, resuming it after errors; ``opened``
    after each (re)open, except one asked for by ``Reopen`` (it resumes where it was: no gap),
    ``changed`` after each wait (``None``: no event came)."""
    token: Mapping[str, Any] | None = None
    backoff = 0.1
    switched = False
    while True:
        try:
            stream = await database.watch(
                pipeline(), resume_after=token, max_await_time_ms=500, batch_size=STREAM_BATCH
            )
            async with stream:
                if not switched:
                    await opened()  # after the stream is open: nothing slips between
                switched = False
                backoff = 0.1
                # A closed stream (invalidated: the database or collection was dropped)
                # answers try_next with None at once: reopen it rather than spin.
                while stream.alive:
                    before = cancel_requests()
                    change = await stream.try_next()
                    raise_if_cancelled(before)  # pymongo's send may swallow one (driver.py)
                    token = stream.resume_token
                    if change is not None and change.get("operationType") == "invalidate":
                        token = None  # nothing to resume after: reopen afresh and rescan
                        break
                    await changed(change)
            log.warning("change stream closed (was the collection dropped?); reopening")
        except Reopen:
            switched = True
            continue  # at once, after the last event seen
        except OperationFailure as exc:
            switched = False
            if exc.code in FATAL_STREAM_CODES:
                log.warning("change stream history lost (%s); rescanning", exc.code)
                token = None
            else:
                log.warning("change stream failed, resuming: %s", exc)
        except (PyMongoError, StorageError) as exc:
            switched = False
            log.warning("change stream interrupted, resuming: %s", exc)
        restarted()
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 5.0)


class OwnStream:
    """The watcher's own change stream (``--stream own``)."""

    def claimed(self, key: str, claim_at: Any) -> None:
        pass  # the stream's own filter leaves out this worker's writes

    def held(self, key: str) -> None:
        pass

    def succeeded(self, key: str) -> None:
        pass

    def missed(self, key: str) -> None:
        pass

    def gone(self, key: str) -> None:
        pass

    async def run(self, watcher: Watcher) -> None:
        collection = watcher.driver.collections["tasks"]

        async def changed(change: Mapping[str, Any] | None) -> None:
            if change is not None:
                watcher.on_change(change)
                # let a woken worker loop send its claim before this task
                # spends its turn sending the next getMore (W2 latency)
                await asyncio.sleep(0)
            await watcher.settle()

        def restarted() -> None:
            watcher.stream_restarts += 1

        # One stream on the database: the tasks collection and the pause/resume controls.
        await follow(
            collection.database,
            lambda: stream_pipeline(collection.name, watcher.worker_id),
            opened=watcher.opened,
            changed=changed,
            restarted=restarted,
        )
