"""JSON Schemas of the task document, generated from ``mtask.models`` (the one definition).

Three schemas, versioned and shipped in ``mtask/schema/`` (a test keeps the files equal to
what this module generates; ``python -m mtask.jsonschema`` rewrites them):

- ``publish.v1.json``: what a publisher in another language writes, at least
  (``PublishedDocument``), as standard JSON Schema;
- ``task.v1.json``: the document as mtask stores it (``TaskDocument``), as standard JSON Schema;
- ``mongodb-validator.v1.json``: both as one MongoDB ``$jsonSchema`` (BSON types: dates are
  ``date``, integers ``int``/``long``, arrays never null; no ``$ref``): a document without
  ``status`` is a publisher's and is checked field by field; one with ``status`` must hold
  every field of the stored shape. ``mtask collection init --validator`` installs it.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

VERSION = 1
SCHEMA_DIR = Path(__file__).parent / "schema"
FILES = {
    f"publish.v{VERSION}.json": "publish",
    f"task.v{VERSION}.json": "stored",
    f"mongodb-validator.v{VERSION}.json": "validator",
}

Schema = dict[str, Any]

_BSON_TYPES = {
    "string": "string",
    "boolean": "bool",
    "object": "object",
    "array": "array",
    "null": "null",
}
_DROPPED = ("title", "default", "format", "$defs", "examples")


def _with_ids(schema: Schema, name: str) -> Schema:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://mtask.dev/schema/{name}.v{VERSION}.json",
        **schema,
    }


def publish_schema() -> Schema:
    """The minimal shape a publisher writes (standard JSON Schema; dates are BSON dates)."""
    from mtask.models import PublishedDocument

    return _with_ids(_mark_dates(PublishedDocument.model_json_schema(by_alias=True)), "publish")


def stored_schema() -> Schema:
    """The full stored shape (standard JSON Schema; dates are BSON dates)."""
    from mtask.models import TaskDocument

    return _with_ids(_mark_dates(TaskDocument.model_json_schema(by_alias=True)), "task")


def _mark_dates(schema: Any) -> Any:
    """Say in the schema itself that a date is a BSON date, not a string."""
    if isinstance(schema, list):
        return [_mark_dates(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _mark_dates(v) for k, v in schema.items()}
    if out.get("format") == "date-time":
        out["description"] = "A BSON date (a string is refused)."
    return out


def validator_schema() -> Schema:
    """The MongoDB ``$jsonSchema`` of a task document, published or stored."""
    from mtask.models import REQUIRED_FIELDS, PublishedDocument, TaskDocument

    stored = _to_bson(TaskDocument.model_json_schema(by_alias=True))
    published = _to_bson(PublishedDocument.model_json_schema(by_alias=True))
    properties = {**published["properties"], **stored["properties"]}
    return {
        "bsonType": "object",
        "description": f"mtask task document v{VERSION} (docs/publishing.md)",
        "required": ["_id", "name"],
        "properties": properties,
        # a document with a status is mtask's (or claims to be): it holds the whole shape
        "anyOf": [{"not": {"required": ["status"]}}, {"required": list(REQUIRED_FIELDS)}],
    }


def _to_bson(schema: Schema) -> Schema:
    defs = schema.get("$defs", {})
    return _convert(schema, defs)  # type: ignore[no-any-return]


def _convert(node: Any, defs: Schema) -> Any:
    if isinstance(node, list):
        return [_convert(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        return _convert({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    out: Schema = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "type":
            out["bsonType"] = _bson_type(value, node)
        elif key == "const":
            out["enum"] = [value]
        elif key == "anyOf":
            merged = _merge_types(_convert(value, defs))
            out.update(merged)
        else:
            out[key] = _convert(value, defs)
    return out


def _bson_type(json_type: str, node: Schema) -> str | list[str]:
    if json_type == "string" and node.get("format") == "date-time":
        return "date"
    if json_type == "integer":
        return ["int", "long"]
    if json_type == "number":
        return ["double", "int", "long"]
    return _BSON_TYPES[json_type]


def _merge_types(options: list[Schema]) -> Schema:
    """``anyOf`` of plain types (``X | None``) as one ``bsonType`` list; else kept."""
    if all(set(o) <= {"bsonType", "description"} for o in options):
        kinds: list[str] = []
        for option in options:
            kind = option["bsonType"]
            kinds += kind if isinstance(kind, list) else [kind]
        return {"bsonType": kinds}
    null = {"bsonType": "null"}
    rest = [o for o in options if o != null]
    if len(rest) == 1 and "bsonType" in rest[0] and null in options:
        kind = rest[0]["bsonType"]
        return {**rest[0], "bsonType": [*(kind if isinstance(kind, list) else [kind]), "null"]}
    return {"anyOf": options}


def generated() -> dict[str, Schema]:
    """Each shipped file's content, as this version of the models defines it."""
    build = {"publish": publish_schema, "stored": stored_schema, "validator": validator_schema}
    return {name: build[kind]() for name, kind in FILES.items()}


def shipped(name: str) -> Schema:
    data: Schema = json.loads((SCHEMA_DIR / name).read_text())
    return data


def shipped_validator() -> Schema:
    """The MongoDB ``$jsonSchema`` as shipped (``mongodb-validator.v1.json``): what
    ``validator_schema`` generates (``test_contract.py`` keeps the file equal to it), read
    without building a model or importing pydantic (a worker's completion of a published
    document checks it: ``store.complete``)."""
    return shipped(f"mongodb-validator.v{VERSION}.json")


def dump(schema: Schema) -> str:
    """A schema as shipped: its fields in the models' order (the worker's completion checks
    a document's fields in the order the shipped validator lists them)."""
    return json.dumps(schema, indent=2) + "\n"


def write() -> None:
    SCHEMA_DIR.mkdir(exist_ok=True)
    for name, schema in generated().items():
        (SCHEMA_DIR / name).write_text(dump(schema))


if __name__ == "__main__":  # python -m mtask.jsonschema: regenerate the shipped files
    write()
    sys.exit(0)
