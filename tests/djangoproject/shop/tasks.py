"""The test project's tasks."""

import asyncio
import os
import time

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task

from shop.models import Order, Ran


class OutOfStock(Exception):
    pass


@task
def ship(order_id):
    Order.objects.filter(pk=order_id).update(shipped=True)
    return order_id


@task(max_retries=0)
def explode(item):
    raise OutOfStock(f"no {item} left")


@task(max_retries=2, options={"retry_delay_ms": 10})
def always_flaky():
    raise ValueError("flaky again")


@task
async def aadd(a, b):
    await asyncio.sleep(0)
    return a + b


@task(takes_context=True)
def attempt_of(context, label):
    return {"attempt": context.attempt, "label": label, "id": context.task_result.id}


def _until(path):
    while not os.path.exists(path):  # released by the test
        time.sleep(0.02)


@task
def hold(path):
    _until(path)
    return "released"


@task(options={"worker_timeout_ms": 1500, "ping_interval_ms": 300})
def hold_short_lease(path):
    _until(path)
    return "released"


@task(queue_name="emails")
def record(label):
    Ran.objects.create(label=label)
    return label


@task(key=lambda number: f"invoice-{number}", group="billing")
def invoice(number):
    return number
