"""Transactional completion: a handler's MongoDB writes and its run's SUCCESS in one transaction.

``complete_transactionally`` opens a transaction (snapshot read concern, majority write concern)
on the worker's ``AsyncMongoClient``, awaits the handler with the session, then writes the run's
SUCCESS in the same transaction with ``store.transactional.complete_in_transaction`` — the fence
(run id RUNNING, task running, lease alive on the server's clock) is that update's filter — and
commits. If the fence fails the transaction is aborted and ``LeaseLost`` raised: none of the
handler's writes land. Anything the handler raises (``Retry``, ``Fail``, an error) aborts the
transaction and propagates, so the caller records the FAIL/retry outside it, as for any run.

pymongo's ``with_transaction`` retries the whole body on ``TransientTransactionError`` (a write
conflict, e.g. with a takeover) and the commit on ``UnknownTransactionCommitResult``: a rerun
body finds the fence gone if the run lost the task meanwhile. The body is bounded by
``lifetime_s``, under MongoDB's ``transactionLifetimeLimitSeconds`` (60 s by default), after
which ``TransactionTooLong`` is raised and the transaction aborted.

A worker's run passes a ``RunFence`` (docs/transactions.md, "Under faults"): the sessions of
earlier runs whose lease expired are killed first (a dead or frozen worker's transaction would
otherwise stay open, and block this run's writes, for a minute or more); one fenced write then
extends the run's lease and records this run's session id; the run is not pinged while its
transaction is open (a ping would make the fenced SUCCESS a write conflict), so the transaction
must end within that lease.

Transactional handlers are ``async def`` and get an ``AsyncClientSession``: the worker is an
asyncio program, and a session must be used by the client that started it (a sync handler in a
thread would need a second, synchronous ``MongoClient``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pymongo import AsyncMongoClient
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from mtask import errors
from mtask.clock import Clock
from mtask.driver import AsyncDriver, Doc, Op
from mtask.errors import LeaseLost, MtaskError
from mtask.store.outcomes import Outcome
from mtask.store.transactional import (
    begin_run_transaction,
    complete_in_transaction,
    kill_sessions,
)

T = TypeVar("T")

DEFAULT_LIFETIME_S = 50.0
"""How long a transactional run's body may take: under MongoDB's default 60 s
``transactionLifetimeLimitSeconds``, leaving time to commit."""


class TransactionTooLong(MtaskError):
    """The handler's transaction outlived its time limit; it was aborted, nothing landed."""

    default_message = "the handler's transaction took too long and was aborted"


class TransactionEnded(MtaskError):
    """The handler ended mtask's transaction itself (committed, aborted, or ended its session):
    the run's SUCCESS could no longer commit with its writes."""

    default_message = (
        "the handler ended its transaction itself (commit_transaction, abort_transaction or "
        "end_session on ctx.session): mtask commits it with the run's SUCCESS when the handler "
        "returns, and aborts it when the handler raises"
    )


@dataclass(frozen=True)
class RunFence:
    """What a worker's transactional run adds to its transaction (docs/transactions.md, "Under
    faults"): its task, run and worker; the sessions of earlier runs to kill first; ``alive()``,
    false once the worker stopped the run (the body is then not run again); and the worker's
    pinger for this run: ``pause()`` before the transaction, ``held(sent)`` once the run has
    extended its own lease with a write sent at ``sent`` (returns the lease's local expiry),
    ``resume()`` after it."""

    key: str
    run_id: str
    worker_id: str
    stale_sessions: tuple[Any, ...] = ()
    alive: Callable[[], bool] = lambda: True
    pause: Callable[[], None] = lambda: None
    held: Callable[[float], float | None] = lambda sent: None
    resume: Callable[[], None] = lambda: None


LEASE_MARGIN_S = 1.0
"""A transaction in a lease must end this long before the lease does (at most a tenth of it)."""


async def complete_transactionally(
    mongo: AsyncMongoClient[Doc],
    driver: AsyncDriver,
    handler: Callable[[AsyncClientSession], Awaitable[T]],
    outcome_for: Callable[[T], Outcome],
    now: Callable[[], dt.datetime],
    lifetime_s: float = DEFAULT_LIFETIME_S,
    fence: RunFence | None = None,
) -> tuple[T, Doc]:
    """Run ``handler(session)`` and record ``outcome_for(its result)`` in one transaction;
    returns the handler's result and the task document after its SUCCESS (see
    ``transact``)."""
    return await transact(
        mongo,
        driver,
        handler,
        lambda result: complete_in_transaction(outcome_for(result), now()),
        now,
        lifetime_s,
        fence,
    )


async def transact(
    mongo: AsyncMongoClient[Doc],
    driver: AsyncDriver,
    handler: Callable[[AsyncClientSession], Awaitable[T]],
    write: Callable[[T], Op[Doc | None]],
    now: Callable[[], dt.datetime],
    lifetime_s: float = DEFAULT_LIFETIME_S,
    fence: RunFence | None = None,
) -> tuple[T, Doc]:
    """Run ``handler(session)`` and the fenced ``write(its result)`` in one transaction: a
    run's SUCCESS (``complete_transactionally``) or a durable step's record (docs/steps.md).
    ``write`` returns ``None`` when the run lost its task: the transaction aborts and
    ``LeaseLost`` is raised. Returns the handler's result and what ``write`` returned.

    With ``fence``, first kill the earlier runs' sessions (their open transactions abort, so
    this run's writes do not wait on them), then, with pings paused, extend the run's lease and
    record this run's session id in its run entry (``begin_run_transaction``; so that a run
    taking the task over can kill it in turn); neither is in the transaction. The transaction
    must then end before the lease does: ``TransactionTooLong`` otherwise."""

    async def body(session: AsyncClientSession) -> tuple[T, Doc]:
        if fence is not None and not fence.alive():
            raise LeaseLost()  # stopped: not worth another try
        result = await handler(session)
        if not session.in_transaction:  # the write would land on its own, outside it
            raise TransactionEnded()
        doc = await driver.run(write(result), session)
        if doc is None:
            raise LeaseLost()  # with_transaction aborts: none of the handler's writes land
        return result, doc

    loop = asyncio.get_running_loop()
    deadline, limit = loop.time() + lifetime_s, f"{lifetime_s:g} s"
    async with mongo.start_session() as session:
        committed = False
        try:
            if fence is not None:
                deadline, limit = await _begin(driver, fence, session, now, (deadline, limit))
            async with asyncio.timeout_at(deadline):
                done = await session.with_transaction(
                    body,
                    read_concern=ReadConcern("snapshot"),
                    write_concern=WriteConcern("majority"),
                )
            committed = True
            return done
        except TimeoutError:
            raise TransactionTooLong(
                f"the handler's transaction took more than {limit} and was aborted (MongoDB "
                "aborts transactions after transactionLifetimeLimitSeconds, 60 s by default; "
                "a run's lease is not pinged while its transaction is open); nothing it wrote "
                "landed"
            ) from None
        finally:
            if fence is not None:
                fence.resume()
                if not committed:
                    discard_session(session)


log = logging.getLogger(__name__)


async def _begin(
    driver: AsyncDriver,
    fence: RunFence,
    session: AsyncClientSession,
    now: Callable[[], dt.datetime],
    bound: tuple[float, str],
) -> tuple[float, str]:
    """Before a fenced run's transaction: kill the earlier runs' sessions, pause the run's
    pings, and extend its lease with this session's id on its run entry. Returns ``bound``
    (when the transaction must end, by the loop's clock, and how that is said), brought
    before the lease's end if that comes first."""
    await _kill(driver, fence.stale_sessions)
    fence.pause()
    sent = asyncio.get_running_loop().time()  # the monotonic clock, as the pinger's
    lsid = session.session_id["id"]
    begun = begin_run_transaction(fence.key, fence.run_id, fence.worker_id, now(), lsid)
    if not await driver.run(begun):
        raise LeaseLost()
    expires = fence.held(sent)
    if expires is None:
        return bound
    end = expires - min(LEASE_MARGIN_S, (expires - sent) / 10)
    if end < bound[0]:
        return end, f"{end - sent:.3g} s (its lease, worker_timeout_ms)"
    return bound


async def _kill(driver: AsyncDriver, sessions: tuple[Any, ...]) -> None:
    """Kill the earlier runs' sessions, best effort: the kill is for the new run's speed, never
    its safety (the fence is), so a failed kill is logged and the run goes on (its writes may
    then meet the old transaction's until the server reaps it)."""
    try:
        await driver.run(kill_sessions(list(sessions)))
    except errors.StorageError as exc:
        log.warning("cannot kill the open transactions of earlier runs: %s", exc)


def discard_session(session: AsyncClientSession) -> None:
    """Keep the session's server session out of pymongo's pool: its id is on the run entry, and
    a later takeover may kill it; it must not be reused meanwhile by another operation of this
    worker (which the kill would interrupt). pymongo has no public call for this; its own
    ``mark_dirty`` (used after network errors) makes the pool drop the session."""
    server_session = getattr(session, "_server_session", None)
    mark_dirty = getattr(server_session, "mark_dirty", None)
    if callable(mark_dirty):
        mark_dirty()


@dataclass(frozen=True)
class Transactions:
    """What a worker needs to complete runs transactionally: its client, driver and clock."""

    mongo: AsyncMongoClient[Doc]
    driver: AsyncDriver
    clock: Clock
    lifetime_s: float = DEFAULT_LIFETIME_S

    async def complete(
        self,
        handler: Callable[[AsyncClientSession], Awaitable[T]],
        outcome_for: Callable[[T], Outcome],
        fence: RunFence | None = None,
    ) -> tuple[T, Doc]:
        return await complete_transactionally(
            self.mongo, self.driver, handler, outcome_for, self.clock.now, self.lifetime_s, fence
        )

    async def transact(
        self,
        handler: Callable[[AsyncClientSession], Awaitable[T]],
        write: Callable[[T], Op[Doc | None]],
        fence: RunFence | None = None,
    ) -> tuple[T, Doc]:
        return await transact(
            self.mongo, self.driver, handler, write, self.clock.now, self.lifetime_s, fence
        )
