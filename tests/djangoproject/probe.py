"""The test's hands inside the Django project: one JSON command a line on stdin, one JSON
answer a line on stdout (tests/integration/test_django.py). Django is set up once."""

import datetime as dt
import json
import os
import sys
import time
import traceback

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djproject.settings")
import django

django.setup()

from asgiref.sync import async_to_sync  # noqa: E402
from django_mongodb_backend import transaction  # noqa: E402
from shop import tasks  # noqa: E402
from shop.models import Order, Ran  # noqa: E402

from mtask.contrib.django.compat import (  # noqa: E402
    InvalidTask,
    TaskResultDoesNotExist,
    default_task_backend,
    task_enqueued,
)

ENQUEUED = []
task_enqueued.connect(lambda sender, task_result, **kw: ENQUEUED.append(task_result.id), weak=False)


class Abort(Exception):
    pass


def shown(result):
    out = {
        "id": result.id,
        "status": str(result.status),
        "mtask_status": result.mtask_status,
        "attempts": result.attempts,
        "worker_ids": result.worker_ids,
        "errors": [
            {"class": e.exception_class_path, "traceback": e.traceback} for e in result.errors
        ],
        "enqueued_at": result.enqueued_at and result.enqueued_at.isoformat(),
        "started_at": result.started_at and result.started_at.isoformat(),
        "last_attempted_at": result.last_attempted_at and result.last_attempted_at.isoformat(),
        "finished_at": result.finished_at and result.finished_at.isoformat(),
        "run_after": result.task.run_after and result.task.run_after.isoformat(),
        "priority": result.task.priority,
        "queue": result.task.queue_name,
        "module_path": result.task.module_path,
        "args": result.args,
        "kwargs": result.kwargs,
    }
    if str(result.status) == "SUCCESSFUL":
        out["return_value"] = result.return_value
    if result.errors:
        out["error_class_importable"] = result.errors[-1].exception_class.__name__
    return out


def enqueue(name, args=(), kwargs=None, using=None):
    task = getattr(tasks, name)
    if using:
        if "run_after_s" in using:
            using = dict(using)
            seconds = using.pop("run_after_s")
            using["run_after"] = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)
        task = task.using(**using)
    return shown(task.enqueue(*args, **(kwargs or {})))


def aenqueue(name, args=()):
    result = async_to_sync(getattr(tasks, name).aenqueue)(*args)
    return shown(result)


def get(id):
    return shown(default_task_backend.get_result(id))


def aget(id):
    return shown(async_to_sync(default_task_backend.aget_result)(id))


def wait(id, status, timeout=60):
    """Read the result until it has ``status`` (the test's wait, on MongoDB's state)."""
    deadline = time.monotonic() + timeout
    while True:
        result = default_task_backend.get_result(id)
        if str(result.status) == status:
            return shown(result)
        if time.monotonic() > deadline:
            return {"timeout": shown(result)}
        time.sleep(0.05)


def missing(id):
    try:
        default_task_backend.get_result(id)
    except TaskResultDoesNotExist as exc:
        return {"raised": type(exc).__name__}
    return {"raised": None}


def atomic(number, fail):
    """An order saved and its shipping enqueued in one transaction; ``fail``: it raises."""
    before = len(ENQUEUED)
    try:
        with transaction.atomic():
            order = Order.objects.create(number=number)
            result = tasks.ship.enqueue(str(order.pk))
            signalled_inside = len(ENQUEUED) - before
            if fail:
                raise Abort
    except Abort:
        pass
    try:
        default_task_backend.get_result(result.id)
        exists = True
    except TaskResultDoesNotExist:
        exists = False
    return {
        "id": result.id,
        "order": str(order.pk),
        "orders": Order.objects.filter(number=number).count(),
        "task_exists": exists,
        "signalled_inside": signalled_inside,
        "signalled": len(ENQUEUED) - before,
    }


def shipped(order):
    return {"shipped": Order.objects.get(pk=order).shipped}


def invalid(name, using):
    try:
        getattr(tasks, name).using(**using)
    except InvalidTask as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def ran():
    return {"labels": [r.label for r in Ran.objects.order_by("id")]}


def check():
    from django.core import checks

    return {"messages": [m.id for m in checks.run_checks(databases=["default"])]}


def signed_in():
    """A staff user's and another user's session cookies, as Django's login sets them."""
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.test import Client

    cookies = {"name": settings.SESSION_COOKIE_NAME}
    for name, staff in (("ada", True), ("bob", False)):
        user = User.objects.create_user(name, is_staff=staff)  # no password to hash
        client = Client()
        client.force_login(user)
        cookies[name] = client.cookies[settings.SESSION_COOKIE_NAME].value
    return cookies


COMMANDS = {f.__name__: f for f in (
    enqueue, aenqueue, get, aget, wait, missing, atomic, shipped, invalid, ran, check, signed_in,
)}  # fmt: skip

for line in sys.stdin:
    command = json.loads(line)
    try:
        answer = COMMANDS[command.pop("do")](**command)
    except Exception:  # noqa: BLE001 - the test reads it
        answer = {"error": traceback.format_exc()}
    print(json.dumps(answer), flush=True)
