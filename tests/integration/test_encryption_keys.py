"""Encrypted tasks never burn: a real worker process without the key, with a wrong key, or with
the master key from before a rotation gives an encrypted task back (RELEASED, no retry spent,
why kept on the run and said by ``explain`` and ``mtask get``; its log says it once per name),
its handler never sees ciphertext, and a worker holding the key then runs it. Across a rotation
an old-key worker and a new-key worker together finish every task."""

from __future__ import annotations

import base64
import datetime as dt
import html
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import bson
import httpx
import pytest
from bson.binary import Binary
from harness import poll, run_cli, running_worker, wait_for, worker_process
from pymongo import MongoClient
from webserver import serving

from mtask import TaskClient
from mtask.registry import Registry
from mtask.security.encryption import (
    KEY_FILE_ENV,
    KEY_VAULT,
    UNOPENED,
    Encryption,
    is_ciphertext,
    rotate_local,
)
from mtask.store.claims import claim_filter, claim_lean_filter, unopened_by
from mtask.web.auth import Keys

SECRET = "4242 4242 4242 4242"
LIMIT = 60.0
"""How long a wait may take at most before the test fails (a hang, not a measurement)."""


def key_file(path: Path, key: bytes | None = None) -> Path:
    path.write_bytes(base64.b64encode(key or os.urandom(96)))
    return path


@contextmanager
def worker(uri: str, db: str, log: Path, key: Path | None) -> Iterator[subprocess.Popen[Any]]:
    """A worker process holding ``key`` (``None``: no key), logging to ``log``."""
    env = {} if key is None else {KEY_FILE_ENV: str(key)}
    with (
        log.open("ab") as out,
        worker_process(
            uri, db, "--log-level", "INFO", env=env, stdout=out, stderr=subprocess.STDOUT
        ) as proc,
    ):
        yield proc


@pytest.fixture(autouse=True)
def _no_key_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """No worker inherits a key from the test's environment."""
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)


def released(doc: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The runs of ``doc`` given back because their worker could not decrypt it."""
    runs = (doc or {}).get("runs") or []
    return [
        r for r in runs if r["state"] == "RELEASED" and (r.get("error") or "").startswith(UNOPENED)
    ]


def met(tasks: Any, key: str) -> bool:
    """Whether a worker has met the task: given it back, or burnt it (a failure spent, the
    handler run on ciphertext), so the test fails at once on what happened."""
    doc = tasks.find_one({"_id": key}) or {}
    burnt = doc.get("failures") or doc.get("status") in ("succeeded", "failed")
    return bool(released(doc) or burnt)


def assert_not_burnt(doc: dict[str, Any] | None) -> None:
    """No retry spent, no failure, nothing the handler did: the task is still open."""
    assert doc is not None
    assert doc["status"] in ("pending", "running"), doc["status"]
    assert not doc.get("failures"), doc
    assert not doc.get("error"), doc.get("error")
    assert all(r["state"] in ("RELEASED", "RUNNING") for r in doc["runs"]), doc["runs"]
    assert doc.get("result") is None


@pytest.mark.parametrize("held", ["no key", "a wrong key"])
def test_a_worker_that_cannot_decrypt_gives_the_task_back_and_one_with_the_key_runs_it(
    held: str,
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
    tmp_path: Path,
) -> None:
    master = key_file(tmp_path / "master.key")
    wrong = None if held == "no key" else key_file(tmp_path / "wrong.key")
    encryption = Encryption.local(master, mongo_uri, db_name)
    encryption.ensure_key()
    tasks = mongo[db_name].tasks
    log = tmp_path / "keyless.log"
    with TaskClient(mongo_uri, database=db_name, encryption=encryption) as client:
        client.publish("echo", "secret", {"card": SECRET}, encrypt=True)
        client.publish("echo", "plain", {"card": "none"})
        with worker(mongo_uri, db_name, log, wrong):
            assert client.wait("plain", timeout=LIMIT).status == "succeeded"  # it works
            poll(lambda: met(tasks, "secret"), LIMIT, "met")
            assert_not_burnt(tasks.find_one({"_id": "secret"}))
            client.publish("echo", "secret-2", {"card": SECRET}, encrypt=True)
            poll(lambda: met(tasks, "secret-2"), LIMIT, "met")
            client.publish("echo", "plain-2", {"card": "none"})  # claimed after both
            assert client.wait("plain-2", timeout=LIMIT).status == "succeeded"
            for key in ("secret", "secret-2"):  # given back once each, never claimed again
                doc = tasks.find_one({"_id": key})
                assert_not_burnt(doc)
                assert doc is not None and len(doc["runs"]) == 1, doc["runs"]
            why = released(tasks.find_one({"_id": "secret"}))[-1]["error"]
            expected = "no encryption key" if wrong is None else "cannot open its data key"
            assert expected in why, why
            task = client.get("secret")  # the reason, while its only worker cannot decrypt it
            assert task is not None
            explained = client.explain(task)
            assert (explained.state, explained.why) == ("blocked", "no_key"), explained
            assert UNOPENED in explained.reason and expected in explained.reason, explained
            assert "no retry spent" in explained.reason, explained
            code, out, err = run_cli("get", "secret", "--database", db_name, "--uri", mongo_uri)
            assert code == 0 and "no key" in out and UNOPENED in out, (out, err)
            assert SECRET not in out
            with serving(mongo_uri, db_name, token="t0k") as url, httpx.Client(base_url=url) as web:
                got = web.get("/tasks/secret", headers={"Authorization": "Bearer t0k"}).json()
                assert (got["state"], got["why"]) == ("blocked", "no_key"), got
                assert UNOPENED in got["reason"] and got["params"] == "encrypted", got
                web.cookies.set("mtask_session", Keys.of("t0k").new_session())
                page = web.get("/ui/tasks/secret").text
                assert UNOPENED in html.unescape(page) and SECRET not in page
        said = log.read_text(errors="replace")
        assert said.count("cannot decrypt the params of `echo` tasks") == 1, said  # once
        with worker(mongo_uri, db_name, tmp_path / "keyed.log", master):
            for key in ("secret", "secret-2"):
                assert client.wait(key, timeout=LIMIT).status == "succeeded"
        for key in ("secret", "secret-2"):
            done = client.get(key)  # read with the key: decrypted
            assert done is not None
            assert done.result["params"] == {"card": SECRET}  # what its handler was given
            stored = tasks.find_one({"_id": key})
            assert stored is not None and is_ciphertext(stored["result"])
            assert not stored.get("failures")


def test_across_a_rotation_old_and_new_key_workers_finish_every_task(
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
    tmp_path: Path,
) -> None:
    old, new = os.urandom(96), os.urandom(96)
    old_file, new_file = key_file(tmp_path / "old.key", old), key_file(tmp_path / "new.key", new)
    vault = f"{db_name}.{KEY_VAULT}"
    before = Encryption.local(old_file, mongo_uri, db_name)
    before.ensure_key()
    tasks = mongo[db_name].tasks
    with TaskClient(mongo_uri, database=db_name, encryption=before) as client:
        for i in range(3):
            client.publish("echo", f"before-{i}", {"card": SECRET, "i": i}, encrypt=True)
    assert rotate_local(mongo, old, new, vault) == 1
    after = Encryption.local(new_file, mongo_uri, db_name)
    keys = [f"before-{i}" for i in range(3)] + [f"after-{i}" for i in range(3)]
    with TaskClient(mongo_uri, database=db_name, encryption=after) as client:
        with worker(mongo_uri, db_name, tmp_path / "old.log", old_file):
            for i in range(3):
                client.publish("echo", f"after-{i}", {"card": SECRET, "i": i}, encrypt=True)
            # the old-key worker meets every task first, and burns none of them
            for key in keys:
                poll(lambda k=key: met(tasks, k), LIMIT, "met")
                assert released(tasks.find_one({"_id": key})), key
            for key in keys:
                assert_not_burnt(tasks.find_one({"_id": key}))
            with worker(mongo_uri, db_name, tmp_path / "new.log", new_file):
                for key in keys:
                    client.wait(key, timeout=LIMIT)
        for key in keys:
            i = int(key.rsplit("-", 1)[1])
            task = client.get(key)  # read with the new key: decrypted
            assert task is not None and task.status == "succeeded", (key, task)
            assert task.result["params"] == {"card": SECRET, "i": i}, key
            doc = tasks.find_one({"_id": key})
            assert doc is not None and not doc.get("failures"), doc


def test_a_claim_skips_only_the_encrypted_tasks_its_worker_gave_back(
    mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    """``store.unopened_by`` on the real server: a worker that met a task it cannot decrypt
    skips the encrypted tasks it gave back, and nothing else (a plain task, an encrypted one it
    never met, one another worker gave back); a worker that never met one adds nothing."""
    now = dt.datetime.now(dt.UTC)
    sealed = {"__mtask_encrypted__": Binary(b"\x02" + os.urandom(40), 6)}

    def given_back(by: str) -> dict[str, Any]:
        error = f"{UNOPENED} `{by}`: this worker has no encryption key"
        return {"worker_id": by, "state": "RELEASED", "error": error, "run_id": f"r-{by}"}

    tasks = mongo[db_name].tasks
    tasks.insert_many(
        [
            {"_id": "plain", "params": {"a": 1}, "runs": [given_back("w1")]},
            {"_id": "met", "params": sealed, "runs": [given_back("w1")]},
            {"_id": "unmet", "params": sealed, "runs": []},
            {"_id": "theirs", "params": sealed, "runs": [given_back("w2")]},
        ]
    )
    keys = ["plain", "met", "unmet", "theirs"]
    skipping = unopened_by("w1")
    assert {d["_id"] for d in tasks.find({"_id": {"$in": keys}, **skipping})} == {
        "plain",
        "unmet",
        "theirs",
    }
    plain = claim_filter(keys, ["echo"], "w1", now)
    assert "$nor" not in plain and plain == {
        k: v for k, v in claim_filter(keys, ["echo"], "w1", now, True).items() if k != "$nor"
    }
    assert "$nor" not in claim_lean_filter(keys, ["echo"], "w1", now)
    assert claim_lean_filter(keys, ["echo"], "w1", now, True)["$nor"] == skipping["$nor"]


async def test_in_one_process_a_keyless_worker_gives_back_and_a_keyed_one_seals_the_result(
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same promises as above, fast (workers in the test's loop, the handler seen): a
    worker without the key never hands the ciphertext to its handler, and gives the task back;
    one with the key hands it the plain params and stores the result encrypted."""
    master = key_file(tmp_path / "master.key")
    encryption = Encryption.local(master, mongo_uri, db_name)
    encryption.ensure_key()
    tasks = mongo[db_name].tasks
    seen: list[Any] = []
    registry = Registry()

    @registry.task("echo")
    async def echo(params: Any) -> Any:
        seen.append(params)
        return {"params": params}

    with TaskClient(mongo_uri, database=db_name, encryption=encryption) as client:
        client.publish("echo", "secret", {"card": SECRET}, encrypt=True)
        async with running_worker(registry, mongo_uri, db_name):  # no key
            await wait_for(lambda: met(tasks, "secret"), LIMIT)
        assert seen == []  # the handler never saw the ciphertext
        assert_not_burnt(tasks.find_one({"_id": "secret"}))
        assert len(released(tasks.find_one({"_id": "secret"}))) == 1
        monkeypatch.setenv(KEY_FILE_ENV, str(master))
        async with running_worker(registry, mongo_uri, db_name):
            await wait_for(lambda: tasks.find_one({"_id": "secret", "status": "succeeded"}), LIMIT)
        assert seen == [{"card": SECRET}]  # plain, for the handler only
        stored = tasks.find_one({"_id": "secret"})
        assert stored is not None and is_ciphertext(stored["result"])
        assert SECRET.encode() not in bson.encode(stored)
        done = client.get("secret")  # the holder of the key reads it plain
        assert done is not None and done.result == {"params": {"card": SECRET}}
