"""Triggers (docs/triggers.md): tasks published by changes to the application's own collections.

A ``Trigger`` is a declaration (``Registry.trigger``): which collection, which changes (the
operation types, a match on the changed document, the fields an update touched), which task
each change publishes, under which key and with which params. Everything here is pure: the
change stream's pipeline, a change's key and params, the scan's filter. The worker follows each
trigger on one change stream for the whole cluster (``worker/reacting``); the writes are
``store/triggers.py`` (the tasks) and ``store/followers.py`` (the lease and the position).

Keys. A change's key is ``<trigger>:<document id>:<digest of its resume token>``: the resume
token names one event of the oplog for good (its cluster time, its place in a transaction, the
document), so a change handed out again after a crash or a failover gets the same key, and its
publish finds the task there. ``key="document"`` keys the task by the document alone
(``<trigger>:<document id>``; the rules of joining and resetting it are ``store/triggers.py``'s).
A scan publishes ``<trigger>:<document id>:scan<epoch>``: a scan run again after a crash finds
its tasks there.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import bson
from bson import ObjectId, json_util

from mtask.errors import InvalidTask
from mtask.vocabulary import MAX_KEY_LENGTH, bson_json, encodable, validate_name

if TYPE_CHECKING:
    from mtask.models import TaskOptions

Doc = dict[str, Any]

OPERATIONS = ("insert", "update", "replace", "delete")
DEFAULT_ON = ("insert", "update", "replace")
KEYS = ("change", "document")
STARTS = ("now", "scan")
LOGICAL = ("$and", "$or", "$nor")
"""The top-level operators a match may use: their clauses are matches too."""
MAX_NAME = 100
MAX_DEBOUNCE_S = 86_400.0
MAX_FIELDS = 100
DIGEST_BYTES = 10
"""A change's key holds this many bytes of its resume token's digest (as hex): 80 bits."""


def _refuse(field: str, message: str) -> InvalidTask:
    return InvalidTask(message, field=field)


def check_collection(name: object, field: str = "collection") -> str:
    """A collection's name as MongoDB takes it: not empty, no ``$`` or NUL, not ``system.``."""
    if not isinstance(name, str) or not name or len(name) > 200:
        raise _refuse(field, "must be a collection's name, 1 to 200 characters")
    if "$" in name or "\x00" in name or name.startswith("system."):
        raise _refuse(field, f"{name!r} is not a collection mtask may follow")
    return name


def _paths(value: object, field: str) -> tuple[str, ...]:
    """Field paths (``a``, ``a.b``): strings without ``$``, none the prefix of another."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise _refuse(field, "must be a list of field names")
    paths = tuple(value)
    if len(paths) > MAX_FIELDS:
        raise _refuse(field, f"at most {MAX_FIELDS} fields")
    for path in paths:
        if not isinstance(path, str) or not path or path.startswith("$") or "\x00" in path:
            raise _refuse(field, f"{path!r} is not a field name")
        if any(p != path and p.startswith(path + ".") for p in paths):
            raise _refuse(field, f"{path!r} and a field inside it are both named")
    return paths


def prefixed(match: Mapping[str, Any], prefix: str, field: str = "match") -> Doc:
    """``match`` with each field path under ``prefix`` (``fullDocument.``): the same query on the
    change's document. Only field conditions and ``$and``/``$or``/``$nor`` are rewritten; any
    other top-level operator (``$expr``, ``$where``, ``$text``, ``$jsonSchema``) names fields in
    ways a prefix cannot reach, and is refused."""
    out: Doc = {}
    for name, condition in match.items():
        if not isinstance(name, str):
            raise _refuse(field, "its keys are field names")
        if name in LOGICAL:
            if not isinstance(condition, list | tuple) or not condition:
                raise _refuse(field, f"{name} takes a non-empty list of matches")
            clauses = [c for c in condition if isinstance(c, Mapping)]
            if len(clauses) != len(condition):
                raise _refuse(field, f"{name} takes a list of matches")
            out[name] = [prefixed(c, prefix, field) for c in clauses]
        elif name == "$comment":
            out[name] = condition
        elif name.startswith("$"):
            raise _refuse(
                field, f"{name} is not supported: a match holds field conditions, $and, $or, $nor"
            )
        else:
            out[prefix + name] = condition
    return out


def _check_match(match: object) -> Doc:
    if match is None:
        return {}
    if not isinstance(match, Mapping):
        raise _refuse("match", "must be a mapping of field conditions")
    try:
        bson.encode(dict(match))
    except Exception as exc:  # noqa: BLE001 - any encoding problem is the declaration's
        raise _refuse("match", f"must be BSON: {exc}") from None
    prefixed(match, "fullDocument.")  # refuses what cannot be followed
    return dict(match)


def _check_on(on: object, match: Doc) -> tuple[str, ...]:
    if isinstance(on, str) or not isinstance(on, Iterable):
        raise _refuse("on", f"must be a list of {', '.join(OPERATIONS)}")
    kinds = tuple(dict.fromkeys(on))
    if not kinds or any(k not in OPERATIONS for k in kinds):
        raise _refuse("on", f"must name some of {', '.join(OPERATIONS)}, not {list(on)!r}")
    if "delete" in kinds and match:
        raise _refuse("on", "a delete leaves no document to match: a match excludes 'delete'")
    return kinds


def _check_debounce(debounce: object) -> float | None:
    if debounce is None:
        return None
    seconds = debounce.total_seconds() if isinstance(debounce, dt.timedelta) else debounce
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or not 0 < seconds <= MAX_DEBOUNCE_S
    ):
        raise _refuse(
            "debounce", f"must be a number of seconds above 0, at most {MAX_DEBOUNCE_S:g}"
        )
    return float(seconds)


def _check_options(options: TaskOptions | Mapping[str, Any] | None) -> Doc:
    given: Doc = {}
    if options:  # none given: nothing to check (nor pydantic to load)
        from mtask.models import explicit_options

        given = explicit_options(options)
    if "run_at" in given:
        raise _refuse("options.run_at", "a trigger's tasks run when their change comes")
    return given


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise _refuse("name", f"must be a string of 1 to {MAX_NAME} characters")
    if ":" in name or "/" in name or "\x00" in name or not encodable(name):
        raise _refuse("name", f"{name!r}: no ':', '/' or NUL (it starts the tasks' keys)")
    return name


@dataclass(frozen=True)
class Trigger:
    """One declared trigger (``Registry.trigger``); ``build`` checks it."""

    name: str
    collection: str
    task: str
    match: Doc
    on: tuple[str, ...]
    fields: tuple[str, ...]
    """Updates pass only if they touched one of these fields (or one inside, or around, it);
    empty: any update."""
    params: tuple[str, ...]
    """The changed document's fields copied into the task's params."""
    key: str
    debounce: float | None
    start: str
    images: bool
    """Match the document as the change left it (a post-image: the collection needs
    ``changeStreamPreAndPostImages``), not as it is when the event is read."""
    options: Doc

    @classmethod
    def build(
        cls,
        collection: str,
        *,
        task: str,
        name: str | None = None,
        match: Mapping[str, Any] | None = None,
        on: Iterable[str] = DEFAULT_ON,
        fields: Sequence[str] | None = None,
        params: Sequence[str] | None = None,
        key: str | None = None,
        debounce: float | dt.timedelta | None = None,
        start: str = "now",
        images: bool = False,
        options: TaskOptions | Mapping[str, Any] | None = None,
    ) -> Trigger:
        """Check a declaration; a bad one is ``InvalidTask`` naming the field, at import."""
        checked_match = _check_match(match)
        seconds = _check_debounce(debounce)
        if key is None:
            key = "document" if seconds is not None else "change"
        if key not in KEYS:
            raise _refuse("key", f"must be 'change' or 'document', not {key!r}")
        if seconds is not None and key != "document":
            raise _refuse("debounce", "debounces the document's task: it needs key='document'")
        if start not in STARTS:
            raise _refuse("start", f"must be 'now' or 'scan', not {start!r}")
        if not isinstance(images, bool):
            raise _refuse("images", "must be True or False")
        try:
            task = validate_name(task)
        except InvalidTask as exc:
            raise _refuse("task", exc.message.removeprefix("name: ")) from None
        return cls(
            name=_check_name(name if name is not None else task),
            collection=check_collection(collection),
            task=task,
            match=checked_match,
            on=_check_on(on, checked_match),
            fields=_paths(fields, "fields"),
            params=_paths(params, "params"),
            key=key,
            debounce=seconds,
            start=start,
            images=images,
            options=_check_options(options),
        )

    # -- the stream ------------------------------------------------------------------------------

    @property
    def full_document(self) -> str:
        return "required" if self.images else "updateLookup"

    def pipeline(self) -> list[Doc]:
        """The change stream's pipeline: the changes that publish, reduced to what a task
        needs (the document's key, the operation, the cluster time, the params' fields)."""
        clauses: list[Doc] = [{"operationType": {"$in": list(self.on)}}]
        if self.match:
            clauses.append(prefixed(self.match, "fullDocument."))
        if self.fields and "update" in self.on:
            clauses.append(
                {"$or": [{"operationType": {"$ne": "update"}}, {"$expr": touched(self.fields)}]}
            )
        match = clauses[0] if len(clauses) == 1 else {"$and": clauses}
        project: Doc = {"operationType": 1, "clusterTime": 1, "documentKey": 1}
        project.update({f"fullDocument.{f}": 1 for f in self.params})
        return [{"$match": match}, {"$project": project}]

    def scan_filter(self) -> Doc:
        """The documents a scan publishes for: the match, as a find's filter."""
        return dict(self.match)

    def scan_projection(self) -> Doc:
        return {"_id": 1, **{f: 1 for f in self.params}}

    def spec(self) -> Doc:
        """What operators see of the declaration (stored with its position)."""
        return {
            "collection": self.collection,
            "task": self.task,
            "match": json.dumps(bson_json(self.match)),
            "on": list(self.on),
            "fields": list(self.fields),
            "params": list(self.params),
            "key": self.key,
            "debounce": self.debounce,
            "start": self.start,
            "images": self.images,
        }

    # -- what a change publishes ----------------------------------------------------------------

    def change_key(self, doc_id: Any, token: Mapping[str, Any]) -> str:
        return _fit(self.name, id_text(doc_id), digest(token))

    def document_key(self, doc_id: Any) -> str:
        return _fit(self.name, id_text(doc_id), None)

    def scan_key(self, doc_id: Any, epoch: int) -> str:
        return _fit(self.name, id_text(doc_id), f"scan{epoch}")

    def params_for(self, doc_id: Any, document: Any, operation: str, at: dt.datetime | None) -> Doc:
        """The task's params: the document's ``_id``, the chosen fields it holds, and the
        change (``op``: insert, update, replace, delete or scan; ``at``: its cluster time)."""
        picked = {}
        if isinstance(document, Mapping):
            picked = {k: v for k, v in document.items() if k != "_id"}
        return {"_id": doc_id, **picked, "change": {"op": operation, "at": at}}

    def run_at(self, at: dt.datetime | None) -> dt.datetime | None:
        """When a debounced document's task may run: ``debounce`` after its latest change."""
        if self.debounce is None or at is None:
            return None
        return at + dt.timedelta(seconds=self.debounce)


def touched(fields: Sequence[str]) -> Doc:
    """An expression: the update set, removed or truncated one of ``fields``, a field inside
    one, or one holding it (``a`` set whole touches ``a.b``)."""

    def hits(path: Any) -> Doc:
        tests: list[Doc] = []
        for f in fields:
            tests.append({"$eq": [path, f]})
            tests.append({"$eq": [{"$indexOfBytes": [path, f + "."]}, 0]})
            tests.append({"$eq": [{"$indexOfBytes": [f, {"$concat": [path, "."]}]}, 0]})
        return {"$or": tests}

    updated = {"$objectToArray": {"$ifNull": ["$updateDescription.updatedFields", {}]}}
    removed = {"$ifNull": ["$updateDescription.removedFields", []]}
    truncated = {"$ifNull": ["$updateDescription.truncatedArrays", []]}
    return {
        "$or": [
            {"$anyElementTrue": [{"$map": {"input": updated, "in": hits("$$this.k")}}]},
            {"$anyElementTrue": [{"$map": {"input": removed, "in": hits("$$this")}}]},
            {"$anyElementTrue": [{"$map": {"input": truncated, "in": hits("$$this.field")}}]},
        ]
    }


def digest(token: Mapping[str, Any]) -> str:
    """A resume token's digest: the same event always has the same token."""
    data = token.get("_data") if isinstance(token, Mapping) else None
    raw = data.encode() if isinstance(data, str) else bson.encode({"t": token})
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).hexdigest()


def id_text(value: Any) -> str:
    """A document's ``_id`` in a key, one text per value: a string as itself (unless it starts
    with ``~``), an ObjectId as ``~`` and its hex, a number as ``~`` and its digits, anything
    else as ``~`` and its canonical extended JSON (so ``5`` and ``"5"`` differ)."""
    if isinstance(value, str) and not value.startswith("~"):
        return value
    if isinstance(value, ObjectId):
        return f"~{value}"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"~{value!r}"
    text = json_util.dumps(
        value, json_options=json_util.CANONICAL_JSON_OPTIONS, separators=(",", ":")
    )
    return "~" + text


def _fit(name: str, text: str, tail: str | None) -> str:
    """``name:text[:tail]``, the text replaced by its digest when the key would pass 512
    characters (or hold a NUL, which a key may not)."""
    key = f"{name}:{text}" + (f":{tail}" if tail else "")
    if len(key) <= MAX_KEY_LENGTH and "\x00" not in key and encodable(key):
        return key
    short = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{name}:#{short}" + (f":{tail}" if tail else "")


def follower_label(kind: Any, name: Any) -> str:
    """A follower's name for people: a trigger's name, or ``wait:COLLECTION``."""
    return f"wait:{name}" if kind == "wait" else str(name)


def describe_lag(ms: Any) -> str:
    """A lag for people: ``0.4 s``, ``12 s``, ``3 min``, ``2.5 h``; ``-`` when unknown."""
    if not isinstance(ms, int | float) or isinstance(ms, bool):
        return "-"
    seconds = max(0.0, ms / 1000)
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def follower_of(name: str) -> tuple[Literal["trigger", "wait"], str]:
    """An operator's name for a follower: a trigger's name (or ``trigger:NAME``), or
    ``wait:COLLECTION`` for a collection that tasks wait on."""
    if not isinstance(name, str) or not name:
        raise InvalidTask("must be a trigger's name, or wait:COLLECTION", field="name")
    if name.startswith("wait:"):
        return "wait", name.removeprefix("wait:")
    return "trigger", name.removeprefix("trigger:")


def cluster_time(change: Mapping[str, Any]) -> dt.datetime | None:
    """A change's cluster time as a date (seconds; the increment orders events within one)."""
    ts = change.get("clusterTime")
    if isinstance(ts, bson.Timestamp):
        return dt.datetime.fromtimestamp(ts.time, dt.UTC)
    return None
