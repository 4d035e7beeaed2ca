"""The one Celery app, configured from Django settings under the ``CELERY_`` prefix."""

import os

from celery import Celery
from celery.signals import worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")

app = Celery("fleet", include=["fleet.tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@worker_process_init.connect
def _one_torch_thread_per_worker_process(**_):
    """Each worker process aggregates with one torch thread: concurrency comes from worker processes (and
    chord shards), and torch's own threads on top of them oversubscribe the cores (measured in
    bench/aggregation.py: verify + fedavg of 100 x 10M parameters took 11.7 s on one thread, 316 s with the
    default threads on a busy 2-core machine)."""
    try:
        import torch
    except ImportError:  # a worker without torch has nothing to aggregate
        return
    torch.set_num_threads(int(os.environ.get("WORKER_TORCH_THREADS", "1")))
