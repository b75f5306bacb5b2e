"""Running a claimed task, from its claimed document to its recorded outcome (River's executor
and completer).

The claim side sees this wing through one protocol (``protocols.RunStarter``); the wing knows
the claim side only by what it is built with: the ``Signal``s it tells a run's start and end
(``wiring.Wires``), the ``SlotReturns`` its recorder gives limit slots back to, the handler
slots a run claimed ahead waits for. ``build`` makes its parts; ``docs/architecture.md``
follows one run through them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pymongo import AsyncMongoClient, MongoClient

from mtask import driver
from mtask.clock import Clock
from mtask.driver import Doc
from mtask.registry import Registry
from mtask.vocabulary import DEFAULT_MAX_PARAMS_BYTES
from mtask.worker.config import WorkerConfig
from mtask.worker.inflight import InFlight
from mtask.worker.running.backoffs import Holds
from mtask.worker.running.batches import Batches
from mtask.worker.running.call import HandlerCalls
from mtask.worker.running.context import RunContexts
from mtask.worker.running.executor import Executor
from mtask.worker.running.handler_slots import RunSlots
from mtask.worker.running.outcomes import RunOutcomes
from mtask.worker.running.output_writer import OutputWriter
from mtask.worker.running.pinger import LeasePinger, LoopTicker
from mtask.worker.running.protocols import Recorded, SlotReturns
from mtask.worker.running.recorder import OutcomeRecorder
from mtask.worker.running.sealing import from_env as sealing_from_env
from mtask.worker.running.step_stores import RunStepStores
from mtask.worker.running.task_deadlines import TaskDeadlines
from mtask.worker.running.traces import RunTraces
from mtask.worker.running.transactional import Transactions
from mtask.worker.running.usage_stores import RunUsages
from mtask.worker.stats import WorkerStats
from mtask.worker.wiring import Signal, Wires
from mtask.worker.worker_events import Emitter

if TYPE_CHECKING:
    from mtask.client import AsyncTaskClient
    from mtask.worker.running.pool.pool import ProcessPool


class Publisher:
    """What a handler publishes with (``ctx.publish``): an ``AsyncTaskClient`` on the worker's
    own connection and clock, made on the first publish, so that a worker's start loads none
    of the client's modules (its reads, its explanations: bench WST)."""

    max_params_bytes = DEFAULT_MAX_PARAMS_BYTES
    """The client's limit on a task's params (its default, which the worker does not set)."""

    def __init__(
        self,
        database: str,
        collection: str,
        clock: Clock,
        mongo_client: AsyncMongoClient[dict[str, Any]],
    ) -> None:
        self._made: AsyncTaskClient | None = None
        self._where = (database, collection)
        self._clock = clock
        self._mongo = mongo_client

    @property
    def client(self) -> AsyncTaskClient:
        if self._made is None:
            from mtask.client import AsyncTaskClient

            database, collection = self._where
            self._made = AsyncTaskClient(
                database=database,
                collection=collection,
                clock=self._clock,
                mongo_client=self._mongo,
            )
        return self._made

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        return await self.client.publish(*args, **kwargs)


@dataclass(frozen=True)
class Running:
    """The run side's parts, made together."""

    ticker: LoopTicker
    pinger: LeasePinger
    recorder: OutcomeRecorder
    publisher: Publisher
    """The client a handler publishes with (``ctx.publish``)."""
    process_pool: ProcessPool | None
    outputs: OutputWriter
    executor: Executor


def process_pool(config: WorkerConfig, registry: Registry, names: list[str]) -> ProcessPool | None:
    """The process pool, if the worker runs a handler isolated (``--pool process``, or a
    handler's ``isolation``); multiprocessing is imported only then."""
    if config.pool != "process" and all(registry[n].isolation != "process" for n in names):
        return None
    from mtask.worker.running.pool.pipe import Bounds
    from mtask.worker.running.pool.pool import ProcessPool

    modules = {registry[n].fn.__module__ for n in names}
    return ProcessPool(
        max_tasks_per_child=config.max_tasks_per_child,
        max_memory_per_child=config.max_memory_per_child,
        memory_limit=config.memory_limit_per_child,
        preload=tuple(sorted(modules - {"__main__"})),
        bounds=Bounds.of(config.max_result_bytes),
    )


def build(
    adriver: driver.AsyncDriver,
    clock: Clock,
    config: WorkerConfig,
    registry: Registry,
    *,
    names: list[str],
    worker_id: str,
    clients: tuple[AsyncMongoClient[dict[str, Any]], MongoClient[dict[str, Any]]],
    inflight: InFlight,
    sink: Recorded,
    releases: SlotReturns,
    slots: RunSlots | None,
    held: Callable[[str, Doc], None],
    stats: WorkerStats,
    measured: Callable[[str], tuple[str, ...]] | None = None,
    emit: Emitter,
    wake: asyncio.Event,
    wires: Wires,
) -> Running:
    """The run side: ``sink`` hears of the outcomes written, ``releases`` takes the ended runs'
    limit slots back, ``slots`` are the handler slots a run claimed ahead waits for, ``held``
    hears of a hold a handler's ``BackOff`` set (the gate)."""
    aclient, sclient = clients
    recorder = OutcomeRecorder(
        adriver, clock, releases=releases, sink=sink, inflight=inflight, emit=emit, wake=wake
    )
    ticker = LoopTicker()
    pinger = LeasePinger(
        driver.SyncDriver(driver.collections(sclient[config.database], config.collection)),
        worker_id,
        clock,
        on_lost=wires.lost,
        on_slot_lost=wires.slot_lost,
        loop_heartbeat=lambda: ticker.last,
    )
    publisher = Publisher(config.database, config.collection, clock, aclient)
    outputs = OutputWriter(aclient, adriver, clock)
    transactions = Transactions(aclient, adriver, clock)
    pool = process_pool(config, registry, names)
    outcomes = RunOutcomes(stats, emit, config.max_result_bytes, publisher.max_params_bytes)
    contexts = RunContexts(
        registry=registry,
        worker_id=worker_id,
        publisher=publisher.publish,
        inflight=inflight,
        outputs=outputs,
        journals=RunStepStores(
            adriver, clock, transactions, watched=registry.watched, options_for=registry.options_for
        ),
        leases=pinger,
        usages=RunUsages(adriver, clock, registry.prices, measured=measured),
    )
    calls = HandlerCalls(
        outcomes,
        transactions=transactions,
        leases=pinger,
        outputs=outputs,
        pool=pool,
        isolation=config.pool,
        slots=slots,
        sealing=sealing_from_env(sclient, config.database, wires.unopened),
        batches=Batches(emit, slots=config.concurrency),
        holds=Holds(adriver, clock, held),
        traces=RunTraces(adriver),
    )
    executor = Executor(
        registry=registry,
        inflight=inflight,
        pinger=pinger,
        recorder=recorder,
        contexts=contexts,
        calls=calls,
        outcomes=outcomes,
        stats=stats,
        wake=wake,
        emit=emit,
        lost=wires.lost,
        slot_lost=wires.slot_lost,
        task_deadlines=TaskDeadlines(clock, Signal()),
        run_started=wires.run_started,
        run_ended=wires.run_ended,
    )
    return Running(ticker, pinger, recorder, publisher, pool, outputs, executor)


__all__ = ["Publisher", "Running", "build", "process_pool"]
