"""Where the training side's services queue Celery work, by task name.

The task modules (``training.tasks``) call into the services; the services never import the tasks back
(docs/architecture.md, "Layers"). A task's name is its contract: ``CELERY_TASK_ROUTES`` routes by it and a
worker runs the function registered under it. Whoever queues inside a transaction does it in
``transaction.on_commit``, so a worker never looks for a row that is not committed yet.
"""

from __future__ import annotations

from celery import current_app
from django.db import InterfaceError, OperationalError
from redis.exceptions import ConnectionError as RedisConnectionError

# What a verification or aggregation task is retried for: PostgreSQL or Redis away for a moment.
TRANSIENT_ERRORS = (ConnectionError, RedisConnectionError, OperationalError, InterfaceError)


def aggregate_round(round_id: int) -> None:
    current_app.send_task("training.tasks.aggregate_round", args=(round_id,))


def release_round_result(version_id: int) -> None:
    current_app.send_task("training.tasks.release_round_result", args=(version_id,))


def verify_shard(shard: int, *, countdown: float | None = None) -> None:
    current_app.send_task("training.tasks.verify_shard", args=(shard,), countdown=countdown)
