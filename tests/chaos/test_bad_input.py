"""Bad input at the edges: credentials, URIs, and random documents in the collection."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from finders import finder_for
from harness import CHAOS, MTASK_ROOT, Cluster, on_a_server, until_finished
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pymongo import MongoClient
from pymongo.errors import WriteError

from mtask import TaskClient, store
from mtask.clock import FixedClock
from mtask.driver import SyncDriver, collections
from mtask.embedded import EmbeddedMongo
from mtask.models import Task

pytestmark = pytest.mark.chaos


def run_cli(*args: str, worker: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mtask", *(["worker", "run"] if worker else []), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=CHAOS,
        env={"PYTHONPATH": f"{CHAOS}:{MTASK_ROOT}", "PATH": "/usr/bin:/bin"},
    )


def test_worker_with_an_unreachable_or_wrong_uri_exits_clearly() -> None:
    proc = run_cli(
        "chaosapp:registry", "--uri", "mongodb://127.0.0.1:9/?serverSelectionTimeoutMS=500",
        "--startup-timeout", "3", worker=True,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "gave up after 3s: cannot reach MongoDB" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("chaosapp:registry", "--uri", "http://localhost:27017", worker=True)
    assert proc.returncode != 0
    assert "invalid MongoDB URI" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
async def test_mongodb_with_authentication(tmp_path: Path, db_name: str) -> None:
    """The embedded mongod with --auth (and the key file a replica set needs) and one user:
    the right credentials publish and run tasks; wrong or missing ones are a clear error."""
    key_file = tmp_path / "keyfile"
    key_file.write_text("mtaskChaosSuiteKeyFile0123456789abcdef")
    key_file.chmod(0o600)
    server = EmbeddedMongo(tmp_path / "auth", extra_args=("--auth", "--keyFile", str(key_file)))
    uri = server.start()  # the localhost exception lets it initiate the replica set
    try:
        port = uri.split(":")[2].split("/")[0]
        with MongoClient(f"mongodb://127.0.0.1:{port}/?directConnection=true") as local:
            local.admin.command("createUser", "app", pwd="s3cret", roles=["root"])
        good = f"mongodb://app:s3cret@127.0.0.1:{port}/?replicaSet=mtask&authSource=admin"
        bad = f"mongodb://app:wrong@127.0.0.1:{port}/?replicaSet=mtask&authSource=admin"
        cluster = Cluster(good, db_name, tmp_path)
        try:
            with TaskClient(good, database=db_name) as client:
                client.publish("work", "authed", {"ms": 10})
                cluster.spawn("w", "--concurrency", "1")
                await until_finished(client, 1, timeout=60, explain=cluster.explainer(client))
                task = client.get("authed")
                assert task is not None and task.status == "succeeded"
        finally:
            cluster.close()
        for uri_, text in ((bad, "Authentication failed"), (uri, "requires authentication")):
            proc = run_cli("stats", "--uri", uri_, "--database", db_name)
            assert proc.returncode == 1, proc.stderr
            assert text in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        proc = run_cli("chaosapp:registry", "--uri", bad, "--startup-timeout", "5", worker=True)
        assert proc.returncode != 0
        assert "Authentication failed" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
    finally:
        server.stop()


# -- fuzzing the decoding path ------------------------------------------------------------------

FIELDS = [
    "_id", "name", "status", "next_claim_at", "available_at", "runs", "successes", "failures",
    "attempts", "params", "options", "result", "error", "created_at", "updated_at",
]  # fmt: skip
OPTION_FIELDS = [
    "priority", "concurrency", "max_retries", "worker_timeout_ms", "ping_interval_ms",
    "specific_worker_ids", "run_at",
]  # fmt: skip
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.sampled_from(["pending", "running", "succeeded", "RUNNING", "add", "w1", "$x"]),
    st.datetimes(
        min_value=dt.datetime(1970, 1, 1),
        max_value=dt.datetime(2100, 1, 1),
        timezones=st.just(dt.UTC),
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["state", "run_id", "lease_expires_at", "x"]), inner, max_size=3
        ),
    ),
    max_leaves=6,
)
options = st.dictionaries(st.sampled_from(OPTION_FIELDS), values, max_size=7)
documents = st.dictionaries(
    st.sampled_from(FIELDS),
    st.one_of(values, options),
    max_size=len(FIELDS),
).map(lambda d: {**d, "_id": d.get("_id", "k")})


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(doc=documents)
def test_random_documents_never_break_decoding(doc: dict[str, Any]) -> None:
    """The worker's decoding of event and scan documents, and the typed view every reader
    uses: any document at all is placed, noted as malformed, or skipped, never raised."""
    finder = finder_for(None, FixedClock(NOW), ["add"])  # placing needs no MongoDB
    finder.scanner.place_safely(doc)
    task = Task.from_document(doc)
    assert task.status == "invalid" or task.key == str(doc["_id"])


@pytest.mark.timeout(600)
@on_a_server(max_examples=25)
@given(junk=st.lists(documents, min_size=1, max_size=6))
def test_random_documents_never_break_a_claim(
    junk: list[dict[str, Any]], mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    """Random documents next to a good task in the real collection: a claim of all of them
    either claims the good task or fails on one document's write error (which the worker
    isolates), and quarantine marks what no claim can match."""
    db = mongo[db_name]
    db.drop_collection("tasks")
    driver = SyncDriver(collections(db))
    with TaskClient(database=db_name, mongo_client=mongo, clock=FixedClock(NOW)) as client:
        client.publish("add", "good", {"a": 1, "b": 2})
    keys: list[Any] = ["good"]
    for i, doc in enumerate(junk):
        doc = {**doc, "_id": f"junk{i}", "name": "add", "next_claim_at": NOW}
        try:
            db["tasks"].insert_one(doc)
        except WriteError:  # the server refuses it (e.g. parallel arrays in an index)
            continue
        keys.append(doc["_id"])
    claimed: list[Any] = []
    try:
        claimed = driver.run(store.claim(keys, ["add"], "w1", NOW, None, store.CLAIMED_FIELDS))
    except Exception as exc:  # noqa: BLE001
        assert getattr(exc, "document", False), exc  # only one document's own write error
    if not claimed:  # the worker isolates: one key at a time
        claimed = driver.run(store.claim(["good"], ["add"], "w1", NOW, isolate=True))
    assert [d["_id"] for d in claimed if d["_id"] == "good"] == ["good"]
    driver.run(store.quarantine(keys, NOW))
    for doc in driver.run(store.placements(keys)):
        assert doc.get("well_formed") is not False, doc
