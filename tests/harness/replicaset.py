"""MongoDB servers of a test's own: a replica set of real mongod processes (started from the
embedded mongod binary) to kill, restart, step down, fail-point or cut off."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pymongo import MongoClient
from pymongo.errors import PyMongoError

from mtask.embedded import find_mongod, free_port

from .processes import Cluster


class ReplicaSet:
    """A three-member replica set started from the embedded mongod binary."""

    NAME = "chaos"

    def __init__(
        self,
        root: Path,
        members: int = 3,
        test_commands: bool = False,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.root = root
        self.ports = [free_port() for _ in range(members)]
        self.pids: dict[int, int] = {}
        self.test_commands = test_commands
        """Start the members with ``enableTestCommands`` (fail points: ``fail_point``)."""
        self.settings = {"electionTimeoutMillis": 2000, **(settings or {})}
        """The replica set configuration's ``settings``."""

    @property
    def uri(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"mongodb://{hosts}/?replicaSet={self.NAME}"

    def start(self) -> str:
        for port in self.ports:
            self._launch(port)
        first = self.direct(self.ports[0])
        members = [{"_id": i, "host": f"127.0.0.1:{p}"} for i, p in enumerate(self.ports)]
        first.admin.command(
            "replSetInitiate",
            {"_id": self.NAME, "members": members, "settings": self.settings},
        )
        first.close()
        self.wait_primary()
        return self.uri

    def _launch(self, port: int) -> None:
        """Start (or start again) the member on ``port`` with its data directory."""
        path = self.dbpath(port)
        path.mkdir(parents=True, exist_ok=True)
        pid_file = path / "mongod.pid"
        subprocess.run(
            [
                str(find_mongod()), "--replSet", self.NAME, "--dbpath", str(path),
                "--port", str(port), "--bind_ip", "127.0.0.1",
                "--wiredTigerCacheSizeGB", "0.25",
                "--setParameter", "diagnosticDataCollectionEnabled=false",
                *(["--setParameter", "enableTestCommands=1"] if self.test_commands else []),
                "--logpath", str(path / "mongod.log"), "--logappend", "--fork",
                "--pidfilepath", str(pid_file),
            ],
            check=True, capture_output=True, timeout=120, start_new_session=True,
        )  # fmt: skip
        self.pids[port] = int(pid_file.read_text().strip())

    def kill_all(self, timeout: float = 30) -> None:
        """SIGKILL every member at once (one signal after the other, nothing in between), and
        wait until all are gone."""
        pids = list(self.pids.values())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.pids.clear()
        deadline = time.monotonic() + timeout
        while not all(_gone(pid) for pid in pids):
            if time.monotonic() > deadline:
                raise AssertionError(f"mongod processes {pids} still there after SIGKILL")
            time.sleep(0.05)

    def restart_all(self) -> int:
        """Start every member again on its port and data directory, all at once; returns the
        port of the primary they elect."""
        with ThreadPoolExecutor(len(self.ports)) as pool:
            list(pool.map(self._launch, self.ports))
        return self.wait_primary(timeout=120)

    def direct(self, port: int) -> MongoClient[dict[str, Any]]:
        return MongoClient(
            f"mongodb://127.0.0.1:{port}/?directConnection=true", serverSelectionTimeoutMS=2000
        )

    def primary_port(self) -> int | None:
        for port in self.ports:
            client = self.direct(port)
            try:
                if client.admin.command("hello").get("isWritablePrimary"):
                    return port
            except PyMongoError:
                pass
            finally:
                client.close()
        return None

    def wait_primary(self, timeout: float = 60, other_than: int | None = None) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = self.primary_port()
            if port is not None and port != other_than:
                return port
            time.sleep(0.2)
        raise AssertionError("the replica set elected no primary")

    def step_down(self) -> tuple[int, int]:
        """Step the primary down; returns (old primary, new primary). Under load the step-down
        is refused while no secondary has caught up: try again."""
        old = self.wait_primary()
        for _ in range(5):
            client = self.direct(old)
            try:
                client.admin.command("replSetStepDown", 30, secondaryCatchUpPeriodSecs=10)
            except PyMongoError:
                pass  # the step-down closes the connection, or was refused
            finally:
                client.close()
            try:
                return old, self.wait_primary(timeout=20, other_than=old)
            except AssertionError:
                continue
        raise AssertionError(f"the primary on port {old} could not be stepped down")

    def fail_point(self, port: int, name: str, mode: Any = "alwaysOn", **data: Any) -> None:
        """Set a server fail point on one member (needs ``test_commands``)."""
        client = self.direct(port)
        try:
            client.admin.command("configureFailPoint", name, mode=mode, data=data)
        finally:
            client.close()

    def dbpath(self, port: int) -> Path:
        return self.root / f"m{self.ports.index(port)}"

    def stop(self) -> None:
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.pids.clear()


def _gone(pid: int) -> bool:
    """The process has ended (a zombie nobody reaped yet counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def replica_set_with_workers(
    root: Path, database: str, **replica: Any
) -> tuple[ReplicaSet, Cluster]:
    """A replica set of the test's own started in ``root``/rs (``replica``: ``ReplicaSet``'s
    options) and a ``Cluster`` of workers on it logging to ``root``; the test stops both."""
    replica_set = ReplicaSet(root / "rs", **replica)
    uri = await asyncio.to_thread(replica_set.start)
    return replica_set, Cluster(uri, database, root)
