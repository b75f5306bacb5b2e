"""Recording how runs ended, fenced by run id and RUNNING: one, or many in one bulk write."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import bson
from pymongo import ReturnDocument, UpdateOne

from mtask.driver import Call, Doc, Op
from mtask.statemachine import (
    RUNNING,
    recompute_stages,
    set_run_fields,
)
from mtask.store.claims import run_filter
from mtask.store.schema import LAST_WRITE, literal, marked_invalid, success_tag
from mtask.vocabulary import (
    DEFAULT_KEEP_MS,
    MAX_JOURNALS_KEPT,
    OPTION_DEFAULTS,
    RunState,
    TaskStatus,
)

if TYPE_CHECKING:
    from mtask.steps import Wait  # the step engine: not for a command that only reads


@dataclass(frozen=True)
class Outcome:
    """How a run ended, for ``finish``/``finish_many``."""

    key: str
    run_id: str
    state: RunState
    result: Any = None
    error: str | None = None
    error_class: str | None = None
    """FAIL: the importable path of the exception the handler raised (``builtins.ValueError``),
    kept on the run beside its traceback (``runs.error_class``); None: it raised none."""
    permanent: bool = False
    retry_delay_ms: int | None = None
    """Explicit delay before the task may be claimed again (FAIL: ``Retry(delay=…)``, None:
    the task's backoff; SNOOZED: the snooze's, ``mtask.limits.snooze``; RELEASED: a ``BackOff``'s
    hold, None: at once)."""
    jitter: float = 1.0
    """Backoff multiplier drawn by the caller, e.g. uniform(0.8, 1.2)."""
    steps: tuple[Doc, ...] = ()
    """SUCCESS: next steps (``flows.outbox_entry``), written to the outbox with the success."""
    has_dependents: bool = False
    """Other tasks depend on this one: resolve them once the outcome is recorded."""
    has_output: bool = False
    """The run stored log lines or chunks: seal them once the outcome is recorded
    (``store.output.seal``)."""
    worker_id: str | None = None
    """The worker whose run this is: a SUCCESS it records is tagged ``last_write``."""
    result_bytes: int | None = None
    """The result's BSON size, if the caller measured it (else measured when needed)."""
    keep_ms: int | None = DEFAULT_KEEP_MS["succeeded"]
    """SUCCESS: the task's retention once succeeded (``statemachine.keep_ms`` of the claimed
    options; ``None``: forever), for the plain-update shortcuts that cannot read the document.
    The pipeline path reads the document's own options instead."""
    committed: bool = False
    """A SUCCESS already committed in the handler's transaction (``store.transactional``):
    the recorder does not write it again, only what follows it."""
    wait: Wait | None = None
    """WAITING: the sleep or signal wait the run ended in (``mtask.steps``)."""
    has_spills: bool = False
    """The run stored step results aside: seal them once the outcome is recorded
    (``store.steps.seal``)."""
    child_of: Doc | None = None
    """A spawned child's ``spawn``: once its outcome is recorded, a final one is
    counted on its parent (``store.children.count_finished``)."""
    backed_off: bool = False
    """RELEASED by its handler's ``BackOff``: ``error`` says what it held until when (kept on
    the run), and the task's ``backoffs`` counts it."""
    renew: Doc | None = None
    """CONTINUED (``ctx.continue_as_new``): the task's new ``params`` and the signals its
    journal ``taken`` (``mtask.steps.waits.Wait.renew``)."""


def _success_tag(outcome: Outcome) -> Doc:
    return {} if outcome.worker_id is None else {LAST_WRITE: success_tag(outcome.worker_id)}


def _step_fields(outcome: Outcome) -> Doc:
    if not outcome.steps:
        return {}
    return {"outbox": list(outcome.steps), "children": [s["key"] for s in outcome.steps]}


def _option(name: str) -> Any:
    """``$options.<name>``, or its default where the document lacks it."""
    return {"$ifNull": [f"$options.{name}", OPTION_DEFAULTS[name]]}


def _backoff_expr(outcome: Outcome, now: dt.datetime) -> Any:
    if outcome.retry_delay_ms is not None:
        return now + dt.timedelta(milliseconds=outcome.retry_delay_ms)
    # a document written without the retry options backs off by their defaults (never null)
    delay = {
        "$min": [
            _option("max_retry_delay_ms"),
            {
                "$multiply": [
                    _option("retry_delay_ms"),
                    {
                        "$pow": [
                            _option("retry_backoff"),
                            {"$max": [0, {"$subtract": ["$failures", 1]}]},
                        ]
                    },
                    outcome.jitter,
                ]
            },
        ]
    }
    return {"$add": [now, {"$toLong": {"$round": [delay, 0]}}]}


def finish_update(outcome: Outcome, now: dt.datetime) -> tuple[Doc, list[Doc]]:
    """Filter and pipeline that record ``outcome`` on its run, fenced by run id and RUNNING."""
    state = outcome.state
    run_fields, sets = _state_fields(outcome, now)
    if state is not RunState.WAITING:
        # the wait it was woken from is over (a run that fails before it asks for its wait
        # again records no step, which would clear it): a signal must not wake it from a backoff
        sets["waiting"] = "$$REMOVE"
    stages: list[Doc] = [{"$set": {"runs": set_run_fields(outcome.run_id, run_fields), **sets}}]
    if state is RunState.FAIL and not outcome.permanent:
        stages.append({"$set": {"available_at": _backoff_expr(outcome, now)}})
    if (
        state in (RunState.WAITING, RunState.SNOOZED)
        or (state is RunState.FAIL and not outcome.permanent)
        or (state is RunState.RELEASED and outcome.retry_delay_ms)
    ):
        stages.append({"$set": {"available_at": by_deadline("$available_at")}})
    return run_filter(outcome.key, outcome.run_id), [*stages, *recompute_stages(now)]


def _state_fields(outcome: Outcome, now: dt.datetime) -> tuple[Doc, Doc]:
    """What ``outcome``'s state writes: on its run, and on the task."""
    state = outcome.state
    run_fields: Doc = {"state": state.value, "finished_at": now}
    sets: Doc = {}
    if state is RunState.SUCCESS:
        run_fields["result"] = literal(outcome.result)
        sets["successes"] = {"$add": ["$successes", 1]}
        sets["result"] = literal(outcome.result)
        sets.update({k: literal(v) for k, v in _step_fields(outcome).items()})
        sets.update({k: literal(v) for k, v in _success_tag(outcome).items()})
    elif state is RunState.FAIL:
        run_fields["error"] = literal(outcome.error)
        if outcome.error_class is not None:
            run_fields["error_class"] = literal(outcome.error_class)
        sets["error"] = literal(outcome.error)
        sets["failures"] = {"$add": ["$failures", 1]}
        if outcome.permanent:
            sets["failed_permanently"] = True
        # its retries spent too: its last word, as a permanent FAIL's
        final = outcome.permanent or {"$gt": [{"$add": ["$failures", 1]}, "$options.max_retries"]}
        sets["steps"] = settled_waits_expr(now, final)
    elif state is RunState.RELEASED:
        _released_fields(outcome, now, run_fields, sets)
    elif state is RunState.SNOOZED:  # no failure counted, the snooze counted
        run_fields["error"] = literal(outcome.error)
        sets["snoozes"] = {"$add": [{"$ifNull": ["$snoozes", 0]}, 1]}
        sets["available_at"] = now + dt.timedelta(milliseconds=outcome.retry_delay_ms or 0)
    elif state is RunState.CANCELLED:
        run_fields["error"] = literal(outcome.error)
    else:
        sets.update(_resumed_fields(outcome, now))
    return run_fields, sets


def _released_fields(outcome: Outcome, now: dt.datetime, run_fields: Doc, sets: Doc) -> None:
    """A RELEASED run: its task due at once, or after a back-off's hold or the wait of a task
    its worker could not decrypt; the run keeps why (``error``), a ``BackOff`` is counted."""
    sets["available_at"] = now + dt.timedelta(milliseconds=outcome.retry_delay_ms or 0)
    if outcome.error is not None:
        run_fields["error"] = literal(outcome.error)
    if outcome.backed_off:
        sets["backoffs"] = {"$add": [{"$ifNull": ["$backoffs", 0]}, 1]}


def _resumed_fields(outcome: Outcome, now: dt.datetime) -> Doc:
    """What a run that ends WAITING or CONTINUED writes on its task."""
    if outcome.state is RunState.WAITING and outcome.wait is not None:
        return _waiting_fields(outcome.wait, now)
    if outcome.state is RunState.CONTINUED and outcome.renew is not None:
        return continued_fields(outcome.run_id, outcome.renew, now)
    raise ValueError(f"a run cannot be finished as {outcome.state}")


def continued_fields(run_id: str, renew: Doc, now: dt.datetime) -> Doc:
    """A run that continued as new (docs/steps.md, "Loops without end"): the task afresh, due
    now, with its new params and an empty journal (no ``steps``, ``waiting``, ``spawned``), its
    retries unspent (``failures`` 0, no ``error``), the signals its journal's waits took gone
    and the others kept, and the journal it leaves summarised in ``continued`` (the newest
    ``MAX_JOURNALS_KEPT``). Its key, group, priority, options, runs and counters stay."""
    count = {"$add": [{"$ifNull": ["$continued.n", 0]}, 1]}
    summary = {
        "n": count,
        "run_id": run_id,
        "at": now,
        "steps": {"$size": {"$ifNull": ["$steps", []]}},
        "last": {"$ifNull": [{"$last": {"$ifNull": ["$steps.name", []]}}, None]},
    }
    journals = {"$concatArrays": [{"$ifNull": ["$continued.journals", []]}, [summary]]}
    fields: Doc = {
        "params": literal(renew["params"]),
        "steps": "$$REMOVE",
        "spawned": "$$REMOVE",
        "failures": 0,
        "error": "$$REMOVE",
        "available_at": now,
        "continued": {
            "n": count,
            "at": now,
            "journals": {"$lastN": {"input": journals, "n": MAX_JOURNALS_KEPT}},
        },
    }
    taken = [t for t in renew.get("taken") or () if t.get("n")]
    if taken:
        fields["signals"] = _signals_left(taken)
    return fields


def _signals_left(taken: Sequence[Doc]) -> Doc:
    """``signals`` without the first ``n`` of each name in ``taken`` (``[{name, n}]``): those
    the journal's waits took; the order of the others kept."""
    same = {"$eq": ["$$x.name", "$$this.name"]}
    find = {"$first": {"$filter": {"input": "$$value.t", "as": "x", "cond": same}}}
    less = {
        "$map": {
            "input": "$$value.t",
            "as": "x",
            "in": {
                "$cond": [
                    same,
                    {"name": "$$x.name", "n": {"$subtract": ["$$x.n", 1]}},
                    "$$x",
                ]
            },
        }
    }
    step = {
        "$let": {
            "vars": {"left": {"$ifNull": [{"$getField": {"field": "n", "input": find}}, 0]}},
            "in": {
                "$cond": [
                    {"$gt": ["$$left", 0]},
                    {"t": less, "kept": "$$value.kept"},
                    {"t": "$$value.t", "kept": {"$concatArrays": ["$$value.kept", ["$$this"]]}},
                ]
            },
        }
    }
    folded = {
        "$reduce": {
            "input": {"$ifNull": ["$signals", []]},
            "initialValue": {"t": literal([dict(t) for t in taken]), "kept": []},
            "in": step,
        }
    }
    return {"$getField": {"field": "kept", "input": folded}}


def settled_waits_expr(now: dt.datetime, final: Any = True) -> Doc:
    """The journal of a task that fails for good, each wait its runs never came back to said as
    it ended (a run woken from it failed before its replay reached it: a changed handler's
    ``StepMismatch``, say): a sleep whose end has passed ``done``; a signal wait whose signal
    came ``done``, with that signal's payload as its result (what a replay would have taken);
    one whose deadline passed without it ``timed_out``; any other left as it was. A FAIL's write
    carries this (no other outcome's does), and only one that ends the task (``final``: an
    expression, or ``True``) changes the journal."""
    came = {
        "$filter": {
            "input": {"$ifNull": ["$signals", []]},
            "as": "g",
            "cond": {"$eq": ["$$g.name", "$$s.signal"]},
        }
    }
    over = {"$lte": ["$$s.until", now]}
    settled = {
        "$switch": {
            "branches": [
                {
                    "case": {"$and": [{"$eq": ["$$s.kind", "sleep"]}, over]},
                    "then": {"$mergeObjects": ["$$s", {"state": "done"}]},
                },
                {
                    "case": {
                        "$and": [
                            {"$eq": ["$$s.kind", "signal"]},
                            {"$gt": [{"$size": came}, {"$ifNull": ["$$s.nth", 0]}]},
                        ]
                    },
                    "then": {
                        "$mergeObjects": [
                            "$$s",
                            {
                                "state": "done",
                                "result": {
                                    "$getField": {
                                        "field": "payload",
                                        "input": {
                                            "$arrayElemAt": [came, {"$ifNull": ["$$s.nth", 0]}]
                                        },
                                    }
                                },
                            },
                        ]
                    },
                },
                {
                    "case": {"$and": [{"$eq": ["$$s.kind", "signal"]}, over]},
                    "then": {"$mergeObjects": ["$$s", {"state": "timed_out"}]},
                },
            ],
            "default": "$$s",
        }
    }
    waiting = {"$eq": ["$$s.state", "waiting"]}
    journal = {"$ifNull": ["$steps", "$$REMOVE"]}
    return {
        "$cond": [
            {"$and": [final, {"$isArray": "$steps"}]},
            {"$map": {"input": "$steps", "as": "s", "in": {"$cond": [waiting, settled, "$$s"]}}},
            journal,
        ]
    }


def by_deadline(when: Any) -> Doc:
    """``when``, or the task's deadline if that comes first (a retry's backoff or a
    wait that would pass it; ``$min`` passes over a missing deadline). Claimed then, the run
    fails for good at once, saying why (``worker.running.task_deadlines``). A deadline that is
    not a date (a hand edit) is passed over too."""
    deadline = "$options.deadline"
    return {"$min": [when, {"$cond": [{"$eq": [{"$type": deadline}, "date"]}, deadline, when]}]}


def _waiting_fields(wait: Wait, now: dt.datetime) -> Doc:
    """A run that ends waiting (docs/steps.md): its step's entry (if new), ``waiting``, and
    ``available_at``: the sleep's end, or the wait's deadline, or now if the signal is there
    already (sent while the run was deciding to wait: it is not lost), or if a change woke the
    data wait its run announced."""
    fields: Doc = {"waiting": literal(wait.to_document())}
    if wait.entry is not None:
        entry = literal([dict(wait.entry)])
        fields["steps"] = {"$concatArrays": [{"$ifNull": ["$steps", []]}, entry]}
    if wait.data is not None:
        # a data wait announced by its run (store.datawaits.announce) and woken by a change
        # before this write: claimable now, its next run looks again (docs/triggers.md)
        woke = {
            "$and": [
                {"$eq": ["$waiting.index", wait.index]},
                {"$eq": [{"$type": "$waiting.data.woke"}, "date"]},
            ]
        }
        fields["available_at"] = {"$cond": [woke, now, wait.until]}
    elif wait.children is not None:  # now, if the last child finished meanwhile
        counted = {"$gte": ["$spawned.done", "$spawned.total"]}
        fields["available_at"] = {"$cond": [counted, now, wait.until]}
    elif wait.signal is None:
        fields["available_at"] = wait.until
    else:
        came = {
            "$size": {
                "$filter": {
                    "input": {"$ifNull": ["$signals", []]},
                    "cond": {"$eq": ["$$this.name", wait.signal]},
                }
            }
        }
        fields["available_at"] = {"$cond": [{"$gt": [came, wait.nth]}, now, wait.until]}
    return fields


def finish(outcome: Outcome, now: dt.datetime) -> Op[Doc | None]:
    """Record one run's outcome; ``None`` when the run no longer owns the task (fenced out)."""
    filt, pipeline = finish_update(outcome, now)
    doc: Doc | None = yield Call(
        "find_one_and_update", (filt, pipeline), {"return_document": ReturnDocument.AFTER}
    )
    return doc


def mark_invalid(outcome: Outcome, now: dt.datetime, reason: str) -> Op[int]:
    """The last resort for a run whose document refuses its outcome and the FAIL in its place:
    its task marked ``invalid`` with ``reason`` (as ``store.quarantine`` does: out of the claim
    index), fenced by run id and RUNNING like any outcome. Returns 1 if marked, 0 if the run
    no longer owns the task."""
    result = yield Call(
        "update_many",
        (
            run_filter(outcome.key, outcome.run_id),
            [marked_invalid(literal(reason), now)],
        ),
    )
    return int(result.modified_count)


def success_fast_update(outcome: Outcome, now: dt.datetime) -> tuple[Doc, Doc]:
    """The common case as a plain update: SUCCESS of a concurrency-1 task that is running.

    Its result is fully determined (succeeded, no next claim, nothing to fold), so it needs no
    pipeline; the filter keeps the same fence (run id + RUNNING) and adds the conditions that
    make the shortcut exact. A task it does not match gets the general pipeline instead."""
    filt = {
        **run_filter(outcome.key, outcome.run_id),
        "status": TaskStatus.RUNNING.value,
        "options.concurrency": 1,
    }
    fields = {**_succeeded(outcome, now), **_step_fields(outcome)}
    return filt, _positional_success(outcome.result, now, fields)


def _succeeded(outcome: Outcome, now: dt.datetime) -> Doc:
    """The top-level fields a recorded SUCCESS of a concurrency-1 task sets, except the result:
    with ``expire_at`` as ``statemachine.compute_expire_at`` gives it (a task with next steps
    is held instead, ``expire_held``)."""
    fields: Doc = {
        "status": TaskStatus.SUCCEEDED.value,
        "next_claim_at": None,
        "finished_at": now,
        "updated_at": now,
        **_success_tag(outcome),
    }
    if outcome.steps:
        fields["expire_held"] = True
    elif outcome.keep_ms is not None:
        fields["expire_at"] = now + dt.timedelta(milliseconds=outcome.keep_ms)
    return fields


def _positional_success(result: Any, now: dt.datetime, fields: Doc) -> Doc:
    """A plain update that ends the run ``$`` (the one the filter's ``$elemMatch`` matched)."""
    return {
        "$set": {
            "runs.$.state": RunState.SUCCESS.value,
            "runs.$.finished_at": now,
            "runs.$.result": result,
            "result": result,
            **fields,
        },
        "$inc": {"successes": 1},
    }


GROUP_RESULT_BYTES = 4 * 1024 * 1024
"""The most result BSON one grouped update carries (a command is capped at 16 MiB)."""


def _groupable(outcome: Outcome) -> bool:
    """A SUCCESS with no next steps (its outbox is per task) and a result that fits a group."""
    return (
        outcome.state is RunState.SUCCESS
        and not outcome.steps
        and _result_bytes(outcome) <= GROUP_RESULT_BYTES
    )


def _result_bytes(outcome: Outcome) -> int:
    if outcome.result is None:
        return 0
    if outcome.result_bytes is not None:
        return outcome.result_bytes
    return len(bson.encode({"result": outcome.result}))


def success_group_update(
    outcomes: Sequence[Outcome], now: dt.datetime
) -> tuple[Doc, Doc | list[Doc]]:
    """``success_fast_update`` for many ``_groupable`` outcomes of one worker, as the filter and
    update of one ``update_many``: one write of many documents costs the server about half of
    as many single-document writes in a bulk (docs/journal/2026-11.md, finding 13).

    The fence is the same: each task matches only while one of its runs is RUNNING with an id
    from the list, and a run id belongs to one task (``run_id_for``: a uuid4 batch id and the
    key), so that run is the task's own; with concurrency 1 it is the only RUNNING run. When no
    outcome has a result, the update is a plain ``$set`` (``$`` is the run the ``$elemMatch``
    matched); else a pipeline picks each task's result by its key."""
    keys = [o.key for o in outcomes]
    run_ids = [o.run_id for o in outcomes]
    filt = {
        "_id": {"$in": keys},
        "runs": {"$elemMatch": {"run_id": {"$in": run_ids}, "state": RUNNING}},
        "status": TaskStatus.RUNNING.value,
        "options.concurrency": 1,
    }
    done = _succeeded(outcomes[0], now)  # one worker, one retention: the same for all
    if all(o.result is None for o in outcomes):
        return filt, _positional_success(None, now, done)
    result = {
        "$arrayElemAt": [
            literal([o.result for o in outcomes]),
            {"$indexOfArray": [literal(keys), "$_id"]},
        ]
    }
    ended = {"state": RunState.SUCCESS.value, "finished_at": now, "result": "$_result"}
    pipeline: list[Doc] = [
        {"$set": {"_result": result}},
        {
            "$set": {
                "runs": set_run_fields(run_ids, ended),  # a task's only run among them: its own
                "result": "$_result",
                "successes": {"$add": ["$successes", 1]},
                **done,
            }
        },
        {"$unset": "_result"},
    ]
    return filt, pipeline


def _groups(outcomes: Sequence[Outcome]) -> tuple[list[list[Outcome]], list[Outcome]]:
    """Outcomes to write in one ``update_many`` each (two or more of one worker and one
    retention, at most ``GROUP_RESULT_BYTES`` of results, each key once: a group picks results
    by key), and the rest."""
    alike: dict[tuple[str | None, int | None], list[Outcome]] = {}
    rest: list[Outcome] = []
    keys: set[str] = set()
    for outcome in outcomes:
        if _groupable(outcome) and outcome.key not in keys:
            alike.setdefault((outcome.worker_id, outcome.keep_ms), []).append(outcome)
            keys.add(outcome.key)
        else:
            rest.append(outcome)
    groups: list[list[Outcome]] = []
    for same_worker in alike.values():
        group: list[Outcome] = []
        size = 0
        for outcome in same_worker:
            size += _result_bytes(outcome)
            if group and size > GROUP_RESULT_BYTES:
                groups.append(group)
                group, size = [], _result_bytes(outcome)
            group.append(outcome)
        groups.append(group)
    rest += [g[0] for g in groups if len(g) == 1]
    return [g for g in groups if len(g) > 1], rest


def outcome_update(outcome: Outcome, now: dt.datetime) -> tuple[Doc, Any]:
    """The fenced update of one outcome: the plain-update shortcut for SUCCESS, else the
    pipeline."""
    if outcome.state is RunState.SUCCESS:
        return success_fast_update(outcome, now)
    return finish_update(outcome, now)


def outcome_requests(outcomes: Sequence[Outcome], now: dt.datetime) -> list[UpdateOne]:
    """One fenced update per outcome, for a bulk write."""
    return [UpdateOne(*outcome_update(o, now)) for o in outcomes]


def _finish_unmatched(outcomes: Sequence[Outcome], now: dt.datetime) -> Op[int]:
    """After a bulk write that applied fewer updates than expected: SUCCESS outcomes whose run
    is still RUNNING were not matched by the shortcut (concurrency > 1, a cancelled task) and
    take the pipeline; the others were fenced out (their runs lost the task) and stay so."""
    success = {o.run_id: o for o in outcomes if o.state is RunState.SUCCESS}
    if not success:
        return 0
    open_runs = yield Call(
        "find",
        (
            {
                "_id": {"$in": [o.key for o in success.values()]},
                "runs": {"$elemMatch": {"run_id": {"$in": list(success)}, "state": RUNNING}},
            },
            {"runs.run_id": 1, "runs.state": 1},
        ),
    )
    pending = [
        success[r["run_id"]]
        for doc in open_runs
        for r in doc.get("runs", ())
        if r.get("state") == RUNNING and r.get("run_id") in success
    ]
    if not pending:
        return 0
    requests = [UpdateOne(*finish_update(o, now)) for o in pending]
    result = yield Call("bulk_write", (requests,), {"ordered": False})
    return int(result.modified_count)


def finish_many(outcomes: Sequence[Outcome], now: dt.datetime) -> Op[int]:
    """Record many outcomes: a worker's SUCCESSes in one ``update_many``
    (``success_group_update``), the others in one unordered bulk write of one fenced update
    each (one alone: an ``update_many`` of its key, not a retryable write); returns how many
    were recorded."""
    if not outcomes:
        return 0
    groups, rest = _groups(outcomes)
    recorded = 0
    for group in groups:
        result = yield Call("update_many", success_group_update(group, now))
        recorded += int(result.modified_count)
    if len(rest) == 1:
        # One outcome (a trickle's): its fenced update as `update_many`, which matches one
        # document by its key and is not a retryable write, so the server keeps no session
        # record for it. The recorder sends a failed write again itself, and the fence makes a
        # repeat harmless (docs/journal/2026-11.md, "A claim, a ping and an outcome alone are not
        # retryable writes").
        result = yield Call("update_many", outcome_update(rest[0], now))
        recorded += int(result.modified_count)
    elif rest:
        result = yield Call("bulk_write", (outcome_requests(rest, now),), {"ordered": False})
        recorded += int(result.modified_count)
    if recorded != len(outcomes):
        recorded += yield from _finish_unmatched(outcomes, now)
    return recorded
