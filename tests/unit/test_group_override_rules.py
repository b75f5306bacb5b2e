"""Per-group overrides and weights, their pure parts: a group's limit as an override
makes it, what a batch asks of an overridden group's slot, and the claim queue's weighted
turns. Property-tested, no MongoDB."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtask.errors import InvalidTask
from mtask.limits import rules as limits
from mtask.limits.rules import GroupOverride, Limit, group_limit_for, validate_override
from mtask.worker.claim_queue import ClaimQueue, GroupWeights
from mtask.worker.claiming.limited import counted, plan
from mtask.worker.finding.placement import TaskMeta

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
entries = st.fixed_dictionaries(
    {},
    optional={
        "group": st.sampled_from(["pro", "free", 3, None]) | json_values,
        "concurrency": st.sampled_from([None, 0, 1, 2, 5, -1, 2.5, "3", True, float("nan")]),
        "rate": st.sampled_from([None, 0.5, 3.0, "x", float("inf")]),
        "burst": st.sampled_from([None, 1, 4, "y"]),
        "weight": st.sampled_from([None, 0, -1, 0.5, 3, 1e9, "3", True, float("nan")]),
    },
)
docs = st.fixed_dictionaries(
    {},
    optional={
        "group_concurrency": st.sampled_from([None, 1, 2, 3, "2"]),
        "group_rate": st.sampled_from([None, 1.0, 5.0]),
        "group_overrides": st.lists(entries | json_values, max_size=5) | json_values,
    },
)


@given(docs, st.sampled_from([None, "pro", "free", "other"]))
def test_any_document_reads_as_a_limit_and_never_makes_a_sequence(
    doc: dict[str, Any], group: str | None
) -> None:
    """A document of any shape (written by hand, by an older version) never stops a worker:
    what is not an override is none. An override never makes a group a sequence, and the groups
    of a sequence keep the name's limit."""
    limit = group_limit_for(doc, group)
    assert isinstance(limit, Limit)
    base = limits.group_limit(doc)
    if base.concurrency == 1 or group is None:
        assert limit == base
    if limits.is_sequence(limit):
        assert limits.is_sequence(base)
    for weight in limits.weights(doc).values():
        assert 0 < weight <= limits.MAX_WEIGHT
    assert isinstance(limits.restricts(doc), bool)


def test_an_override_takes_the_names_group_limit_for_what_it_does_not_give() -> None:
    doc = {
        "group_concurrency": 2,
        "group_rate": 5.0,
        "group_burst": 5,
        "group_overrides": [
            {"group": "pro", "concurrency": 8, "rate": None, "burst": None, "weight": 3.0},
            {"group": "api", "concurrency": None, "rate": 1.0, "burst": 2, "weight": None},
            {"group": "solo", "concurrency": 1, "rate": None, "burst": None, "weight": None},
        ],
    }
    assert group_limit_for(doc, "pro") == Limit(8, 5.0, 5)
    assert group_limit_for(doc, "api") == Limit(2, 1.0, 2)
    assert group_limit_for(doc, "free") == Limit(2, 5.0, 5)
    assert group_limit_for(doc, "solo") == Limit(1, 5.0, 5)  # one at a time, by its slot
    assert limits.weights(doc) == {"pro": 3.0}
    no_rate = {**doc, "group_rate": None, "group_burst": None}
    assert group_limit_for(no_rate, "solo") == Limit(2)  # would be a sequence: not applied
    sequence = {**doc, "group_concurrency": 1}
    assert group_limit_for(sequence, "pro") == limits.group_limit(sequence)
    weights_only = {"group_overrides": [{"group": "pro", "weight": 3}]}
    assert not limits.restricts(weights_only)  # claimed plainly
    assert limits.restricts({"group_overrides": [{"group": "pro", "concurrency": 4}]})


@pytest.mark.parametrize(
    ("group", "override", "field"),
    [
        ("", GroupOverride(concurrency=2), "group"),
        ("a\x00b", GroupOverride(concurrency=2), "group"),
        ("x" * 201, GroupOverride(concurrency=2), "group"),
        (7, GroupOverride(concurrency=2), "group"),
        ("pro", GroupOverride(), "group"),
        ("pro", GroupOverride(concurrency=0), "concurrency"),
        ("pro", GroupOverride(concurrency=1), "concurrency"),  # a sequence is the name's
        ("pro", GroupOverride(rate=-1.0), "rate"),
        ("pro", GroupOverride(burst=3), "burst"),
        ("pro", GroupOverride(weight=0), "weight"),
        ("pro", GroupOverride(weight=float("nan")), "weight"),
        ("pro", GroupOverride(weight=1001), "weight"),
        ("pro", GroupOverride(weight=True), "weight"),  # type: ignore[arg-type]
    ],
)
def test_bad_overrides_are_refused_naming_the_field(
    group: Any, override: GroupOverride, field: str
) -> None:
    with pytest.raises(InvalidTask) as raised:
        validate_override("n", group, override)
    assert raised.value.field == field


def meta(name: str, group: str) -> TaskMeta:
    return TaskMeta(name, 0, frozenset(), 1000, group=(name, group))


def test_a_batch_asks_an_overridden_groups_slot_with_its_own_limit() -> None:
    doc = {
        "group_concurrency": 2,
        "group_overrides": [{"group": "pro", "concurrency": 5}],
    }
    known = {f"p{i}": meta("n", "pro") for i in range(8)}
    known |= {f"f{i}": meta("n", "free") for i in range(8)}
    out = plan(list(known), known, {"n": doc}, {}, NOW, lambda k: f"run-{k}", 30_000)
    asked = Counter(r.slot for _, requests in out.claims for r in requests)
    pro, free = limits.group_slot("n", "pro"), limits.group_slot("n", "free")
    assert asked == {pro: 5, free: 2}  # as many as each allows at once; the rest wait
    assert {r.limit for _, rs in out.claims for r in rs if r.slot == pro} == {Limit(5)}
    assert {r.limit for _, rs in out.claims for r in rs if r.slot == free} == {Limit(2)}
    assert out.locked == {}
    # a group of a name with no group limit is limited by its override alone
    only = {"group_overrides": [{"group": "pro", "concurrency": 3}]}
    out = plan(list(known), known, {"n": only}, {}, NOW, lambda k: f"run-{k}", 30_000)
    assert Counter(r.slot for _, rs in out.claims for r in rs) == {pro: 3}
    assert len(out.claims) == 3 + 8
    # a run in flight counts towards its group's override when the limit changes
    assert counted("n", "pro", (), doc) == [(pro, Limit(5))]


@given(
    st.dictionaries(
        st.sampled_from(["A", "B", "C", "D"]),
        st.sampled_from([0.5, 1.0, 2.0, 3.0, 7.0]),
        min_size=2,
    ),
    st.integers(1, 200),
)
def test_weighted_groups_take_turns_in_proportion_to_their_weights(
    weights: dict[str, float], pops: int
) -> None:
    """While every group has due tasks, each group's turns divided by its weight stay within
    one turn's worth of every other's: a weight of 3 takes three turns for one of weight 1."""
    shares = GroupWeights()
    shares.set("n", weights)
    queue = ClaimQueue(weights=shares)
    for g in weights:
        for i in range(300):
            queue.push(f"{g}{i}", NOW, group=("n", g), place=NOW)
    popped = queue.pop_due(NOW, pops)
    served = Counter(k[0] for k in popped)
    for g, w in weights.items():
        for h, v in weights.items():
            assert served[g] / w - served[h] / v <= max(1 / w, 1 / v) + 1e-9, (served, weights)


def test_a_three_to_one_weight_gives_three_turns_for_one() -> None:
    shares = GroupWeights()
    shares.set("n", {"pro": 3.0})
    queue = ClaimQueue(weights=shares)
    for i in range(100):
        queue.push(f"free{i}", NOW, group=("n", "free"), place=NOW)
        queue.push(f"pro{i}", NOW, group=("n", "pro"), place=NOW)
    popped = queue.pop_due(NOW, 80)
    assert sum(k.startswith("pro") for k in popped) == 60
    shares.set("n", {})  # weights cleared: even turns from here on
    popped = queue.pop_due(NOW, 20)
    assert abs(sum(k.startswith("pro") for k in popped) - 10) <= 1
    assert queue.like().weights is shares  # the relay's queue takes the worker's weights


def test_a_batch_asks_each_shared_resource_its_names_use_for_no_more_than_it_allows() -> None:
    """Three names use the resource ``api`` (3 at once); one also uses ``unset`` (no limit):
    the batch asks ``api`` for three runs in all, whatever their names, and ``unset`` for
    none. A name with its own limit asks both slots."""
    api, unset = limits.resource_slot("api"), limits.resource_slot("unset")
    docs: dict[str, Any] = {api: {"concurrency": 3, "holders": []}, "c": {"concurrency": 5}}
    uses = {"a": (api,), "b": (api,), "c": (api, unset)}
    known = {f"{n}{i}": TaskMeta(n, 0, frozenset(), 1000) for n in "abc" for i in range(4)}
    out = plan(list(known), known, docs, {}, NOW, lambda k: f"run-{k}", 30_000, uses)
    asked = Counter(r.slot for _, requests in out.claims for r in requests)
    assert asked[api] == 3 and unset not in asked
    assert all(r.limit is None for _, rs in out.claims for r in rs)  # its document's limit
    for key, requests in out.claims:
        slots = {r.slot for r in requests}
        assert slots == ({api, "c"} if key.startswith("c") else {api})
    assert {w.key for w in out.waits} == set(known) - {k for k, _ in out.claims}
    # without the resource's document (no limit set), a name that uses it is a plain claim
    out = plan(["a0"], known, {}, {}, NOW, str, 30_000, uses)
    assert out.claims == [("a0", [])]


def test_a_resources_slot_is_neither_a_names_nor_a_groups() -> None:
    slot = limits.resource_slot("api")
    assert limits.is_resource(slot) and not limits.is_group_slot(slot)
    assert limits.resource_of(slot) == "api"
    assert limits.is_group_slot(limits.group_slot("n", "g"))
    assert not limits.is_resource("n") and not limits.is_resource(limits.group_slot("n", "g"))
    for bad in ("", " ", "a\x00b", "x" * 201, 3):
        with pytest.raises(InvalidTask) as raised:
            limits.validate_resource(bad)
        assert raised.value.field == "resource"


def test_a_batch_counts_each_runs_units_against_a_limit() -> None:
    """A name whose runs take 4 units of a resource of 10 at once: two of its runs fit in one
    batch (8), a third does not; a name of one unit each fills the rest."""
    api = limits.resource_slot("api")
    docs: dict[str, Any] = {api: {"concurrency": 10, "holders": []}}
    uses = {"big": (api,), "small": (api,)}
    known = {f"big{i}": TaskMeta("big", 0, frozenset(), 1000) for i in range(3)}
    known |= {f"small{i}": TaskMeta("small", 0, frozenset(), 1000) for i in range(3)}
    out = plan(list(known), known, docs, {}, NOW, str, 30_000, uses, {"big": 4})
    claimed = [k for k, _ in out.claims]
    assert claimed == ["big0", "big1", "small0", "small1"]
    assert {r.units for k, rs in out.claims for r in rs if k.startswith("big")} == {4}
    assert {w.key for w in out.waits} == {"big2", "small2"}
