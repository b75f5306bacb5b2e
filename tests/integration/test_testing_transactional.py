"""``mtask.testing.run_handler`` runs a ``transactional=True`` handler in a real transaction,
as docs/transactions.md says: its writes commit together when it returns, none lands when it
raises; without MongoDB it refuses with the handler's name."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from pymongo import AsyncMongoClient, MongoClient

from mtask import Registry, TaskContext
from mtask.errors import ConfigError
from mtask.registry import Retry
from mtask.testing import arun_handler, run_handler
from mtask.vocabulary import RunState

registry = Registry()


@registry.task("charge", transactional=True)
async def charge(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    db = ctx.session.client[params["db"]]
    await db["ledger"].insert_one({"task": ctx.key}, session=ctx.session)
    await db["counters"].update_one(
        {"_id": "charges"}, {"$inc": {"n": 1}}, upsert=True, session=ctx.session
    )
    if params.get("decline"):
        raise Retry("declined")
    return {"charged": ctx.key}


def test_a_transactional_handler_commits_its_writes_together(
    mongo_uri: str, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    outcome = run_handler(registry, "charge", {"db": db_name}, key="k1", mongo_uri=mongo_uri)
    assert outcome.state is RunState.SUCCESS and outcome.result == {"charged": "k1"}
    assert mongo[db_name]["ledger"].count_documents({"task": "k1"}) == 1
    assert mongo[db_name]["counters"].find_one({"_id": "charges"}) == {"_id": "charges", "n": 1}


async def test_a_transactional_handler_that_raises_writes_nothing(
    mongo_uri: str, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri)
    try:
        outcome = await arun_handler(
            registry, "charge", {"db": db_name, "decline": True}, key="k2", mongo_client=client
        )
    finally:
        await client.close()
    assert outcome.state is RunState.FAIL and not outcome.permanent
    assert mongo[db_name]["ledger"].count_documents({}) == 0  # aborted: none of it landed


@registry.task("due", transactional=True)
async def due(params: dict[str, Any], ctx: TaskContext) -> bool:
    order = await ctx.session.client[params["db"]]["orders"].find_one({}, session=ctx.session)
    return bool(order["due"] < dt.datetime.now(dt.UTC))


def test_the_session_reads_dates_as_a_workers_does(
    mongo_uri: str, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    """A worker's session decodes dates timezone-aware (UTC), as every mtask client does; so
    does run_handler's, or a handler passing in a worker fails in its test (naive vs aware)."""
    mongo[db_name]["orders"].insert_one({"due": dt.datetime(2000, 1, 1, tzinfo=dt.UTC)})
    outcome = run_handler(registry, "due", {"db": db_name}, mongo_uri=mongo_uri)
    assert outcome.state is RunState.SUCCESS, outcome.error
    assert outcome.result is True


@registry.task("aborts", transactional=True)
async def aborts(params: dict[str, Any], ctx: TaskContext) -> None:
    await ctx.session.abort_transaction()


def test_a_handler_ending_its_transaction_fails_as_in_a_worker(mongo_uri: str) -> None:
    outcome = run_handler(registry, "aborts", mongo_uri=mongo_uri)
    assert outcome.state is RunState.FAIL and outcome.permanent
    assert "ended its transaction itself" in (outcome.error or "")


def test_without_mongodb_a_transactional_handler_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="'charge' is a transactional handler"):
        run_handler(registry, "charge", {"db": "x"})
