"""Beanie 2.x and mtask in one transaction: an order inserted and its shipping task published
commit together, or neither exists. Beanie runs on PyMongo's native ``AsyncMongoClient``, as
mtask's ``AsyncTaskClient`` does: one client, one session for both.

Run it with ``MTASK_MONGODB_URI`` set to a replica set (docs/integrations.md, "Beanie")."""

import asyncio
import os

from beanie import Document, init_beanie
from pymongo import AsyncMongoClient

from mtask import AsyncTaskClient


class Order(Document):
    number: str

    class Settings:
        name = "orders"


class Abort(Exception):
    pass


async def main() -> None:
    mongo: AsyncMongoClient = AsyncMongoClient(os.environ["MTASK_MONGODB_URI"])
    database = os.environ.get("EXAMPLE_DATABASE", "shop")
    await init_beanie(database=mongo[database], document_models=[Order])
    tasks = AsyncTaskClient(mongo_client=mongo, database=database)  # mtask never closes it
    await tasks.ensure_indexes()  # before the first transaction (docs/transactions.md)

    # aborted: neither the order nor the task
    try:
        async with mongo.start_session() as session, await session.start_transaction():
            await Order(number="o-1").insert(session=session)
            await tasks.publish("ship", "ship-o-1", {"order": "o-1"}, session=session)
            raise Abort
    except Abort:
        pass
    assert await Order.find_one(Order.number == "o-1") is None
    assert await tasks.get("ship-o-1") is None

    # committed: both
    async with mongo.start_session() as session, await session.start_transaction():
        await Order(number="o-2").insert(session=session)
        await tasks.publish("ship", "ship-o-2", {"order": "o-2"}, session=session)
    assert await Order.find_one(Order.number == "o-2") is not None
    task = await tasks.get("ship-o-2")
    assert task is not None and task.status == "pending"
    print("aborted: neither; committed: both")
    await mongo.close()


asyncio.run(main())
