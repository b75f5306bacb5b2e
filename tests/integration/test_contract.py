"""The task document contract: one definition, a tolerant reader, completion of a
publisher's minimal document, stranded documents, the JSON Schemas and the validator."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

import pytest
import workerapp
from finders import finder_for
from harness import on_a_server, running_worker, wait_for
from hypothesis import given
from hypothesis import strategies as st
from pymongo import MongoClient
from pymongo.errors import WriteError

from mtask import AsyncTaskClient, Next, TaskClient, jsonschema, store
from mtask.cli import main as cli_main
from mtask.clock import FixedClock
from mtask.driver import AsyncDriver, SyncDriver, collections
from mtask.errors import InvalidTask
from mtask.models import REQUIRED_FIELDS, NewTask, StoredOptions, Task, TaskDocument, TaskOptions
from mtask.registry import Registry, TaskContext
from mtask.store.complete import INVALID_FILL
from mtask.vocabulary import OPTION_DEFAULTS, RunState
from mtask.worker.finding.scan import Sweep

registry = Registry()


@registry.task("add")
async def add(params: dict[str, int]) -> int:
    return params.get("a", 0) + params.get("b", 0)


registry.task("flaky")(workerapp.flaky)  # one definition: tests/workerapp.py


@registry.task("fan_out")
async def fan_out(params: dict[str, int]) -> list[Next]:
    return [Next("add", {"a": i, "b": 1}) for i in range(params.get("n", 2))]


@registry.task("wait_cancel")
async def wait_cancel(params: dict[str, object], ctx: TaskContext) -> str:
    await ctx.cancelled.wait()
    return "not recorded"


FAST = {"worker_timeout_ms": 2000, "ping_interval_ms": 200, "retry_delay_ms": 10}


# -- one definition -----------------------------------------------------------------------------


def test_shipped_schemas_are_the_generated_ones() -> None:
    """``mtask/schema/*.json`` ship inside the package; regenerate with
    ``python -m mtask.jsonschema`` when the models change (and bump the version if a change
    refuses documents the previous version accepted)."""
    for name, schema in jsonschema.generated().items():
        assert jsonschema.shipped(name) == schema, f"{name} is stale"
        # in the same order too: the worker's completion names a document's first bad field
        # by the shipped validator's order (``store.complete``), the models' order
        assert (jsonschema.SCHEMA_DIR / name).read_text() == jsonschema.dump(schema), (
            f"{name} is stale"
        )
    validator = jsonschema.shipped("mongodb-validator.v1.json")
    assert validator["properties"]["options"]["additionalProperties"] is False
    assert validator["properties"]["created_at"]["bsonType"] == "date"
    assert validator["properties"]["runs"]["bsonType"] == "array"  # never null
    assert "$ref" not in json.dumps(validator) and "format" not in json.dumps(validator)


def test_the_views_follow_the_one_definition() -> None:
    assert set(StoredOptions.model_fields) == set(TaskOptions.model_fields)
    task_fields = {f.alias or n for n, f in Task.model_fields.items()}
    stored = {f.alias or n for n, f in TaskDocument.model_fields.items()}
    assert task_fields - {"missing", "problems", "extra"} <= stored
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    for task in (
        NewTask.build("add", "k", {"a": 1}),
        NewTask.build("add", "k", None, {"priority": 3}, depends_on=["x"], parent="p"),
    ):
        doc = store.new_document(task, now)
        TaskDocument.model_validate(doc)  # what publish writes is the stored shape
        assert set(REQUIRED_FIELDS) <= set(doc)
        assert Task.from_document(doc).complete


def test_reader_shows_what_the_document_holds() -> None:
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    doc = store.new_document(NewTask.build("add", "k", {"a": 1, "b": 2}), now)
    run = {
        "run_id": "r1",
        "worker_id": "w1",
        "state": "SUCCESS",
        "claimed_at": now,
        "finished_at": now,
        "result": 3,
    }
    doc.update(status="succeeded", attempts=1, successes=1, runs=[run], result=3)
    doc["options"] = {**doc["options"], "max_retry": 5}  # a typo that a worker once ran
    del doc["created_at"]
    doc["source"] = "billing"  # a field of the publisher's own
    task = Task.from_document(doc)
    assert (task.result, task.attempts, task.params) == (3, 1, {"a": 1, "b": 2})
    assert [r.run_id for r in task.runs] == ["r1"]
    assert task.created_at is None and task.missing == ["created_at"]
    assert task.problems == ["'options.max_retry': unknown option"]
    assert task.options.max_retries == 3 and task.extra == {"source": "billing"}
    assert not task.complete
    # a minimal document: nothing invented
    bare = Task.from_document({"_id": "m", "name": "add", "params": {"a": 1}})
    assert bare.status is None and bare.attempts is None and bare.created_at is None
    assert bare.options == StoredOptions() and bare.runs == []
    assert {"status", "attempts", "runs", "created_at"} <= set(bare.missing)
    # an ISO string where a date belongs is named, not parsed
    iso = Task.from_document({"_id": "i", "name": "add", "created_at": "2026-01-01T00:00:00Z"})
    assert iso.created_at is None and iso.problems[0].startswith("'created_at'")
    json.dumps(Task.from_document({**doc, "x": b"\x00", "y": dt.date}).extra, default=str)


def test_unknown_options_are_refused_by_the_python_publisher(client: TaskClient) -> None:
    with pytest.raises(InvalidTask, match=r"options\.max_retry: unknown option"):
        client.publish("add", "k", options={"max_retry": 3})
    assert client.get("k") is None


def test_stats_does_not_count_a_status_none(client: TaskClient) -> None:
    client.collection.insert_one({"_id": "m", "name": "add", "params": {}})
    client.publish("add", "p")
    assert client.stats() == {"add": {"incomplete": 1, "pending": 1}}


# -- completion, end to end ---------------------------------------------------------------------


def _full(now: dt.datetime, **changes: Any) -> dict[str, Any]:
    doc = store.new_document(NewTask.build("flaky", "x", {"fail_times": 1}, FAST), now)
    doc.update(changes)
    return doc


async def test_minimal_documents_are_completed_and_run(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    now = client.now()
    later = now + dt.timedelta(milliseconds=300)
    client.collection.insert_many(
        [
            {"_id": "min", "name": "add", "params": {"a": 1, "b": 2}},
            {"_id": "no-params", "name": "add"},
            {"_id": "delayed", "name": "add", "params": {"a": 2}, "run_at": later},
            {"_id": "prio", "name": "add", "options": {"priority": 7, "max_retries": 0}},
            {"_id": "retry", "name": "flaky", "params": {"fail_times": 1}, "options": FAST},
            {"_id": "iso", "name": "add", "run_at": later.isoformat()},
            {"_id": "typo", "name": "add", "options": {"max_retry": 3}},
            {"_id": "junk", "name": 42, "params": "x"},
            {"_id": "full-iso", **{k: v for k, v in _full(now).items() if k != "_id"}},
        ]
    )
    client.collection.update_one({"_id": "full-iso"}, {"$set": {"available_at": "2026-01-01"}})
    # a full document without the retry options: its backoff uses the defaults (never null)
    no_retry_options = _full(now, _id="no-retry-opts")
    for option in ("retry_delay_ms", "retry_backoff", "max_retry_delay_ms"):
        del no_retry_options["options"][option]
    no_retry_options["options"]["retry_delay_ms"] = 10  # only the delay given
    client.collection.insert_one(no_retry_options)
    async with running_worker(registry, mongo_uri, db_name, sweep_interval=0.2):
        settled = {"succeeded", "invalid"}
        await wait_for(
            lambda: all(d.get("status") in settled for d in client.collection.find()), 90
        )
    docs = {d["_id"]: d for d in client.collection.find()}
    for key in ("min", "no-params", "delayed", "prio", "retry", "no-retry-opts"):
        assert docs[key]["status"] == "succeeded", docs[key]
        assert Task.from_document(docs[key]).complete, Task.from_document(docs[key]).problems
    assert docs["min"]["result"] == 3 and docs["no-params"]["params"] == {}
    assert docs["prio"]["options"] == {**OPTION_DEFAULTS, "priority": 7, "max_retries": 0}
    assert docs["delayed"]["runs"][0]["claimed_at"] >= later
    assert abs(docs["delayed"]["options"]["run_at"] - later) < dt.timedelta(milliseconds=1)
    assert "run_at" not in docs["delayed"]  # moved into options
    assert docs["retry"]["attempts"] == 2 and docs["no-retry-opts"]["attempts"] == 2
    reasons = {k: d.get("invalid_reason") for k, d in docs.items() if d["status"] == "invalid"}
    assert set(reasons) == {"iso", "typo", "junk", "full-iso"}
    assert reasons["iso"] == "'run_at' must be a date, found string"
    assert reasons["typo"].startswith("'options.max_retry' is not an option")
    assert reasons["junk"] == "'name' must be a string, found int"
    assert "'available_at' must be a date, found string" in reasons["full-iso"]
    listed = {t.key: t.invalid_reason for t in client.list(status="invalid")}
    assert listed == reasons


async def test_stranded_documents_are_found_by_one_sweep(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """Documents no change event brings (already there when the worker starts, or written by
    hand into open tasks) are settled by the sweep's rescan alone."""
    now = client.now()
    client.collection.insert_many(
        [
            {"_id": "min", "name": "add", "params": {"a": 1}},
            _full(now, _id="null-claim", next_claim_at=None),
            _full(now, _id="no-claim"),
            {"_id": "weird", "name": "add", "status": None, "params": []},
        ]
    )
    client.collection.update_one({"_id": "no-claim"}, {"$unset": {"next_claim_at": 1}})
    async with running_worker(registry, mongo_uri, db_name, names=["fan_out"]) as (worker, _):
        await (
            worker.parts.finding.finder.scanner.rescan()
        )  # the sweep's once-function (one ran at start)
        docs = {d["_id"]: d for d in client.collection.find()}
    assert docs["min"]["status"] == "pending" and isinstance(
        docs["min"]["next_claim_at"], dt.datetime
    )
    assert docs["null-claim"]["status"] == "invalid"
    assert "'next_claim_at' must be a date" in docs["null-claim"]["invalid_reason"]
    assert docs["no-claim"]["status"] == "invalid"
    assert docs["weird"]["invalid_reason"] == "'params' must be an object, found array"


# -- the validator ------------------------------------------------------------------------------


async def test_the_validator_refuses_wrong_documents_and_never_mtasks_own_writes(
    mongo_uri: str, db_name: str, client: TaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    # a malformed document from before the validator: it can still be marked invalid
    client.collection.insert_one(
        {"_id": "old-junk", "name": "add", "status": "pending", "next_claim_at": client.now()}
    )
    options = client.init_collection(validator=True)
    assert options["validationLevel"] == "moderate" and options["validationAction"] == "error"
    for wrong in (
        {"_id": "typo", "name": "add", "options": {"max_retry": 3}},
        {"_id": "iso", "name": "add", "run_at": "2026-01-01T00:00:00Z"},
        {"_id": "half", "name": "add", "status": "pending"},
        {"_id": "no-name", "params": {}},
    ):
        with pytest.raises(WriteError, match="Document failed validation"):
            client.collection.insert_one(wrong)
    client.collection.insert_one({"_id": "min", "name": "add", "params": {"a": 1, "b": 1}})
    client.publish("add", "ok", {"a": 1, "b": 2})
    client.publish("flaky", "retry", {"fail_times": 1}, options=FAST)
    client.publish("flaky", "fails", {"fail_times": 9}, options={**FAST, "max_retries": 1})
    client.publish("fan_out", "flow", {"n": 2})
    client.publish("add", "after", {"a": 0, "b": 0}, depends_on=["flow"])
    client.publish("wait_cancel", "cancel-me", options=FAST)
    client.publish("add", "later", delay=0.2)
    client.set_limit("add", concurrency=1, rate=100.0)
    async with running_worker(registry, mongo_uri, db_name, sweep_interval=0.2) as (_, events):
        await events.wait("claimed", key="cancel-me")
        client.cancel("cancel-me")
        finished = {"succeeded", "failed", "cancelled", "invalid"}
        await wait_for(
            lambda: all(d.get("status") in finished for d in client.collection.find()), 90
        )
        await wait_for(
            lambda: client.collection.count_documents({"runs.state": "RUNNING"}) == 0, 10
        )
    statuses = {d["_id"]: d["status"] for d in client.collection.find()}
    assert statuses == {
        "old-junk": "invalid",
        "min": "succeeded",
        "ok": "succeeded",
        "retry": "succeeded",
        "fails": "failed",
        "flow": "succeeded",
        "flow/add.0": "succeeded",
        "flow/add.1": "succeeded",
        "after": "succeeded",
        "cancel-me": "cancelled",
        "later": "succeeded",
    }
    client.retry("fails")  # an operator action on a validated collection
    assert client.init_collection(validator=False).get("validator", {}) == {}


def test_a_published_document_the_validator_accepts_but_no_worker_can_run_is_marked_invalid(
    mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    """The validator cannot see a publisher's params over 1 MiB, nor refuse dependencies in
    a status-less document, so it accepts them; the worker refuses them. Marking one
    ``invalid`` gives it a status, and a document with a status must hold the whole shape:
    without the rest, the server refused the marking and the document stayed without a
    status for ever (its publisher waiting for an outcome)."""
    with TaskClient(mongo_uri, database=db_name) as client:
        client.init_collection(validator=True)
    tasks = mongo[db_name].tasks
    tasks.insert_many(
        [
            {"_id": "big", "name": "add", "params": {"blob": "x" * (1 << 20)}},
            {"_id": "deps", "name": "add", "depends_on": ["other"]},
            {"_id": "fine", "name": "add", "options": {"priority": 2}},
        ]
    )
    asyncio.run(one_sweep(mongo_uri, db_name))
    found = {d["_id"]: (d.get("status"), d.get("invalid_reason")) for d in tasks.find()}
    assert found["big"] == ("invalid", "'params' is larger than 1048576 bytes as BSON")
    assert found["deps"][0] == "invalid"
    assert found["deps"][1].startswith("'depends_on' cannot be published by hand")
    assert found["fine"] == ("pending", None)
    filled = {"_id", "name", "status", "next_claim_at", "available_at", "created_at", "updated_at"}
    assert set(REQUIRED_FIELDS) <= filled | set(INVALID_FILL)


def test_collection_command(
    mongo_uri: str,
    db_name: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = ["--uri", mongo_uri, "--database", db_name]
    assert cli_main(["collection", "init", *common, "--validator", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["validator"] is True and out["validationLevel"] == "moderate"
    assert out["operator_indexes"] == []  # made on request only
    assert cli_main(["collection", "init", *common, "--operator-indexes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["operator_indexes"] == ["runs_worker"]
    assert cli_main(["collection", "init", *common]) == 0  # left as they are
    assert "operator indexes: runs_worker" in capsys.readouterr().out
    assert cli_main(["collection", "init", *common, "--no-operator-indexes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["operator_indexes"] == []
    assert cli_main(["collection", "schema", "validator"]) == 0
    assert json.loads(capsys.readouterr().out) == jsonschema.validator_schema()
    with TaskClient(mongo_uri, database=db_name) as client:
        with pytest.raises(WriteError):
            client.collection.insert_one({"_id": "x", "name": "add", "options": {"max_retry": 1}})
        client.init_collection(validator=False)
        client.collection.insert_one({"_id": "x", "name": "add", "options": {"max_retry": 1}})
        client.collection.insert_one({"_id": "y", "name": "add", "status": "pending"})
        driver_op = store.quarantine(["x", "y"], client.now())
        client._run(driver_op)
    assert cli_main(["list", *common, "--status", "invalid", "--json"]) == 0
    listed = {t["_id"]: t["invalid_reason"] for t in json.loads(capsys.readouterr().out)}
    assert listed["x"].startswith("'options.max_retry' is not an option")
    assert "'runs' must be an array, found missing" in listed["y"]
    assert cli_main(["list", *common, "--status", "invalid"]) == 0
    table = capsys.readouterr().out  # rich wraps the reason within its column
    assert "invalid:" in table and "'options.max_retry'" in table
    assert "None" not in table  # y holds no attempts: shown as "-"
    assert cli_main(["get", *common, "x"]) == 0
    assert "is not an option" in capsys.readouterr().out
    assert cli_main(["get", *common, "y"]) == 0
    shown = capsys.readouterr().out
    assert "(successes -, failures -)" in shown and "None" not in shown


# -- random partial documents -------------------------------------------------------------------

NOW = dt.datetime(2026, 3, 1, 12, tzinfo=dt.UTC)


def _not_str(value: object) -> bool:
    return not isinstance(value, str)


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.just(NOW),
    st.just("2026-03-01T12:00:00Z"),
    st.lists(st.integers(-9, 9), max_size=2),
    st.dictionaries(
        st.text(st.characters(blacklist_characters="\x00"), max_size=3),
        st.integers(-9, 9),
        max_size=2,
    ),
)
good_options = {
    "priority": st.integers(-5, 5),
    "concurrency": st.integers(1, 2),
    "max_retries": st.integers(0, 3),
    "worker_timeout_ms": st.integers(1000, 5000),
    "retry_delay_ms": st.integers(0, 100),
    "retry_backoff": st.floats(1, 3),
    "specific_worker_ids": st.just([]),
    "run_at": st.just(NOW),
}
option_values = st.fixed_dictionaries(
    {}, optional={**{k: st.one_of(v, junk) for k, v in good_options.items()}, "max_retry": junk}
)
partial_documents = st.fixed_dictionaries(
    # a string name no worker handles is a task waiting for its worker, not a stranded one
    {"name": st.one_of(st.just("add"), st.just("add"), st.just(""), junk.filter(_not_str))},
    optional={
        "params": st.one_of(st.just({"a": 1, "b": 2}), junk),
        "options": st.one_of(option_values, option_values, junk),
        "run_at": st.one_of(st.just(NOW), junk),
        "status": st.one_of(st.just(None), st.just("pending"), junk),
        "attempts": st.one_of(st.just(0), junk),
        "runs": st.one_of(st.just([]), junk),
        "created_at": st.one_of(st.just(NOW), junk),
        "next_claim_at": st.one_of(st.just(NOW), junk),
        "depends_on": st.just(["other"]),
        "note": junk,
    },
)


def _shows_only_what_it_holds(task: Task, doc: dict[str, Any]) -> None:
    for name, field in Task.model_fields.items():
        if name in ("key", "options", "missing", "problems", "extra"):
            continue
        value = getattr(task, name)
        if value not in (None, [], {}):
            assert (field.alias or name) in doc, (name, value)
    held = doc.get("options") if isinstance(doc.get("options"), dict) else {}
    for name, value in task.options.model_dump().items():
        if value is not None:
            assert name in held, (name, value)


async def one_sweep(mongo_uri: str, db_name: str) -> None:
    """One rescan of a worker's finder for ``add``, as the sweep runs it (its once-function),
    with no change stream: what the sweep alone settles."""
    async with AsyncTaskClient(mongo_uri, database=db_name) as aclient:
        finder = finder_for(AsyncDriver(collections(aclient.db)), FixedClock(NOW), ["add"])
        await Sweep.of(finder.scanner).run_once()


def test_an_open_document_the_claim_cannot_read_is_marked_by_the_sweep_alone(
    mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    # A claim time, so it sits in the claim index, but no runs and a date for attempts: the scan
    # and the claim skip it, and its insert event went to no worker (none was running). Found by
    # the hypothesis test below; before, it stayed pending for ever.
    doc = {"_id": "d1", "name": "add", "status": "pending", "next_claim_at": NOW}
    mongo[db_name].tasks.insert_one({**doc, "attempts": NOW, "depends_on": ["other"]})

    asyncio.run(one_sweep(mongo_uri, db_name))
    after = mongo[db_name].tasks.find_one({"_id": "d1"})
    assert after is not None and after["status"] == "invalid"
    assert "'runs' must be an array" in after["invalid_reason"]


def test_nul_names_and_keys_of_other_types_are_marked_by_one_sweep(
    mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    """A name with a NUL, or a key that is not a string, published by hand (minimal or full):
    no worker can run it, so one sweep marks it invalid, naming the field."""
    tasks = mongo[db_name].tasks
    tasks.insert_many(
        [
            {"_id": "nul-min", "name": "a\x00dd", "params": {}},
            {"_id": "nul-full", "name": "a\x00dd", "status": "pending", "next_claim_at": NOW},
            {"_id": {"n": 1}, "name": "add", "params": {}},
            {"_id": 7, "name": "add", "status": "pending", "next_claim_at": NOW, "runs": []},
            {"_id": "long", "name": "a" * 201, "params": {}},
        ]
    )
    asyncio.run(one_sweep(mongo_uri, db_name))
    reasons = {str(d["_id"]): (d["status"], d.get("invalid_reason")) for d in tasks.find()}
    bad = "malformed task document: "  # a document with a status: not a publisher's
    assert reasons == {
        "nul-min": ("invalid", "'name' must not contain NUL characters"),
        "nul-full": (
            "invalid",
            f"{bad}'name' must be a task name without NUL characters, found string",
        ),
        "{'n': 1}": ("invalid", "'_id' must be a string, found object"),
        "7": ("invalid", f"{bad}'_id' must be a string, found int"),
        "long": ("invalid", "'name' must be at most 200 characters"),
    }


@pytest.mark.timeout(600)
@on_a_server(max_examples=40)
@given(docs=st.lists(partial_documents, min_size=1, max_size=5))
def test_random_partial_documents_are_completed_or_marked_in_one_sweep(
    docs: list[dict[str, Any]], mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    db = mongo[db_name]
    db.drop_collection("tasks")
    keys = []
    for i, doc in enumerate(docs):
        doc = {**doc, "_id": f"d{i}"}
        db.tasks.insert_one(doc)
        keys.append(doc["_id"])
        task = Task.from_document(doc)  # readers never raise, never invent
        _shows_only_what_it_holds(task, doc)

    asyncio.run(one_sweep(mongo_uri, db_name))
    driver = SyncDriver(collections(db))
    for doc in db.tasks.find():
        task = Task.from_document(doc)
        _shows_only_what_it_holds(task, doc)
        if doc.get("status") == "invalid":
            assert isinstance(doc.get("invalid_reason"), str) and doc["invalid_reason"], doc
            continue
        # everything else is a complete, open task that a claim can reach
        assert task.complete, (doc, task.missing, task.problems)
        assert doc["status"] == "pending" and isinstance(doc["next_claim_at"], dt.datetime)
        due = max(NOW, doc["next_claim_at"]) + dt.timedelta(seconds=1)
        claimed = driver.run(store.claim([doc["_id"]], [doc["name"]], "w1", due))
        assert [c["_id"] for c in claimed] == [doc["_id"]], doc


def test_rest_and_dashboard_show_what_documents_hold(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    from fastapi.testclient import TestClient

    from mtask.web import create_app
    from mtask.web.auth import COOKIE, Keys

    client.collection.insert_many(
        [
            {"_id": "bare", "name": "add", "params": {"a": 1}, "note": "mine"},
            {"_id": "typo", "name": "add", "options": {"max_retry": 3}},
        ]
    )
    client._run(store.quarantine(["typo"], client.now()))
    auth = {"Authorization": "Bearer t0k"}
    with TestClient(create_app(mongo_uri, database=db_name, token="t0k")) as http:
        bare = http.get("/tasks/bare", headers=auth).json()
        assert bare["status"] is None and bare["attempts"] is None and bare["params"] == {"a": 1}
        assert "status" in bare["missing"] and bare["extra"] == {"note": "mine"}
        listed = http.get("/tasks", params={"status": "invalid"}, headers=auth).json()["tasks"]
        assert [t["key"] for t in listed] == ["typo"]
        assert listed[0]["invalid_reason"].startswith("'options.max_retry' is not an option")
        http.cookies.set(COOKIE, Keys.of("t0k").new_session())
        page = http.get("/ui/tasks/typo").text
        assert "&#39;options.max_retry&#39; is not an option" in page
        page = http.get("/ui/tasks/bare").text
        assert "not in the document" in page and "holds no count of its attempts" in page


@pytest.mark.parametrize("state", [RunState.FAIL, RunState.RELEASED, RunState.SUCCESS])
def test_a_task_marked_invalid_while_running_stays_invalid_after_its_runs_outcome(
    client: TaskClient, state: RunState
) -> None:
    """The quarantine may mark a running task (its document edited under it); the outcome of
    the run in flight is recorded on its run, and the status judged from fields found
    malformed is not derived again (it read ``succeeded``: 0 successes >= a missing
    concurrency)."""
    client.publish("add", "edited")
    doc = client._run(store.claim(["edited"], ["add"], "w1", client.now()))[0]
    client.collection.update_one({"_id": "edited"}, {"$unset": {"options.concurrency": ""}})
    assert client._run(store.quarantine(["edited"], client.now())) == 1
    outcome = store.Outcome("edited", doc["claim_run_id"], state, result=1, error="boom")
    client._run(store.finish(outcome, client.now()))
    after = client.collection.find_one({"_id": "edited"})
    assert after is not None
    assert [r["state"] for r in after["runs"]] == [state.value]  # the run's end is recorded
    assert after["status"] == "invalid" and after["next_claim_at"] is None
    assert "expire_at" not in after  # invalid tasks are kept until purged


async def test_async_client_installs_the_validator(mongo_uri: str, db_name: str) -> None:
    async with AsyncTaskClient(mongo_uri, database=db_name) as aclient:
        options = await aclient.init_collection(validator=True)
        assert options["validator"] == {"$jsonSchema": jsonschema.validator_schema()}
        with pytest.raises(WriteError, match="Document failed validation"):
            await aclient.collection.insert_one({"_id": "k", "name": "add", "run_at": "2026"})


def test_a_published_group_lock_is_not_kept_by_the_completion(
    mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    """``group_lock`` is taken by a sequence's claim; a document without a status holds no
    lock. Kept by the completion (a document copied from another collection, say), two of a
    group collided in the unique ``group_lock`` index: the second could not be completed and
    stayed without a status, and the first blocked its group's sequence."""
    with TaskClient(mongo_uri, database=db_name) as client:
        client.init_collection()
    tasks = mongo[db_name].tasks
    tasks.insert_many(
        [
            {"_id": f"g{i}", "name": "add", "options": {"group": "g"}, "group_lock": True}
            for i in range(2)
        ]
    )
    asyncio.run(one_sweep(mongo_uri, db_name))
    found = {d["_id"]: (d.get("status"), "group_lock" in d) for d in tasks.find()}
    assert found == {"g0": ("pending", False), "g1": ("pending", False)}
