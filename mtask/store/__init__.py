"""Every MongoDB operation on tasks, each one atomic call, each taking ``now`` from a clock.

Each operation is a generator that yields one ``Call`` per MongoDB call and returns its result;
``mtask.driver`` runs it on the sync or the async client.

Fencing: every write that changes a run matches ``{"runs": {"$elemMatch": {"run_id": R,
"state": "RUNNING"}}}`` (a grouped SUCCESS write: R among the group's run ids, each of which
names one task), so a run whose lease was lost (taken over, released, cancelled) can change
nothing. Every transition ends with ``statemachine.recompute_stages(now)``.
"""

from mtask.store.claims import (
    claim,
    claim_fast_update,
    claim_filter,
    claim_lean_filter,
    claim_lean_pipeline,
    claim_locked,
    claim_pipeline,
    extend_lease,
    read_claimed,
    run_id_for,
)
from mtask.store.complete import complete, stranded
from mtask.store.counts import Counts, stats
from mtask.store.open_groups import heads, heads_and_slots, largest
from mtask.store.outcomes import (
    Outcome,
    finish,
    finish_many,
    finish_update,
    mark_invalid,
    outcome_requests,
    success_fast_update,
    success_group_update,
)
from mtask.store.schema import (
    CLAIMED_FIELDS,
    INDEXES,
    LAST_WRITE,
    PLACEMENT_FIELDS,
    SPECIFIC,
    WELL_FORMED,
    claim_tag,
    collection_init,
    collection_uuid,
    ensure_indexes,
    new_document,
    placeable,
    success_tag,
)
from mtask.store.tasks import (
    LIST_ORDERS,
    Published,
    cancel,
    get,
    get_status,
    list_query,
    list_tasks,
    missing_keys,
    placements,
    publish,
    publish_many,
    quarantine,
    retry,
    scan,
)
from mtask.vocabulary import RunState

__all__ = [
    "CLAIMED_FIELDS",
    "INDEXES",
    "LAST_WRITE",
    "LIST_ORDERS",
    "PLACEMENT_FIELDS",
    "SPECIFIC",
    "WELL_FORMED",
    "Counts",
    "Outcome",
    "Published",
    "RunState",
    "cancel",
    "claim",
    "claim_fast_update",
    "claim_filter",
    "claim_lean_filter",
    "claim_lean_pipeline",
    "claim_locked",
    "claim_pipeline",
    "claim_tag",
    "collection_init",
    "collection_uuid",
    "complete",
    "ensure_indexes",
    "extend_lease",
    "finish",
    "finish_many",
    "finish_update",
    "get",
    "get_status",
    "heads",
    "heads_and_slots",
    "largest",
    "list_query",
    "list_tasks",
    "mark_invalid",
    "missing_keys",
    "new_document",
    "outcome_requests",
    "placeable",
    "placements",
    "publish",
    "publish_many",
    "quarantine",
    "read_claimed",
    "retry",
    "run_id_for",
    "scan",
    "stats",
    "stranded",
    "success_fast_update",
    "success_group_update",
    "success_tag",
]
