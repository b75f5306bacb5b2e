"""The preflight's sandbox: ``python -m mtask.steps.sandbox REGISTRY TIMEOUT``.

It imports the registry, says which names it has, then reads task documents (BSON) on its
standard input and writes one verdict (BSON) per task on its standard output
(``mtask.steps.preflight``'s dry replay). It has no MongoDB client and needs none; once the registry
is imported, an audit hook refuses the I/O a handler could do between its steps (``FORBIDDEN``,
and opening a file to write), and a timer stops a replay that does not end within ``TIMEOUT``
seconds. What a handler prints goes to standard error, never among the verdicts.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO

import bson
from bson.codec_options import CodecOptions

from mtask.errors import MtaskError
from mtask.registry import Registry, load_registry
from mtask.steps.preflight import ForbiddenIo, Stuck, Verdict, alarm, replay, replay_now

FORBIDDEN = frozenset(
    {
        "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
        "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
        "os.forkpty", "os.kill", "os.killpg", "os.remove", "os.rename", "os.rmdir", "os.mkdir",
        "os.symlink", "os.link", "os.truncate", "os.chmod", "os.chown", "os.utime",
        "os.putenv", "os.unsetenv", "shutil.rmtree", "shutil.move", "shutil.copyfile",
        "shutil.copytree", "sqlite3.connect", "webbrowser.open", "ctypes.dlopen",
    }
)  # fmt: skip
"""The audit events a dry replay refuses (https://docs.python.org/3/library/audit_events.html)."""
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
AWARE: CodecOptions[dict[str, Any]] = CodecOptions(tz_aware=True)


class Guard:
    """The audit hook: armed while a handler replays."""

    def __init__(self) -> None:
        self.armed = False
        self.tried: str | None = None
        """What the replay under way tried first (a handler that swallows the refusal is still
        reported)."""

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.armed:
            return
        if event in FORBIDDEN or (event == "open" and _writes(args)):
            shown = ", ".join(repr(a)[:80] for a in args[:2] if not hasattr(a, "fileno"))
            self.tried = self.tried or f"it did I/O outside a step ({event} {shown}): not checked"
            raise ForbiddenIo(self.tried)


def _writes(args: tuple[Any, ...]) -> bool:
    mode, flags = (args[1], args[2]) if len(args) >= 3 else (None, 0)
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & WRITES)


def _documents(stream: BinaryIO) -> Iterator[dict[str, Any]]:
    yield from bson.decode_file_iter(stream, codec_options=AWARE)


def serve(registry: Registry, timeout: float, stream: BinaryIO, out: BinaryIO) -> None:
    """Replay each document read from ``stream``, in order, and write its verdict to ``out``
    (flushed after each ``{"_flush": true}`` the reader sends and at the end)."""
    guard = Guard()
    sys.addaudithook(guard)
    loop = asyncio.new_event_loop()

    def expired(signum: int, frame: Any) -> None:
        raise Stuck(f"it did not reach where its journal ends within {timeout:g} s: not checked")

    for doc in _documents(stream):
        if doc.get("_flush"):
            out.flush()
            continue
        key, name = str(doc.get("_id")), str(doc.get("name"))
        guard.armed, guard.tried = True, None
        alarm(timeout, expired)
        try:
            verdict = replay_now(registry, doc, loop) or loop.run_until_complete(
                replay(registry, doc)
            )
        except Stuck as exc:  # the loop itself was interrupted: start a new one
            verdict = Verdict(key, name, "unchecked", None, str(exc))
            loop = asyncio.new_event_loop()
        finally:
            guard.armed = False
            alarm(0, expired)
        if guard.tried is not None:
            verdict = Verdict(key, name, "unchecked", None, guard.tried)
        out.write(bson.encode(verdict.to_document()))
    out.flush()


def main(argv: list[str]) -> int:
    spec, timeout = argv[0], float(argv[1])
    sys.dont_write_bytecode = True  # an import during a replay writes no .pyc
    stream, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a handler's print() never lands among the verdicts
    try:
        registry = load_registry(spec)
    except MtaskError as exc:
        out.write(bson.encode({"error": str(exc)}))
        out.flush()
        return 2
    out.write(bson.encode({"names": registry.names}))
    out.flush()
    serve(registry, timeout, stream, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
