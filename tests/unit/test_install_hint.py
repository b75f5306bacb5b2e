"""The hint of a missing extra is right for the way mtask was installed: a clone's editable
install (no index has a distribution of it), a local directory or wheel, a VCS URL, the index."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest

import mtask
from mtask.cli import common


class Dist:
    def __init__(self, record: dict[str, Any] | None) -> None:
        self.record = record

    def read_text(self, name: str) -> str | None:
        assert name == "direct_url.json"
        return None if self.record is None else json.dumps(self.record)


def installed(monkeypatch: pytest.MonkeyPatch, where: Path, record: dict[str, Any] | None) -> str:
    (where / "mtask").mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(mtask, "__file__", str(where / "mtask" / "__init__.py"))
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Dist(record))
    return common.installed_from("server")


def test_a_clone_installed_editable_says_pip_install_e_the_clone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'mtask'\n")
    editable = {"url": tmp_path.as_uri(), "dir_info": {"editable": True}}
    monkeypatch.chdir(tmp_path)
    assert installed(monkeypatch, tmp_path, editable) == "-e '.[server]'"
    monkeypatch.chdir("/")
    assert installed(monkeypatch, tmp_path, editable) == f"-e '{tmp_path}[server]'"
    assert installed(monkeypatch, tmp_path, None) == f"-e '{tmp_path}[server]'"  # on PYTHONPATH


def test_a_wheel_from_the_index_a_file_or_a_repository(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    site = tmp_path / "site-packages"  # no pyproject.toml beside the package
    assert installed(monkeypatch, site, None) == "'mtask[server]'"
    wheel = tmp_path / "dist" / "mtask-1.0-py3-none-any.whl"
    archive = {"url": wheel.as_uri(), "archive_info": {}}
    assert installed(monkeypatch, site, archive) == f"'{wheel}[server]'"
    git = {"url": "https://example.com/mtask.git", "vcs_info": {"vcs": "git", "commit_id": "a"}}
    assert (
        installed(monkeypatch, site, git) == "'mtask[server] @ git+https://example.com/mtask.git'"
    )


def test_the_hint_uses_this_interpreters_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert common.install_command("cli").split(" install ")[0].endswith(" -m pip")
    message = str(common.missing_extra("mtask serve", "fastapi"))
    assert "needs the 'server' extra (fastapi is not installed)" in message
    assert message.endswith(common.install_command("server"))
