"""The wire between a host's relay and its subscribers: an abstract Unix socket named after
the tasks collection, length-prefixed BSON frames, and the peer's credentials.

Relay to subscriber: ``{"relay": "open"}`` (the relay's stream is open: from now on the relay
hands this worker its tasks), ``{"relay": "own"}`` (to the relay's own worker while it is the
only subscriber: the task events follow, find work yourself), ``{"relay": "tick"}`` (alive,
nothing to say), ``{"d": [[key,
name, priority, worker_timeout_ms], …]}`` (tasks handed over, due now), and the change events
of ``controls``, ``limits`` and ``schedules`` as they come. Subscriber to relay: its hello
(``{"hello": PROTOCOL, "worker_id", "names", "free"}``), then reports: ``free`` and ``got``
(its credit), ``names`` (when a pause changes them), ``claimed`` (``[[key, next_claim_at]]``),
``held`` and ``done`` (keys).
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import struct
from collections.abc import Mapping
from typing import Any
from uuid import UUID

import bson

from mtask.connection import CODEC_OPTIONS

PROTOCOL = 2
MAX_FRAME = 16 * 1024 * 1024 + 16 * 1024
OPEN = {"relay": "open"}
OWN = {"relay": "own"}
TICK = {"relay": "tick"}


def endpoint(database: str, collection: str, uuid: Any) -> str:
    """The abstract socket name of the relay for one tasks collection (``uuid``: its UUID)."""
    if isinstance(uuid, UUID):
        uuid = uuid.bytes
    if isinstance(uuid, bytes):  # a bson Binary too, whatever the client's uuidRepresentation
        uuid = uuid.hex()
    identity = f"{database}\x00{collection}\x00{uuid}".encode()
    return f"\x00mtask-stream-{PROTOCOL}-{hashlib.blake2b(identity, digest_size=12).hexdigest()}"


def frame(doc: Mapping[str, Any]) -> bytes:
    """One frame: the BSON document (its first four bytes are its length)."""
    return bson.encode(doc)


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame, or ``None`` at the end of the stream; ``ConnectionError`` if cut or bad."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionError("connection cut inside a frame") from exc
        return None
    size = int.from_bytes(head, "little")
    if not 5 <= size <= MAX_FRAME:
        raise ConnectionError(f"bad frame length {size}")
    try:
        return head + await reader.readexactly(size - 4)
    except asyncio.IncompleteReadError as exc:
        raise ConnectionError("connection cut inside a frame") from exc


def decode(data: bytes) -> dict[str, Any]:
    return bson.decode(data, codec_options=CODEC_OPTIONS)


def peer(writer: asyncio.StreamWriter) -> tuple[int, int]:
    """The (pid, uid) of the process at the other end of a Unix socket."""
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid
