"""The change streams open on a test's database, as MongoDB's ``$currentOp`` lists them; and
killed, as a fault."""

from __future__ import annotations

from typing import Any

from pymongo import MongoClient

Mongo = MongoClient[dict[str, Any]]


def change_streams(mongo: Mongo, db: str, collection: str | None = None) -> list[dict[str, Any]]:
    """The change-stream cursors open on ``db`` (on its ``collection`` only, if given), idle,
    and the operations in flight on them (a getMore waiting, an aggregate opening one)."""
    ns: Any = f"{db}.{collection}" if collection else {"$regex": f"^{db}\\."}
    ops = mongo.admin.aggregate(
        [
            {"$currentOp": {"idleCursors": True, "allUsers": True}},
            {
                "$match": {
                    "ns": ns,
                    "$or": [
                        {"cursor.originatingCommand.pipeline.0.$changeStream": {"$exists": True}},
                        {"command.pipeline.0.$changeStream": {"$exists": True}},
                    ],
                }
            },
        ]
    )
    return list(ops)


def count_streams(mongo: Mongo, db: str, collection: str | None = None) -> int:
    """How many change streams ``change_streams`` finds (a cursor, or an op not yet one)."""
    ops = change_streams(mongo, db, collection)
    return len({op.get("cursor", {}).get("cursorId", op.get("opid")) for op in ops})


def kill_change_streams(mongo: Mongo, db: str, in_flight: bool = True) -> int:
    """Kill every change-stream cursor on ``db`` (``killCursors``) and, with ``in_flight``,
    the operations waiting on them (``killOp``); returns how many were killed."""
    killed = 0
    for op in change_streams(mongo, db):
        if in_flight and op.get("type") == "op" and "opid" in op:
            mongo.admin.command("killOp", op=op["opid"])
            killed += 1
        cursor_id = op.get("cursor", {}).get("cursorId")
        if cursor_id:
            collection = op["ns"].split(".", 1)[1]  # "$cmd.aggregate" for a database stream
            reply = mongo[db].command("killCursors", collection, cursors=[cursor_id])
            killed += len(reply["cursorsKilled"])
    return killed
