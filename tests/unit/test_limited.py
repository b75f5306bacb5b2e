"""Property tests of the pure part that chooses what a batch of limited keys asks for
(``mtask.worker.claiming.limited``) and of the group limits' pure rules, without MongoDB."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtask.errors import InvalidTask
from mtask.limits import rules as limits
from mtask.limits.slots import Request, Taken, decide
from mtask.worker.claiming.limited import plan, sequences
from mtask.worker.finding.placement import TaskMeta

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
NAMES = ["a", "b"]
GROUPS = ["g1", "g2", "g3"]

limit_docs = st.fixed_dictionaries(
    {},
    optional={
        "concurrency": st.integers(1, 3),
        "rate": st.sampled_from([1.0, 5.0]),
        "group_concurrency": st.integers(1, 3),
        "group_rate": st.sampled_from([1.0, 5.0]),
    },
)
keys = st.lists(
    st.tuples(st.sampled_from(NAMES), st.sampled_from([None, *GROUPS])),
    max_size=30,
)


@given(
    keys,
    st.dictionaries(st.sampled_from(NAMES), limit_docs),
    st.dictionaries(
        st.tuples(st.sampled_from(NAMES), st.sampled_from(GROUPS)),
        st.tuples(st.integers(0, 40), st.booleans()),
    ),
    st.sets(st.integers(0, 29)),
)
def test_a_batch_never_asks_more_than_a_limit_allows_and_a_sequence_runs_only_its_head(
    entries: list[tuple[str, str | None]],
    limited: dict[str, dict[str, Any]],
    head_of: dict[tuple[str, str], tuple[int, bool]],
    forgotten: set[int],
) -> None:
    metas = {
        f"k{i}": TaskMeta(name, 0, frozenset(), 1000, group=None if g is None else (name, g))
        for i, (name, g) in enumerate(entries)
    }
    popped = list(metas)
    # the worker may forget a popped key's task before its batch is planned (a switch to the
    # relay's hand-outs clears what it found alone)
    known = {k: m for i, (k, m) in enumerate(metas.items()) if i not in forgotten}

    def head_id(pair: tuple[str, str], index: int) -> str:
        """A sequence's head is a task of its group: one of the keys, or one not popped."""
        mine = [k for k, m in known.items() if m.group == pair]
        return mine[index % len(mine)] if mine and index % 3 else f"h-{pair[0]}-{pair[1]}"

    heads = {
        pair: {
            "_id": head_id(pair, index),
            "next_claim_at": NOW if is_due else NOW + dt.timedelta(seconds=1),
        }
        for pair, (index, is_due) in head_of.items()
    }
    assert set(sequences(popped, known, limited)) == {
        (m.name, m.group[1])
        for m in known.values()
        if m.group and limits.group_limit(limited.get(m.name, {})).concurrency == 1
    }
    out = plan(popped, known, limited, heads, NOW, lambda k: f"run-{k}", 30_000)

    claimed = [key for key, _ in out.claims]
    assert len(claimed) == len(set(claimed))  # a key is claimed once
    # a forgotten key is never claimed blind (a plain claim would pass every limit by): it is
    # looked up again, though it may still be claimed as its sequence's head for another key
    assert out.unknown == [k for k in popped if k not in known]
    for key in out.unknown:
        assert key not in claimed or any(
            h["_id"] == key and h["next_claim_at"] <= NOW for h in heads.values()
        )
    waiting = {w.key for w in out.waits}
    accounted = set(claimed) | waiting | set(out.gone) | set(out.unknown)
    assert set(popped) <= accounted | {h["_id"] for h in heads.values()}  # nothing dropped
    asked = Counter(r.slot for _, requests in out.claims for r in requests)
    for slot, n in asked.items():
        name, _, group = slot.partition(limits.GROUP_SEPARATOR)
        doc = limited[name]
        cap = (limits.group_limit(doc) if group else limits.own_limit(doc)).concurrency
        assert cap is None or n <= cap  # never more requests than runs a slot allows at once
    for key, requests in out.claims:
        assert all(r.run_id == f"run-{key}" and r.key == key for r in requests)
        meta = known.get(key)
        if meta is None:  # a sequence's head claimed in the place of a key
            assert any(h["_id"] == key and h["next_claim_at"] <= NOW for h in heads.values())
            continue
        doc = limited.get(meta.name)
        if doc is None:
            assert requests == []  # no limit: a plain claim
            continue
        own, each = limits.own_limit(doc), limits.group_limit(doc)
        assert [r.slot for r in requests if r.limit is None] == ([meta.name] if own.set else [])
        grouped = meta.group is not None and each.set
        locked = grouped and limits.is_sequence(each)  # the claim takes the group's lock
        assert len([r for r in requests if r.limit is not None]) == int(grouped and not locked)
        assert out.locked.get(key) == (
            limits.claim_lock(meta.name, meta.group[1]) if locked and meta.group else None
        )
        if grouped and each.concurrency == 1:  # in a sequence only the due head runs
            head = heads[(meta.name, meta.group[1])]
            assert head["_id"] == key and head["next_claim_at"] <= NOW
    for pair in {(m.name, m.group[1]) for m in known.values() if m.group}:
        candidates = [
            k
            for k in claimed
            if (m := known.get(k)) is not None and m.group and (m.name, m.group[1]) == pair
        ]
        if limits.group_limit(limited.get(pair[0], {})).concurrency == 1:
            assert len(candidates) <= 1  # one turn per sequence in a batch


def test_a_key_that_is_not_its_sequences_head_waits_and_the_head_is_claimed() -> None:
    known = {
        "second": TaskMeta("a", 0, frozenset(), 1000, group=("a", "g")),
        "third": TaskMeta("a", 0, frozenset(), 1000, group=("a", "g")),
    }
    heads = {("a", "g"): {"_id": "first", "next_claim_at": NOW}}
    out = plan(["second", "third"], known, {"a": {"group_concurrency": 1}}, heads, NOW, str, 30_000)
    assert [k for k, _ in out.claims] == ["first"]
    assert {w.key for w in out.waits} == {"second", "third"}
    lock = limits.claim_lock("a", "g")  # no slot: the claim takes the group's lock
    assert out.claims[0][1] == [] and out.locked == {"first": lock}
    assert {w.slot for w in out.waits} == {lock}
    # with a group rate too, the group's slot document counts both
    rated = {"a": {"group_concurrency": 1, "group_rate": 5.0}}
    out = plan(["second", "third"], known, rated, heads, NOW, str, 30_000)
    slot = limits.group_slot("a", "g")
    assert out.claims[0][1] == [Request(slot, "first", "first", 30_000, limits.Limit(1, 5.0))]
    assert out.locked == {}
    # the head retrying later: nothing runs, its group waits for it
    later = {("a", "g"): {"_id": "second", "next_claim_at": NOW + dt.timedelta(seconds=5)}}
    out = plan(["second"], known, {"a": {"group_concurrency": 1}}, later, NOW, str, 30_000)
    assert out.claims == [] and out.waits[0].until == NOW + dt.timedelta(seconds=5)
    # the group has no open task any more: the key finished
    out = plan(["second"], known, {"a": {"group_concurrency": 1}}, {}, NOW, str, 30_000)
    assert out.gone == ["second"]


def test_a_head_whose_key_is_not_a_string_is_never_claimed() -> None:
    """A sequence's head read with a key of another type (a hand-written document; the sweep
    marks it invalid) is no key to claim: ``7`` is not the task ``"7"`` of another group, which
    would take its own group's lock out of turn. The group's keys wait for it."""
    known = {
        "k": TaskMeta("a", 0, frozenset(), 1000, group=("a", "g")),
        "7": TaskMeta("a", 0, frozenset(), 1000, group=("a", "h")),
    }
    heads: dict[tuple[str, str], dict[str, Any]] = {
        ("a", "g"): {"_id": 7, "next_claim_at": NOW},
        ("a", "h"): {"_id": "6", "next_claim_at": NOW + dt.timedelta(seconds=5)},
    }
    sequence = {"a": {"group_concurrency": 1}}
    out = plan(["k", "7"], known, sequence, heads, NOW, str, 30_000)
    assert out.claims == [] and out.locked == {}
    assert {w.key for w in out.waits} == {"k", "7"}
    heads[("a", "g")]["_id"] = {"tenant": 7}
    assert plan(["k"], known, sequence, heads, NOW, str, 30_000).claims == []


def test_what_a_slot_document_says_of_each_request() -> None:
    requests = [Request("n", "r1", "k1", 1000), Request("n", "r2", "k2", 1000)]
    docs = {
        "n": {
            "granted": ["r2"],  # a rate's grants: not read for a concurrency
            "concurrency": 1,
            "holders": [{"run_id": "r1", "expires": NOW + dt.timedelta(seconds=2)}],
        }
    }
    got = decide(requests, docs, NOW)
    assert got[0] == Taken(taken=True, holder=True)
    assert not got[1].taken and got[1].retry_at is not None
    assert got[1].retry_at >= NOW + dt.timedelta(seconds=2)  # when the holder's lease ends
    # no document: the name's limit is gone (claim without a slot)
    assert decide(requests[:1], {}, NOW) == [Taken(taken=True, limited=False)]


def test_a_concurrency_written_as_a_double_is_read_from_the_holders() -> None:
    """mongosh writes ``1`` as a double: the take's pipeline counts it a concurrency
    (``$isNumber``) and adds the holder; so must ``decide``, or the take is reported refused."""
    requests = [Request("n", "r1", "k1", 1000), Request("n", "r2", "k2", 1000)]
    expires = NOW + dt.timedelta(seconds=2)
    doc = {"concurrency": 1.0, "rate": 5.0, "holders": [{"run_id": "r1", "expires": expires}]}
    got = decide(requests, {"n": doc}, NOW)
    assert got[0] == Taken(taken=True, holder=True)
    assert not got[1].taken and got[1].retry_at == expires + dt.timedelta(milliseconds=1)


@pytest.mark.parametrize(
    ("own", "group", "field"),
    [
        (limits.Limit(), limits.Limit(), "limit"),
        (limits.Limit(), limits.Limit(concurrency=0), "group_concurrency"),
        (limits.Limit(), limits.Limit(rate=-1.0), "group_rate"),
        (limits.Limit(), limits.Limit(concurrency=1, burst=3), "group_burst"),
    ],
)
def test_bad_group_limits_name_the_field(
    own: limits.Limit, group: limits.Limit, field: str
) -> None:
    with pytest.raises(InvalidTask) as caught:
        limits.validate_limit("n", own, group)
    assert caught.value.field == field


@pytest.mark.parametrize("value", [0, 0.0, -2, float("nan")])
def test_a_group_limit_admitting_no_run_is_no_lock(value: float) -> None:
    """A lock's upsert needs room for at least one (``holders.{n - 1}``): one of none would
    admit every run. It is refused on the exact path instead, as the server reads it."""
    each = limits.group_limit({"group_concurrency": value})
    assert each.concurrency == 0 and not limits.is_lock(each)


def test_a_rate_only_slot_is_read_from_its_grants() -> None:
    requests = [Request("n", "r1", "k1", 1000), Request("n", "r2", "k2", 1000)]
    docs = {"n": {"granted": ["r0", "r1"], "rate": 5.0, "tokens": 0.2, "refilled_at": NOW}}
    got = decide(requests, docs, NOW)
    assert got[0] == Taken(taken=True)
    assert not got[1].taken and got[1].retry_at is not None
