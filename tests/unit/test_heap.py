"""Property tests of the claim queue (pure, no MongoDB)."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st

from mtask.worker.claim_queue import ClaimQueue

BASE = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
ops = st.lists(
    st.tuples(
        st.sampled_from(["push", "discard"]),
        st.integers(0, 30).map(lambda i: f"k{i}"),
        st.integers(-5_000, 5_000).map(lambda ms: BASE + dt.timedelta(milliseconds=ms)),
        st.integers(-3, 3),
        st.booleans(),
    ),
    max_size=120,
)


@given(ops, st.integers(1, 40), st.integers(1, 20))
def test_pop_due_returns_the_best_due_keys(
    operations: list[tuple[str, str, dt.datetime, int, bool]], size: int, limit: int
) -> None:
    queue = ClaimQueue(max_size=size)
    model: dict[str, tuple[dt.datetime, int, bool]] = {}
    for op, key, at, priority, specific in operations:
        if op == "push":
            if queue.push(key, at, priority, specific):
                model[key] = (at, priority, specific)
            # the queue keeps the soonest entries when full
            model = {k: v for k, v in model.items() if k in queue}
        else:
            queue.discard(key)
            model.pop(key, None)
        assert len(queue) <= size
        assert set(model) == set(queue.entries)
    now = BASE
    due = {k: v for k, v in model.items() if v[0] <= now}
    popped = queue.pop_due(now, limit)
    assert len(popped) == min(limit, len(due))
    assert set(popped) <= set(due)
    order = sorted(due, key=lambda k: (-due[k][1], not due[k][2], due[k][0]))
    ranks = [(-due[k][1], not due[k][2], due[k][0]) for k in popped]
    assert ranks == sorted(ranks)
    assert ranks == [(-due[k][1], not due[k][2], due[k][0]) for k in order[: len(popped)]]
    assert not set(popped) & set(queue.entries)
    rest = [v[0] for k, v in model.items() if k not in popped]
    expected_next = (now if any(t <= now for t in rest) else min(rest)) if rest else None
    assert queue.next_due(now) == expected_next


def test_full_queue_keeps_the_soonest_and_says_it_overflowed() -> None:
    queue = ClaimQueue(max_size=2)
    assert queue.push("a", BASE + dt.timedelta(seconds=3))
    assert queue.push("b", BASE + dt.timedelta(seconds=1))
    assert not queue.push("late", BASE + dt.timedelta(seconds=9))
    assert queue.overflowed
    assert queue.push("soon", BASE)  # evicts the latest ("a")
    assert set(queue.entries) == {"b", "soon"}
    assert queue.pop_due(BASE + dt.timedelta(seconds=5), 10) == ["soon", "b"]
