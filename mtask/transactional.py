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

Transactional handlers are ``async def`` and get an ``AsyncClientSession``: the worker is an
asyncio program, and a session must be used by the client that started it (a sync handler in a
thread would need a second, synchronous ``MongoClient``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from pymongo import AsyncMongoClient
from pymongo.asynchronous.client_session import AsyncClientSession
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from mtask.clock import Clock
from mtask.driver import AsyncDriver, Doc
from mtask.errors import LeaseLost, MtaskError
from mtask.store.outcomes import Outcome
from mtask.store.transactional import complete_in_transaction

T = TypeVar("T")

DEFAULT_LIFETIME_S = 50.0
"""How long a transactional run's body may take: under MongoDB's default 60 s
``transactionLifetimeLimitSeconds``, leaving time to commit."""


class TransactionTooLong(MtaskError):
    """The handler's transaction outlived its time limit; it was aborted, nothing landed."""

    default_message = "the handler's transaction took too long and was aborted"


async def complete_transactionally(
    mongo: AsyncMongoClient[Doc],
    driver: AsyncDriver,
    handler: Callable[[AsyncClientSession], Awaitable[T]],
    outcome_for: Callable[[T], Outcome],
    now: Callable[[], dt.datetime],
    lifetime_s: float = DEFAULT_LIFETIME_S,
) -> tuple[T, Doc]:
    """Run ``handler(session)`` and record ``outcome_for(its result)`` in one transaction;
    returns the handler's result and the task document after its SUCCESS."""

    async def body(session: AsyncClientSession) -> tuple[T, Doc]:
        result = await handler(session)
        doc = await driver.run(complete_in_transaction(outcome_for(result), now()), session)
        if doc is None:
            raise LeaseLost()  # with_transaction aborts: none of the handler's writes land
        return result, doc

    async with mongo.start_session() as session:
        try:
            async with asyncio.timeout(lifetime_s):
                return await session.with_transaction(
                    body,
                    read_concern=ReadConcern("snapshot"),
                    write_concern=WriteConcern("majority"),
                )
        except TimeoutError:
            raise TransactionTooLong(
                f"the handler's transaction took more than {lifetime_s:g} s "
                "(MongoDB aborts transactions after transactionLifetimeLimitSeconds, 60 s by "
                "default); nothing it wrote landed"
            ) from None


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
    ) -> tuple[T, Doc]:
        return await complete_transactionally(
            self.mongo, self.driver, handler, outcome_for, self.clock.now, self.lifetime_s
        )
