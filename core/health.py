"""Liveness and readiness: /healthz says the process answers, /readyz that its dependencies do."""

from __future__ import annotations

import logging
import time
from datetime import datetime
from functools import cache as memoize

import redis
from celery import current_app as celery_app
from django.conf import settings
from django.core.cache import cache
from django.db import connection
from django.http import JsonResponse
from django.utils import timezone
from django.views.decorators.cache import never_cache

logger = logging.getLogger(__name__)
# Where beat's heartbeat task (``fleet.tasks.beat_tick``) records its last tick.
BEAT_TICK_KEY = "system:beat:last-tick"
WORKER_PING_TIMEOUT = 1.5
BEAT_STALE_AFTER_SECONDS = 60


def _timed(check) -> dict:
    started = time.perf_counter()
    try:
        detail = check() or {}
        result = {"ok": True, **detail}
    except Exception as exc:  # a readiness probe reports every failure instead of raising
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result["ms"] = round((time.perf_counter() - started) * 1000, 1)
    return result


def _check_database() -> dict:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return {}


@memoize
def _redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)


def _check_redis() -> dict:
    _redis_client().ping()
    return {}


def _check_workers() -> dict:
    replies = celery_app.control.ping(timeout=WORKER_PING_TIMEOUT, limit=1)
    if not replies:
        raise RuntimeError(f"no Celery worker answered within {WORKER_PING_TIMEOUT}s")
    return {"workers": sorted(name for reply in replies for name in reply)}


def _beat_status() -> dict:
    raw = cache.get(BEAT_TICK_KEY)
    if raw is None:
        return {"ok": False, "error": "no beat tick recorded yet"}
    age = (timezone.now() - datetime.fromisoformat(raw)).total_seconds()
    return {"ok": age < BEAT_STALE_AFTER_SECONDS, "last_tick_seconds_ago": round(age, 1)}


def readiness() -> dict:
    checks = {
        "database": _timed(_check_database),
        "redis": _timed(_check_redis),
        "worker": _timed(_check_workers),
    }
    report = {"ok": all(check["ok"] for check in checks.values()), "checks": checks}
    # Beat is reported but does not gate readiness: the web process serves fine without it.
    report["checks"]["beat"] = _beat_status()
    return report


@never_cache
def healthz(request):
    return JsonResponse({"ok": True})


@never_cache
def readyz(request):
    report = readiness()
    response = JsonResponse(report, status=200 if report["ok"] else 503)
    if not report["ok"]:
        # Not ready is an answer, not a server error: say which check failed, at warning level, once.
        failing = {
            name: check.get("error") for name, check in report["checks"].items() if name != "beat" and not check["ok"]
        }
        logger.warning("not ready: %s", failing)
        response._has_been_logged = True  # keeps Django from logging the 503 again as an ERROR
    return response
