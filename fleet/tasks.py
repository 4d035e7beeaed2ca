"""System tasks: the beat heartbeat and the worker diagnostic that operators and /readyz rely on."""

from __future__ import annotations

import socket
import time

from celery import shared_task
from django.core.cache import cache
from django.db import connection
from django.utils import timezone

from core.health import BEAT_TICK_KEY


@shared_task(name="fleet.tasks.beat_tick", ignore_result=True)
def beat_tick() -> None:
    """Record that beat is scheduling and a worker is consuming; /readyz shows its age."""
    cache.set(BEAT_TICK_KEY, timezone.now().isoformat(), timeout=3600)


@shared_task(name="fleet.tasks.system_diagnostic", soft_time_limit=20, time_limit=30)
def system_diagnostic(*, sent_at: float) -> dict:
    """Prove the whole path works: a worker picked the task up, reached PostgreSQL and Redis."""
    picked_up_at = time.time()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    cache.set("system:diagnostic:last", picked_up_at, timeout=600)
    return {
        "worker": socket.gethostname(),
        "queue_delay_ms": round((picked_up_at - sent_at) * 1000, 1),
        "database": "ok",
        "redis": "ok",
    }
