"""What a run's journal may hold (docs/steps.md): its limits, the kinds and states of an entry,
step, signal and patch names, results as BSON; the errors that refuse the rest."""

from __future__ import annotations

import datetime as dt
from typing import Any

import bson

from mtask.errors import MtaskError

Doc = dict[str, Any]

MAX_STEPS = 1000
"""The most steps one task records (its document holds them)."""
MAX_STEP_NAME = 200
INLINE_BYTES = 16 * 1024
"""A result larger than this as BSON is kept in the side collection (``<tasks>.steps``)."""
INLINE_TOTAL_BYTES = 1024 * 1024
"""The most inline results one task document holds; later results spill."""
SPILL_CHUNK_BYTES = 4 * 1024 * 1024
"""A spilled result is cut into side documents of at most this many bytes."""
MAX_SPILL_BYTES = 512 * 1024 * 1024
MAX_TRIES_KEPT = 10
"""A step keeps its newest tries (run, attempt, when, how long, error)."""
NEVER = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)
"""``available_at`` of a task waiting for a signal without a timeout."""
KINDS: tuple[str, ...] = ("call", "sleep", "signal", "data")
# children spawned and awaited, a recorded value (ctx.now, ctx.uuid), a patch marker
KINDS += ("children", "value", "patch")
STATES = ("done", "failed", "waiting", "timed_out")


class StepError(MtaskError):
    """A step asked for in a way the journal cannot record (a name used twice, too many steps,
    a result that is not BSON): the run fails for good, nothing is written."""

    default_message = "invalid step"


class StepMismatch(StepError):
    """This run asked for a step other than the one recorded at its place: the handler's code
    changed, or it chooses its steps by something other than its params and earlier steps."""

    default_message = "the steps asked for differ from the recorded ones"


class SignalTimeout(MtaskError):
    """``wait_for`` timed out before its signal came (the handler may catch it)."""

    default_message = "no signal before the timeout"


class ConditionTimeout(SignalTimeout):
    """``wait_until`` timed out before its document was in the state it waits for (a durable
    wait's timeout, as ``SignalTimeout``: the handler may catch either)."""

    default_message = "the document did not reach the state before the timeout"


def encode(result: Any) -> bytes:
    try:
        return bson.encode({"v": result})
    except Exception as exc:  # noqa: BLE001 - any encoding problem is the handler's
        raise StepError(f"a step's result must be BSON: {exc}") from None


def decode(data: bytes) -> Any:
    return bson.decode(data)["v"]


def error_text(exc: BaseException) -> str:
    """How an entry names the error of a try (at most 2,000 characters)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + "…"


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME or "\x00" in name:
        raise StepError(f"a step's name is a string of 1 to {MAX_STEP_NAME} characters, no NUL")
    return name


def check_signal_name(name: Any) -> str:
    """A signal's name: a step's name that does not start with ``$`` (it is a value in the
    signal's pipeline update, where ``$…`` would read a field)."""
    if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME or "\x00" in name:
        raise StepError(f"a signal's name is a string of 1 to {MAX_STEP_NAME} characters, no NUL")
    if name.startswith("$"):
        raise StepError(f"a signal's name cannot start with '$': {name!r}")
    return name


def check_patch(patch: Any) -> str:
    if not isinstance(patch, str) or not patch or len(patch) > MAX_STEP_NAME - 6:
        raise StepError(f"a patch's id is a string of 1 to {MAX_STEP_NAME - 6} characters")
    return check_name(patch)


def replays(prior: Doc | None) -> bool:
    """Whether a recorded entry is given back as it is (a result, a timeout, children that
    failed), rather than called, checked or awaited again."""
    if prior is None:
        return False
    state = prior.get("state")
    return state in ("done", "timed_out") or (state == "failed" and prior.get("kind") == "children")


def aware(when: dt.datetime) -> dt.datetime:
    """``when`` with its zone (BSON gives back naive UTC times)."""
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def to_ms(when: dt.datetime) -> dt.datetime:
    """``when`` to the millisecond, as BSON keeps it."""
    return aware(when).replace(microsecond=when.microsecond // 1000 * 1000)
