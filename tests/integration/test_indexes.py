"""The claim and list query shapes use indexes, not collection scans."""

from __future__ import annotations

import struct
from typing import Any

import bson
import pytest
from bson import ObjectId
from bson.raw_bson import RawBSONDocument
from pymongo.errors import PyMongoError

from mtask import TaskClient
from mtask.driver import GATHER, Call
from mtask.store import (
    Outcome,
    RunState,
    claim,
    claim_filter,
    finish_many,
    list_query,
    scan,
    schema,
)
from mtask.store.across import name_parts
from mtask.store.complete import stranded
from mtask.store.counts import stats
from mtask.store.queries import (
    delayed,
    delayed_find,
    finished_since,
    recently_finished,
    runs_by_worker,
    with_error,
)
from mtask.store.schema import ensure_indexes
from mtask.store.tasks import across_names


def _stages(plan: dict[str, Any]) -> set[str]:
    found = {plan.get("stage", "")}
    for child in ("inputStage", "queryPlan"):
        if child in plan:
            found |= _stages(plan[child])
    for sub in plan.get("inputStages", []):
        found |= _stages(sub)
    return found


def _winning(explain: dict[str, Any]) -> set[str]:
    return _stages(explain["queryPlanner"]["winningPlan"])


def _plan(explain: dict[str, Any]) -> set[str]:
    """The winning plan's stages, of a query or of an aggregation (whose first stage holds
    the query, unless the whole pipeline was pushed down into it)."""
    if "queryPlanner" in explain:
        return _winning(explain)
    return _stages(explain["stages"][0]["$cursor"]["queryPlanner"]["winningPlan"])


def test_claim_and_scan_use_the_claim_index(client: TaskClient) -> None:
    client.publish_many([{"name": f"n{i % 3}", "key": f"k{i}"} for i in range(300)])
    now = client.now()
    explain = client.collection.find(claim_filter(["k1", "k2"], ["n1"], "w", now)).explain()
    assert "COLLSCAN" not in _winning(explain) and "IXSCAN" in _winning(explain)
    op = scan(["n1", "n2"], "w", 100)
    call = next(op)
    explain = client.collection.find(*call.args, **call.kwargs).explain()
    assert "COLLSCAN" not in _winning(explain)
    assert "claim" in str(explain["queryPlanner"]["winningPlan"])


def test_list_queries_use_indexes(client: TaskClient) -> None:
    client.publish_many([{"name": f"n{i % 3}", "key": f"k{i}"} for i in range(300)])
    for name, status, order in [
        (None, None, "newest"),
        ("n1", None, "newest"),
        (None, "pending", "newest"),
        ("n1", "pending", "newest"),
        ("n1", None, "next_claim_at"),
    ]:
        filt, sort = list_query(name, status, order)
        # a status across names is read name by name (store.across): each string part in order
        parts = name_parts(client.names())[:-1] if across_names(name, status) else [None]
        for part in parts:
            query = filt if part is None else {"$and": [filt, {"name": part}]}
            explain = client.collection.find(query, sort=sort, limit=10).explain()
            assert "COLLSCAN" not in _winning(explain), (name, status, order)
            assert "SORT" not in _winning(explain), (name, status, order)


# -- stats and the operator queries, each from an index --------------------------------


def _explain_call(client: TaskClient, call: Call) -> dict[str, Any]:
    """``explain`` of one store ``Call`` on the tasks collection, as the server would run it."""
    coll = client.collection
    if call.method == "find":
        explained: dict[str, Any] = coll.find(*call.args, **call.kwargs).explain()
        return explained
    command: dict[str, Any]
    if call.method == "count":
        command = {"count": coll.name, "query": call.args[0], **call.kwargs}
    elif call.method == "estimated_document_count":
        command = {"count": coll.name}
    elif call.method == "distinct":
        query = {"query": call.args[1]} if len(call.args) > 1 else {}
        command = {"distinct": coll.name, "key": call.args[0], **query, **call.kwargs}
    elif call.method == "aggregate":
        command = {"aggregate": coll.name, "pipeline": call.args[0], "cursor": {}, **call.kwargs}
    else:
        raise AssertionError(f"no explain for {call.method}")
    result: dict[str, Any] = coll.database.command("explain", command, verbosity="queryPlanner")
    return result


def _finished_mix(client: TaskClient) -> None:
    client.publish_many([{"name": f"n{i % 3}", "key": f"k{i}"} for i in range(300)])
    docs = client._run(claim([f"k{i}" for i in range(0, 300, 3)], ["n0"], "w1", client.now()))
    outcomes = [Outcome(d["_id"], d["claim_run_id"], RunState.SUCCESS) for d in docs[:50]]
    outcomes += [
        Outcome(
            d["_id"], d["claim_run_id"], RunState.FAIL, error="ValueError: width 0", permanent=True
        )
        for d in docs[50:]
    ]
    client._run(finish_many(outcomes, client.now()))
    client.publish("n1", "later", delay=3600)


def _explained(client: TaskClient, op: Any) -> tuple[Any, list[tuple[str, set[str]]]]:
    """Run ``op`` call by call, explaining each (each call of a ``gather`` too): its result,
    and (method, plan stages) of each call."""
    call = next(op)
    plans = []
    while True:
        for one in call.args if call.method == GATHER else [call]:
            plans.append((one.method, _plan(_explain_call(client, one))))
        try:
            call = op.send(client._run(_replay(call)))
        except StopIteration as stop:
            return stop.value, plans


def test_stats_counts_from_the_index_alone(client: TaskClient) -> None:
    _finished_mix(client)
    client.collection.insert_one({"_id": "by-hand", "name": "n2"})  # no status yet
    found, plans = _explained(client, stats())
    assert found == client.stats() == client.stats(exact=True)
    assert found["n0"] == {"succeeded": 50, "failed": 50}
    assert found["n1"] == {"pending": 101}
    assert found["n2"] == {"pending": 100, "incomplete": 1}
    assert not found.at_least
    assert all("COLLSCAN" not in p and "FETCH" not in p for _, p in plans), plans
    methods = [m for m, _ in plans]
    # the names present; then one count per name and finished status and of the incomplete
    # (3 names x (succeeded, failed, cancelled, invalid, incomplete)); then the open tasks
    assert methods == ["distinct"] + ["count"] * 15 + ["aggregate"], methods
    assert "DISTINCT_SCAN" in plans[0][1], plans
    # COUNT_SCANs (a status of null is two, null and missing, under an OR)
    assert all("COUNT_SCAN" in p and p <= {"COUNT", "COUNT_SCAN", "OR"} for _, p in plans[2:-1])
    assert plans[-1][1] >= {"IXSCAN", "PROJECTION_COVERED"}, plans  # the open tasks, covered


def test_finished_counts_stop_at_their_bound(client: TaskClient) -> None:
    """Above ``exact_up_to``, a finished count is a lower bound, and the count that found it
    walked at most ``exact_up_to + 1`` keys; open counts stay exact."""
    _finished_mix(client)  # n0: 50 succeeded, 50 failed; n1: 101 pending; n2: 100 pending
    found = client._run(stats(exact_up_to=40))
    assert found == {
        "n0": {"succeeded": 41, "failed": 41},
        "n1": {"pending": 101},
        "n2": {"pending": 100},
    }
    assert found.at_least == {("n0", "succeeded"), ("n0", "failed")}
    assert found.show("n0", "failed") == "40+" and found.show("n1", "pending") == "101"
    calls = [c for c in _calls(stats(exact_up_to=40), client) if c.method == "count"]
    # the finished ones (a count of documents without a status is exact: publishers' own,
    # not completed yet, few)
    counted = [c for c in calls if c.args[0]["status"] is not None]
    assert counted and all(c.kwargs["limit"] == 41 for c in counted)
    executed = [
        client.collection.database.command(
            "explain",
            {"count": "tasks", "query": c.args[0], **c.kwargs},
            verbosity="executionStats",
        )["executionStats"]["totalKeysExamined"]
        for c in counted
    ]
    assert all(keys <= 41 for keys in executed), executed
    assert client._run(stats(exact_up_to=40, exact=True))["n0"] == {"succeeded": 50, "failed": 50}
    only_open = client._run(stats(["pending", "running"], exact_up_to=40))
    assert only_open == {"n1": {"pending": 101}, "n2": {"pending": 100}}
    assert client.stats(statuses=["pending"]) == only_open


def _calls(op: Any, client: TaskClient) -> list[Call]:
    call, calls = next(op), []
    try:
        while True:
            calls += call.args if call.method == GATHER else [call]
            call = op.send(client._run(_replay(call)))
    except StopIteration:
        return calls


def test_finished_since_reads_the_finished_index(client: TaskClient) -> None:
    before = client.now()
    _finished_mix(client)
    stages = _plan(_explain_call(client, next(finished_since(before))))
    assert "COLLSCAN" not in stages and "IXSCAN" in stages
    assert client.finished_since(before) == {"n0": 100}
    assert client.finished_since(client.now()) == {}


def _replay(call: Call) -> Any:
    result = yield call
    return result


def _counting(op: Any, methods: list[str]) -> Any:
    """``op``, noting the method of each call it makes (a failed call's too)."""
    call = next(op)
    while True:
        methods.append(call.method)
        try:
            result = yield call
        except PyMongoError as exc:  # the server's error goes on to the op, as the driver's does
            try:
                call = op.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            call = op.send(result)
        except StopIteration as stop:
            return stop.value


def test_operator_queries_use_their_indexes(client: TaskClient) -> None:
    client.init_collection(operator_indexes=True)  # runs_worker is made on request only
    _finished_mix(client)
    now = client.now()
    for op, index in [
        (recently_finished(10), "finished"),
        (runs_by_worker("w1", 10), "runs_worker"),
        (iter([delayed_find(["n0", "n1"], now, 10)]), "claim"),
    ]:
        explain = _explain_call(client, next(op))
        stages = _winning(explain)
        assert "COLLSCAN" not in stages and "SORT" not in stages, (index, stages)
        assert f"'indexName': '{index}'" in str(explain["queryPlanner"]["winningPlan"]), index
    # error words: the text index is made by the first search if it is not there; then a
    # search is its one find
    assert "error_text" not in client.collection.index_information()
    calls: list[str] = []
    found = client._run(_counting(with_error("ValueError width"), calls))
    assert len(found) == 50 and calls == ["find", "create_indexes", "find"]
    assert "error_text" in client.collection.index_information()
    calls.clear()
    assert len(client._run(_counting(with_error("ValueError width"), calls))) == 50
    assert calls == ["find"]
    explain = _explain_call(client, next(with_error("ValueError width")))
    assert "TEXT_MATCH" in _winning(explain) and "COLLSCAN" not in _winning(explain)
    assert len(client._run(recently_finished(500))) == 100
    assert len(client._run(runs_by_worker("w1", 500))) == 100
    assert [d["_id"] for d in client._run(delayed(now, 10))] == ["later"]
    assert len(client._run(with_error("ValueError width"))) == 50
    assert client._run(with_error("TypeError")) == []


def test_a_task_without_runs_has_no_key_in_runs_worker(client: TaskClient) -> None:
    """``runs_worker`` is partial: a task gets its key at its first claim, none before (a
    multikey index holds one for an empty array, replaced at the claim)."""
    client.init_collection(operator_indexes=True)
    client.publish_many({"name": "rw", "key": f"rw{i}", "params": {}} for i in range(5))
    now = client.now()
    claimed = client._run(claim(["rw0", "rw1"], ["rw"], "w-rw", now))
    assert sorted(d["_id"] for d in claimed) == ["rw0", "rw1"]
    keys = client.collection.database.command("validate", client.collection.name)["keysPerIndex"]
    assert keys["runs_worker"] == 2
    assert "worker_runs" not in keys


def test_ensure_indexes_drops_the_retired_indexes(client: TaskClient) -> None:
    """A collection made by an earlier version holds ``worker_runs`` (not partial) and
    ``status_newest``: the next ``ensure_indexes`` drops them, and dropping them again is not
    an error."""
    client.collection.create_index("runs.worker_id", name="worker_runs")
    client.collection.create_index([("status", 1), ("created_at", -1)], name="status_newest")
    client._run(ensure_indexes())
    indexes = client.collection.index_information()
    assert "worker_runs" not in indexes and "status_newest" not in indexes
    client._run(ensure_indexes())


def ensure_calls(present: dict[str, Any]) -> list[tuple[str, str]]:
    """The calls ``ensure_indexes`` makes where the tasks' indexes are ``present``, each
    (method, collection): the tasks' list answered with ``present``, every write with
    nothing."""
    calls: list[tuple[str, str]] = []
    op = ensure_indexes()
    reply: Any = None
    try:
        while True:
            call = op.send(reply)
            assert isinstance(call, Call)
            calls.append((call.method, call.collection))
            reply = present if call.method == "index_information" else None
    except StopIteration:
        return calls


def test_a_start_reads_the_tasks_indexes_once_and_asks_again_only_for_a_difference(
    client: TaskClient,
) -> None:
    """Where the server holds every one of the tasks' indexes as written (``schema.made``, read
    against this server's own account of them), a start reads their list once and asks for
    them no more (the workers' and limits' are asked for); one missing, or one with other
    options, asks for them all again."""
    client._run(ensure_indexes())
    present = client.collection.index_information()
    assert all(schema.made(m, present) for m in schema.INDEXES["tasks"])
    others = [("create_indexes", c) for c in schema.INDEXES if c != "tasks"]
    assert ensure_calls(present) == [("index_information", "tasks"), *others]
    missing = {k: v for k, v in present.items() if k != "newest"}
    other = {**present, "claim": {**present["claim"], "sparse": True}}
    for changed in (missing, other):
        asked = [c for c in ensure_calls(changed) if c[0] == "create_indexes"]
        assert asked == [("create_indexes", "tasks"), *others]


def test_indexes_no_worker_reads_are_made_on_request(client: TaskClient) -> None:
    """A worker makes the indexes its claims, scans, outcomes, flows and retention read, and
    those of the commands every user has (lists, stats, ``top``); not an operator's own
    (``runs_worker``: made and dropped by ``collection init``, kept by a worker's start), nor
    error search's text index (made by the dashboard's start or the first search by text)."""
    client._run(ensure_indexes())
    made = set(client.collection.index_information())
    assert {"claim", "name_status_newest", "finished", "expire"} <= made
    assert not made & {"runs_worker", "error_text"}, made
    client.init_collection(operator_indexes=True)
    indexes = client.collection.index_information()
    assert indexes["runs_worker"]["partialFilterExpression"] == {
        "runs.worker_id": {"$exists": True}
    }
    client._run(ensure_indexes())  # a worker's start leaves it
    assert "runs_worker" in client.collection.index_information()
    client.init_collection()  # and so does init without the option
    assert "runs_worker" in client.collection.index_information()
    client.init_collection(operator_indexes=False)
    client.init_collection(operator_indexes=False)  # dropping what is not there: no error
    assert "runs_worker" not in client.collection.index_information()
    client.publish("n", "k", params={})
    assert client.search(text="boom") == []  # the first search by error words makes its index
    assert "error_text" in client.collection.index_information()


def test_the_sweeps_search_for_stranded_documents_reads_indexes(client: TaskClient) -> None:
    """The sweep's search (each rescan: no status, an unknown one, a name no worker can have,
    a key that is not a string; every few: open ones no claim can reach) reads the names
    present, then ``name_status_newest`` name by name: never the whole collection."""
    _finished_mix(client)
    client.collection.insert_many(
        [
            {"_id": "no-status", "name": "n1"},
            {"_id": "odd-status", "name": "n2", "status": "paused"},
            {"_id": 7, "name": "n1", "status": "pending"},
            {"_id": "no-name", "status": "pending"},
        ]
    )
    for open_too in (False, True):
        found, plans = _explained(client, stranded(open_too=open_too))
        assert sorted(map(str, found)) == ["7", "no-name", "no-status", "odd-status"]
        assert [m for m, _ in plans] == ["distinct", "find"], plans
        assert all("COLLSCAN" not in p for _, p in plans), plans


def _symbol_key(key: str, name: str) -> RawBSONDocument:
    """An open task whose ``_id`` is a BSON symbol (type 0x0E: a deprecated type that PyMongo
    reads as a string and cannot write; other drivers still can)."""
    key_bytes = key.encode() + b"\x00"
    element = b"\x0e_id\x00" + struct.pack("<i", len(key_bytes)) + key_bytes
    rest = bson.encode({"name": name, "status": "pending"})[4:-1]
    body = element + rest + b"\x00"
    return RawBSONDocument(struct.pack("<i", len(body) + 4) + body)


def test_keys_that_are_not_strings_are_found_through_the_id_index(client: TaskClient) -> None:
    """The search at each sweep finds an open task whose key is not a string by the ``_id``
    index's bounds (a list of types): it reads those documents, not every open one, whatever
    the backlog. A symbol key (indexed as a string) is found by the search of the open
    documents, every few sweeps."""
    client.publish_many({"name": "n1", "key": f"k{i}"} for i in range(500))
    oid = ObjectId()
    client.collection.insert_many(
        [
            {"_id": 7, "name": "n1", "status": "pending"},
            {"_id": oid, "name": "n1", "status": "pending"},
        ]
    )
    client.collection.insert_one(_symbol_key("sym", "n1"))
    op = stranded(open_too=False)
    call = op.send(client._run(_replay(next(op))))  # the names present, then the search
    stats = client.collection.find(*call.args, **call.kwargs).explain()["executionStats"]
    assert stats["totalDocsExamined"] < 20, stats["totalDocsExamined"]  # 500 open tasks
    assert sorted(map(str, client._run(stranded(open_too=False)))) == sorted(["7", str(oid)])
    found = client._run(stranded(open_too=True))
    assert sorted(map(str, found)) == sorted(["7", str(oid), "sym"])


def test_a_retired_index_waits_for_no_open_transaction(
    client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropping an index needs the collection's exclusive lock, which a transaction open on it
    holds off for up to a minute: the start gives up after ``DROP_WAIT_MS`` and goes on, and
    a later one drops it."""
    monkeypatch.setattr(schema, "DROP_WAIT_MS", 300)
    client.publish("t", "held", {})
    client.collection.create_index([("status", 1), ("created_at", -1)], name="status_newest")
    with client.mongo.start_session() as session:
        session.start_transaction()
        client.collection.update_one({"_id": "held"}, {"$set": {"x": 1}}, session=session)
        client._run(ensure_indexes())  # returns: the index stays
        assert "status_newest" in client.collection.index_information()
        session.abort_transaction()
    client._run(ensure_indexes())
    assert "status_newest" not in client.collection.index_information()
