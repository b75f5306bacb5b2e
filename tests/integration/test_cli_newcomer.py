"""A newcomer's dead ends, each closed where it starts: ``mtask pause``/``resume`` run, a
dependency no task has is named at publish and in the why (or refused), a publish says why its
task will not run yet (no live worker handles its name), one vocabulary of derived states."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness import run_cli

from mtask import TaskClient


def test_pause_and_resume_a_name(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    code, out, err = run_cli("pause", "newsletter", *common)
    assert (code, err) == (0, "") and out.startswith("paused: newsletter"), out + err
    assert client.paused() == {"newsletter"}
    client.publish("newsletter", "nl-1")
    code, out, _ = run_cli("get", "nl-1", *common)
    assert "blocked · paused" in out and "mtask resume newsletter" in " ".join(out.split())
    code, out, err = run_cli("resume", "newsletter", *common)
    assert (code, err) == (0, "") and out.startswith("resumed: newsletter")
    assert client.paused() == set()


def test_a_dependency_no_task_has_is_named(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    code, out, err = run_cli("publish", "invoice", "inv-1", "--depends-on", "no-such-key", *common)
    assert code == 0, err
    assert "warning: --depends-on no-such-key: no task has that key" in " ".join(err.split())
    flat = " ".join(out.split())
    assert "created: inv-1 (invoice, waiting · dependencies)" in flat, out
    assert "`no-such-key` does not exist" in flat, out
    code, out, _ = run_cli("get", "inv-1", *common)
    assert "`no-such-key` does not exist" in " ".join(out.split()), out
    said = client.explain(client.get("inv-1"))  # type: ignore[arg-type]
    assert said.why == "dependencies" and "does not exist" in said.reason
    assert client.publish("x", "x-1", depends_on=["no-such-key", "inv-1"]).missing_dependencies == [
        "no-such-key"
    ]
    code, out, err = run_cli(
        "publish", "invoice", "inv-2", "--depends-on", "no-such-key", "--require-dependencies",
        *common,
    )  # fmt: skip
    assert code == 2 and "no task has that key (nothing was published" in err, err
    assert client.get("inv-2") is None
    code, out, err = run_cli(
        "publish", "invoice", "inv-3", "--depends-on", "inv-1", "--require-dependencies", *common
    )
    assert (code, err) == (0, ""), err  # inv-1 exists
    client.publish("invoice", "no-such-key")  # published late: the why no longer says so
    said = client.explain(client.get("inv-1"))  # type: ignore[arg-type]
    assert said.why == "dependencies" and "does not exist" not in said.reason


def test_a_publish_says_no_live_worker_handles_its_name(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    common = ("--uri", mongo_uri, "--database", db_name)
    code, out, err = run_cli("publish", "resize_image", "img-1", *common)
    assert (code, err) == (0, "")
    flat = " ".join(out.split())
    assert "created: img-1 (resize_image, blocked · no worker)" in flat, out
    assert "why: no live worker handles `resize_image`" in flat, out
    code, out, _ = run_cli("publish", "resize_image", "img-1", "--json", *common)
    assert json.loads(out)["missing_dependencies"] == []


def test_recovering_a_wait_reads_in_order(client: TaskClient) -> None:
    """A signal to a failed task is refused with the order that works (retry first); a reset
    says what it removed in whole sentences and what comes next; a failed dependent says its
    dependency did not succeed, not that it still waits on it."""
    import pytest

    from mtask.cli.render import _flow_rows
    from mtask.cli.step import reset_said
    from mtask.errors import InvalidTransition
    from mtask.models import Task
    from mtask.store.steps import Reset

    client.publish("approve", "approve-42", delay=3600)
    client.cancel("approve-42")
    with pytest.raises(InvalidTransition) as refused:
        client.signal("approve-42", "approved", {"by": "ann"})
    assert "retry it first, `mtask retry approve-42`" in str(refused.value)
    failed = Reset("approve-42", "wait:approved", 0, ["wait:approved"], 1, False, "failed")
    assert reset_said(failed) == (
        "reset: approve-42: removed 1 step (wait:approved) and the 1 signal its waits had "
        "taken: each wait takes the next one sent. It is failed: `mtask retry approve-42` runs "
        "it again from wait:approved; a signal sent before that is refused."
    )
    dependent = Task.from_document(
        {"_id": "invoice-42", "status": "failed", "depends_on": ["approve-42"],
         "waiting_on": ["approve-42"]}
    )  # fmt: skip
    assert ("depends on", "approve-42 (approve-42 did not succeed)") in _flow_rows(dependent)


def test_a_reset_of_no_task_says_so_once(mongo_uri: str, db_name: str) -> None:
    code, _, err = run_cli("step", "reset", "no-such-key", "charge", "--uri", mongo_uri,
                           "--database", db_name)  # fmt: skip
    assert (code, err.strip()) == (1, "mtask: no task with key 'no-such-key'"), err


def test_rest_names_an_unknown_field_and_an_unknown_action(mongo_uri: str, db_name: str) -> None:
    from fastapi.testclient import TestClient

    from mtask.web import create_app

    auth = {"Authorization": "Bearer t"}
    with TestClient(create_app(mongo_uri, database=db_name, token="t")) as api:
        bad = api.post("/tasks", json={"name": "n", "key": "k", "parms": {}}, headers=auth)
        assert bad.status_code == 422
        [error] = bad.json()["detail"]
        assert error["msg"] == "unknown field 'parms': did you mean 'params'?", error
        api.post("/tasks", json={"name": "n", "key": "k"}, headers=auth)
        frob = api.post("/tasks/k:frob", json={}, headers=auth)
        assert frob.status_code == 404, frob.text
        assert frob.json()["detail"].startswith("unknown action :frob: POST /tasks/KEY:ACTION")
        assert api.post("/tasks/k:cancel", headers=auth).status_code == 200


def test_a_piped_get_is_not_wrapped_at_80_columns(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """In a pipe (no terminal, no ``$COLUMNS``) a line is as wide as a wide terminal's: a long
    key and its why read, and grep, whole."""
    key = "fulfil:o-1002:2b447c2bb89c9f4129ab/" + "mail-" * 12
    client.publish("invoice", key, depends_on=["no-such-key"])
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-m", "mtask", "get", key, "--uri", mongo_uri, "--database", db_name],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == key, lines[:3]
    why = next(line for line in lines if line.startswith("why"))
    assert "`no-such-key` does not exist: no task has that key, so it" in why, done.stdout
