"""Encrypted params and results, on the real server with libmongocrypt: a raw find
shows ciphertext, a real worker process holding the key gives its handler the plain params and
stores its result encrypted; readers without the key (the client, ``mtask get``, REST, the
dashboard) show ``encrypted``; a task that does not ask is stored as before; rotating the master
key keeps old tasks readable."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import bson
import httpx
import pytest
from harness import run_cli, worker_process
from pymongo import MongoClient
from webserver import serving

from mtask import TaskClient
from mtask.errors import InvalidTask
from mtask.security.encryption import (
    KEY_FILE_ENV,
    KEY_VAULT,
    MARK,
    Encryption,
    is_ciphertext,
    rotate_local,
    sealed,
)

SECRET = "4242 4242 4242 4242"


def key_file(path: Path) -> Path:
    path.write_bytes(base64.b64encode(os.urandom(96)))
    return path


def test_an_encrypted_task_runs_and_reads_as_encrypted_without_the_key(
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    master = key_file(tmp_path / "master.key")
    encryption = Encryption.local(master, mongo_uri, db_name, names={"echo_named"})
    encryption.ensure_key()
    with TaskClient(mongo_uri, database=db_name, encryption=encryption) as publisher:
        publisher.publish("echo", "secret", {"card": SECRET}, encrypt=True)
        publisher.publish("echo", "plain", {"card": "none"})
        tasks = mongo[db_name].tasks
        stored = tasks.find_one({"_id": "secret"})
        assert stored is not None and sealed(stored["params"])
        assert SECRET.encode() not in bson.encode(stored)
        assert tasks.find_one({"_id": "plain"})["params"] == {"card": "none"}  # type: ignore[index]
        monkeypatch.setenv(KEY_FILE_ENV, str(master))
        with worker_process(mongo_uri, db_name, "--concurrency", "2"):
            for key in ("secret", "plain"):
                assert publisher.wait(key, timeout=60).status == "succeeded"
        done = tasks.find_one({"_id": "secret"})
        assert done is not None and is_ciphertext(done["result"])
        assert SECRET.encode() not in bson.encode(done)
        opened = publisher.get("secret")  # the holder of the key reads it plain
        assert opened is not None and opened.params == {"card": SECRET}
        assert opened.result["params"] == {"card": SECRET}  # what the handler was given
        assert tasks.find_one({"_id": "plain"})["result"]["params"] == {"card": "none"}  # type: ignore[index]
    monkeypatch.delenv(KEY_FILE_ENV)
    with TaskClient(mongo_uri, database=db_name) as reader:
        task = reader.get("secret")
        assert task is not None and sealed(task.params) and sealed(task.result)
        with pytest.raises(InvalidTask, match="no encryption"):
            reader.publish("echo", "x", {"a": 1}, encrypt=True)
    code, out, err = run_cli("get", "secret", "--database", db_name, "--uri", mongo_uri)
    assert code == 0 and '"encrypted"' in out and SECRET not in out, err
    monkeypatch.setenv(KEY_FILE_ENV, str(master))
    code, out, err = run_cli("get", "secret", "--database", db_name, "--uri", mongo_uri)
    assert code == 0 and SECRET in out, err
    monkeypatch.delenv(KEY_FILE_ENV)
    with serving(mongo_uri, db_name, token="t0k") as url, httpx.Client(base_url=url) as http:
        auth = {"Authorization": "Bearer t0k"}
        got = http.get("/tasks/secret", headers=auth).json()
        assert got["params"] == "encrypted" and got["result"] == "encrypted"
        http.cookies.set(
            "mtask_session", __import__("mtask.web.auth").web.auth.Keys.of("t0k").new_session()
        )
        page = http.get("/ui/tasks/secret").text
        assert "encrypted" in page and SECRET not in page


def test_a_named_task_is_encrypted_and_rotation_keeps_old_tasks_readable(
    mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]], tmp_path: Path
) -> None:
    old, new = os.urandom(96), os.urandom(96)
    vault = f"{db_name}.{KEY_VAULT}"
    before = Encryption(mongo, {"local": {"key": old}}, key_vault=vault, names={"charge"})
    before.ensure_key()
    with TaskClient(mongo_uri, database=db_name, encryption=before) as client:
        client.publish("charge", "old-1", {"card": SECRET})  # the name asks for it
        client.publish_many([{"name": "charge", "key": "old-2", "params": {"card": SECRET}}])
    for key in ("old-1", "old-2"):
        assert sealed(mongo[db_name].tasks.find_one({"_id": key})["params"])  # type: ignore[index]
    assert rotate_local(mongo, old, new, vault) == 1
    new_file = tmp_path / "new.key"
    new_file.write_bytes(base64.b64encode(new))
    after = Encryption.local(
        new_file, mongo_uri, db_name
    )  # as workers read MTASK_ENCRYPTION_KEY_FILE
    with TaskClient(mongo_uri, database=db_name, encryption=after) as client:
        for key in ("old-1", "old-2"):
            task = client.get(key)
            assert task is not None and task.params == {"card": SECRET}
    stale = Encryption(mongo, {"local": {"key": old}}, key_vault=vault)
    with (
        TaskClient(mongo_uri, database=db_name, encryption=stale) as client,
        pytest.raises(Exception, match="(?i)decrypt|hmac|kms|key"),
    ):
        client.get("old-1")  # the old master key no longer opens the data key


def test_the_command_line_makes_the_data_key_and_rotates_it(
    mongo_uri: str, db_name: str, tmp_path: Path
) -> None:
    old, new = key_file(tmp_path / "old.key"), key_file(tmp_path / "new.key")
    common = ["--uri", mongo_uri, "--database", db_name, "--json"]
    made = [run_cli("collection", "key", "--key-file", str(old), *common) for _ in range(2)]
    assert [code for code, _, _ in made] == [0, 0], made
    ids = {json.loads(out)["key"] for _, out, _ in made}
    assert len(ids) == 1  # made once, found the second time
    with TaskClient(
        mongo_uri, database=db_name, encryption=Encryption.local(old, mongo_uri, db_name)
    ) as c:
        c.publish("echo", "kept", {"card": SECRET}, encrypt=True)
    code, out, err = run_cli(
        "collection", "key", "--key-file", str(old), "--rotate-to", str(new), *common
    )
    assert code == 0 and json.loads(out)["rotated"] == 1, err
    with TaskClient(
        mongo_uri, database=db_name, encryption=Encryption.local(new, mongo_uri, db_name)
    ) as c:
        task = c.get("kept")
        assert task is not None and task.params == {"card": SECRET}
    code, out, err = run_cli("collection", "key", "--key-file", str(tmp_path / "none"), *common)
    assert code != 0 and "cannot read the encryption key file" in err and "Traceback" not in err


def test_an_encrypted_task_that_continues_as_new_keeps_its_params_encrypted(
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The new params of an encrypted task's ``ctx.continue_as_new`` are stored encrypted, as a
    publish stores them; the next journal's handler is given them plain."""
    master = key_file(tmp_path / "master.key")
    encryption = Encryption.local(master, mongo_uri, db_name)
    encryption.ensure_key()
    with TaskClient(mongo_uri, database=db_name, encryption=encryption) as publisher:
        publisher.publish("rounds", "r", {"card": SECRET, "round": 0, "until": 2}, encrypt=True)
        monkeypatch.setenv(KEY_FILE_ENV, str(master))
        with worker_process(mongo_uri, db_name):
            assert publisher.wait("r", timeout=60).status == "succeeded"
        raw = mongo[db_name].tasks.find_one({"_id": "r"})
        assert raw is not None and raw["continued"]["n"] == 2
        assert list(raw["params"]) == [MARK] and sealed(raw["params"])  # a publish's shape
        assert is_ciphertext(raw["result"])
        assert SECRET.encode() not in bson.encode(raw)
        opened = publisher.get("r")
        assert opened is not None and opened.params == {"card": SECRET, "round": 2, "until": 2}
        assert opened.result == opened.params
