"""The auth-and-TLS tier: one embedded mongod with ``--auth``, a key file and
``--tlsMode requireTLS`` (certificates made here, ``tests/certs.py``), started once for the
module, with the roles of ``mtask collection roles --create`` and one SCRAM user per part.

Each part runs under its least role: a publisher publishes and reads, and is refused a claim, a
forged outcome and a drop; a real worker process runs its tasks; ``mtask serve`` reads with the
viewer's role and names the missing privilege when asked to act; the CLI likewise. Every log
line, error and page of these tests is scanned for the passwords.
"""

from __future__ import annotations

import base64
import os
import secrets
import subprocess
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import certs
import httpx
import pytest
from harness import run_cli, spawn_worker
from needs import missing
from pymongo import MongoClient
from pymongo.errors import OperationFailure
from webserver import serving

from mtask import TaskClient
from mtask.driver import Call, SyncDriver, collections
from mtask.embedded import EmbeddedMongo, Tls
from mtask.errors import MtaskError, StorageError
from mtask.security import roles
from mtask.security.encryption import KEY_FILE_ENV, Encryption
from mtask.web.auth import Principal

DB = "secured"
USERS = {
    "root": ["root"],
    "publisher": ["mtaskPublisher"],
    "worker": ["mtaskRelay", "mtaskRelayInboxes@secured_inbox"],  # the inboxes' own database
    "viewer": ["mtaskViewer"],
    "operator": ["mtaskOperator"],
    "admin": ["mtaskAdmin"],
}


@dataclass
class Secured:
    base: str
    """The server's URI without credentials (TLS options included)."""
    passwords: dict[str, str]
    said: list[str] = field(default_factory=list)
    """Every log line, error and output these tests saw: scanned for the passwords."""

    def uri(self, user: str) -> str:
        host = self.base.partition("://")[2]
        return f"mongodb://{user}:{self.passwords[user]}@{host}&authSource=admin"

    def clean(self, *texts: str) -> None:
        self.said.extend(texts)
        for text in texts:
            for password in self.passwords.values():
                assert password not in text, "a password in what mtask said"


def _start(base: Path) -> tuple[EmbeddedMongo, str]:
    files = certs.make(base / "certs")
    key_file = base / "keyfile"
    key_file.write_text(secrets.token_hex(32))
    key_file.chmod(0o600)
    server = EmbeddedMongo(
        base / "data",
        cache_size_gb=0.25,
        extra_args=("--auth", "--keyFile", str(key_file)),
        tls=Tls(files.ca, files.server),
    )
    try:
        return server, server.start()
    except MtaskError as exc:
        missing(f"the auth+TLS mongod did not start: {exc}")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    server, base = _start(tmp_path_factory.mktemp("secured"))
    passwords = {user: f"pw-{user}-{secrets.token_hex(8)}" for user in USERS}
    found = Secured(base, passwords)
    try:
        direct = base.replace("replicaSet=mtask", "directConnection=true")
        with MongoClient(direct) as local:  # the localhost exception: the first user
            local.admin.command("createUser", "root", pwd=passwords["root"], roles=["root"])
        code, out, err = run_cli(
            "collection", "roles", "--create", "--uri", found.uri("root"), "--database", DB
        )
        assert code == 0, err
        found.clean(out, err)
        with MongoClient(found.uri("root")) as root:
            for user, names in USERS.items():
                if user != "root":
                    given = [
                        {"role": name, "db": db or DB}
                        for name, _, db in (n.partition("@") for n in names)
                    ]
                    root.admin.command("createUser", user, pwd=passwords[user], roles=given)
        code, out, err = run_cli(
            "collection", "init", "--serve-indexes", "--uri", found.uri("admin"), "--database", DB
        )
        assert code == 0, err  # the admin's role makes the collection and every index
        yield found
    finally:
        server.stop()


def test_the_roles_are_made_as_roles_defines_them(secured: Secured) -> None:
    with MongoClient(secured.uri("root")) as root:
        info = root[DB].command("rolesInfo", 1, showPrivileges=True)["roles"]
    made = {r["role"]: r for r in info}
    for part, role in roles.ROLES.items():
        have = {
            p["resource"].get("collection"): set(p["actions"])
            for p in made[role.name]["privileges"]
        }
        assert have == {
            name.replace("{tasks}", "tasks"): set(acts) for name, acts in role.grants.items()
        }, part


def test_a_publisher_publishes_reads_and_cannot_claim_complete_or_drop(secured: Secured) -> None:
    with TaskClient(secured.uri("publisher"), database=DB) as client:
        assert client.publish("add", "pub-1", {"a": 1, "b": 2}).created
        again = client.publish("add", "pub-1", {"a": 1, "b": 2})
        assert not again.created and again.task.key == "pub-1"  # read back, no update needed
        assert client.get("pub-1") is not None
        run = SyncDriver(collections(client.db)).run
        claim = Call(
            "find_one_and_update",
            ({"_id": "pub-1"}, {"$set": {"status": "running"}, "$push": {"runs": {"x": 1}}}),
        )
        forged = Call("update_one", ({"_id": "pub-1"}, {"$set": {"status": "succeeded"}}))
        for call, privilege in ((claim, "find and update"), (forged, "update")):
            with pytest.raises(StorageError) as refused:
                run(_one(call))
            said = str(refused.value)
            assert f"lacks the privilege {privilege}" in said and f"{DB}.tasks" in said, said
            secured.clean(said)
        with pytest.raises(OperationFailure) as dropped:
            client.collection.drop()
        assert dropped.value.code == 13
    with TaskClient(secured.uri("root"), database=DB) as root:
        task = root.get("pub-1")
        assert task is not None and task.status == "pending" and task.runs == []


def _one(call: Call) -> Any:
    return (yield call)


def _scan_file(secured: Secured, path: Path) -> str:
    text = path.read_text(errors="replace")
    secured.clean(text)
    return text


def _worker(
    uri: str, log: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "wb") as sink:
        return spawn_worker(uri, DB, *extra, env=env, stderr=sink, stdout=sink)


def test_a_worker_runs_the_publishers_tasks_under_its_role(
    secured: Secured, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with TaskClient(secured.uri("publisher"), database=DB) as client:
        keys = [f"w-{i}" for i in range(5)]
        client.publish_many({"name": "add", "key": k, "params": {"a": 1, "b": 1}} for k in keys)
        proc = _worker(secured.uri("worker"), log, "--log-level", "INFO")
        try:
            for key in keys:
                done = client.wait(key, timeout=60)
                assert done.status == "succeeded", done
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    text = _scan_file(secured, log)
    assert "Traceback" not in text, text[-3000:]


def test_a_worker_with_a_publishers_role_says_what_it_lacks(
    secured: Secured, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    proc = _worker(secured.uri("publisher"), log, "--startup-timeout", "10")
    code = proc.wait(timeout=120)
    text = _scan_file(secured, log)
    assert code != 0 and "Traceback" not in text, text[-3000:]
    assert "lacks the privilege" in text, text[-3000:]


def test_the_cli_reads_as_a_viewer_and_names_what_an_action_lacks(secured: Secured) -> None:
    with TaskClient(secured.uri("publisher"), database=DB) as client:
        client.publish("add", "cli-1", {"a": 1, "b": 1})
    code, out, err = run_cli("get", "cli-1", "--uri", secured.uri("viewer"), "--database", DB)
    secured.clean(out, err)
    assert code == 0 and "cli-1" in out, err
    code, out, err = run_cli("cancel", "cli-1", "--uri", secured.uri("viewer"), "--database", DB)
    secured.clean(out, err)
    assert code == 1 and "lacks the privilege" in err and "Traceback" not in err, err
    code, out, err = run_cli("cancel", "cli-1", "--uri", secured.uri("operator"), "--database", DB)
    secured.clean(out, err)
    assert code == 0, err
    bad = secured.uri("viewer").replace(secured.passwords["viewer"], "wrong-" + "x" * 8)
    code, out, err = run_cli("stats", "--uri", bad, "--database", DB)
    secured.clean(out, err)
    assert code == 1 and "Authentication failed" in err and "wrong-xxxxxxxx" not in err, err


def test_serve_reads_with_the_viewers_role_and_names_what_an_action_lacks(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    with TaskClient(secured.uri("publisher"), database=DB) as client:
        client.publish("add", "srv-1", {"a": 1, "b": 1})
    with serving(secured.uri("viewer"), DB, token="t0ken") as url:
        auth = {"Authorization": "Bearer t0ken"}
        with httpx.Client(base_url=url, headers=auth, timeout=30) as http:
            assert http.get("/healthz").status_code == 200
            got = http.get("/tasks/srv-1")
            assert got.status_code == 200 and got.json()["status"] == "pending"
            searched = http.get("/tasks", params={"q": "nothing failed"})
            assert searched.status_code == 200, searched.text  # the admin made the text index
            refused = http.post("/tasks/srv-1:cancel")
            assert refused.status_code == 503 and "lacks the privilege" in refused.text
            page = http.get("/", headers={})
            pages = [got.text, refused.text, page.text, http.get("/metrics").text]
    secured.clean(*pages, caplog.text)


def test_serve_acts_and_audits_with_the_operators_role(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    with TaskClient(secured.uri("publisher"), database=DB) as client:
        client.publish("add", "srv-2", {"a": 1, "b": 1})
    tokens = {"op-token": Principal("operator", "otto")}
    with (
        serving(secured.uri("operator"), DB, tokens=tokens) as url,
        httpx.Client(base_url=url, headers={"Authorization": "Bearer op-token"}) as http,
    ):
        assert http.post("/tasks/srv-2:cancel").json()["status"] == "cancelled"
        records = http.get("/audit").json()
        assert [(r["who"], r["action"], r["target"]) for r in records][:1] == [
            ("otto", "cancel", "srv-2")
        ]
        secured.clean(http.get("/ui/audit").text)
    secured.clean(caplog.text)


def test_encrypted_tasks_run_under_the_roles(secured: Secured, tmp_path: Path) -> None:
    """The admin makes the data key; the publisher encrypts with it (``find`` on the vault);
    the worker decrypts with it."""
    master = tmp_path / "master.key"
    master.write_bytes(base64.b64encode(os.urandom(96)))
    keys = Encryption.local(master, secured.uri("admin"), DB)
    try:
        keys.ensure_key()
    finally:
        keys.close()
    sealing = Encryption.local(master, secured.uri("publisher"), DB)
    log = tmp_path / "worker.log"
    with TaskClient(secured.uri("publisher"), database=DB, encryption=sealing) as client:
        client.publish("echo", "enc-1", {"card": "4242"}, encrypt=True)
        proc = _worker(secured.uri("worker"), log, env={KEY_FILE_ENV: str(master)})
        try:
            assert client.wait("enc-1", timeout=60).status == "succeeded"
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        task = client.get("enc-1")
        assert task is not None and task.result["params"] == {"card": "4242"}
    assert "Traceback" not in _scan_file(secured, log)


def test_no_password_in_any_log_line(secured: Secured, caplog: pytest.LogCaptureFixture) -> None:
    """What the other tests saw was scanned as they ran; this one makes the driver say the URI
    back (a wrong scheme, a bad option) and scans that too."""
    for uri in (
        secured.uri("viewer").replace("mongodb://", "mongo://"),
        secured.uri("viewer").replace("127.0.0.1:", "127.0.0.1:x"),
    ):
        with pytest.raises(MtaskError) as refused:
            TaskClient(uri, database=DB)
        secured.clean(str(refused.value))
    secured.clean(caplog.text)
    assert secured.said, "nothing was scanned"
    quoted = urllib.parse.quote(secured.passwords["viewer"])
    assert all(quoted not in text for text in secured.said)
