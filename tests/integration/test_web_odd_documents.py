"""Documents nobody meant to write, read through ``mtask serve``'s API, dashboard and the CLI:
task documents holding any BSON value (a Node publisher's ObjectId or Buffer in params), and
hand-edited worker heartbeats. Each renders; never a 500."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
from bson import (
    Binary,
    Code,
    DatetimeMS,
    DBRef,
    Decimal128,
    Int64,
    MaxKey,
    MinKey,
    ObjectId,
    Regex,
    Timestamp,
)
from fastapi.testclient import TestClient
from pymongo import MongoClient

from mtask import TaskClient
from mtask.cli import main
from mtask.cli.common import out
from mtask.vocabulary import bson_json
from mtask.web import create_app

TOKEN = "odd-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api(mongo_uri: str, db_name: str) -> Iterator[TestClient]:
    app = create_app(mongo_uri, database=db_name, token=TOKEN, sample_seconds=3600)
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


def sign_in(api: TestClient) -> None:
    page = api.get("/login").text
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf
    form = {"token": TOKEN, "csrf": csrf.group(1)}
    origin = {"Origin": "http://testserver"}
    assert api.post("/login", data=form, headers=origin, follow_redirects=False).status_code == 303


# -- task documents holding any BSON value ----------------------------------------------------

NOW = dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.UTC)
VALUES: dict[str, Any] = {
    "objectid": ObjectId("65f000000000000000000001"),
    "bytes": b"\xff\xfe",
    "binary": Binary(b"\x01\x02", 5),
    "decimal128": Decimal128("1.5"),
    "regex": Regex("a.*", "i"),
    "timestamp": Timestamp(1, 2),
    "minkey": MinKey(),
    "maxkey": MaxKey(),
    "code": Code("x = 1"),
    "dbref": DBRef("c", ObjectId("65f000000000000000000002")),
    "nan": math.nan,
    "infinity": -math.inf,
    "int64": Int64(2**62),
    "date": NOW,
    "nested": {"a": [ObjectId("65f000000000000000000003"), {"b": b"\x00"}]},
}


def odd_document(key: str, value: Any) -> dict[str, Any]:
    """A task holding ``value`` everywhere a task document holds values of any type."""
    run = {"run_id": "r", "worker_id": "w", "state": "FAIL", "claimed_at": NOW}
    return {
        "_id": key,
        "name": "odd",
        "status": "failed",
        "created_at": NOW,
        "updated_at": NOW,
        "params": {"v": value},
        "result": value,
        "runs": [{**run, "result": value, "junk": value, "output": {"logs": 1, "x": value}}],
        "steps": [
            {
                "name": "s",
                "kind": "call",
                "state": "done",
                "run_id": "r",
                "started_at": NOW,
                "result": value,
                "spill": {"at": value},
                "tries": [{"run_id": "r", "at": NOW, "ms": 1, "x": value}],
            }
        ],
        "signals": [{"name": "s", "payload": value, "at": NOW, "x": value}],
        "progress": {"run_id": "r", "at": NOW, "x": value},
        "waiting": {"until": NOW, "index": 0, "x": value},
        "outbox_rejected": [{"entry": value, "reason": "x"}],
        "extra_field": value,
    }


@pytest.mark.parametrize("kind", list(VALUES))
def test_a_task_holding_any_bson_value_reads_as_extended_json(
    api: TestClient, mongo: MongoClient[dict[str, Any]], db_name: str, kind: str
) -> None:
    value = VALUES[kind]
    tasks = mongo[db_name]["tasks"]
    tasks.insert_one(odd_document(kind, value))
    tasks.insert_one(odd_document(f"{kind}-older", value) | {"created_at": NOW - dt.timedelta(1)})
    want = bson_json(value)
    answer = api.get(f"/tasks/{kind}", headers=AUTH)
    assert answer.status_code == 200, answer.text
    task = answer.json()
    assert task["params"] == {"v": want}
    assert task["result"] == want
    run = task["runs"][0]
    assert (run["result"], run["junk"], run["output"]["x"]) == (want, want, want)
    step = task["steps"][0]
    assert (step["result"], step["spill"], step["tries"][0]["x"]) == (want, {"at": want}, want)
    assert (task["signals"][0]["payload"], task["signals"][0]["x"]) == (want, want)
    assert (task["progress"]["x"], task["waiting"]["x"]) == (want, want)
    assert task["outbox_rejected"] == [{"entry": want, "reason": "x"}]
    assert task["extra"] == {"extra_field": want}
    page = api.get("/tasks", params={"name": "odd", "limit": 1}, headers=AUTH)
    assert page.status_code == 200, page.text
    assert [t["key"] for t in page.json()["tasks"]] == [kind]
    after = api.get("/tasks", params={"name": "odd", "after": kind}, headers=AUTH)
    assert [t["result"] for t in after.json()["tasks"]] == [want]


@pytest.mark.parametrize("kind", sorted(set(VALUES) - {"date", "nan", "infinity", "code"}))
def test_mtask_get_json_writes_any_bson_value_as_the_api_does(
    capsys: pytest.CaptureFixture[str],
    mongo: MongoClient[dict[str, Any]],
    mongo_uri: str,
    db_name: str,
    kind: str,
) -> None:
    """``mtask get --json`` writes a BSON value as the REST API does, in Extended JSON (a date
    stays ISO 8601 and a NaN JSON's own, as the command always wrote them; a ``Code``, a string
    to Python's ``json``, its text)."""
    value = VALUES[kind]
    mongo[db_name]["tasks"].insert_one(odd_document(kind, value))
    assert main(["get", kind, "--uri", mongo_uri, "--database", db_name, "--json"]) == 0
    task = json.loads(capsys.readouterr().out)
    want = bson_json(value)
    assert (task["params"], task["result"]) == ({"v": want}, want)
    assert (task["runs"][0]["junk"], task["signals"][0]["payload"]) == (want, want)


def test_dates_no_python_date_can_hold_read_as_the_first_and_last(
    api: TestClient, mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str
) -> None:
    """A date before year 1 or after 9999 is valid BSON, which any service may write, but no
    Python date: PyMongo raised InvalidBSON reading it, a 500 on the task and on every list
    page holding it, and a traceback from the client and the CLI. Readers read it as the first
    or last date Python holds, as the workers do."""
    tasks = mongo[db_name]["tasks"]
    far, early = DatetimeMS(2**60), DatetimeMS(-(2**60))
    tasks.insert_one(odd_document("far", far) | {"created_at": far})
    tasks.insert_one(odd_document("early", early) | {"created_at": NOW})
    last = dt.datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=dt.UTC)
    first = dt.datetime.min.replace(tzinfo=dt.UTC)
    for key, date in (("far", last), ("early", first)):
        answer = api.get(f"/tasks/{key}", headers=AUTH)
        assert answer.status_code == 200, answer.text
        assert answer.json()["params"] == {"v": bson_json(date)}
    page = api.get("/tasks", params={"name": "odd"}, headers=AUTH)
    assert page.status_code == 200, page.text
    assert sorted(t["key"] for t in page.json()["tasks"]) == ["early", "far"]
    with TaskClient(mongo_uri, database=db_name) as client:
        task = client.get("far")
        assert task is not None and task.params == {"v": last} and task.created_at == last


def test_bson_values_are_written_as_relaxed_extended_json() -> None:
    assert bson_json(VALUES["objectid"]) == {"$oid": "65f000000000000000000001"}
    assert bson_json(b"\xff\xfe") == {"$binary": {"base64": "//4=", "subType": "00"}}
    assert bson_json(VALUES["decimal128"]) == {"$numberDecimal": "1.5"}
    assert bson_json(math.nan) == {"$numberDouble": "NaN"}
    assert bson_json({"s": "x", "n": [1, 2.5, True, None]}) == {"s": "x", "n": [1, 2.5, True, None]}


# -- worker heartbeats of any shape -----------------------------------------------------------

ODD_WORKERS: list[dict[str, Any]] = [
    {"_id": "w-running-strings", "running": ["abc"], "names": ["n"]},
    {"_id": "w-names-null", "names": None, "pool": {"children": [{"pid": "x"}]}},
    {"_id": ObjectId("65f000000000000000000009"), "junk": ObjectId(), "pid": "pid?"},
    {"_id": "w-markup[/b]", "names": ["[bold]n"], "started_at": "yesterday", "state": 5},
]


def test_worker_heartbeats_of_any_shape_render_everywhere(
    api: TestClient,
    mongo: MongoClient[dict[str, Any]],
    db_name: str,
    mongo_uri: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5)
    mongo[db_name]["workers"].insert_many([{**w, "last_seen": seen} for w in ODD_WORKERS])
    answer = api.get("/workers", headers=AUTH)
    assert answer.status_code == 200, answer.text
    workers = {w["_id"]: w for w in answer.json()}
    assert set(workers) == {
        "w-running-strings",
        "w-names-null",
        "65f000000000000000000009",
        "w-markup[/b]",
    }
    assert workers["w-running-strings"]["running"] == []
    assert workers["w-running-strings"]["problems"][0].startswith("'running': ")
    assert workers["w-names-null"]["pool"] is None and workers["w-names-null"]["names"] is None
    odd_id = workers["65f000000000000000000009"]
    assert odd_id["pid"] is None and "junk" in odd_id and odd_id["junk"]["$oid"]
    assert [p.split(":")[0] for p in odd_id["problems"]] == ["'_id'", "'pid'"]
    markup = workers["w-markup[/b]"]
    assert markup["started_at"] is None and markup["state"] is None  # never a guessed date
    sign_in(api)
    page = api.get("/ui/workers")
    assert page.status_code == 200, page.text
    assert "w-markup[/b]" in page.text and "65f000000000000000000009" in page.text
    assert "unreadable: &#39;running&#39;: " in page.text  # what could not be read, said
    assert "None" not in page.text  # a count it could not read shows as "-"
    assert api.get("/").status_code == 200
    common = ("--uri", mongo_uri, "--database", db_name)
    monkeypatch.setattr(out.console, "width", 300)  # no id wrapped
    for argv in (["workers"], ["workers", "--json"], ["top", "--iterations", "1"]):
        assert main([*argv, *common]) == 0, argv
        shown = capsys.readouterr().out
        assert "w-markup[/b]" in shown and "65f000000000000000000009" in shown, argv
