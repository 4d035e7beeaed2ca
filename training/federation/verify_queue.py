"""Waking the verification workers: a drain task per shard of received deltas instead of a task per delta.

An upload that completes raises its shard's wake flag (``queue_verification``, a Redis ``SET NX``); only
the upload that raised it queues a ``verify_shard`` task. That task (``shard_drain``), holding the shard's
drain lock, lowers the flag, verifies the shard's received deltas in batches and looks again until none are
left, so under load one task verifies many deltas: one Celery message and one query per batch, not per
delta (measured in bench/fleet_simulator.py). A batch's verdicts are written in one transaction
(``delta_record_batch``): the outcomes and rounds ``delta_verify`` would give each delta on its own, without
a transaction, a round lock and a count per delta.

Nothing is lost between a flag and a drainer: the drainer lowers the flag before it looks for deltas, and
after it lets go of the lock it looks at the flag once more, so a delta committed while it finished is
either seen by its last look or raised the flag after it, and then either this drainer goes on or the task
that upload queued finds the lock free. A drain task that is lost (a worker killed) leaves its deltas
``received``: beat's ``requeue_unverified_deltas`` verifies them one by one after
DELTA_VERIFY_RESCUE_SECONDS, as before.

Nothing is tried for ever either: each run begun on a delta is counted first (``delta_attempt``), a delta
tried before without an outcome is verified on its own after its batch, and past DELTA_VERIFY_MAX_ATTEMPTS
it is rejected (``given_up``), so a delta that kills its worker every time neither holds its shard nor takes
its batch's verdicts with it.
"""

from __future__ import annotations

import logging
import secrets
import time
from contextlib import contextmanager

from django.conf import settings
from django.core.cache import cache
from django.db.models import F

from training import dispatch

logger = logging.getLogger(__name__)
BATCH = 16  # deltas loaded per query, judged one by one and recorded in one transaction
DRAIN_SECONDS = 2.0  # then the drainer hands its shard to a fresh task, so aggregation gets a process too
LOCK_SECONDS = 30  # renewed after each batch; a drainer that died (a killed worker) frees its shard after this
WAKE_SECONDS = 10  # a wake whose task was lost stops holding back new ones after this


def shard_of(delta_id: int) -> int:
    return delta_id % settings.DELTA_VERIFY_SHARDS


def _flag(shard: int) -> str:
    return f"verify:wake:{shard}"


def _lock(shard: int) -> str:
    return f"verify:drain:{shard}"


def _recheck(shard: int) -> str:
    return f"verify:recheck:{shard}"


def _look_again(shard: int, countdown: int) -> None:
    """Queue a drain of the shard ``countdown`` seconds from now, unless one is queued already (at most one
    per shard within LOCK_SECONDS)."""
    if cache.add(_recheck(shard), 1, timeout=LOCK_SECONDS):
        dispatch.verify_shard(shard, countdown=countdown)


# A drainer renews or lets go of the shard's lock only while the lock holds its own token: one that outlived
# its lock (paused or starved past LOCK_SECONDS) must neither keep nor free the lock a successor took since.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('expire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


def _lock_take(shard: int) -> int | None:
    """Take the shard's drain lock: its token, or None if another drainer holds it."""
    token = secrets.randbits(62) + 1  # the cache stores an int as its digits, which the scripts compare
    return token if cache.add(_lock(shard), token, timeout=LOCK_SECONDS) else None


def _lock_if_held(script: str, shard: int, token: int, *args) -> bool:
    """Run ``_RENEW`` or ``_RELEASE`` on the shard's lock, atomically in Redis; whether it still held ``token``."""
    key = cache.make_and_validate_key(_lock(shard))
    return bool(cache._cache.get_client(key, write=True).eval(script, 1, key, token, *args))


def queue_verification(delta_id: int) -> None:
    """Have a received delta verified: wake its shard's drainer unless it is awake already."""
    shard = shard_of(delta_id)
    try:
        if cache.add(_flag(shard), delta_id, timeout=WAKE_SECONDS):
            try:
                dispatch.verify_shard(shard)
            except Exception:
                cache.delete(_flag(shard))  # let the next upload try; if Redis is away this fails too
                raise
    except Exception:  # Redis away: the delta stays `received`; beat's rescue verifies it later
        logger.warning("could not queue verification of delta %s", delta_id, exc_info=True)


def _received(shard: int, failed: set[int]) -> list:
    from training.models import Delta

    return list(
        Delta.objects.select_related("device__cohort")
        .filter(state=Delta.State.RECEIVED)
        .alias(shard=F("id") % settings.DELTA_VERIFY_SHARDS)
        .filter(shard=shard)
        .exclude(pk__in=failed)
        .order_by("id")[:BATCH]
    )


def _task_failures() -> tuple:
    """What fails the whole task, for Celery to retry: PostgreSQL or Redis away, or its soft time limit."""
    from celery.exceptions import SoftTimeLimitExceeded

    return (*dispatch.TRANSIENT_ERRORS, SoftTimeLimitExceeded)


@contextmanager
def _own_trouble(delta_id: int, failed: set[int]):
    """Anything raised here but ``_task_failures`` is this delta's own trouble: it is logged and the delta
    left `received` for beat's rescue, and the batch goes on."""
    try:
        yield
    except _task_failures():
        raise
    except Exception:
        logger.exception("verifying delta %s failed; left for beat's rescue", delta_id)
        failed.add(delta_id)


def _verify_batch(batch: list, failed: set[int]) -> None:
    """Count a try for each delta (``delta_attempt``), judge each (``delta_judge``, no writes), then write the
    verdicts together (``delta_record_batch``). If writing them breaks for another reason than PostgreSQL or
    Redis being away, each is verified on its own (``delta_verify``), so one delta's trouble stays its own.

    A delta tried before without an outcome (its worker died, or its checks raised) is verified on its own
    after the rest, fewest tries first: one that kills its worker every time takes no other delta's verdict
    with it, and is rejected once past DELTA_VERIFY_MAX_ATTEMPTS (``given_up``)."""
    from training.federation.verification import delta_attempt, delta_judge, delta_verify

    retried = sorted((d for d in batch if d.verify_attempts), key=lambda d: (d.verify_attempts, d.pk))
    fresh = [d for d in batch if not d.verify_attempts]
    attempts = delta_attempt([delta.pk for delta in fresh])
    memo: dict = {}
    judged = []
    for delta in fresh:
        if delta.pk in attempts:  # else verified meanwhile by another run
            with _own_trouble(delta.pk, failed):
                judged.append((delta, delta_judge(delta, memo)))
    _record_judged(judged, failed)
    for delta in retried:
        with _own_trouble(delta.pk, failed):
            delta_verify(delta_id=delta.pk)


def _record_judged(judged: list, failed: set[int]) -> None:
    from training.federation.verification import delta_record_batch, delta_verify

    try:
        delta_record_batch(judged)
        return
    except _task_failures():
        raise
    except Exception:
        logger.exception("recording %d verifications together failed; recording them one by one", len(judged))
    for delta, _ in judged:
        with _own_trouble(delta.pk, failed):
            delta_verify(delta_id=delta.pk)


def shard_drain(shard: int) -> int:
    """Verify the shard's received deltas until none are left (or DRAIN_SECONDS pass); how many were done.

    Returns at once when another drainer holds the shard: that one looks at the flag before it stops. In
    case that one died holding it (a killed worker: the lock outlives it by up to LOCK_SECONDS), a look
    again after that is queued, at most one per shard at a time."""
    done, deadline, more, lost, failed = 0, time.monotonic() + DRAIN_SECONDS, False, False, set()
    if (token := _lock_take(shard)) is None:
        _look_again(shard, countdown=LOCK_SECONDS + 1)
        return 0
    while True:
        try:
            while not (more := time.monotonic() > deadline):
                cache.delete(_flag(shard))
                batch = _received(shard, failed)
                _verify_batch(batch, failed)
                done += len(batch)
                if lost := not _lock_if_held(_RENEW, shard, token, LOCK_SECONDS):
                    break  # it outlived its lock: the shard may be another drainer's now
                if len(batch) < BATCH:  # all there was; a delta committed since raised the flag
                    break
        finally:
            _lock_if_held(_RELEASE, shard, token)
        if lost:
            logger.warning("shard %d's drain lock ran out during a batch; leaving the shard to its next drainer", shard)
            _look_again(shard, countdown=1)  # in case nobody took it
            break
        if more:  # out of time with work left: a fresh task goes on, behind whatever else is queued
            dispatch.verify_shard(shard)
            break
        if cache.get(_flag(shard)) is None:
            break  # nobody woke the shard since its last look
        if (token := _lock_take(shard)) is None:
            break  # another drainer took the shard meanwhile; it looks at the flag before it stops
    if done:
        logger.info("verified %d deltas of shard %d", done, shard)
    return done
