"""mtask.store.bulk and mtask.store.throughput on the real server: the task list's searches use
their indexes (``explain``), bulk actions keep to the statuses they apply to, and the
per-minute throughput is idempotent and survives a new client (a serve restart)."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest

from mtask import TaskClient
from mtask.clock import FixedClock
from mtask.errors import InvalidTransition
from mtask.store import bulk, throughput
from mtask.store.across import NOT_A_NAME, name_parts
from mtask.store.complete import stranded


def plan_stages(explained: dict[str, Any]) -> list[str]:
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "stage" in node:
                found.append(f"{node['stage']}:{node.get('indexName', '')}")
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(explained["queryPlanner"]["winningPlan"])
    return found


def test_searches_use_their_indexes(client: TaskClient) -> None:
    client.ensure_bulk_indexes()
    client.publish_many([{"name": f"n{i % 5}", "key": f"k/{i}"} for i in range(200)])
    cases = [
        (dict(name="n1", status=None, prefix=None, text=None), "IXSCAN:mtask_bulk_name_newest"),
        (dict(name=None, status="failed", prefix=None, text=None), "IXSCAN:name_status_newest"),
        (dict(name=None, status=None, prefix="k/1", text=None), "IXSCAN:_id_"),
        (dict(name=None, status=None, prefix=None, text="boom"), "error_text"),
    ]
    for filters, index in cases:
        filt, sort = bulk.search_query(**filters)  # type: ignore[arg-type]
        # a status across names is read name by name: one find per part, merged
        across = bulk.search_across_names(**filters)  # type: ignore[arg-type]
        parts = name_parts(client.names()) if across else [None]
        for part in parts:
            query = filt if part is None else {"$and": [filt, {"name": part}]}
            stages = plan_stages(client.collection.find(query).sort(sort).limit(50).explain())
            assert "COLLSCAN:" not in stages, (filters, stages)
            if part is None:
                assert any(index in s for s in stages), (filters, stages)
                continue
            assert "IXSCAN:name_status_newest" in stages, (filters, stages)
            if part is not NOT_A_NAME:  # string names, read in order: no sort of the matches
                assert "SORT:" not in stages, (filters, stages)
    # an action by status across names, too: name by name, no collection scan
    where = bulk.Filter(status=["failed"], older_than_s=60)
    query = where.query("purge", dt.datetime.now(dt.UTC), client.names())
    stages = plan_stages(client.collection.find(query).explain())
    assert "IXSCAN:name_status_newest" in stages and "COLLSCAN:" not in stages, stages
    since = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=3)
    explained = client.collection.find({"finished_at": {"$gte": since}}).explain()
    assert "IXSCAN:mtask_throughput_finished_at" in plan_stages(explained)


def test_search_pages_and_error_words(client: TaskClient) -> None:
    client.publish_many([{"name": "n", "key": f"p/{i:02d}"} for i in range(25)])
    client.collection.update_many(
        {"_id": {"$in": ["p/03", "p/07"]}},
        {"$set": {"status": "failed", "error": "ValueError: the disk is full"}},
    )
    seen: list[str] = []
    after = None
    while True:
        page = client.search(prefix="p/", limit=10, after=after)
        seen += [t.key for t in page]
        if len(page) < 10:
            break
        after = page[-1].key
    assert sorted(seen) == [f"p/{i:02d}" for i in range(25)] and len(set(seen)) == 25
    assert sorted(t.key for t in client.search(text="disk")) == ["p/03", "p/07"]
    assert [t.key for t in client.search(text="disk", status="failed", prefix="p/07")] == ["p/07"]
    where = bulk.Filter(name="n")
    assert client.bulk("purge", where, dry_run=True).matched == 2  # finished ones only
    assert client.bulk("cancel", where).changed == 23
    assert client.bulk("retry", bulk.Filter(keys=["p/03", "p/04"])).changed == 2


def test_throughput_is_idempotent_and_kept(mongo_uri: str, db_name: str) -> None:
    with TaskClient(mongo_uri, database=db_name) as probe:  # near the server's time: the TTL
        now = probe.now().replace(minute=0, second=30, microsecond=0)  # monitor uses it
    with TaskClient(mongo_uri, database=db_name, clock=FixedClock(now)) as client:
        client.ensure_bulk_indexes()
        client.publish_many([{"name": "a", "key": f"t{i}"} for i in range(5)])
        for i, minute in enumerate([57, 58, 58, 59, 59]):
            finished = now - dt.timedelta(minutes=60 - minute, seconds=20)
            client.collection.update_one(
                {"_id": f"t{i}"},
                {"$set": {"status": "failed" if i == 0 else "succeeded", "finished_at": finished}},
            )
        assert client.record_throughput() == 3
        assert client.record_throughput() == 3  # again: the same documents
        first = client.throughput(60)
    with TaskClient(mongo_uri, database=db_name, clock=FixedClock(now)) as again:  # a restart
        assert again.throughput(60) == first
    assert [(r["minute"].minute, r["finished"], r["failed"]) for r in first] == [
        (57, 1, 1),
        (58, 2, 0),
        (59, 2, 0),
    ]
    with TaskClient(mongo_uri, database=db_name) as c:
        indexes = {i["name"]: i for i in c.db[throughput.COLLECTION].list_indexes()}
    assert indexes["ttl"]["expireAfterSeconds"] == throughput.KEEP_SECONDS


def test_serve_charts_the_hour_before_it_started(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The minutes before ``mtask serve`` started are read from the tasks when it starts: a
    task that failed 30 minutes earlier is on the chart (the regular recount covers a few
    minutes only)."""
    from webserver import serving

    client.publish("csv_import", "csv-bad")
    finished = client.now() - dt.timedelta(minutes=30)
    client.collection.update_one(
        {"_id": "csv-bad"}, {"$set": {"status": "failed", "finished_at": finished}}
    )
    assert client.record_throughput() == 0  # the last few minutes: nothing
    with serving(mongo_uri, db_name, token="t", sample_seconds=0.2):
        deadline = time.monotonic() + 60
        while not client.throughput(60):
            assert time.monotonic() < deadline, "serve did not chart the hour before it"
            time.sleep(0.1)
    [row] = client.throughput(60)
    assert (row["name"], row["finished"], row["failed"]) == ("csv_import", 1, 1)
    assert row["minute"] == throughput.minute_of(finished)


def test_by_status_across_names_every_document_and_a_page_at_a_time(client: TaskClient) -> None:
    """A status without a name: more names than MongoDB merges in one find (200), and names
    that are not strings (documents written by hand). Every matching document is listed,
    searched and acted on, in order; each find reads a page, not every match; a name holding
    a ``$`` key breaks nothing (it could not go in a ``$in``)."""
    client.publish_many({"name": f"n{i % 230:03d}", "key": f"t{i:04d}"} for i in range(690))
    failed = [f"t{i:04d}" for i in range(0, 690, 3)]
    client.collection.update_many({"_id": {"$in": failed}}, {"$set": {"status": "failed"}})
    odd_names: list[Any] = [[], 7, {"$x": 1}, [["x"]], "", None]
    client.collection.insert_many(
        [
            {"_id": f"odd{i}", "name": name, "status": "failed", "created_at": client.now()}
            for i, name in enumerate(odd_names)
        ]
    )
    everything = list(client.collection.find({"status": "failed"}, {"_id": 1}))
    newest = sorted(
        client.collection.find({"status": "failed"}, {"created_at": 1}),
        key=lambda d: (d["created_at"], d["_id"]),
        reverse=True,
    )
    pages: list[str] = []
    after = None
    while True:
        page = client._run(bulk.search(status="failed", limit=50, after=after))
        pages += [d["_id"] for d in page]
        if len(page) < 50:
            break
        after = page[-1]["_id"]
    assert pages == [d["_id"] for d in newest] and len(pages) == len(everything) == 236
    listed = [t.key for t in client.list(status="failed", limit=10)]
    assert listed == [d["_id"] for d in newest[:10]]
    assert client.bulk("purge", bulk.Filter(status=["failed"]), dry_run=True).matched == 236
    # each find of a page reads a page (keys examined near its size, not the 236 matches)
    filt, sort = bulk.search_query(None, "failed", None, None)
    for part in name_parts(client.names())[:-1]:
        stats = (
            client.collection.find({"$and": [filt, {"name": part}]})
            .sort(sort)
            .limit(10)
            .explain()["executionStats"]
        )
        assert stats["totalKeysExamined"] <= 10 + len(part["$in"]), stats["totalKeysExamined"]
    assert client._run(stranded()) is not None  # the sweep's search: no error
    assert client.stats()[str({"$x": 1})] == {"failed": 1}  # a count by that name too


def test_bulk_refuses_an_unknown_action_and_filter_fields_of_the_wrong_type(
    client: TaskClient,
) -> None:
    """Bad input is an ``InvalidTask`` naming the field, before anything is read or written: a
    string of keys is not read as its characters (``keys="k1"`` would act on "k" and "1")."""
    import pytest

    from mtask.errors import InvalidTask

    client.publish_many([{"name": "n", "key": k} for k in ("k", "1", "k1")])
    with pytest.raises(InvalidTask, match="^action:"):
        client.bulk("delete", bulk.Filter())  # type: ignore[arg-type]
    with pytest.raises(InvalidTask, match="^action:"):
        client.bulk_count("delete", bulk.Filter(), 10)  # type: ignore[arg-type]
    for bad, field in [
        ({"keys": "k1"}, "keys"),
        ({"keys": 5}, "keys"),
        ({"status": "pending"}, "status"),
        ({"status": 5}, "status"),
        ({"older_than_s": "5"}, "older_than"),
        ({"older_than_s": True}, "older_than"),
    ]:
        with pytest.raises(InvalidTask, match=f"^{field}:"):
            client.bulk("cancel", bulk.Filter(**bad))
    with pytest.raises(InvalidTask, match="^keys:"):
        client.purge(keys="k1", status=["cancelled"])
    with pytest.raises(InvalidTask, match="^older_than:"):
        client.purge(older_than="5")  # type: ignore[arg-type]
    assert {t.status.value for t in client.list()} == {"pending"}


def test_a_malformed_document_is_named_and_passed_over_by_retry_and_cancel(
    client: TaskClient,
) -> None:
    """A hand-written document without the fields a retry or a cancel recomputes made the server
    refuse the update: one retry or cancel was a ``StorageError``, and a bulk retry stopped at
    it, with the tasks after it left as they were and no result. It is named now, and a bulk
    action passes over it."""
    client.collection.insert_many(
        [
            {"_id": "a-failed", "name": "add", "status": "failed"},
            {"_id": "a-pending", "name": "add", "status": "pending"},
        ]
    )
    client.publish("add", "b-failed", {"a": 1, "b": 1})
    client.collection.update_one({"_id": "b-failed"}, {"$set": {"status": "failed"}})
    with pytest.raises(InvalidTransition, match="cannot retry task 'a-failed': .*'runs' must be"):
        client.retry("a-failed")
    with pytest.raises(InvalidTransition, match="cannot cancel task 'a-pending': .*'runs'"):
        client.cancel("a-pending")
    result = client.bulk("retry", bulk.Filter(name="add"))
    assert (result.matched, result.changed) == (2, 1)
    again = client.get("b-failed")
    assert again is not None and again.status == "pending"
    with pytest.raises(InvalidTransition, match="it is pending"):  # the well-formed rule holds
        client.retry("b-failed")
