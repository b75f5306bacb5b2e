"""Writing the runs' live output (docs/output.md): one writer per worker, a follower per run
that reports.

A run that never calls ``ctx.progress``, ``ctx.log`` or ``ctx.emit`` makes no ``RunOutput`` and
costs nothing here. The first call wakes the writer, which starts a follower for that run: it
waits ``interval`` (calls made meanwhile coalesce: progress keeps its newest value), then writes
what the buffer holds with ``store.output.write``, fenced by the run: a progress-only batch is
one update, a batch with lines or chunks is a transaction (the fenced update numbers them, the
insert stores them). A transient error keeps the batch and tries it again; a failed fence (the
run lost its task) closes the output: nothing more of this run is written.

The run's end (``finish``) writes what is left before the run's outcome is recorded, so the
last progress value and the last chunk land before the task is seen finished. A transactional
handler's output is held until its body returns and then written in its transaction
(``write_in``): it commits with the run's SUCCESS, or not at all.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pymongo import AsyncMongoClient
from pymongo.errors import BulkWriteError, DuplicateKeyError, PyMongoError
from pymongo.write_concern import WriteConcern

from mtask import metrics
from mtask.clock import Clock
from mtask.driver import AsyncDriver, Doc, storage_error
from mtask.errors import StorageError
from mtask.follow.output import DEFAULT_LIMITS, Batch, OutputLimits, RunOutput
from mtask.registry import TaskContext
from mtask.store import output as store_output
from mtask.worker.running.transactional import discard_session

log = logging.getLogger(__name__)

INTERVAL_S = 0.25
"""How long a run's output coalesces before it is written: at most four writes a second."""
FINAL_WRITE_S = 10.0
"""How long the run's end keeps trying to write what is left while MongoDB is out of reach."""
MAX_ENTRIES = 500
"""Lines and chunks per write (one transaction)."""


@dataclass(eq=False)
class _Followed:
    output: RunOutput
    key: str
    run_id: str
    attempt: int
    options: Mapping[str, Any]
    held: bool
    loop: asyncio.AbstractEventLoop
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    unwritten: Batch | None = None
    batches: int = 0
    """The number of the newest batch taken (``store.output.write``'s ``batch``)."""
    writing: bool = False
    ending: bool = False
    wrote_entries: bool = False
    progress_counted: bool = False
    lost: bool = False
    refused: bool = False
    """A batch of it could not be sent at all (not a MongoDB error): said once."""
    session: Any = None
    """The session of its transactions of output, taken for its first one: its id is on the
    run entry (``output_txn``), so that a run taking the task over can kill a transaction of
    it left open. At the run's end it goes back to the driver's pool, unless the run lost its
    task (then a kill may come for it: it is dropped)."""


class OutputWriter:
    """Writes the live output of one worker's runs."""

    def __init__(
        self,
        mongo: AsyncMongoClient[Doc],
        driver: AsyncDriver,
        clock: Clock,
        *,
        interval: float = INTERVAL_S,
        limits: OutputLimits = DEFAULT_LIMITS,
    ) -> None:
        self.mongo = mongo
        self.driver = driver
        self.clock = clock
        self.interval = interval
        self.limits = limits
        self._runs: dict[int, _Followed] = {}
        self._indexed = False
        self.writes = 0
        """Writes sent (updates and transactions), for tests and the bench."""

    # -- a run's output, made on its first report ----------------------------------------------

    def output_for(
        self,
        ctx: TaskContext,
        *,
        options: Mapping[str, Any],
        held: bool,
        loop: asyncio.AbstractEventLoop,
    ) -> RunOutput:
        """The ``RunOutput`` of ``ctx``'s run (``TaskContext.output_for``, bound per run by the
        executor); ``held``: a transactional run's, written only in its transaction."""
        followed: list[_Followed] = []

        def wake(_out: RunOutput) -> None:  # from the handler's thread, whichever it is
            loop.call_soon_threadsafe(self._woken, followed[0])

        output = RunOutput(self.limits, wake=wake, now=self.clock.now)
        run = _Followed(output, ctx.key, ctx.run_id, ctx.attempt, options, held, loop)
        followed.append(run)
        self._runs[id(output)] = run
        return output

    def _woken(self, run: _Followed) -> None:
        if run.held or run.lost or id(run.output) not in self._runs:
            return
        if run.task is None:
            run.task = asyncio.create_task(self._follow(run), name=f"mtask-output-{run.key}")
        run.wakeup.set()

    async def _follow(self, run: _Followed) -> None:
        while not run.lost and not run.ending:
            await asyncio.sleep(self.interval)  # what is said meanwhile coalesces
            run.writing = True
            try:
                await self._write_all(run, drain=False)
            except StorageError as exc:
                self._failed(run, exc)
                continue
            finally:
                run.writing = False
            if run.ending:
                return  # the run's end writes the rest
            run.wakeup.clear()
            if not run.output.pending():
                await run.wakeup.wait()

    @staticmethod
    def _failed(run: _Followed, exc: StorageError) -> None:
        """A transient error keeps the batch, tried again (with its number: never twice);
        any other drops it (the server refuses it as it is)."""
        if exc.transient:
            log.warning("cannot write the output of %s yet: %s", run.key, exc)
            return
        if not run.refused:
            log.warning("output of %s refused, one batch dropped: %s", run.key, exc)
        run.unwritten = None

    # -- the run's end ---------------------------------------------------------------------------

    async def finish(self, output: RunOutput, *, write: bool) -> bool:
        """The run ended: write what is left (``write`` False: it lost its task, drop it) and
        stop following it. Returns whether any line or chunk of it was stored."""
        run = self._runs.pop(id(output), None)
        output.close()
        if run is None:
            return False
        run.ending = True
        if run.task is not None:
            if not run.writing:
                run.task.cancel()  # it waits: nothing is half-sent
            await asyncio.gather(run.task, return_exceptions=True)  # a write in flight ends
        if write and not run.lost and not run.held:
            deadline = asyncio.get_running_loop().time() + FINAL_WRITE_S
            while True:
                try:
                    await self._write_all(run)
                    break
                except StorageError as exc:
                    if not exc.transient or asyncio.get_running_loop().time() > deadline:
                        log.warning("the last output of %s is lost: %s", run.key, exc)
                        break
                    await asyncio.sleep(0.2)
        if run.progress_counted:
            metrics.RUNS_IN_PROGRESS.dec()
        await _end_session(run, taken_over=run.lost or not write)
        return run.wrote_entries

    async def write_in(self, output: RunOutput, session: Any) -> None:
        """Write all of a held (transactional) run's output in its transaction."""
        run = self._runs.get(id(output))
        if run is not None:
            await self._write_all(run, session)

    def restart(self, output: RunOutput) -> None:
        """A transactional body runs again: what the aborted one said is forgotten (its
        batches' numbers too: they were never committed)."""
        output.discard()
        run = self._runs.get(id(output))
        if run is not None:
            run.unwritten, run.batches = None, 0

    # -- writing -----------------------------------------------------------------------------------

    async def _write_all(self, run: _Followed, session: Any = None, *, drain: bool = True) -> None:
        """Write what the run has said; ``drain`` False (the follower's turn): what it held
        when the turn began, not what it says meanwhile (that waits for the next turn)."""
        while not run.lost:
            batch = run.unwritten
            if batch is None:
                batch = run.output.take(MAX_ENTRIES)
                if not batch:
                    return
                run.batches += 1
                run.unwritten = batch
            written = await self._write(run, batch, run.batches, session)
            run.unwritten = None
            if not written:
                run.lost = True
                run.output.close()
                log.info("%s run %s lost its task: its output is no longer written",
                         run.key, run.run_id[:8])  # fmt: skip
                return
            if batch.entries:
                run.wrote_entries = True
            if batch.progress is not None and not run.progress_counted:
                run.progress_counted = True
                metrics.RUNS_IN_PROGRESS.inc()
            if not drain and len(batch.entries) < MAX_ENTRIES:
                return

    async def _write(self, run: _Followed, batch: Batch, number: int, session: Any) -> bool:
        if batch.entries and not self._indexed:
            await self.driver.run(store_output.ensure_indexes())
            self._indexed = True

        def op(now: dt.datetime) -> Any:
            return store_output.write(
                run.key,
                run.run_id,
                run.attempt,
                number,
                progress=batch.progress,
                counts=batch.counts,
                entries=batch.entries,
                expire_at=store_output.keep_until(run.options, now),
                now=now,
            )

        self.writes += 1
        if session is not None:  # the run's transaction: an error is the body's
            return bool(await self.driver.run(op(self.clock.now()), session))
        try:
            if not batch.entries:
                return bool(await self.driver.run(op(self.clock.now())))
            try:
                return await self._transaction(
                    run, lambda s: self.driver.run(op(self.clock.now()), s)
                )
            except StorageError as exc:
                # entries of an earlier task of this key outlived it: number after them, once
                if not _duplicate_key(exc.__cause__) or not await self.driver.run(
                    store_output.skip_past_stored(run.key, run.run_id)
                ):
                    raise
                log.info("output of %s: numbered after the entries stored before", run.key)
                return await self._transaction(
                    run, lambda s: self.driver.run(op(self.clock.now()), s)
                )
        except (StorageError, PyMongoError):
            raise
        except Exception as exc:
            # not MongoDB's answer (e.g. a task's output_seq that no int follows): the batch
            # cannot be sent as it is, it is dropped; the writer and the run's end go on, and
            # this is said once per run
            if not run.refused:
                run.refused = True
                log.warning(
                    "output of %s cannot be written, dropped: %s: %s",
                    run.key,
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
            raise StorageError(f"cannot write the output: {type(exc).__name__}: {exc}") from exc

    async def _transaction(self, run: _Followed, body: Callable[[Any], Any]) -> bool:
        """``body`` in a transaction of the run's output session, recorded on its run entry
        first (``store.output.record_session``): a worker frozen or killed before a commit
        leaves the transaction open on the task document, and the claim taking the task over
        kills it instead of waiting for the server to give it up (docs/output.md). ``False``:
        the run no longer owns its task."""
        try:
            if run.session is None:
                session = self.mongo.start_session()
                lsid = session.session_id["id"]
                try:
                    recorded = await self.driver.run(
                        store_output.record_session(run.key, run.run_id, lsid)
                    )
                except BaseException:  # it may have been written: never reused
                    discard_session(session)
                    await session.end_session()
                    raise
                if not recorded:  # not written: the session goes back to the pool
                    await session.end_session()
                    return False
                run.session = session
            return bool(
                await run.session.with_transaction(body, write_concern=WriteConcern("majority"))
            )
        except PyMongoError as exc:
            raise storage_error(exc) from exc


async def _end_session(run: _Followed, *, taken_over: bool) -> None:
    """The run's output session back to the driver's pool, or dropped if the run lost its task:
    a run taking it over may kill that session (its id is on the run entry), which must then
    interrupt nothing else of this worker."""
    if run.session is not None:
        if taken_over:
            discard_session(run.session)
        await run.session.end_session()


def _duplicate_key(exc: BaseException | None) -> bool:
    """The insert of entries met an entry with one of their numbers."""
    if isinstance(exc, DuplicateKeyError):
        return True
    if isinstance(exc, BulkWriteError):
        return any(e.get("code") == 11000 for e in (exc.details or {}).get("writeErrors", ()))
    return False
