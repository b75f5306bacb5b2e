"""Change events of any shape: a worker's finder applies, notes or sets aside each one, and never
raises or queues a key that is not a string."""

from __future__ import annotations

import datetime as dt
from typing import Any

from bson import Binary, Decimal128, Int64, MaxKey, MinKey, ObjectId, Timestamp
from finders import finder_for
from hypothesis import given
from hypothesis import strategies as st

from mtask import metrics
from mtask.clock import FixedClock
from mtask.worker.finding.finder import Finder
from mtask.worker.finding.setaside import SetAside

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-(2**31), 2**31).map(Int64),
    st.floats(),
    st.just(Decimal128("1.5")),
    st.text(max_size=6),
    st.binary(max_size=4).map(Binary),
    st.just(ObjectId("650000000000000000000000")),
    st.sampled_from([MinKey(), MaxKey(), Timestamp(1, 1), NOW]),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text("ab_", max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)
documents = st.fixed_dictionaries(
    {"_id": values},
    optional={
        "name": st.one_of(st.just("add"), values),
        "status": st.one_of(st.just("pending"), values),
        "next_claim_at": st.one_of(st.just(NOW), values),
        "options": values,
    },
)
events = st.fixed_dictionaries(
    {},
    optional={
        "operationType": st.one_of(st.sampled_from(["insert", "update", "delete"]), values),
        "ns": st.one_of(st.just({"coll": "tasks"}), st.just({"coll": "limits"}), values),
        "documentKey": st.one_of(st.builds(lambda d: {"_id": d["_id"]}, documents), values),
        "fullDocument": st.one_of(documents, values),
        "updateDescription": st.one_of(
            st.fixed_dictionaries(
                {"updatedFields": st.fixed_dictionaries({}, optional={"next_claim_at": values})}
            ),
            values,
        ),
    },
)


def watcher() -> Finder:
    return finder_for(None, FixedClock(NOW), ["add"])  # applying events needs no MongoDB


@given(batch=st.lists(events, max_size=6))
def test_any_event_is_applied_noted_or_set_aside(batch: list[dict[str, Any]]) -> None:
    w = watcher()
    for change in batch:
        w.on_change(change)  # never raises
    assert all(isinstance(key, str) for key in w.placement.meta)
    assert all(isinstance(key, str) for key in w.scanner.unknown)
    assert all(isinstance(key, str) for key in w.placement.queue.entries)


def test_an_error_in_one_event_notes_its_document_and_counts_it() -> None:
    w = watcher()
    before = metrics.SET_ASIDE.labels("event")._value.get()

    def broken(doc: Any) -> None:
        raise RuntimeError("a bug about this one document")

    w.scanner.place_safely = broken  # type: ignore[method-assign]
    w.on_change({"operationType": "insert", "documentKey": {"_id": "k"}, "fullDocument": {}})
    assert list(w.scanner.malformed) == ["k"]
    assert metrics.SET_ASIDE.labels("event")._value.get() == before + 1


def test_keys_of_other_types_are_noted_as_they_are() -> None:
    w = watcher()
    odd: list[Any] = [
        {"n": 1},
        {"n": 1},
        1,
        1.0,
        True,
        Int64(1),
        ObjectId("650000000000000000000000"),
    ]
    for key in odd:
        w.on_change(
            {
                "operationType": "insert",
                "documentKey": {"_id": key},
                "fullDocument": {"_id": key, "name": "add"},
            }
        )
    assert not w.placement.meta and not len(w.placement.queue)
    noted = w.scanner.malformed.take()
    assert noted[0] == {"n": 1} and len(noted) == 6  # one of each (1, 1.0, True differ in BSON)
    assert not w.scanner.malformed


def test_set_aside_keeps_each_key_once() -> None:
    aside = SetAside()
    for key in ({"a": [1]}, {"a": [1]}, "k", "k", 2):
        aside.add(key)
    assert len(aside) == 3 and aside.take() == [{"a": [1]}, "k", 2]
