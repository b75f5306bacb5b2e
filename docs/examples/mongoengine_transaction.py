"""MongoEngine and mtask in one transaction: an order saved and its shipping task published
commit together, or neither exists.

MongoEngine 0.29 (its released line) has no sessions: ``save()`` takes none. Its connection is
a PyMongo ``MongoClient``, which has: start a session on it, write the document through its
collection (``Order._get_collection()``, the document validated and turned into BSON by
MongoEngine) in that session, and publish with mtask's ``TaskClient`` on the same client and
session. Reads go through MongoEngine as usual.

Run it with ``MTASK_MONGODB_URI`` set to a replica set (docs/integrations.md, "MongoEngine")."""

import contextlib
import os

from mongoengine import Document, StringField, connect, disconnect, get_connection

from mtask import TaskClient


class Order(Document):
    number = StringField(required=True)
    meta = {"collection": "orders"}


class Abort(Exception):
    pass


def place(tasks: TaskClient, number: str, fail: bool = False) -> None:
    """The order and its task in one transaction; ``fail``: it raises before the commit."""
    order = Order(number=number)
    order.validate()  # what save() would check
    with get_connection().start_session() as session, session.start_transaction():
        Order._get_collection().insert_one(order.to_mongo(), session=session)
        tasks.publish("ship", f"ship-{number}", {"order": number}, session=session)
        if fail:
            raise Abort


def main() -> None:
    database = os.environ.get("EXAMPLE_DATABASE", "shop")
    connect(db=database, host=os.environ["MTASK_MONGODB_URI"])
    tasks = TaskClient(mongo_client=get_connection(), database=database)  # never closes it
    tasks.ensure_indexes()  # before the first transaction (docs/transactions.md)
    Order.ensure_indexes()

    # aborted: neither the order nor the task
    with contextlib.suppress(Abort):
        place(tasks, "o-1", fail=True)
    assert Order.objects(number="o-1").count() == 0
    assert tasks.get("ship-o-1") is None

    # committed: both
    place(tasks, "o-2")
    assert Order.objects(number="o-2").count() == 1
    task = tasks.get("ship-o-2")
    assert task is not None and task.status == "pending"
    print("aborted: neither; committed: both")
    disconnect()


main()
