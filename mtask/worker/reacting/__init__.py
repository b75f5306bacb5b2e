"""Tasks that react to data (docs/triggers.md): the followers of a worker whose registry declares
triggers (``Registry.trigger``) or collections its tasks wait on (``Registry.waits_on``).

``build`` makes one ``Holdings`` side loop holding every follower this registry declares, each
a ``Follower`` (one change stream for the whole cluster, under a lease) with its ``Reaction``:
``Publishing`` for a trigger, ``Waking`` for a collection tasks wait on. A registry that
declares neither gets nothing: no loop, no read, no stream.
"""

from __future__ import annotations

from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.registry import Registry
from mtask.store import datawaits
from mtask.store.followers import Declared
from mtask.worker.reacting.holdings import Declaration, Holdings
from mtask.worker.reacting.trigger_tasks import Publishing
from mtask.worker.reacting.waking import Waking
from mtask.worker.service import Service
from mtask.worker.worker_events import Emitter

__all__ = ["Holdings", "build"]


def build(
    driver: AsyncDriver,
    clock: Clock,
    registry: Registry,
    *,
    holder: str,
    emit: Emitter,
    sweep_interval: float,
    max_params_bytes: int,
) -> tuple[Service, ...]:
    """The followers' side loop for ``registry``, or nothing if it declares none."""
    declarations = []
    for trigger in registry.triggers.values():
        options = registry.options_for(trigger.task, trigger.options)
        reaction = Publishing(driver, clock, trigger, dict(options or {}), max_params_bytes)
        declared = Declared(
            "trigger",
            trigger.name,
            trigger.collection,
            trigger.spec(),
            scan_first=trigger.start == "scan",
        )
        declarations.append(Declaration(declared, reaction))
    for collection in registry.watched:
        declared = Declared("wait", collection, collection, {"collection": collection})
        declarations.append(Declaration(declared, Waking(driver, collection, sweep_interval)))
    if not declarations:
        return ()
    holdings = Holdings(
        driver,
        clock,
        holder=holder,
        declarations=declarations,
        emit=emit,
        setup=datawaits.ensure_index if registry.watched else None,
    )
    return (holdings,)
