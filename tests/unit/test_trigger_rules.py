"""Triggers' pure parts (``mtask.triggers``): the declaration's checks, the change stream's
pipeline, a change's key, params and debounce; and the follower's store operations read without
I/O (``store.followers``, ``store.triggers``). What MongoDB decides (the pipeline's match, the
leases, the publishes) is tested on a real server in tests/integration/test_triggers.py."""

from __future__ import annotations

import datetime as dt
from typing import Any

import bson
import pytest
from bson import ObjectId
from hypothesis import given
from hypothesis import strategies as st
from pymongo.results import UpdateResult
from scripted import ScriptedDriver, Step

from mtask.errors import InvalidTask
from mtask.models import NewTask, TaskOptions
from mtask.registry import Registry
from mtask.store import followers
from mtask.store import triggers as store_triggers
from mtask.triggers import Trigger, cluster_time, digest, id_text, prefixed
from mtask.vocabulary import MAX_KEY_LENGTH

T0 = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.UTC)


def build(**kw: Any) -> Trigger:
    return Trigger.build(kw.pop("collection", "orders"), task=kw.pop("task", "ship"), **kw)


@pytest.mark.parametrize(
    ("declaration", "field", "says"),
    [
        ({"match": {"$where": "1"}}, "match", "$where is not supported"),
        ({"match": {"$expr": {"$eq": [1, 1]}}}, "match", "$expr is not supported"),
        ({"match": {"$or": "x"}}, "match", "non-empty list"),
        ({"match": ["status"]}, "match", "mapping"),
        ({"on": ["insert", "upsert"]}, "on", "must name some of"),
        ({"on": "insert"}, "on", "must be a list"),
        ({"on": ["delete"], "match": {"a": 1}}, "on", "a delete leaves no document"),
        ({"fields": "status"}, "fields", "list of field names"),
        ({"fields": ["$status"]}, "fields", "not a field name"),
        ({"params": ["a", "a.b"]}, "params", "a field inside it"),
        ({"key": "doc"}, "key", "'change' or 'document'"),
        ({"debounce": 0}, "debounce", "above 0"),
        ({"debounce": float("nan")}, "debounce", "above 0"),
        ({"debounce": 5, "key": "change"}, "debounce", "key='document'"),
        ({"start": "later"}, "start", "'now' or 'scan'"),
        ({"name": "a:b"}, "name", "no ':'"),
        ({"collection": "system.views"}, "collection", "not a collection"),
        ({"collection": "a$b"}, "collection", "not a collection"),
        ({"task": ""}, "task", "must not be empty"),
        ({"options": {"max_retry": 1}}, "options", "max_retry"),
        ({"options": {"run_at": T0}}, "options.run_at", "when their change comes"),
    ],
)
def test_a_bad_declaration_is_refused_naming_its_field(
    declaration: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(InvalidTask) as raised:
        build(**declaration)
    assert str(raised.value).startswith(field) or field in str(raised.value), raised.value
    assert says in str(raised.value)


def test_a_registry_refuses_two_triggers_of_one_name_and_keeps_its_watched_collections() -> None:
    registry = Registry()
    registry.trigger("orders", task="ship")
    with pytest.raises(InvalidTask, match="already declared"):
        registry.trigger("payments", task="ship")
    registry.trigger("payments", task="ship", name="ship-payments")
    registry.waits_on("invoices", "orders")
    registry.waits_on("invoices")
    assert sorted(registry.triggers) == ["ship", "ship-payments"]
    assert registry.watched == ("invoices", "orders")
    with pytest.raises(InvalidTask, match="collection"):
        registry.waits_on("")


def test_the_pipeline_matches_the_changed_document_and_keeps_what_a_task_needs() -> None:
    trigger = build(
        match={"status": "paid", "$or": [{"total": {"$gt": 10}}, {"vip": True}]},
        on=["insert", "update"],
        fields=["status"],
        params=["total", "customer.email"],
    )
    match, project = trigger.pipeline()
    clauses = match["$match"]["$and"]
    assert clauses[0] == {"operationType": {"$in": ["insert", "update"]}}
    assert clauses[1] == {
        "fullDocument.status": "paid",
        "$or": [{"fullDocument.total": {"$gt": 10}}, {"fullDocument.vip": True}],
    }
    assert clauses[2]["$or"][0] == {"operationType": {"$ne": "update"}}
    assert project["$project"] == {
        "operationType": 1,
        "clusterTime": 1,
        "documentKey": 1,
        "fullDocument.total": 1,
        "fullDocument.customer.email": 1,
    }
    assert trigger.full_document == "updateLookup"
    assert build(images=True).full_document == "required"
    assert build().pipeline()[0] == {
        "$match": {"operationType": {"$in": ["insert", "update", "replace"]}}
    }


@given(
    st.dictionaries(st.from_regex(r"[a-z][a-z.]{0,8}", fullmatch=True), st.integers(), max_size=5)
)
def test_a_match_is_the_same_query_one_level_down(match: dict[str, int]) -> None:
    assert prefixed(match, "fullDocument.") == {f"fullDocument.{k}": v for k, v in match.items()}


def test_a_change_key_is_its_resume_tokens_and_a_document_key_its_ids() -> None:
    trigger = build()
    token = {"_data": "826B0A6095000000122B0229296E04"}
    key = trigger.change_key("o-1", token)
    assert key == f"ship:o-1:{digest(token)}"
    assert trigger.change_key("o-1", dict(token)) == key  # the same event: the same key
    assert trigger.change_key("o-1", {"_data": token["_data"] + "00"}) != key
    assert build(key="document").document_key("o-1") == "ship:o-1"
    assert trigger.scan_key("o-1", 3) == "ship:o-1:scan3"


def _one_id(a: Any, b: Any) -> bool:
    """Whether MongoDB holds ``a`` and ``b`` as one ``_id`` (numbers compare by value)."""
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers):
        return (not isinstance(a, bool) and not isinstance(b, bool) and a == b) or (
            isinstance(a, bool) and isinstance(b, bool) and a == b
        )
    return type(a) is type(b) and a == b


ids = st.one_of(
    st.text(max_size=40),
    st.integers(-(2**63), 2**63 - 1),
    st.builds(ObjectId),
    st.booleans(),
    st.none(),
    st.dictionaries(st.text(max_size=5), st.integers(0, 9), max_size=3),
)


@given(ids, ids)
def test_two_ids_share_a_key_text_only_if_they_are_one_id(a: Any, b: Any) -> None:
    assert (id_text(a) == id_text(b)) == _one_id(a, b), (a, b)


def test_a_key_too_long_names_its_document_by_a_digest() -> None:
    trigger = build()
    key = trigger.change_key("x" * 600, {"_data": "00"})
    assert len(key) <= MAX_KEY_LENGTH and key.startswith("ship:#")
    assert key == trigger.change_key("x" * 600, {"_data": "00"})
    assert id_text("~odd") != "~odd" and id_text(ObjectId("0" * 24)) == "~" + "0" * 24
    assert id_text(5) == "~5" and id_text("5") == "5"


def test_params_carry_the_id_the_fields_and_the_change_and_debounce_moves_the_start() -> None:
    trigger = build(key="document", debounce=dt.timedelta(seconds=30), params=["total"])
    params = trigger.params_for("o-1", {"_id": "o-1", "total": 5}, "update", T0)
    assert params == {"_id": "o-1", "total": 5, "change": {"op": "update", "at": T0}}
    assert trigger.params_for("o-1", None, "delete", T0)["_id"] == "o-1"
    assert trigger.run_at(T0) == T0 + dt.timedelta(seconds=30)
    assert build().run_at(T0) is None
    change = {"clusterTime": bson.Timestamp(int(T0.timestamp()), 4)}
    assert cluster_time(change) == T0 and cluster_time({}) is None


def test_handler_options_complete_a_triggers_options() -> None:
    registry = Registry()
    registry.task("ship", options=TaskOptions(max_retries=7))(lambda params: None)
    trigger = registry.trigger("orders", task="ship", options={"priority": 3})
    assert registry.options_for("ship", trigger.options) == {"max_retries": 7, "priority": 3}


# -- the store's operations, read without I/O ------------------------------------------------------


def test_a_lease_is_taken_on_the_servers_clock_only_if_free_or_ones_own_and_not_paused() -> None:
    def check(call: Any) -> None:
        filt, pipeline = call.args
        assert filt["paused"] == {"$ne": True}
        assert filt["$or"] == [{"holder": "w1"}, {"$expr": {"$lte": ["$expires_at", "$$NOW"]}}]
        assert pipeline[0]["$set"]["expires_at"] == {"$add": ["$$NOW", 10_000]}

    driver = ScriptedDriver(
        Step(
            "find_one_and_update", {"_id": "tasks/trigger/ship"}, collection="triggers", check=check
        )
    )
    assert driver.run(followers.acquire("tasks/trigger/ship", "w1", 10_000)) is not None
    assert driver.done


def test_a_renewal_writes_each_position_fenced_by_its_holder_in_one_bulk_write() -> None:
    token = {"_data": "82"}

    def check(call: Any) -> None:
        [requests] = call.args
        assert len(requests) == 2
        first = requests[0]._filter, requests[0]._doc
        assert first[0] == {"_id": "a", "holder": "w1", "paused": {"$ne": True}}
        sets = first[1][0]["$set"]
        assert sets["token"] == {"$literal": token}
        assert sets["changes"] == {"$add": [{"$ifNull": ["$changes", 0]}, 3]}
        assert "token" not in requests[1]._doc[0]["$set"]

    class Result:
        matched_count = 2

    driver = ScriptedDriver(Step("bulk_write", Result(), collection="triggers", check=check))
    held = [followers.Progress("a", token=token, changes=3), followers.Progress("b")]
    assert driver.run(followers.renew("w1", held, 10_000)) == 2


def test_a_followers_state_is_read_from_a_document_of_any_shape() -> None:
    assert followers.State.of({}) == followers.State(None, None)
    assert followers.State.of({"token": "x", "scan": {"epoch": "1"}}) == followers.State(None, None)
    state = followers.State.of({"token": {"_data": "1"}, "scan": {"epoch": 2, "done": False}})
    assert state.token == {"_data": "1"} and state.scan == {"epoch": 2, "done": False}
    assert followers.State.of({"scan": {"epoch": 2, "done": True}}).scan is None


def _task(key: str) -> NewTask:
    return NewTask.build("ship", key, {"_id": 1})


class _Inserted:
    def __init__(self) -> None:
        self.inserted_id = "x"


def test_a_document_keyed_change_joins_a_task_that_has_not_started() -> None:
    from pymongo.errors import DuplicateKeyError

    pending = {"_id": "ship:1", "status": "pending", "attempts": 0, "runs": []}

    def joins(call: Any) -> None:
        filt, pipeline = call.args
        assert filt == {"_id": "ship:1", "status": "pending", "attempts": 0}
        assert pipeline[0]["$set"]["available_at"] == {"$max": ["$available_at", T0]}

    driver = ScriptedDriver(
        Step("insert_one", raises=DuplicateKeyError("dup")),
        Step("find_one_and_update", pending),  # the key exists: the upsert reads it
        Step("update_one", UpdateResult({"n": 1, "nModified": 1}, True), check=joins),  # joins
    )
    how = driver.run(
        store_triggers.publish_document(_task("ship:1"), _task("ship:1:abc"), T0, T0, {})
    )
    assert how == "joined" and driver.done


def test_a_change_during_a_run_gets_a_follow_up_keyed_by_that_run() -> None:
    key = store_triggers.follow_up_key("ship:1", "run-7")
    assert key.startswith("ship:1:after-") and key == store_triggers.follow_up_key(
        "ship:1", "run-7"
    )
    assert key != store_triggers.follow_up_key("ship:1", "run-8")
