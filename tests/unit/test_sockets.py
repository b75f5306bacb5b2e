"""pymongo's cancelled connect leaks its socket; mtask's stand-in closes it (the
reproduction for pymongo is docs/upstream/pymongo-cancelled-connect.md)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from pymongo import pool_shared

from mtask.connection.clients import async_client, sockets

sockets.install()
ORIGINAL = sockets.replaced or pool_shared._async_create_connection
"""pymongo's own function (the stand-in is in its place if it leaks)."""


class Options:
    connect_timeout = 20.0


async def cancelled_mid_connect(
    create: Callable[[Any, Any], Awaitable[socket.socket]], monkeypatch: pytest.MonkeyPatch
) -> socket.socket:
    """The socket ``create`` made, after its task was cancelled while it connected (a connect
    that never completes stands in for a slow network)."""
    made: list[socket.socket] = []
    connecting = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def never(sock: socket.socket, address: Any) -> None:
        made.append(sock)
        connecting.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(loop, "sock_connect", never)
    task = asyncio.create_task(create(("127.0.0.1", 27017), Options()))
    await connecting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return made[0]


async def test_the_stand_in_closes_the_socket_of_a_cancelled_connect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sock = await cancelled_mid_connect(sockets.create_connection, monkeypatch)
    assert sock.fileno() == -1  # closed


async def test_pymongos_own_leaks_it_while_the_stand_in_is_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reproduction: pymongo's function leaves the socket open. Once a pymongo release
    closes it, ``affected`` is false, ``install`` leaves pymongo's in place, and this test
    says the workaround can go."""
    sock = await cancelled_mid_connect(ORIGINAL, monkeypatch)
    try:
        assert (sock.fileno() != -1) == sockets.affected(ORIGINAL)
    finally:
        sock.close()


def test_an_async_client_installs_it_if_pymongo_leaks() -> None:
    """pymongo 4.20.1 leaks (its source has no ``BaseException``): the stand-in is in place."""
    async_client("mongodb://127.0.0.1:1/?directConnection=true", connect=False)
    installed = pool_shared._async_create_connection
    assert installed is (sockets.create_connection if sockets.affected(ORIGINAL) else ORIGINAL)
