#!/usr/bin/env python3
"""``mtask-healthcheck``: the container image's HEALTHCHECK, one for both roles.

It reads the command line of the mtask process in the container (PID 1, else the first mtask
process found in /proc, e.g. behind ``docker run --init``) and probes the liveness endpoint
of that role, on the port that command line gives:

- ``mtask-worker`` (or ``mtask worker run``): ``/healthz`` on ``--metrics-port`` (200 unless
  the worker has stopped; a draining worker is alive). A worker started without
  ``--metrics-port``, or with 0 (any free port), has nothing to probe: the check passes while
  the process runs.
- ``mtask serve``: ``/static/style.css`` on ``--port`` (default 8080), a file serve answers
  without MongoDB. ``/healthz`` of serve is readiness (MongoDB reachable and primary): a
  database outage must not mark every serve container unhealthy (an orchestrator that
  restarts unhealthy containers would restart them all, and fix nothing).

``MTASK_HEALTHCHECK_URL`` replaces all this with one URL. Exit status 0 when healthy, 1 when
not (with the reason on stderr), as Docker's HEALTHCHECK expects.

Standard library only, and no import of mtask: the image runs it as a file
(``/opt/mtask/bin/mtask-healthcheck``) every few seconds, and importing mtask (pymongo,
pydantic) would cost more than the check itself.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

SERVE_LIVENESS_PATH = "/static/style.css"
WORKER_LIVENESS_PATH = "/healthz"
SERVE_DEFAULT_PORT = 8080
TIMEOUT_S = 2.0


def _option(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` (the last one wins, as in argparse)."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def _local(host: str | None) -> str:
    """Where to reach a server bound to ``host`` from inside its container."""
    if host in (None, "", "0.0.0.0", "::", "[::]", "localhost"):
        return "127.0.0.1"
    return f"[{host}]" if host and ":" in host and not host.startswith("[") else str(host)


def role_of(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """``("worker" | "serve", the arguments after the command)`` for an mtask command line,
    else None. Knows ``mtask-worker …``, ``mtask worker run …``, ``mtask serve …`` and their
    ``python -m mtask …`` and ``python /path/to/script …`` forms."""
    for i, arg in enumerate(argv):
        base = os.path.basename(arg)
        if base == "mtask-worker":
            return "worker", list(argv[i + 1 :])
        is_mtask = base == "mtask" or (arg == "mtask" and i > 0 and argv[i - 1] == "-m")
        if not is_mtask:
            continue
        rest = list(argv[i + 1 :])
        if rest[:1] == ["serve"]:
            return "serve", rest[1:]
        if rest[:2] == ["worker", "run"]:
            return "worker", rest[2:]
        return None
    return None


def url_for(argv: Sequence[str]) -> str | None:
    """The liveness URL of the mtask process started with ``argv``; None if it has none (a
    worker without ``--metrics-port``). ValueError if ``argv`` is no mtask server."""
    found = role_of(argv)
    if found is None:
        raise ValueError(f"not an mtask worker or serve command: {' '.join(argv)[:200]}")
    role, args = found
    if role == "serve":
        port = _option(args, "--port") or str(SERVE_DEFAULT_PORT)
        return f"http://{_local(_option(args, '--host'))}:{port}{SERVE_LIVENESS_PATH}"
    metrics_port = _option(args, "--metrics-port")
    if metrics_port is None or metrics_port == "0":
        return None
    host = _local(_option(args, "--metrics-host"))
    return f"http://{host}:{metrics_port}{WORKER_LIVENESS_PATH}"


def _cmdline(pid: str, proc: Path) -> list[str]:
    try:
        raw = (proc / pid / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def find_command(proc: Path = Path("/proc")) -> list[str] | None:
    """The command line of the container's mtask process: PID 1's if it is one, else the
    lowest PID's that is."""
    first = _cmdline("1", proc)
    if role_of(first) is not None:
        return first
    try:
        pids = sorted((p.name for p in proc.iterdir() if p.name.isdigit()), key=int)
    except OSError:
        return None
    for pid in pids:
        argv = _cmdline(pid, proc)
        if role_of(argv) is not None:
            return argv
    return None


def probe(url: str, timeout: float = TIMEOUT_S) -> str | None:
    """None if ``url`` answers 2xx, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        return f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{url}: {exc}"
    return None if 200 <= status < 300 else f"{url}: HTTP {status}"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    url = args[0] if args else os.environ.get("MTASK_HEALTHCHECK_URL")
    if not url:
        command = find_command()
        if command is None:
            print("mtask-healthcheck: no mtask worker or serve process here", file=sys.stderr)
            return 1
        url = url_for(command)
        if url is None:
            print("mtask-healthcheck: no fixed --metrics-port to probe: the worker runs")
            return 0
    problem = probe(url)
    if problem is not None:
        print(f"mtask-healthcheck: unhealthy: {problem}", file=sys.stderr)
        return 1
    print(f"mtask-healthcheck: ok: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
