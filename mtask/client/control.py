"""A client's settings of the cluster: the collection and roles, workers and pauses, limits,
retention defaults, schedules and triggers."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

from mtask import schedules, store
from mtask.client.checks import check_number
from mtask.client.core import Core, operation
from mtask.driver import Op
from mtask.errors import InvalidTask, TriggerNotFound
from mtask.limits import rules as limits
from mtask.models import read_worker
from mtask.store import controls as control
from mtask.store import followers, occupancy, retention
from mtask.store import limits as store_limits
from mtask.store import schedules as store_schedules
from mtask.triggers import follower_of
from mtask.vocabulary import MAX_AGE_SECONDS, validate_name


class Control:
    """The operations an operator runs on the cluster rather than on a task."""

    def __init__(self, core: Core) -> None:
        self.core = core

    @operation
    def init_collection(
        self, validator: bool | None = None, operator_indexes: bool | None = None
    ) -> Op[dict[str, Any]]:
        """Create the tasks collection and its indexes; ``validator=True`` installs the task
        document's ``$jsonSchema`` validator (``mtask.jsonschema``), ``False`` removes any;
        ``operator_indexes`` likewise makes or drops ``store.schema.OPERATOR_INDEXES``. Returns
        the collection's options as the server reports them."""
        return (
            yield from store.collection_init(self.core.collection_name, validator, operator_indexes)
        )

    @operation
    def create_roles(self) -> Op[list[str]]:
        """Create or update the MongoDB roles of every part (``mtask.security.roles``) in this
        database, for this tasks collection; returns their names."""
        from mtask.store import roles as store_roles

        return (
            yield from store_roles.create_roles(self.core.database_name, self.core.collection_name)
        )

    # -- workers and names ----------------------------------------------------------------------

    @operation
    def workers(self, within_s: float = 10.0) -> Op[builtins.list[dict[str, Any]]]:
        """Workers that sent a heartbeat in the last ``within_s`` seconds, each document as
        ``models.read_worker`` reads it (any shape: fields in another shape are named in its
        ``problems``)."""
        check_number(within_s, "within_s", 0, MAX_AGE_SECONDS)
        within = dt.timedelta(seconds=within_s)
        docs = yield from control.live_workers(self.core.clock.now(), within)
        return [read_worker(doc) for doc in docs]

    @operation
    def stop_worker(self, worker_id: str) -> Op[bool]:
        """Ask a worker to drain and exit; False if no such worker is registered."""
        return (yield from control.request_stop(worker_id))

    @operation
    def pause(self, name: str) -> Op[None]:
        """Stop claiming of ``name`` on every worker (runs in flight finish)."""
        yield from control.set_paused(validate_name(name), True, self.core.clock.now())

    @operation
    def resume(self, name: str) -> Op[None]:
        yield from control.set_paused(validate_name(name), False, self.core.clock.now())

    @operation
    def paused(self) -> Op[set[str]]:
        """The task names paused on every worker."""
        return (yield from control.paused_names())

    # -- limits and retention -------------------------------------------------------------------

    @operation
    def set_limit(
        self,
        name: str | None = None,
        *,
        resource: str | None = None,
        concurrency: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
        group_concurrency: int | None = None,
        group_rate: float | None = None,
        group_burst: int | None = None,
        overflow: str | None = None,
        names: Sequence[str] | None = None,
        tokens_per: tuple[int, float] | None = None,
    ) -> Op[dict[str, Any]]:
        """Limit ``name`` across all workers: at most ``concurrency`` runs at once, at most
        ``rate`` claims per second (bursts of ``burst``); and each of its groups
        (``options.group``) likewise with ``group_concurrency``, ``group_rate`` and
        ``group_burst`` (``group_concurrency=1``: each group is a sequence, run one at a time
        in publish order). Applies within a second.

        ``resource=`` instead of a name: the limit of a shared resource (an API quota), taken by
        every run of the names whose handler ``uses`` it (``@registry.task(uses=[...])``), and
        of the ``names`` given here (its declared users from now on; ``None``: as they were),
        exactly across the cluster; a resource has no groups.

        ``overflow``: what the limit does with a task it refuses: ``"queue"`` (the default: it
        waits for a slot), ``"drop"`` (cancelled at once) or ``"fail"`` (failed for good at
        once), its ``error`` saying why (a lossy limit).

        ``tokens_per=(N, seconds)`` (a resource's only): at most ``N`` tokens charged in each
        window of that many seconds by the runs that use it (``ctx.record_usage``); a run takes
        the resource only while the window's count is below ``N``."""
        own = limits.Limit(concurrency, rate, burst)
        group = limits.Limit(group_concurrency, group_rate, group_burst)
        now = self.core.clock.now()
        if resource is not None:
            if name is not None or group.set or group_burst is not None:
                raise InvalidTask(
                    "a resource's limit takes no name and no group_…", field="resource"
                )
            return (
                yield from store_limits.set_resource_limit(
                    resource, own, now, overflow, names, tokens_per
                )
            )
        if names is not None or tokens_per is not None:
            field = "names" if names is not None else "tokens_per"
            raise InvalidTask(f"only a resource's limit takes {field}", field=field)
        return (
            yield from store_limits.set_limit(
                validate_name(name), own, group, now, overflow=overflow
            )
        )

    @operation
    def clear_limit(self, name: str | None = None, *, resource: str | None = None) -> Op[bool]:
        """Remove the limit of ``name`` (or of the shared resource ``resource``)."""
        if resource is not None:
            if name is not None:
                raise InvalidTask("give a name or a resource, not both", field="resource")
            return (yield from store_limits.clear_resource_limit(resource))
        return (yield from store_limits.clear_limit(validate_name(name)))

    @operation
    def set_group_limit(
        self,
        name: str,
        group: str,
        *,
        concurrency: int | None = None,
        rate: float | None = None,
        burst: int | None = None,
        weight: float | None = None,
    ) -> Op[dict[str, Any]]:
        """Override the group limit of one group of ``name`` (a tier, a tenant): its own
        ``concurrency``, ``rate`` and ``burst`` (``None``: the name's ``group_…`` value), and its
        ``weight``, its share of turns among the name's groups (3: three turns for every one of a
        group of weight 1). Replaces the group's override; applies within a second."""
        override = limits.GroupOverride(concurrency, rate, burst, weight)
        return (
            yield from store_limits.set_group_limit(name, group, override, self.core.clock.now())
        )

    @operation
    def clear_group_limit(self, name: str, group: str) -> Op[bool]:
        """Remove the override of ``group`` of ``name``: the name's group limit and weight 1."""
        return (yield from store_limits.clear_group_limit(name, group))

    @operation
    def limits(self) -> Op[builtins.list[dict[str, Any]]]:
        return (yield from store_limits.all_limits())

    @operation
    def limit_gauges(self) -> Op[builtins.list[occupancy.LimitGauge]]:
        """Each limit's runs at once in use, its concurrency and whether a back-off holds it,
        from one read of the limits' documents (``metrics.LimitUse``)."""
        docs = yield from store_limits.all_limits()
        return occupancy.gauges(docs, self.core.clock.now())

    @operation
    def limit_use(self) -> Op[builtins.list[occupancy.NameUse]]:
        """How full each limit is: runs at once in use, sequences' locks held, and per group
        its tasks open, running, due and blocked and the one that runs next
        (``store.occupancy``)."""
        return (yield from occupancy.use(self.core.clock.now()))

    @operation
    def set_retention(
        self,
        name: str,
        *,
        succeeded_ms: int | None = None,
        failed_ms: int | None = None,
        cancelled_ms: int | None = None,
    ) -> Op[dict[str, Any]]:
        """How long finished tasks of ``name`` (``"*"``: of every name) are kept, per status,
        in ms (-1: forever; ``None``: the next level's default). Applies to tasks published
        afterwards (it is written into each task's options at publish; other clients read
        the defaults again within ``retention.CACHE_SECONDS``)."""
        self.core.retention_cache.clear()
        return (yield from retention.set_defaults(name, succeeded_ms, failed_ms, cancelled_ms))

    @operation
    def clear_retention(self, name: str) -> Op[bool]:
        self.core.retention_cache.clear()
        return (yield from retention.clear_defaults(name))

    @operation
    def retention(self) -> Op[builtins.list[dict[str, Any]]]:
        """The retention defaults set, per name (``"*"``: every name)."""
        return (yield from retention.all_defaults())

    # -- schedules ------------------------------------------------------------------------------

    @operation
    def add_schedule(self, /, id: str, task: str, **definition: Any) -> Op[dict[str, Any]]:
        """Create or change a schedule: ``cron=`` or ``every=``, and ``timezone``, ``params``,
        ``options``, ``catch_up`` (see ``mtask.schedules.Schedule.build``)."""
        schedule = schedules.Schedule.build(id, task, **definition)
        return (yield from store_schedules.put(schedule, self.core.clock.now()))

    @operation
    def schedules(self) -> Op[builtins.list[dict[str, Any]]]:
        return (yield from store_schedules.all_schedules())

    @operation
    def pause_schedule(self, id: str) -> Op[dict[str, Any]]:
        return (yield from store_schedules.set_paused(id, True, self.core.clock.now()))

    @operation
    def resume_schedule(self, id: str) -> Op[dict[str, Any]]:
        return (yield from store_schedules.set_paused(id, False, self.core.clock.now()))

    @operation
    def remove_schedule(self, id: str) -> Op[bool]:
        return (yield from store_schedules.remove(id))

    # -- triggers and waits on data (docs/triggers.md) -----------------------------------------

    @operation
    def triggers(self) -> Op[builtins.list[dict[str, Any]]]:
        """Every follower of this tasks collection, as ``store.followers`` reads it: the
        registry's triggers (``kind`` ``trigger``) and the collections tasks wait on (``wait``),
        each with its holder, position (``at``, ``through``), lag (``lag_ms``, on the server's
        clock), counts, scan and declaration (``spec``)."""
        return (yield from followers.list_followers(self.core.collection_name))

    @operation
    def pause_trigger(self, name: str) -> Op[dict[str, Any]]:
        """Stop following a trigger (``NAME``, or ``wait:COLLECTION``) until resumed: its
        holder stops within a renewal, and its position is kept."""
        return (yield from self._follower_set(name, followers.set_paused, True))

    @operation
    def resume_trigger(self, name: str) -> Op[dict[str, Any]]:
        """Follow a paused trigger again, from its position (history lost: a scan)."""
        return (yield from self._follower_set(name, followers.set_paused, False))

    @operation
    def reset_trigger(self, name: str, *, scan: bool = False) -> Op[dict[str, Any]]:
        """Forget a trigger's position: it follows from now, after a scan of the matching
        documents if ``scan``."""
        return (yield from self._follower_set(name, followers.reset, scan))

    def _follower_set(
        self, name: str, change: Callable[..., Op[Any]], value: bool
    ) -> Op[dict[str, Any]]:
        kind, bare = follower_of(name)
        if not (yield from change(self.core.collection_name, kind, bare, value)):
            raise TriggerNotFound(name)
        found = yield from followers.get(self.core.collection_name, kind, bare)
        return found or {}
