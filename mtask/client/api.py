"""``Operations``: what both clients do, one line per operation naming the part that writes it.

Each part (``Publishing``, ``Reading``, ``Acting``, ``Control``, ``History``, ``Spending``) is a
plain class built with the client's ``Core``; an operation written in it (``@operation``) is
offered here once, and bound to the client's instance of its part when looked up on a client:
the sync client runs it, the async client awaits it (``TaskClient._bind``,
``AsyncTaskClient._bind``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mtask.client.acting import Acting
from mtask.client.control import Control
from mtask.client.core import Core
from mtask.client.history import History
from mtask.client.publishing import Publishing
from mtask.client.reading import Reading
from mtask.client.spending import Spending
from mtask.clock import Clock, ServerClock

if TYPE_CHECKING:
    from mtask.registry import Registry
    from mtask.security.encryption import Encryption

PARTS = (Publishing, Reading, Acting, Control, History, Spending)
"""The parts of a client, each built once per client with its ``Core``."""


class Operations:
    """What both clients do, each method written once as an operation in one of the ``PARTS``
    and named here: the sync client runs it, the async client awaits it."""

    def __init__(
        self,
        database: str,
        collection: str,
        clock: Clock | None,
        max_params_bytes: int,
        registry: Registry | None,
        encryption: Encryption | None,
        mongo: Any,
    ) -> None:
        self._core = Core(
            database_name=database,
            collection_name=collection,
            max_params_bytes=max_params_bytes,
            clock=clock or ServerClock(),
            registry=registry,
            encryption=encryption,
            mongo=mongo,
        )
        self._parts: dict[type[Any], Any] = {part: part(self._core) for part in PARTS}
        self._server_clock = self.clock if isinstance(self.clock, ServerClock) else None
        self._ready = False
        """The collection's indexes exist and the clock is calibrated (the first ``_run``)."""

    def _calibration_due(self) -> ServerClock | None:
        """The server's clock if it is to be calibrated (again) before its next reading: never
        yet, or not for ``clock.KEEP_BEST`` seconds (``None``: not due, or a client's own
        ``Clock``)."""
        due = self._server_clock is not None and self._server_clock.due()
        return self._server_clock if due else None

    @property
    def clock(self) -> Clock:
        return self._core.clock

    @property
    def registry(self) -> Registry | None:
        """Handlers whose declared option defaults complete this client's publishes."""
        return self._core.registry

    @property
    def encryption(self) -> Encryption | None:
        """Encrypts the params of the publishes that ask (``mtask.security.encryption``) and
        decrypts what ``get`` reads (None: encrypted tasks read as they are stored)."""
        return self._core.encryption

    @property
    def database_name(self) -> str:
        return self._core.database_name

    @property
    def collection_name(self) -> str:
        return self._core.collection_name

    @property
    def max_params_bytes(self) -> int:
        return self._core.max_params_bytes

    # -- publishing.py -----------------------------------------------------------------------------

    publish = Publishing.publish
    publish_many = Publishing.publish_many
    ensure_indexes = Publishing.ensure_indexes

    # -- reading.py --------------------------------------------------------------------------------

    get = Reading.get
    output = Reading.output
    list = Reading.list
    stats = Reading.stats
    groups = Reading.groups
    due = Reading.due
    flow = Reading.flow
    children = Reading.children
    parked = Reading.parked
    names = Reading.names
    missing = Reading.missing
    search = Reading.search
    ensure_bulk_indexes = Reading.ensure_bulk_indexes
    read_token = Reading.read_token
    explain = Reading.explain
    explain_all = Reading.explain_all
    search_state = Reading.search_state
    state_counts = Reading.state_counts

    # -- acting.py ---------------------------------------------------------------------------------

    cancel = Acting.cancel
    retry = Acting.retry
    signal = Acting.signal
    reset_step = Acting.reset_step
    rename_step = Acting.rename_step
    drop_step = Acting.drop_step
    bulk_count = Acting.bulk_count
    bulk = Acting.bulk
    purge = Acting.purge

    # -- control.py --------------------------------------------------------------------------------

    init_collection = Control.init_collection
    create_roles = Control.create_roles
    workers = Control.workers
    stop_worker = Control.stop_worker
    pause = Control.pause
    resume = Control.resume
    paused = Control.paused
    set_limit = Control.set_limit
    clear_limit = Control.clear_limit
    set_group_limit = Control.set_group_limit
    clear_group_limit = Control.clear_group_limit
    limits = Control.limits
    limit_gauges = Control.limit_gauges
    limit_use = Control.limit_use
    set_retention = Control.set_retention
    clear_retention = Control.clear_retention
    retention = Control.retention
    add_schedule = Control.add_schedule
    schedules = Control.schedules
    pause_schedule = Control.pause_schedule
    resume_schedule = Control.resume_schedule
    remove_schedule = Control.remove_schedule
    triggers = Control.triggers
    pause_trigger = Control.pause_trigger
    resume_trigger = Control.resume_trigger
    reset_trigger = Control.reset_trigger

    # -- spending.py -------------------------------------------------------------------------------

    usage = Spending.usage
    set_budget = Spending.set_budget
    clear_budget = Spending.clear_budget

    # -- history.py --------------------------------------------------------------------------------

    ensure_audit = History.ensure_audit
    record_audit = History.record_audit
    audit = History.audit
    record_throughput = History.record_throughput
    throughput = History.throughput
    finished_since = History.finished_since
    runs_by_worker = History.runs_by_worker
