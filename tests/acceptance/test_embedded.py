"""The embedded mongod: start, attach, status, stop, restart on the same data."""

from __future__ import annotations

from pathlib import Path

import pytest
from pymongo import MongoClient

from mtask.embedded import EmbeddedMongo, find_mongod
from mtask.errors import EmbeddedUnavailable, MtaskError


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
