"""Who is online, tracked in Redis and written to the database in batches.

The agent socket records each hello and heartbeat in Redis (one pipelined round trip, no database write).
A beat task, ``flush_presence``, turns that into ``Device.online`` / ``last_seen_at`` / power fields with a
few bulk statements, marks devices offline once they have been silent for ``DEVICE_OFFLINE_AFTER_SECONDS``
or disconnected cleanly, and records the transitions as events. Since the state lives in Redis with
timestamps, a server process that dies simply stops refreshing its devices, and they go offline on time.

Keys (all under REDIS_PREFIX):
    presence:seen   ZSET device_id -> last hello/heartbeat (unix seconds)
    presence:gone   ZSET device_id -> clean disconnect time
    presence:state  HASH device_id -> JSON of the last heartbeat's power/memory/metrics
    presence:conn   HASH device_id -> channel name of its current socket (for pushes)
    presence:personal HASH device_id -> ``updated_at`` of its last stored personal measurement
    presence:feedback HASH device_id -> ``devices.feedback.fingerprint`` of its last stored feedback counts

A heartbeat's ``personal`` object (its own model against the shared one) is stored only when it is a new
measurement: the heartbeat's pipeline reads the last stored ``updated_at`` beside its writes, and only a newer
one goes to the database (``devices.personalization``), after which ``mark_personal`` notes it. Its ``feedback``
object (what its users said of its answers) goes the same way when its counts changed (``devices.feedback``,
``mark_feedback``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from functools import cache

import redis
import redis.asyncio as aioredis
from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.utils import timezone
from psycopg.errors import DeadlockDetected

from devices.feedback import fingerprint, parse_feedback
from devices.models import Device, DeviceEvent
from devices.personalization import parse_personal
from edge_agent.wire import HeartbeatState, validated

logger = logging.getLogger(__name__)

# A flush that PostgreSQL chose to end to break a deadlock is run again (it is idempotent), up to this many times.
FLUSH_ATTEMPTS = 3


def key(name: str) -> str:
    return f"{settings.REDIS_PREFIX}:presence:{name}"


def offline_after() -> float:
    return float(settings.DEVICE_OFFLINE_AFTER_SECONDS)


MAX_METRICS = 32  # edge_agent.wire.HeartbeatState's bound, for the API schema

_async_clients: dict[int, aioredis.Redis] = {}


def async_client() -> aioredis.Redis:
    """One asyncio Redis client per event loop (the server runs one loop per process)."""
    import asyncio

    loop_id = id(asyncio.get_running_loop())
    client = _async_clients.get(loop_id)
    if client is None:
        # A blocking pool: in a reconnect storm more than max_connections writes are in flight at once, and
        # they should wait their turn rather than fail (a plain pool raises, the socket died with 1011, the
        # agent reconnected and the storm grew).
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL,
            max_connections=100,
            timeout=20,
            socket_timeout=30,
            socket_connect_timeout=5,
            health_check_interval=30,
        )
        client = aioredis.Redis(connection_pool=pool)
        _async_clients[loop_id] = client
    return client


@cache
def sync_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10, socket_connect_timeout=5)


async def record_connected(device_id: str, channel_name: str) -> str | None:
    """Mark a device seen and make this socket its current one; returns the channel of a socket it replaces."""
    client = async_client()
    async with client.pipeline(transaction=False) as pipe:
        pipe.hget(key("conn"), device_id)
        pipe.hset(key("conn"), device_id, channel_name)
        pipe.zadd(key("seen"), {device_id: time.time()})
        pipe.zrem(key("gone"), device_id)
        previous, *_ = await pipe.execute()
    previous = previous.decode() if previous else None
    return previous if previous and previous != channel_name else None


def parse_heartbeat(message: dict) -> dict:
    """Validate a heartbeat (``edge_agent.wire.HeartbeatState``: the socket's and the REST body's fields);
    raises ValueError naming the bad field."""
    fields = {key: value for key, value in message.items() if key not in ("type", "personal", "feedback")}
    if fields.get("metrics", {}) is None:
        del fields["metrics"]  # null: none
    state = validated(HeartbeatState, fields, what="heartbeat").to_dict()
    return {
        "battery": state["battery"],
        "charging": state["charging"],
        "free_memory_mb": state["free_memory_mb"],
        "metrics": state["metrics"],
        "personal": parse_personal(message.get("personal")),
        "feedback": parse_feedback(message.get("feedback")),
    }


def _heartbeat_pipeline(pipe, device_id: str, state: dict) -> None:
    pipe.zadd(key("seen"), {device_id: time.time()})
    stored = {name: value for name, value in state.items() if name not in ("personal", "feedback")}
    pipe.hset(key("state"), device_id, json.dumps(stored, separators=(",", ":")))
    pipe.hget(key("personal"), device_id)
    pipe.hget(key("feedback"), device_id)


def _personal_is_new(state: dict, last: bytes | None) -> bool:
    personal = state.get("personal")
    if personal is None:
        return False
    try:
        return last is None or personal["updated_at"] > float(last)
    except ValueError:  # not a number: written by something else; the database decides
        return True


def _new_reports(state: dict, last_personal: bytes | None, last_feedback: bytes | None) -> set[str]:
    new = {"personal"} if _personal_is_new(state, last_personal) else set()
    feedback = state.get("feedback")
    if feedback is not None and (last_feedback or b"").decode(errors="replace") != fingerprint(feedback):
        new.add("feedback")
    return new


async def record_heartbeat(device_id: str, state: dict) -> set[str]:
    """Record a heartbeat (from ``parse_heartbeat``); returns which of its reports the caller then stores:
    ``personal`` when it carries a measurement newer than the last one stored (``devices.personalization``),
    ``feedback`` when its feedback counts differ from the last ones stored (``devices.feedback``)."""
    client = async_client()
    async with client.pipeline(transaction=False) as pipe:
        _heartbeat_pipeline(pipe, device_id, state)
        *_, last_personal, last_feedback = await pipe.execute()
    return _new_reports(state, last_personal, last_feedback)


def record_heartbeat_sync(device_id: str, state: dict) -> set[str]:
    """The same as ``record_heartbeat``, for devices that report over REST instead of a socket."""
    pipe = sync_client().pipeline(transaction=False)
    _heartbeat_pipeline(pipe, device_id, state)
    *_, last_personal, last_feedback = pipe.execute()
    return _new_reports(state, last_personal, last_feedback)


async def mark_personal(device_id: str, updated_at: float) -> None:
    """Note the ``updated_at`` of the measurement just stored, so heartbeats repeating it stop at Redis."""
    await async_client().hset(key("personal"), device_id, repr(updated_at))


def mark_personal_sync(device_id: str, updated_at: float) -> None:
    sync_client().hset(key("personal"), device_id, repr(updated_at))


async def mark_feedback(device_id: str, feedback: dict) -> None:
    """Note the feedback counts just stored, so heartbeats repeating them stop at Redis."""
    await async_client().hset(key("feedback"), device_id, fingerprint(feedback))


def mark_feedback_sync(device_id: str, feedback: dict) -> None:
    sync_client().hset(key("feedback"), device_id, fingerprint(feedback))


# Remove the connection entry only if it still names this socket (a newer socket may have replaced it).
_RELEASE = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
  return 1
end
return 0
"""


async def record_disconnected(device_id: str, channel_name: str) -> None:
    await async_client().eval(_RELEASE, 2, key("conn"), key("gone"), device_id, channel_name, time.time())


async def current_channel(device_id: str) -> str | None:
    value = await async_client().hget(key("conn"), device_id)
    return value.decode() if value else None


@dataclass(frozen=True)
class FlushResult:
    seen: int
    came_online: list[str]
    went_offline: list[str]


def _parse_state(raw: bytes | None) -> dict:
    if not raw:
        return {}
    try:
        state = json.loads(raw)
    except ValueError:
        return {}
    return state if isinstance(state, dict) else {}


def flush_presence(*, now: float | None = None) -> FlushResult:
    """Write the Redis presence picture to the database in bulk; idempotent, safe to run concurrently."""
    client = sync_client()
    now = now or time.time()
    horizon = now - offline_after()
    seen = {
        member.decode(): score for member, score in client.zrangebyscore(key("seen"), horizon, "+inf", withscores=True)
    }
    gone = {
        member.decode(): score for member, score in client.zrangebyscore(key("gone"), horizon, "+inf", withscores=True)
    }
    online = {device_id: ts for device_id, ts in seen.items() if gone.get(device_id, 0) < ts}
    states = dict(zip(online, client.hmget(key("state"), list(online)), strict=True)) if online else {}

    rows = []
    for device_id, ts in online.items():
        state = _parse_state(states.get(device_id))
        rows.append(
            (
                device_id,
                ts,
                _number(state.get("battery")),
                state.get("charging") if isinstance(state.get("charging"), bool) else None,
                int(_number(state.get("free_memory_mb")) or 0) or None,
                json.dumps(state.get("metrics") if isinstance(state.get("metrics"), dict) else {}),
            )
        )

    for attempt in range(1, FLUSH_ATTEMPTS + 1):
        try:
            came_online, went_offline = _write_presence(rows, list(online))
            break
        except OperationalError as exc:
            if not isinstance(exc.__cause__, DeadlockDetected) or attempt == FLUSH_ATTEMPTS:
                raise
            logger.info("presence flush ended by PostgreSQL to break a deadlock; flushing again (%s)", attempt)
    # Forget what is far older than the offline horizon so the sets stay small.
    client.zremrangebyscore(key("seen"), "-inf", now - 86400)
    client.zremrangebyscore(key("gone"), "-inf", horizon)
    return FlushResult(
        seen=len(online), came_online=[str(d) for d in came_online], went_offline=[str(d) for d in went_offline]
    )


def _write_presence(rows: list[tuple], online: list[str]) -> tuple[list[str], list]:
    """One transaction: the rows of ``online`` devices written (``_apply_online``), the other devices marked
    online in the database set offline, an event for each change. Every row it writes is locked first, in id
    order, in one statement: a writer that locks devices one by one in id order (a rollout's assignments) then
    waits for it or it for the writer, never each for the other, as they did when the flush locked its rows in
    whatever order the join gave them (a deadlock in the demo's first minute)."""
    seen = {uuid.UUID(device_id) for device_id in online}
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT id, online FROM devices_device WHERE id = ANY(%s::uuid[]) OR online "
                "ORDER BY id FOR NO KEY UPDATE",
                [online],
            )
            locked = cursor.fetchall()
        came_online = _apply_online(rows)
        # held since the lock above: the devices marked online that were not seen are the ones going offline
        went_offline = [device_id for device_id, was_online in locked if was_online and device_id not in seen]
        if went_offline:
            Device.objects.filter(pk__in=went_offline, online=True).update(online=False)
        now_dt = timezone.now()
        DeviceEvent.objects.bulk_create(
            [
                DeviceEvent(device_id=d, kind=DeviceEvent.Kind.ONLINE, actor_label="system", created_at=now_dt)
                for d in came_online
            ]
            + [
                DeviceEvent(device_id=d, kind=DeviceEvent.Kind.OFFLINE, actor_label="system", created_at=now_dt)
                for d in went_offline
            ],
            batch_size=1000,
        )
    return came_online, went_offline


def _number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _apply_online(rows: list[tuple]) -> list[str]:
    """One UPDATE ... FROM (VALUES ...) per batch; returns the ids that were offline before. The caller holds
    the rows' locks (``_write_presence``), so ``before`` reads them without locking them again."""
    came_online: list[str] = []
    if not rows:
        return came_online
    with connection.cursor() as cursor:
        for start in range(0, len(rows), 2000):
            batch = rows[start : start + 2000]
            values = ",".join(
                ["(%s::uuid, to_timestamp(%s), %s::float8, %s::boolean, %s::int, %s::jsonb)"] * len(batch)
            )
            params = [item for row in batch for item in row]
            cursor.execute(
                f"""
                WITH incoming(id, seen, battery, charging, free_mb, metrics) AS (VALUES {values}),
                before AS (
                    SELECT d.id, d.online FROM devices_device d JOIN incoming i ON i.id = d.id
                )
                UPDATE devices_device d
                   SET online = true,
                       last_seen_at = GREATEST(COALESCE(d.last_seen_at, i.seen), i.seen),
                       battery_percent = COALESCE(i.battery, d.battery_percent),
                       charging = COALESCE(i.charging, d.charging),
                       free_memory_mb = COALESCE(i.free_mb, d.free_memory_mb),
                       local_metrics = CASE WHEN i.metrics = '{{}}'::jsonb THEN d.local_metrics ELSE i.metrics END
                  FROM incoming i JOIN before b ON b.id = i.id
                 WHERE d.id = i.id
             RETURNING d.id, b.online
                """,  # noqa: S608  (only placeholders are interpolated)
                params,
            )
            came_online.extend(str(device_id) for device_id, was_online in cursor.fetchall() if not was_online)
    return came_online
