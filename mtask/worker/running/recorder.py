"""The worker's outcome writer: outcomes of finished runs are written in bulk, in parallel with
the main loop's claims, then their limit slots are given back and their flows followed up
(``follow_ups.FollowUps``).

``unwritten`` (outcomes waiting or in a write) is the main loop's backpressure: it claims only
while at most ``concurrency`` and the runs it may claim ahead (claiming/ahead.py) are unwritten,
so a worker holds at most twice that in leases.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import ClassVar

from pymongo.errors import DocumentTooLarge

from mtask import store
from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.store import Outcome, RunState
from mtask.worker.inflight import InFlight
from mtask.worker.running.follow_ups import FollowUps
from mtask.worker.running.protocols import Recorded, SlotReturns
from mtask.worker.worker_events import Emitter, Event

log = logging.getLogger(__name__)


@dataclass
class Written:
    """What a write of outcomes did: how many it recorded, and the outcomes the server refused
    for their documents (``instead``), by run id: the FAIL recorded in their place, or None
    (nothing of theirs written)."""

    recorded: int = 0
    instead: dict[str, Outcome | None] = field(default_factory=dict)

    def add(self, other: Written) -> None:
        """``other`` (a write after this one) counted in this one."""
        self.recorded += other.recorded
        self.instead.update(other.instead)


class OutcomeRecorder:
    """A side service (``run``) fed by the ``Executor`` (``add``, ``release_slot``).

    Ownership: every field is the event loop's; ``pending`` is appended to by the executor and
    swapped out whole by ``run``.
    """

    name: ClassVar[str] = "outcomes"

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        *,
        releases: SlotReturns,
        sink: Recorded,
        inflight: InFlight,
        emit: Emitter,
        wake: asyncio.Event,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.releases = releases
        """Where the limit slots of ended runs go back, with their outcomes."""
        self.sink = sink
        self.follow_ups = FollowUps(driver, clock)
        """What follows the outcomes written: sealing, next steps, dependents, children."""
        """Told of a success an own stream skips, and of a task whose outcome was not written."""
        self.inflight = inflight
        self.emit = emit
        self.wake = wake
        """The claimer's wake-up: set when outcomes are written (their slots are free)."""
        self.pending: list[Outcome] = []  # outcomes no write has taken yet
        self.ready = asyncio.Event()
        self.writing = 0  # outcomes in a write on its way
        self.all_written = asyncio.Event()
        self.all_written.set()

    @property
    def unwritten(self) -> int:
        return len(self.pending) + self.writing

    def add(self, outcome: Outcome) -> None:
        self.pending.append(outcome)
        self.ready.set()
        self.all_written.clear()

    def release_slot(self, slot: str, run_id: str) -> None:
        """Give a limit slot back after the outcomes now pending (or at once, if none)."""
        self.releases.release_later(slot, [run_id])
        self.ready.set()

    async def run(self) -> None:
        """Side task: write what is pending, in bulk, for as long as the worker lives."""
        while True:
            await self.ready.wait()
            batch, self.pending = self.pending, []
            released = self.releases.take_releases()  # given back with these outcomes or before
            self.ready.clear()
            self.writing += len(batch)
            done = await self.record(batch) if batch else Written()
            if released:  # after the outcomes: a sequence's lock is given up by its outcome
                await self.releases.flush(released)
            if batch:
                written = self.written(batch, done)
                await self.follow_ups.after(written)
                self.writing -= len(batch)
                if not self.pending and not self.writing:
                    self.all_written.set()
                self.recorded(batch, written, done)

    @staticmethod
    def written(batch: list[Outcome], done: Written) -> list[Outcome]:
        """The outcomes a write wrote (or tried to: some may be fenced out), the refused ones
        replaced by the FAIL written in their place or left out."""
        if not done.instead:  # the normal case: all of them
            return batch
        instead = done.instead
        return [o for o in (instead.get(o.run_id, o) for o in batch) if o is not None]

    def recorded(self, outcomes: list[Outcome], written: list[Outcome], done: Written) -> None:
        """After a write: tell the sink which successes its stream will skip, report each
        outcome written and each refused one, and wake the claimer."""
        recorded = done.recorded
        if recorded < len(written):
            log.info(
                "%d of %d outcome(s) were fenced out (their runs lost the task)",
                len(written) - recorded,
                len(written),
                extra={"fenced": len(written) - recorded},
            )
        all_landed = recorded == len(written)  # else some may have been requeued
        for outcome in written:
            if (
                all_landed
                and outcome.state is RunState.SUCCESS
                and not self.inflight.busy(outcome.key)
            ):
                self.sink.succeeded(outcome.key)  # an own stream skips the event
            if all_landed and outcome.state is RunState.CONTINUED:  # due at once: a hint
                self.sink.requeue_at(outcome.key, self.clock.now())  # (the claim decides)
            self.emit(
                Event.RECORDED, key=outcome.key, run_id=outcome.run_id, state=outcome.state.value
            )
        if done.instead:
            for outcome in outcomes:
                if outcome.run_id in done.instead and done.instead[outcome.run_id] is None:
                    self.emit(
                        Event.NOT_RECORDED,
                        key=outcome.key,
                        run_id=outcome.run_id,
                        state=outcome.state.value,
                    )
        self.wake.set()  # their slots are free now
        self.inflight.on_free()  # and the backpressure may have eased

    async def record(self, batch: list[Outcome]) -> Written:
        """Write the outcomes not yet written (a transactional SUCCESS is committed already and
        counts as recorded); returns how many are recorded, and those refused."""
        committed = sum(1 for o in batch if o.committed)
        rest = [o for o in batch if not o.committed]
        written = await self._write(rest) if rest else Written()
        written.recorded += committed
        return written

    async def _write(self, batch: list[Outcome]) -> Written:
        """Write outcomes, retrying transient errors until they land (the fence makes a repeat
        harmless). A batch refused for another reason, or whose update cannot even be built
        (a value no date can hold: a bug, since outcomes are checked when made), is written one
        by one (``_write_one``)."""
        recorded = await self._write_all(batch)
        if recorded is not None:
            return Written(recorded)
        written = Written()
        for outcome in batch:
            written.add(await self._write_one(outcome))
        return written

    async def _write_all(self, batch: list[Outcome]) -> int | None:
        """Write the batch in one go, retrying transient errors until it lands; returns how
        many are recorded, or None if it is refused for another reason."""
        backoff = 0.2
        while True:
            try:
                return await self.driver.run(store.finish_many(batch, self.clock.now()))
            except StorageError as exc:
                if not exc.transient:
                    return None
                log.warning(
                    "cannot record %d outcome(s) yet, retrying: %s",
                    len(batch),
                    exc,
                    extra={"outcomes": len(batch)},
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5)
            except Exception:  # noqa: BLE001 - an update that cannot be built: found one by one
                return None

    async def _write_one(self, outcome: Outcome) -> Written:
        """One outcome of a refused batch. One its document cannot take (too large for it, or
        for a command) becomes its run's permanent FAIL (``_refused``); one refused otherwise,
        or that cannot be built, is logged and dropped: its run's lease then runs out and the
        task is retried, so nothing is lost and the writer goes on."""
        try:
            return Written(await self.driver.run(store.finish_many([outcome], self.clock.now())))
        except StorageError as exc:
            if exc.transient:
                return await self._write([outcome])
            if exc.document:
                return await self._refused(outcome, str(exc))
            await self._drop_refused(outcome, str(exc))
        except DocumentTooLarge as exc:  # its update is past what a command may carry
            return await self._refused(outcome, str(exc))
        except Exception as exc:  # one outcome never stops the writer (logged, traceback too)
            log.exception("cannot build the update that records %s", outcome.key)
            await self._drop_refused(outcome, repr(exc))
        return Written(0, {outcome.run_id: None})

    async def _refused(self, outcome: Outcome, reason: str) -> Written:
        """The server will never store this outcome on its document: record the run's
        permanent FAIL, naming why, in its place (fenced like every outcome), so the task is
        not run again at each lease's end. If even that is refused, mark the task invalid,
        else log it and drop it. Returns how many outcomes were recorded (0 or 1), and what
        stands in the outcome's place."""
        what = "result" if outcome.state is RunState.SUCCESS else f"{outcome.state.value} outcome"
        failed = Outcome(
            outcome.key,
            outcome.run_id,
            RunState.FAIL,
            error=f"the {what} could not be stored: {reason}",
            permanent=True,
            has_dependents=outcome.has_dependents,
            has_output=outcome.has_output,
            has_spills=outcome.has_spills,
            child_of=outcome.child_of,
        )
        log.error(
            "cannot record the %s of %s run %s; recording its FAIL instead: %s",
            what,
            outcome.key,
            outcome.run_id[:8],
            reason,
            extra={"key": outcome.key},
        )
        try:
            recorded = await self.driver.run(store.finish_many([failed], self.clock.now()))
        except StorageError as exc:
            if exc.transient:  # a FAIL lands once the server is back (or is refused in turn)
                written = await self._write([failed])
                written.instead.setdefault(outcome.run_id, failed)
                return written
            elif exc.document:
                return await self._mark_invalid(outcome, failed, str(exc))
            else:
                await self._drop_refused(failed, str(exc))
                return Written(0, {outcome.run_id: None})
        return Written(recorded, {outcome.run_id: failed})

    async def _mark_invalid(self, outcome: Outcome, failed: Outcome, refused: str) -> Written:
        """Neither the outcome nor its FAIL fit the document: mark the task invalid (fenced by
        the run), so it is not run again; if even that is refused, log it and drop it."""
        reason = failed.error or ""
        try:
            marked = await self.driver.run(store.mark_invalid(outcome, self.clock.now(), reason))
        except StorageError as exc:
            await self._drop_refused(outcome, f"{reason}; its FAIL too: {refused}; {exc}")
            marked = False
        if marked:
            log.error(
                "marked task %r invalid: %s (its FAIL could not be stored either: %s)",
                outcome.key,
                reason,
                refused,
                extra={"key": outcome.key},
            )
        return Written(0, {outcome.run_id: None})

    async def _drop_refused(self, outcome: Outcome, reason: str) -> None:
        """MongoDB will not store this outcome. Its run keeps its lease until that runs out and
        the task is retried; no write means no change event, so put the task back in the
        queue for that moment."""
        log.error(
            "cannot record the outcome of %s run %s; the task will be retried when its lease "
            "ends: %s",
            outcome.key,
            outcome.run_id[:8],
            reason,
        )
        await self.sink.requeue([outcome.key])
