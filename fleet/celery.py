"""The one Celery app, configured from Django settings under the ``CELERY_`` prefix."""

import os

from celery import Celery
from celery.signals import task_postrun, worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")

app = Celery("fleet", include=["fleet.tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# Celery's Django fix-up closes every database connection before and after each task unless this old-style
# key is set, so each task opened a new PostgreSQL connection (a backend started, authenticated and warmed up
# per delta verified: measured in bench/fleet_simulator.py). Keep the connection; ``_release_connections``
# below does what Django does after a request instead.
app.conf["CELERY_DB_REUSE_MAX"] = 1000


@task_postrun.connect
def _release_connections(task=None, **_):
    """After each task, as after a request: close a connection that failed (a PostgreSQL restart) or is past
    CONN_MAX_AGE; the next task's first query checks the one kept (CONN_HEALTH_CHECKS)."""
    if task is not None and getattr(task.request, "is_eager", False):
        return  # run inline by its caller, inside the caller's transaction
    from django.db import close_old_connections

    close_old_connections()


@worker_process_init.connect
def _one_torch_thread_per_worker_process(**_):
    """Each worker process aggregates with one torch thread: concurrency comes from worker processes (and
    chord shards), and torch's own threads on top of them oversubscribe the cores: many times slower on a
    busy machine (bench/aggregation.py)."""
    try:
        import torch
    except ImportError:  # a worker without torch has nothing to aggregate
        return
    torch.set_num_threads(int(os.environ.get("WORKER_TORCH_THREADS", "1")))
