"""The faults ``bench/faults.py`` injects into the running product, one function each. Every one returns when
the fault is over from the outside (the service is running again, or the processes are replaced), with
``start`` and ``back`` (``time.perf_counter()``) and what it did.

- ``redis``: stop the embedded Redis (SIGTERM: it saves and exits; ``--redis-stop kill``: SIGKILL), wait
  ``downtime`` seconds, start it again on the same port and data folder;
- ``postgres``: ``pg_ctl stop -m fast`` (``--postgres-stop immediate``: a crash), wait, start it again;
- ``worker``: SIGKILL the Celery pool processes while a round is aggregating (so a task is cut mid-way);
  Celery's main process forks new ones;
- ``worker-main``: SIGKILL the Celery worker's main process (the launcher's ``worker`` child), also while a
  round is aggregating: its pool and its prefetched tasks go with it, and the launcher has to start a new one;
- ``web``: SIGKILL every uvicorn worker process (uvicorn's supervisor forks new ones); every socket drops;
- ``web-main``: SIGTERM the uvicorn supervisor (the launcher's ``web`` child), as a restart of the web server
  would: it closes its sockets and exits, and the launcher has to start it again;
- ``cut``: ``count`` agents start an upload at once and each loses its TCP connection (no close frame, the
  chunk just written still in flight) after 1 to ``chunks - 1`` of its chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
import urllib.request
from dataclasses import dataclass, field


@dataclass
class FaultContext:
    services: object  # bench.fleetsim.services.EmbeddedServices
    server: object  # bench.fleetsim.server.Server
    traffic: object  # bench.fleetsim.fault_traffic.Traffic
    database_url: str
    downtime: float
    redis_stop: str
    postgres_stop: str
    cut_count: int
    chunks: int
    web_workers: int
    rng: random.Random = field(default_factory=lambda: random.Random(5))
    say: object = print


def _pids(processes) -> list[int]:
    return [p.pid for p in processes]


def _kill(pids: list[int], sig: int) -> list[int]:
    done = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            done.append(pid)
    return done


def _round_aggregating(database_url: str) -> int | None:
    import psycopg

    with psycopg.connect(database_url, connect_timeout=3, autocommit=True) as conn:
        row = conn.execute("SELECT id FROM training_round WHERE state = 'aggregating' LIMIT 1").fetchone()
    return row[0] if row else None


async def _when_aggregating(ctx: FaultContext, timeout: float = 60.0) -> int | None:
    """Poll (every 20 ms) until some round is being aggregated; its id, or None after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await asyncio.to_thread(_round_aggregating, ctx.database_url)
        if found is not None:
            return found
        await asyncio.sleep(0.02)
    return None


def _ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/readyz", timeout=3) as response:  # noqa: S310
            return response.status == 200
    except OSError:
        return False


async def _wait(predicate, timeout: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return True
        await asyncio.sleep(step)
    return False


async def redis(ctx: FaultContext) -> dict:
    start = time.perf_counter()
    await asyncio.to_thread(ctx.services.stop_redis, ctx.redis_stop)
    ctx.say(f"redis stopped ({ctx.redis_stop}); down for {ctx.downtime:g}s")
    await asyncio.sleep(ctx.downtime)
    await asyncio.to_thread(ctx.services.start_redis)
    back = time.perf_counter()
    return {"start": start, "back": back, "detail": f"redis-server {ctx.redis_stop}, started again on the same port"}


async def postgres(ctx: FaultContext) -> dict:
    start = time.perf_counter()
    await asyncio.to_thread(ctx.services.stop_postgres, ctx.postgres_stop)
    ctx.say(f"postgres stopped (-m {ctx.postgres_stop}); down for {ctx.downtime:g}s")
    await asyncio.sleep(ctx.downtime)
    await asyncio.to_thread(ctx.services.start_postgres)
    await asyncio.to_thread(ctx.services.wait_postgres)
    back = time.perf_counter()
    return {"start": start, "back": back, "detail": f"pg_ctl stop -m {ctx.postgres_stop}, started again"}


async def worker(ctx: FaultContext) -> dict:
    round_id = await _when_aggregating(ctx)
    pool = _pids(ctx.server.worker_processes()[1:])
    start = time.perf_counter()
    killed = _kill(pool, signal.SIGKILL)
    ctx.say(f"killed the Celery pool processes {killed} (round {round_id} aggregating)")

    def replaced() -> bool:
        now = _pids(ctx.server.worker_processes()[1:])
        return bool(now) and not set(now) & set(killed)

    ok = await _wait(replaced, 120)
    back = time.perf_counter()
    return {
        "start": start,
        "back": back,
        "killed": killed,
        "round_aggregating": round_id,
        "restarted": ok,
        "detail": f"SIGKILL of {len(killed)} pool processes while round {round_id} aggregated; "
        + ("Celery forked new ones" if ok else "no new pool processes within 120 s"),
    }


async def worker_main(ctx: FaultContext) -> dict:
    round_id = await _when_aggregating(ctx)
    tree = ctx.server.worker_processes()
    if not tree:
        return {"start": time.perf_counter(), "back": time.perf_counter(), "fatal": True, "detail": "no worker"}
    main = tree[0].pid
    start = time.perf_counter()
    _kill([main], signal.SIGKILL)
    ctx.say(f"killed the Celery worker main process {main} (round {round_id} aggregating)")

    def replaced() -> bool:
        now = ctx.server.worker_processes()
        return not ctx.server.alive() or (len(now) > 1 and now[0].pid != main)

    await _wait(replaced, 120)
    back = time.perf_counter()
    alive = ctx.server.alive()
    now = ctx.server.worker_processes()
    restarted = alive and bool(now) and now[0].pid != main
    return {
        "start": start,
        "back": back,
        "killed": [main],
        "round_aggregating": round_id,
        "restarted": restarted,
        "fatal": not alive,
        "detail": f"SIGKILL of the worker's main process while round {round_id} aggregated; "
        + (
            "the launcher started a new worker"
            if restarted
            else ("the launcher stopped everything" if not alive else "no new worker within 120 s")
        ),
    }


async def web(ctx: FaultContext) -> dict:
    workers = _pids(ctx.server.web_workers())
    start = time.perf_counter()
    killed = _kill(workers, signal.SIGKILL)
    ctx.say(f"killed the uvicorn worker processes {killed}")

    def replaced() -> bool:
        now = _pids(ctx.server.web_workers())
        return len(now) >= ctx.web_workers and not set(now) & set(killed) and _ready(ctx.server.base_url)

    ok = await _wait(replaced, 120)
    back = time.perf_counter()
    return {
        "start": start,
        "back": back,
        "killed": killed,
        "restarted": ok,
        "detail": f"SIGKILL of {len(killed)} uvicorn workers; "
        + ("uvicorn forked new ones" if ok else "not serving again within 120 s"),
    }


async def web_main(ctx: FaultContext) -> dict:
    tree = ctx.server.web_processes()
    if not tree:
        return {"start": time.perf_counter(), "back": time.perf_counter(), "fatal": True, "detail": "no web"}
    main = tree[0].pid
    start = time.perf_counter()
    _kill([main], signal.SIGTERM)
    ctx.say(f"SIGTERM to the uvicorn supervisor {main} (the launcher's web child)")

    def replaced() -> bool:
        if not ctx.server.alive():
            return True
        now = ctx.server.web_processes()
        return bool(now) and now[0].pid != main and _ready(ctx.server.base_url)

    await _wait(replaced, 120)
    back = time.perf_counter()
    alive = ctx.server.alive()
    now = ctx.server.web_processes()
    restarted = alive and bool(now) and now[0].pid != main
    return {
        "start": start,
        "back": back,
        "killed": [main],
        "restarted": restarted,
        "fatal": not alive,
        "detail": "SIGTERM of the uvicorn supervisor; "
        + (
            "the launcher started it again"
            if restarted
            else ("the launcher stopped everything" if not alive else "not serving again within 120 s")
        ),
    }


async def cut(ctx: FaultContext) -> dict:
    start = time.perf_counter()
    started = ctx.traffic.burst(ctx.cut_count, ctx.rng, ctx.chunks)
    ctx.say(f"{len(started)} agents began an upload, each armed to lose its socket mid-upload")
    deadline = time.monotonic() + 30
    while any(agent.cut_after_chunks is not None for agent in started) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    back = time.perf_counter()
    not_cut = sum(agent.cut_after_chunks is not None for agent in started)
    for agent in started:
        agent.cut_after_chunks = None
    return {
        "start": start,
        "back": back,
        "uploads": len(started),
        "not_cut": not_cut,
        "detail": f"{len(started) - not_cut} sockets cut mid-upload (no close frame) within {back - start:.1f}s",
    }


INJECTORS = {
    "redis": redis,
    "postgres": postgres,
    "worker": worker,
    "worker-main": worker_main,
    "web": web,
    "web-main": web_main,
    "cut": cut,
}
