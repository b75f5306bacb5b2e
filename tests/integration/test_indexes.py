"""The claim and list query shapes use indexes, not collection scans."""

from __future__ import annotations

from typing import Any

from mtask import TaskClient
from mtask.driver import Call
from mtask.store import Outcome, RunState, claim, claim_filter, finish_many, list_query, scan
from mtask.store.queries import (
    delayed,
    delayed_find,
    recently_finished,
    runs_by_worker,
    stats,
    with_error,
)


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
        explain = client.collection.find(filt, sort=sort, limit=10).explain()
        assert "COLLSCAN" not in _winning(explain), (name, status, order)


# -- issue 17: stats and the operator queries, each from an index --------------------------------


def _explain_call(client: TaskClient, call: Call) -> dict[str, Any]:
    """``explain`` of one store ``Call`` on the tasks collection, as the server would run it."""
    coll = client.collection
    if call.method == "find":
        explained: dict[str, Any] = coll.find(*call.args, **call.kwargs).explain()
        return explained
    command: dict[str, Any]
    if call.method == "count_documents":
        command = {"count": coll.name, "query": call.args[0], **call.kwargs}
    elif call.method == "distinct":
        command = {"distinct": coll.name, "key": call.args[0], **call.kwargs}
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


def test_stats_counts_from_the_index_alone(client: TaskClient) -> None:
    _finished_mix(client)
    op = stats()
    call = next(op)
    plans = []
    while True:
        plans.append(_winning(_explain_call(client, call)))
        result = client._run(_replay(call))
        try:
            call = op.send(result)
        except StopIteration as stop:
            counts = stop.value
            break
    assert counts == client.stats()
    assert counts["n0"] == {"succeeded": 50, "failed": 50}
    assert counts["n1"] == {"pending": 101}
    assert all("COLLSCAN" not in p and "FETCH" not in p for p in plans), plans
    assert "DISTINCT_SCAN" in plans[0]
    assert all("COUNT_SCAN" in p for p in plans[1:]), plans


def _replay(call: Call) -> Any:
    result = yield call
    return result


def test_operator_queries_use_their_indexes(client: TaskClient) -> None:
    _finished_mix(client)
    now = client.now()
    for op, index in [
        (recently_finished(10), "finished"),
        (runs_by_worker("w1", 10), "worker_runs"),
        (iter([delayed_find(["n0", "n1"], now, 10)]), "claim"),
    ]:
        explain = _explain_call(client, next(op))
        stages = _winning(explain)
        assert "COLLSCAN" not in stages and "SORT" not in stages, (index, stages)
        assert f"'indexName': '{index}'" in str(explain["queryPlanner"]["winningPlan"]), index
    explain = _explain_call(client, next(with_error("ValueError width")))
    assert "TEXT_MATCH" in _winning(explain) and "COLLSCAN" not in _winning(explain)
    assert len(client._run(recently_finished(500))) == 100
    assert len(client._run(runs_by_worker("w1", 500))) == 100
    assert [d["_id"] for d in client._run(delayed(now, 10))] == ["later"]
    assert len(client._run(with_error("ValueError width"))) == 50
    assert client._run(with_error("TypeError")) == []
