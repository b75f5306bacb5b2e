"""The embedded mongod: start, attach, status, stop, restart on the same data."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
from pymongo import MongoClient

from mtask.cli import main as cli_main
from mtask.embedded import EmbeddedMongo, find_mongod, free_port
from mtask.errors import ConfigError, EmbeddedUnavailable, MtaskError


@pytest.fixture
def mongod_available() -> None:
    try:
        find_mongod()
    except MtaskError as exc:
        pytest.skip(str(exc))


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
