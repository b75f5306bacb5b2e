"""The embedded mongod: start, attach, status, stop, restart on the same data."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
from needs import missing
from pymongo import MongoClient

from mtask import TaskClient
from mtask.cli import main as cli_main
from mtask.embedded import EmbeddedMongo, find_mongod, free_port, remember
from mtask.errors import ConfigError, EmbeddedUnavailable, MtaskError


@pytest.fixture
def mongod_available() -> None:
    try:
        find_mongod()
    except MtaskError as exc:
        missing(str(exc))


@pytest.mark.slow
@pytest.mark.usefixtures("mongod_available")
def test_start_attach_stop_restart(tmp_path: Path) -> None:
    server = EmbeddedMongo(tmp_path)
    uri = server.start()
    try:
        assert EmbeddedMongo(tmp_path).start() == uri  # a second process attaches
        status = server.status()
        assert status.running and status.uri == uri and status.pid
        with MongoClient(uri) as c:
            assert c.admin.command("hello")["isWritablePrimary"]
            c.keep.items.insert_one({"_id": 1})
    finally:
        assert server.stop()
    assert not server.status().running
    assert not server.stop()
    uri2 = server.start()  # persistent data, replica set still valid
    try:
        with MongoClient(uri2) as c:
            assert c.keep.items.find_one({"_id": 1}) == {"_id": 1}
    finally:
        server.stop()


def test_missing_binary_gives_the_alternatives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTASK_MONGOD", str(tmp_path / "no-such-mongod"))
    with pytest.raises(EmbeddedUnavailable) as info:
        EmbeddedMongo(tmp_path).start()
    assert "MTASK_MONGOD=" in str(info.value)
    assert "MTASK_MONGODB_URI" in EmbeddedUnavailable.default_message
    assert "docker compose" in EmbeddedUnavailable.default_message


def test_binary_that_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "mongod"
    fake.write_text("#!/bin/sh\necho 'cannot execute: wrong architecture' >&2\nexit 126\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MTASK_MONGOD", str(fake))
    with pytest.raises(EmbeddedUnavailable, match="wrong architecture") as info:
        EmbeddedMongo(tmp_path / "data").start(timeout=10)
    assert "--uri" in str(info.value)


def test_a_state_file_naming_another_process_is_no_running_mongod(tmp_path: Path) -> None:
    """After a reboot or a container restart (or a mongod killed whose zombie nobody reaped)
    the state file's pid may be another process: it is not the data directory's mongod (none
    holds the lock of its dbpath), so ``status`` says not running and ``stop`` kills nothing.
    Before, ``stop`` sent that process SIGTERM and ``start`` waited for it to become primary
    until its timeout, every time."""
    other = subprocess.Popen(["sleep", "600"])
    try:
        (tmp_path / "db").mkdir()
        (tmp_path / "mtask-mongod.json").write_text(
            json.dumps({"pid": other.pid, "port": free_port(), "running": True})
        )
        server = EmbeddedMongo(tmp_path)
        assert not server.status().running
        assert not server.stop()
        assert other.poll() is None  # not killed
    finally:
        other.kill()
        other.wait()


@pytest.mark.slow
@pytest.mark.usefixtures("mongod_available")
def test_start_after_a_state_file_naming_another_process(tmp_path: Path) -> None:
    other = subprocess.Popen(["sleep", "600"])
    server = EmbeddedMongo(tmp_path)
    try:
        (tmp_path / "mtask-mongod.json").write_text(
            json.dumps({"pid": other.pid, "port": free_port(), "running": True})
        )
        uri = server.start(timeout=20)  # before: StorageError, not primary in time
        with MongoClient(uri) as c:
            assert c.admin.command("hello")["isWritablePrimary"]
    finally:
        server.stop()
        other.kill()
        other.wait()


@pytest.mark.usefixtures("mongod_available")
def test_a_busy_port_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A port another process listens on: the error says so (before: "cannot run on this
    machine", the message for a missing or foreign binary), and the CLI exits 2."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} is in use"):
            EmbeddedMongo(tmp_path, port=port).start(timeout=20)
        args = ["mongod", "start", "--port", str(port), "--data-dir", str(tmp_path)]
        assert cli_main(args) == 2
        assert f"port {port} is in use" in capsys.readouterr().err
    assert not EmbeddedMongo(tmp_path).status().running


def test_a_remembered_data_dir_is_the_default_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$MTASK_DATA_DIR``, else what ``remember`` left in ``./.mtask/data-dir``, else
    ``./.mtask/mongodb``; remembering the default itself removes the file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MTASK_DATA_DIR", raising=False)
    assert EmbeddedMongo().data_dir == tmp_path / ".mtask" / "mongodb"
    assert remember(tmp_path / "x") == Path(".mtask") / "data-dir"
    assert EmbeddedMongo().data_dir == tmp_path / "x"
    monkeypatch.setenv("MTASK_DATA_DIR", str(tmp_path / "y"))
    assert EmbeddedMongo().data_dir == tmp_path / "y"
    monkeypatch.delenv("MTASK_DATA_DIR")
    assert remember(Path(".mtask/mongodb")) is None
    assert not (tmp_path / ".mtask" / "data-dir").exists()
    assert EmbeddedMongo().data_dir == tmp_path / ".mtask" / "mongodb"


@pytest.mark.slow
@pytest.mark.usefixtures("mongod_available")
def test_the_server_a_data_dir_started_is_the_one_later_commands_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``mtask mongod start --data-dir X`` then ``mtask stats`` started a second, empty server
    in ``./.mtask`` without a word, and ``mtask mongod status`` said "not running" while X's
    ran. Now ``start`` remembers X for the commands run from this directory, and a
    command that has to start the server says so on stderr."""
    monkeypatch.delenv("MTASK_MONGODB_URI", raising=False)
    monkeypatch.delenv("MTASK_DATA_DIR", raising=False)
    project, data = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    monkeypatch.chdir(project)
    assert cli_main(["mongod", "start", "--data-dir", str(data)]) == 0
    started = capsys.readouterr()
    try:
        assert f"runs in {data}; remembered in .mtask/data-dir" in started.err
        with TaskClient(started.out.strip()) as tasks:
            tasks.publish("n", "k")
        assert cli_main(["stats", "--json"]) == 0
        shown = capsys.readouterr()
        assert (json.loads(shown.out), shown.err) == ({"n": {"blocked": 1}}, "")  # no worker
        assert cli_main(["mongod", "status"]) == 0
        assert f"running: pid {EmbeddedMongo(data).status().pid}" in capsys.readouterr().out
        assert cli_main(["mongod", "stop"]) == 0
        assert capsys.readouterr().out == "stopped\n"
        assert cli_main(["mongod", "status"]) == 3
        assert capsys.readouterr().out == f"not running (data in {data})\n"
        assert cli_main(["get", "k", "--json"]) == 0  # starts it again, and says so
        again = capsys.readouterr()
        assert json.loads(again.out)["status"] == "pending"
        assert again.err.startswith(f"mtask: started the embedded MongoDB in {data} (mongodb://")
        assert again.err.rstrip().endswith("`mtask mongod stop` stops it")
        assert not (project / ".mtask" / "mongodb").exists()  # no second server
    finally:
        EmbeddedMongo(data).stop()


@pytest.mark.slow
@pytest.mark.usefixtures("mongod_available")
def test_of_two_starting_at_once_one_started_it(tmp_path: Path) -> None:
    """A worker and a command started together (the quickstart's ``mtask-worker &`` and
    ``mtask publish``) both said "started the embedded MongoDB": each had seen it not running
    before taking the lock. ``launch`` decides under the lock."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: EmbeddedMongo(tmp_path).launch(), range(2)))
    try:
        assert sorted(started for _, started in results) == [False, True]
        assert results[0][0] == results[1][0]
    finally:
        EmbeddedMongo(tmp_path).stop()
