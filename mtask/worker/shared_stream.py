"""A worker's side of the host's shared stream (``--stream shared``): relay or subscriber.

Each worker process computes the endpoint of its tasks collection and tries to bind it; the
winner holds the relay (``stream_relay.Relay``) and subscribes to it in memory, the others
connect. A subscriber then finds no work itself: the relay hands it tasks due now
(``Watcher.place_dispatched``), and it tells the relay how many more it can take (``free``,
``got``: its credit), and what it claimed, holds back or finished (the relay's stream leaves
those writes out), could not claim, or found gone. Everything else about a task — the claim,
the run, the outcome — is as with an own stream.

- A relay that goes (its connection ends) is raced for: one subscriber binds, the others
  connect, and the new relay's host queue scans.
- A relay that says nothing for ``SILENT`` seconds (frozen, or its event loop blocked) is left:
  the subscriber follows its own stream for ``OWN_FOR`` seconds, then tries the relay again.
- Where the endpoint cannot be used (not Linux, another user's relay, an unexpected socket
  error) the worker follows its own stream for good, with a warning.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pymongo.errors import PyMongoError

from mtask import store
from mtask.errors import StorageError
from mtask.worker.dispatch import Dispatcher
from mtask.worker.relay_wire import PROTOCOL, decode, endpoint, frame, peer, read_frame
from mtask.worker.stream import OwnStream
from mtask.worker.stream_relay import _LOCAL, SUBSCRIBER_BUFFER, Relay
from mtask.worker.watcher import Watcher

log = logging.getLogger(__name__)

SILENT = 5.0
"""Seconds without a frame from the relay (it ticks every second) before a subscriber leaves
it for its own stream."""
OWN_FOR = 30.0
"""Seconds a subscriber that left a silent relay follows its own stream before it retries."""


class RelaySilent(Exception):
    """The relay said nothing for ``SILENT`` seconds."""


class SharedStream:
    """A watcher's change source when it shares the host's stream: relay or subscriber."""

    def __init__(self, buffer: int | None = None) -> None:
        self.buffer = buffer
        self.capacity: Callable[[], int] = lambda: 0
        """How many more tasks this worker can take now (set by the worker's assembly)."""
        self.relay: Relay | None = None
        self._relay_task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None
        self.connections = 0
        self.fallback = False
        self.left_silent = 0
        self._watcher: Watcher | None = None
        self._send: Callable[[dict[str, Any]], None] | None = None
        self._got = 0
        self._names: list[str] | None = None
        self._said: dict[str, list[Any]] = {}
        """What to tell the relay in the next report, by field (``relay_wire``)."""
        self._flush: asyncio.Handle | None = None
        self._free: int | None = None
        """The ``free`` last told: a tick from the relay makes it say a changed one."""

    # -- what the worker tells the relay --------------------------------------------------------

    def claimed(self, key: str, claim_at: Any) -> None:
        self._say("claimed", [key, claim_at])

    def held(self, key: str) -> None:
        self._say("held", key)

    def succeeded(self, key: str) -> None:
        self._say("done", key)

    def missed(self, key: str) -> None:
        self._say("missed", key)

    def gone(self, key: str) -> None:
        self._say("gone", key)

    def _say(self, field: str, item: Any) -> None:
        self._said.setdefault(field, []).append(item)
        self.report_soon()

    def report_soon(self) -> None:
        """Say it once this turn of the event loop is over (one frame for all of it); only
        while the relay hands this worker its tasks."""
        dispatched = self._watcher is not None and self._watcher.dispatched
        if dispatched and self._send is not None and self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._report)

    def _report(self) -> None:
        self._flush = None
        if self._send is None or self._watcher is None:
            return
        self._free = max(0, self.capacity())
        message: dict[str, Any] = {"free": self._free, "got": self._got}
        names = list(self._watcher.names)
        if names != self._names:
            message["names"] = self._names = names
        message.update(self._said)
        self._said = {}
        self._send(message)

    def state(self) -> dict[str, Any]:
        """For the heartbeat: what this worker's side of the shared stream is doing, and the
        relay's counters if it holds the relay."""
        dispatched = self._watcher is not None and self._watcher.dispatched
        state: dict[str, Any] = {
            "mode": "own" if self.fallback else "dispatched" if dispatched else "alone",
            "connections": self.connections,
            "left_silent": self.left_silent,
        }
        relay = self.relay
        if relay is not None and self._relay_task is not None and not self._relay_task.done():
            state["relay"] = {
                **relay.dispatcher.stats(),
                "direct": relay.direct is not None,
                "dropped": relay.dropped,
            }
        return state

    # -- following the relay --------------------------------------------------------------------

    async def run(self, watcher: Watcher) -> None:
        self._watcher = watcher
        if not sys.platform.startswith("linux"):  # abstract sockets are Linux's
            await self._fall_back(watcher, "abstract Unix sockets need Linux")
        name = self.endpoint = await self._endpoint(watcher)
        try:
            while True:
                try:
                    await self._follow_relay(name, watcher)
                except RelaySilent:
                    self.left_silent += 1
                    log.warning(
                        "the host's relay said nothing for %gs; following an own stream for %gs",
                        SILENT,
                        OWN_FOR,
                    )
                    watcher.to_own()
                    try:
                        async with asyncio.timeout(OWN_FOR):
                            await OwnStream().run(watcher)
                    except TimeoutError:
                        pass
                await asyncio.sleep(random.uniform(0.01, 0.1))
        finally:
            if self._relay_task is not None:
                self._relay_task.cancel()
                await asyncio.gather(self._relay_task, return_exceptions=True)

    async def _follow_relay(self, name: str, watcher: Watcher) -> None:
        """Subscribe to the host's relay (binding it first if nobody holds it) until the
        connection ends."""
        try:
            await self._ensure_relay(name, watcher)
            relay = _LOCAL.get(name)
            if relay is not None and relay.loop is asyncio.get_running_loop():
                await self._consume_local(relay, watcher)
                return
            reader, writer = await asyncio.open_unix_connection(name)
        except (ConnectionRefusedError, FileNotFoundError):
            return  # going or coming: bind again
        except OSError as exc:
            await self._fall_back(watcher, str(exc))
        try:
            if peer(writer)[1] != os.getuid():
                await self._fall_back(watcher, "the endpoint is another user's")
            self.connections += 1
            hello = {"hello": PROTOCOL, "worker_id": watcher.worker_id}
            writer.write(frame({**hello, "names": watcher.names, "free": self.capacity()}))

            async def next_frame() -> Mapping[str, Any] | None:
                data = await read_frame(reader)
                return None if data is None else decode(data)

            def send(message: dict[str, Any]) -> None:
                if not writer.transport.is_closing():
                    writer.write(frame(message))

            await self._consume(next_frame, send, watcher, SILENT)
        except (ConnectionError, OSError) as exc:
            log.info("shared change stream connection lost (%s); reconnecting", exc)
        finally:
            writer.transport.abort()

    async def _consume_local(self, relay: Relay, watcher: Watcher) -> None:
        """Subscribe to the relay of this event loop directly; until it goes or drops us."""
        local = relay.attach(watcher.worker_id, watcher.names, self.capacity())
        self.connections += 1
        try:
            await self._consume(local.next, lambda m: relay.report(local, m), watcher, None)
        finally:
            relay.remove(local)

    async def _consume(
        self,
        next_frame: Callable[[], Awaitable[Mapping[str, Any] | None]],
        send: Callable[[dict[str, Any]], None],
        watcher: Watcher,
        silent: float | None,
    ) -> None:
        self._send, self._got, self._names = send, 0, list(watcher.names)
        self._said = {}  # said of an earlier relay's keys: this one scans for itself
        try:
            while True:
                try:
                    async with asyncio.timeout(silent):
                        doc = await next_frame()
                except TimeoutError:
                    raise RelaySilent from None
                if doc is None:
                    return
                await self._on_frame(doc, watcher)
        finally:
            self._send = None
            if self._flush is not None:
                self._flush.cancel()
                self._flush = None

    async def _on_frame(self, doc: Mapping[str, Any], watcher: Watcher) -> None:
        """One frame from the relay (``relay_wire``)."""
        relay = doc.get("relay")
        if ("d" in doc or relay == "open") and not watcher.dispatched:
            watcher.to_dispatch()  # what it found itself goes: the relay has it
            self.report_soon()
        if "d" in doc:
            for key, name, priority, timeout in doc["d"]:
                watcher.place_dispatched(key, name, priority, timeout)
            self._got += len(doc["d"])
            self.report_soon()
        elif relay == "own":  # alone with the relay: find work yourself
            watcher.to_own()
            await watcher.opened()
        elif relay == "tick":
            if watcher.dispatched and max(0, self.capacity()) != self._free:
                self.report_soon()  # a safety net: credit is never stuck
        elif relay is None:  # a task's event (alone), or a control, limit or schedule's
            watcher.on_change(doc)
            if not watcher.dispatched:
                await asyncio.sleep(0)  # let a woken claimer send its claim first
                await watcher.settle()

    async def _fall_back(self, watcher: Watcher, why: str) -> None:
        # not Linux: expected, so quietly; a squatted or broken endpoint: worth a warning
        level = logging.INFO if "Linux" in why else logging.WARNING
        log.log(level, "cannot share the host's change stream (%s); using an own one", why)
        self.fallback = True
        watcher.to_own()
        await OwnStream().run(watcher)
        raise AssertionError("unreachable: a stream is followed until cancelled")

    async def _endpoint(self, watcher: Watcher) -> str:
        tasks = watcher.driver.collections["tasks"]
        backoff = 0.1
        while True:
            try:
                uuid = await watcher.driver.run(store.collection_uuid(tasks.name))
                return endpoint(tasks.database.name, tasks.name, uuid)
            except (StorageError, PyMongoError) as exc:
                log.warning("cannot read the tasks collection's UUID yet: %s", exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _ensure_relay(self, name: str, watcher: Watcher) -> None:
        task = self._relay_task
        if task is not None and task.done() and not task.cancelled():
            task.result()  # a relay that died of anything but cancellation is a bug: raise it
        if task is not None and not task.done():
            return
        tasks = watcher.driver.collections["tasks"]
        buffer = SUBSCRIBER_BUFFER if self.buffer is None else self.buffer
        dispatcher = Dispatcher.build(
            watcher.driver,
            watcher.worker_id,
            watcher.clock,
            watcher.assignment,
            watcher.sweep_interval,
            watcher.stagger.total_seconds() * 1000,
            watcher.queue.max_size,
        )
        relay = await Relay.bind(
            name, tasks.database, tasks.name, watcher.worker_id, buffer, dispatcher
        )
        if relay is not None:
            log.info("this worker holds the host's shared change stream")

            def restarted() -> None:
                watcher.stream_restarts += 1

            self.relay = relay
            self._relay_task = asyncio.create_task(relay.run(restarted), name="mtask-relay")


__all__ = ["SharedStream"]
