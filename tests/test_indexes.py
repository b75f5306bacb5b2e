"""The claim and list query shapes use indexes, not collection scans."""

from __future__ import annotations

from typing import Any

from mtask import TaskClient
from mtask.store import claim_filter, list_query, scan


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
