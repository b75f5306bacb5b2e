"""Property tests of the claim queue (pure, no MongoDB)."""

from __future__ import annotations

import datetime as dt
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from mtask.worker.claim_queue import ClaimQueue, effective_priority

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


def test_a_full_queue_remembers_the_first_place_it_left_a_task_out() -> None:
    """``resume``: where a top-up reads on from, in the scan's order (claim time, key)."""
    queue = ClaimQueue(max_size=2)
    queue.push("a", BASE + dt.timedelta(seconds=3))
    queue.push("b", BASE + dt.timedelta(seconds=1))
    assert queue.resume is None and not queue.wants_top_up()
    assert not queue.push("late", BASE + dt.timedelta(seconds=9))
    assert queue.resume == (BASE + dt.timedelta(seconds=9), "late")
    assert queue.push("soon", BASE)  # evicts "a", which sits before "late"
    assert queue.resume == (BASE + dt.timedelta(seconds=3), "a")
    assert queue.overflow_at == BASE + dt.timedelta(seconds=3)
    queue.note_overflow(BASE + dt.timedelta(seconds=3), "Z")  # same time, an earlier key
    assert queue.resume == (BASE + dt.timedelta(seconds=3), "Z")
    assert not queue.wants_top_up()
    assert queue.pop_due(BASE, 1) == ["soon"]  # half of the queue gone
    assert queue.wants_top_up()
    queue.clear()
    assert queue.resume is None and not queue.overflowed and not queue.wants_top_up()


# -- fairness between groups, places in line, priority aging -----------------------------------

grouped = st.lists(
    st.tuples(
        st.integers(0, 40).map(lambda i: f"k{i}"),
        st.integers(-5_000, 0).map(lambda ms: BASE + dt.timedelta(milliseconds=ms)),
        st.integers(-2, 2),
        st.booleans(),
        st.sampled_from([None, ("n", "a"), ("n", "b"), ("m", "a")]),
        st.integers(-600, 0).map(lambda s: BASE + dt.timedelta(seconds=s)),
    ),
    max_size=80,
)


@given(grouped, st.integers(1, 60), st.sampled_from([None, 30, 120]))
def test_groups_take_turns_within_the_best_priority(
    pushes: list[tuple[str, dt.datetime, int, bool, object, dt.datetime]],
    limit: int,
    aging_s: int | None,
) -> None:
    aging = None if aging_s is None else dt.timedelta(seconds=aging_s)
    queue = ClaimQueue(max_size=100, aging=aging)
    model: dict[str, tuple[int, bool, object, dt.datetime]] = {}
    for key, at, priority, specific, group, place in pushes:
        assert queue.push(key, at, priority, specific, group=group, place=place)
        model[key] = (priority, specific, group, place)
    now = BASE

    def rank(key: str) -> tuple[int, bool]:
        priority, specific, _, place = model[key]
        return (-effective_priority(priority, place, now, aging), not specific)

    popped = queue.pop_due(now, limit)
    assert len(popped) == min(limit, len(model))
    ranks = [rank(k) for k in popped]
    assert ranks == sorted(ranks)  # the best effective priority first, then this worker's
    left = [rank(k) for k in model if k not in popped]
    if left and popped:
        assert min(left) >= ranks[-1]
    for group in {g for _, _, g, _ in model.values()}:  # within a group: its place in line
        mine = [(rank(k), model[k][3]) for k in popped if model[k][2] == group]
        assert mine == sorted(mine)
    # groups take turns: a group popped is among the least served so far (in this pop, at any
    # rank: a group served ahead at a better priority lets the others catch up) of the groups
    # that still wait at its rank, give or take the one turn a tie allows
    served: Counter[object] = Counter()
    for i, key in enumerate(popped):
        waiting = {model[k][2] for k in model if rank(k) == rank(key) and k not in popped[:i]}
        assert served[model[key][2]] <= min(served[g] for g in waiting) + 1
        served[model[key][2]] += 1


def test_a_group_with_a_few_tasks_is_not_starved_by_a_backlog() -> None:
    queue = ClaimQueue()
    for i in range(200):
        queue.push(f"a{i}", BASE, group=("n", "A"), place=BASE)
    assert queue.pop_due(BASE, 50) == [f"a{i}" for i in range(50)]
    later = BASE + dt.timedelta(seconds=1)
    for i in range(5):
        queue.push(f"b{i}", later, group=("n", "B"), place=later)
    order = queue.pop_due(later, 12)
    assert [k for k in order if k.startswith("b")] == [f"b{i}" for i in range(5)]
    assert order.index("b4") <= 10  # taking turns: five of B within the next eleven


def test_a_task_whose_lease_ran_out_keeps_its_place() -> None:
    queue = ClaimQueue()
    published = BASE - dt.timedelta(seconds=60)
    for i in range(5):  # published after it, due long before its lease ended
        queue.push(f"new{i}", BASE - dt.timedelta(seconds=30 - i), place=None)
    queue.push("taken-over", BASE, place=published)  # due at its lease's end
    assert queue.pop_due(BASE, 6)[0] == "taken-over"


def test_priority_ages_one_level_per_interval() -> None:
    aging = dt.timedelta(seconds=60)
    assert effective_priority(0, BASE, BASE + dt.timedelta(seconds=59), aging) == 0
    assert effective_priority(0, BASE, BASE + dt.timedelta(seconds=120), aging) == 2
    assert effective_priority(3, BASE, BASE - dt.timedelta(seconds=5), aging) == 3
    assert effective_priority(0, BASE, BASE + dt.timedelta(days=1), None) == 0
    queue = ClaimQueue(aging=aging)
    queue.push("old-low", BASE, priority=0, place=BASE - dt.timedelta(minutes=10))
    queue.push("new-high", BASE, priority=5, place=BASE)
    assert queue.pop_due(BASE, 1) == ["old-low"]  # 0 + 10 levels of waiting beats 5
    strict = ClaimQueue()
    strict.push("old-low", BASE, priority=0, place=BASE - dt.timedelta(minutes=10))
    strict.push("new-high", BASE, priority=5, place=BASE)
    assert strict.pop_due(BASE, 1) == ["new-high"]


def test_waiting_entries_age_while_they_wait() -> None:
    aging = dt.timedelta(seconds=10)
    queue = ClaimQueue(aging=aging)
    queue.push("low", BASE, priority=0, place=BASE)
    queue.push("high", BASE, priority=3, place=BASE + dt.timedelta(seconds=1))
    assert queue.due(BASE + dt.timedelta(seconds=1)) == 2  # promoted while both rank 0 < 3
    queue.push("high2", BASE, priority=3, place=BASE + dt.timedelta(seconds=35))
    # 40 s on: low has waited 4 levels (4), high 3 levels (6), high2 0 (3)
    assert queue.pop_due(BASE + dt.timedelta(seconds=40), 3) == ["high", "low", "high2"]


@given(
    st.lists(
        st.tuples(st.sampled_from(["push", "discard", "pop"]), st.integers(0, 2_000)),
        max_size=600,
    )
)
def test_the_heap_of_latest_claim_times_stays_bounded_by_what_the_queue_holds(
    operations: list[tuple[str, int]],
) -> None:
    """A queue that is never cleared (a dispatched worker's never rescans) keeps no more heap
    items than twice its entries and 64, after every change: it grew by one item a task."""
    queue = ClaimQueue(max_size=10_000)
    for i, (op, n) in enumerate(operations):
        if op == "push":
            queue.push(f"k{n}", BASE + dt.timedelta(milliseconds=i))
        elif op == "discard":
            queue.discard(f"k{n}")
        else:
            queue.pop_due(BASE + dt.timedelta(seconds=10), n % 8 + 1)
        assert len(queue._latest) <= 2 * len(queue) + 64


def test_a_queue_handed_many_tasks_one_at_a_time_keeps_few_heap_items() -> None:
    queue = ClaimQueue(max_size=10_000)
    for i in range(5_000):
        queue.push(f"k{i}", BASE + dt.timedelta(milliseconds=i))
        assert queue.pop_due(BASE + dt.timedelta(seconds=10), 1) == [f"k{i}"]
        assert len(queue) == 0 and len(queue._latest) <= 64
