"""``mtask collection``: set up the tasks collection (indexes, the optional ``$jsonSchema``
validator) and print the task document's JSON Schemas (``mtask.jsonschema``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mtask.cli.common import Commands, add_common, out, task_client

commands = Commands()
run = commands.run

SCHEMA_KINDS = {"publish": "publish", "stored": "task", "validator": "mongodb-validator"}


def register(sub: Any) -> None:
    p = sub.add_parser("collection", help="set up the tasks collection; print its JSON Schema")
    actions = p.add_subparsers(dest="collection_action", required=True, metavar="ACTION")
    init = actions.add_parser(
        "init", help="create the collection and its indexes (and optionally the validator)"
    )
    add_common(init)
    init.add_argument(
        "--validator",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="install (--validator) or remove (--no-validator) the $jsonSchema validator that "
        "refuses a wrong task document at insert time; default: leave it as it is",
    )
    init.add_argument(
        "--operator-indexes",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="make (--operator-indexes) or drop (--no-operator-indexes) the indexes for "
        "operators' own queries that no command reads (runs_worker: all runs by a worker); "
        "each index costs every task's writes; default: leave them as they are",
    )
    init.add_argument(
        "--serve-indexes",
        action="store_true",
        help="make the indexes mtask serve's task list, search and charts read (serve makes "
        "them at start if its role may; one with a viewer's role may not)",
    )
    roles = actions.add_parser(
        "roles",
        help="print (or with --create make) the MongoDB roles with the fewest privileges each "
        "part of mtask needs",
    )
    add_common(roles)
    roles.add_argument(
        "--create",
        action="store_true",
        help="create the roles in --database (and the relay's inbox role in <database>_inbox), "
        "or bring them up to date (needs userAdmin on both)",
    )
    key = actions.add_parser(
        "key",
        help="make the data key of encrypted params (if missing), or re-wrap it under a new "
        "local master key (docs/security.md)",
    )
    add_common(key)
    key.add_argument(
        "--key-file", required=True, help="the local master key: 96 bytes, raw or base64"
    )
    key.add_argument(
        "--rotate-to",
        metavar="NEW_KEY_FILE",
        help="re-wrap the data keys under this master key (old tasks stay readable with it)",
    )
    schema = actions.add_parser("schema", help="print a JSON Schema of the task document")
    schema.add_argument(
        "kind",
        nargs="?",
        default="publish",
        choices=list(SCHEMA_KINDS),
        help="publish: what a publisher writes (default); stored: the full document; "
        "validator: the MongoDB $jsonSchema",
    )


@commands.command("collection")
def cmd_collection(args: argparse.Namespace) -> int:
    if args.collection_action == "schema":
        from mtask import jsonschema

        name = f"{SCHEMA_KINDS[args.kind]}.v{jsonschema.VERSION}.json"
        sys.stdout.write(jsonschema.dump(jsonschema.generated()[name]))
        return 0
    if args.collection_action == "roles":
        return _roles(args)
    if args.collection_action == "key":
        return _key(args)
    from mtask.store.schema import OPERATOR_INDEXES

    with task_client(args) as client:
        options = client.init_collection(args.validator, args.operator_indexes)
        if args.serve_indexes:
            client.ensure_bulk_indexes()
        indexes = client.collection.index_information()
    operator = [m.document["name"] for m in OPERATOR_INDEXES if m.document["name"] in indexes]
    installed = bool(options.get("validator"))
    level, action = options.get("validationLevel"), options.get("validationAction")
    if args.json:
        target = f"{args.database}.{args.collection}"
        report = {"collection": target, "validator": installed, "validationLevel": level}
        report |= {"validationAction": action, "operator_indexes": operator}
        sys.stdout.write(json.dumps(report) + "\n")
        return 0
    state = f"validator installed (level {level}, action {action})" if installed else "no validator"
    extra = f"operator indexes: {', '.join(operator)}" if operator else "no operator indexes"
    out.print(f"{args.database}.{args.collection}: indexes ready, {state}, {extra}", markup=False)
    return 0


def _roles(args: argparse.Namespace) -> int:
    """The roles (``mtask.security.roles``) as ``createRole`` commands, or a table; ``--create``
    makes them."""
    from mtask.driver import inbox_database
    from mtask.security import roles

    commands = roles.role_commands(args.database, args.collection)
    if args.create:
        with task_client(args) as client:
            made = client.create_roles()
        if not args.json:
            out.print(f"{args.database}: roles ready: {', '.join(made)}", markup=False)
    if args.json:
        sys.stdout.write(json.dumps(commands, indent=2) + "\n")
        return 0
    if args.create:
        return 0
    inboxes = inbox_database(args.database)
    for part, role in roles.ROLES.items():
        names = f"{role.name}, and {role.inbox_role} in {inboxes}" if role.inbox else role.name
        out.print(f"{names}  ({part}: {role.summary})", markup=False)
        for collection, actions in sorted(roles.grants(part, args.collection).items()):
            where = collection or "(every collection)"
            out.print(f"    {args.database}.{where}: {', '.join(sorted(actions))}", markup=False)
        for collection, actions in sorted(roles.inbox_grants(part).items()):
            where = collection or "(every collection)"
            out.print(f"    {inboxes}.{where}: {', '.join(sorted(actions))}", markup=False)
        out.print(f"    Atlas: {role.atlas}", markup=False)
    return 0


def _key(args: argparse.Namespace) -> int:
    """The data key ``mtask`` in ``<database>.mtask_keys``, made if missing; with
    ``--rotate-to``, every data key re-wrapped under the new master key."""
    from bson.binary import Binary

    from mtask.cli.common import mongodb_uri
    from mtask.security.encryption import Encryption, read_key_file, rotate_local

    encryption = Encryption.local(args.key_file, mongodb_uri(args.uri), args.database)
    try:
        key_id = encryption.ensure_key()
        rotated = None
        if args.rotate_to:
            new = read_key_file(args.rotate_to)
            old = read_key_file(args.key_file)
            rotated = rotate_local(encryption.mongo, old, new, encryption.key_vault)
    finally:
        encryption.close()
    name = str(key_id.as_uuid()) if isinstance(key_id, Binary) else str(key_id)
    report = {"key_vault": encryption.key_vault, "key": name, "rotated": rotated}
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        done = f"; {rotated} re-wrapped under {args.rotate_to}" if rotated is not None else ""
        out.print(f"{encryption.key_vault}: data key {report['key']} ready{done}", markup=False)
    return 0
