"""A workaround for a socket pymongo leaks when a connect is cancelled (until it is fixed).

pymongo's asynchronous ``_async_create_connection`` (4.13 to at least 4.20.1) closes the socket
it made only on ``TimeoutError`` and ``OSError``. A task cancelled while it connects (a worker's
side service at its stop, a caller's ``asyncio.timeout``) raises ``CancelledError``, a
``BaseException``: the socket is left open until the garbage collector finds it, with a
``ResourceWarning`` ("unclosed socket") that a test run with warnings as errors reports against
whichever test is running then. ``install`` puts in its place the same function with the socket
closed on any exception; it is installed once, by the first async client mtask makes, and
only while pymongo's own function still lacks that (its code names no ``BaseException``). The
report for pymongo, with a reproduction, is ``docs/upstream/pymongo-cancelled-connect.md``.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from typing import Any

_installed = False
replaced: Any = None
"""pymongo's own function, once ``install`` put the stand-in in its place."""


def affected(function: Any) -> bool:
    """Whether pymongo's ``_async_create_connection`` is the one that leaks on a cancel."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return "except OSError" in source and "BaseException" not in source


async def create_connection(address: Any, options: Any) -> socket.socket:
    """pymongo 4.20.1's ``_async_create_connection``, closing its socket on any exception."""
    from pymongo.asynchronous.helpers import _getaddrinfo

    host, port = address
    if host.endswith(".sock"):
        return await _unix(host)
    family = socket.AF_INET
    if socket.has_ipv6 and host != "localhost":
        family = socket.AF_UNSPEC
    err: BaseException | None = None
    for af, socktype, proto, _, sa in await _getaddrinfo(
        host, port, family=family, type=socket.SOCK_STREAM
    ):
        sock = _socket(af, socktype, proto)
        try:
            return await _connect(sock, sa, options)
        except TimeoutError as e:
            sock.close()
            err = TimeoutError("timed out")
            err.__cause__ = e
        except OSError as e:
            sock.close()
            err = e
        except BaseException:  # the fix: a cancelled connect closes its socket too
            sock.close()
            raise
    if err is not None:
        raise err
    raise OSError("getaddrinfo failed")


async def _unix(path: str) -> socket.socket:
    from pymongo.errors import ConnectionFailure
    from pymongo.pool_shared import _set_non_inheritable_non_atomic

    if not hasattr(socket, "AF_UNIX"):
        raise ConnectionFailure("UNIX-sockets are not supported on this system")
    sock = socket.socket(socket.AF_UNIX)
    _set_non_inheritable_non_atomic(sock.fileno())
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
        return sock
    except BaseException:  # the fix (pymongo's: OSError only)
        sock.close()
        raise


def _socket(af: int, socktype: int, proto: int) -> socket.socket:
    from pymongo.pool_shared import _set_non_inheritable_non_atomic

    try:
        sock = socket.socket(af, socktype | getattr(socket, "SOCK_CLOEXEC", 0), proto)
    except OSError:
        sock = socket.socket(af, socktype, proto)
    _set_non_inheritable_non_atomic(sock.fileno())
    return sock


async def _connect(sock: socket.socket, address: Any, options: Any) -> socket.socket:
    from pymongo import _csot
    from pymongo.pool_shared import _set_keepalive_times

    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    timeout = _csot.remaining()
    if timeout is None:
        timeout = options.connect_timeout
    elif timeout <= 0:
        raise TimeoutError("timed out")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, True)
    _set_keepalive_times(sock)
    sock.setblocking(False)
    await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, address), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def install() -> None:
    """Put ``create_connection`` in the place of pymongo's, once, if pymongo's leaks."""
    global _installed, replaced
    if _installed:
        return
    _installed = True
    try:
        from pymongo import pool_shared
    except ImportError:  # another layout: nothing of ours to mend
        return
    original = getattr(pool_shared, "_async_create_connection", None)
    if original is not None and affected(original):
        replaced = original
        pool_shared._async_create_connection = create_connection
