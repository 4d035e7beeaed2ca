"""The product under test, started by its real launcher (``python -m fleet.launcher run --no-demo``) on the
machine's PostgreSQL (a fresh ``fleet_bench_<kind>_<random>`` database, created by the launcher) and Redis (a
unique ``REDIS_PREFIX``); its processes for the resource figures; and the clean-up: SIGINT to the launcher,
drop the database, delete the Redis keys."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

from bench.fleetsim import BASE_DIR, say
from bench.fleetsim.resources import safe


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def with_database(url: str, dbname: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    return urlunsplit(urlsplit(url)._replace(path="/" + dbname))


class Server:
    """The product, started by the real launcher, and the processes it runs."""

    def __init__(
        self,
        *,
        workdir: Path,
        database_url: str,
        redis_url: str,
        log_path: Path,
        kind: str,
        web_workers: int,
        worker_concurrency: int,
        env: dict[str, str] | None = None,
    ):
        self.run_id = secrets.token_hex(4)
        self.dbname = f"fleet_bench_{kind}_{self.run_id}"
        self.prefix = f"bench_{kind}_{self.run_id}"
        self.database_url = with_database(database_url, self.dbname)
        self.redis_url = redis_url
        self.log_path = log_path
        self.port = free_port()
        self.workdir = workdir
        self.env = {
            **os.environ,
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "REDIS_PREFIX": self.prefix,
            "FLEET_DATA_DIR": str(workdir / "data"),
            "SECRET_KEY": secrets.token_urlsafe(50),
            "DJANGO_SETTINGS_MODULE": "fleet.settings",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.process: subprocess.Popen | None = None
        self.log = None
        self.known_pids: set[int] = set()
        self.command = [
            sys.executable,
            "-m",
            "fleet.launcher",
            "run",
            "--no-demo",  # the demo fleet (12 training agents) would share the machine with the benchmark
            "--port",
            str(self.port),
            "--web-workers",
            str(web_workers),
            "--worker-concurrency",
            str(worker_concurrency),
        ]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "w")  # noqa: SIM115  (closed in stop())
        self.process = subprocess.Popen(
            self.command,
            cwd=BASE_DIR,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # our Ctrl-C handling stops it in order, with SIGINT
        )

    def wait_ready(self, timeout: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"the launcher exited with code {self.process.returncode}; see {self.log_path}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.base_url}/readyz", timeout=3) as response,  # noqa: S310
            ):
                if response.status == 200:
                    self.remember_pids()
                    return time.monotonic() - started
            time.sleep(0.5)
        raise RuntimeError(f"/readyz not ready after {timeout:.0f}s; see {self.log_path}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _children(self):
        import psutil

        try:
            return psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return []

    def remember_pids(self) -> None:
        import psutil

        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.process.pid).children(recursive=True):
                self.known_pids.add(child.pid)

    def _tree(self, marker: tuple[str, ...]) -> list:
        import psutil

        for child in self._children():
            try:
                cmdline = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if all(any(part in arg for arg in cmdline) for part in marker):
                try:
                    return [child, *child.children(recursive=True)]
                except psutil.NoSuchProcess:
                    return []
        return []

    def web_processes(self) -> list:
        return self._tree(("uvicorn",))

    def worker_processes(self) -> list:
        return self._tree(("celery", "worker"))

    def beat_processes(self) -> list:
        return self._tree(("celery", "beat"))

    def web_workers(self) -> list:
        """The uvicorn worker processes (children of the uvicorn supervisor that accept sockets)."""
        tree = self.web_processes()
        return [p for p in tree[1:] if safe(lambda p=p: "resource_tracker" not in " ".join(p.cmdline()), False)]

    def run_django(self, script: str, *args: str, what: str) -> str:
        """Run a small Django script (``python -c``) against this server's database; its stdout."""
        result = subprocess.run(
            [sys.executable, "-c", script, *args], cwd=BASE_DIR, env=self.env, capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{result.stdout}{result.stderr}")
        return result.stdout

    def redis(self):
        import redis

        return redis.Redis.from_url(self.redis_url, socket_timeout=10)

    def presence_connections(self) -> int:
        client = self.redis()
        try:
            return int(client.hlen(f"{self.prefix}:presence:conn"))
        finally:
            client.close()

    def log_offset(self) -> int:
        return self.log_path.stat().st_size

    def log_problems(self, offset: int) -> dict:
        """Warnings and errors the launcher's children printed since ``offset`` (a byte position in the log)."""
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        counts: Counter[str] = Counter()
        samples: list[str] = []
        for line in text.splitlines():
            lowered = line.lower()
            if any(word in lowered for word in ("error", "warning", "traceback", "exception", "critical")):
                key = line.split("|", 1)[-1].strip()[:160]
                counts[key] += 1
                if len(samples) < 12 and counts[key] == 1:
                    samples.append(line[:300])
        top = counts.most_common(8)
        return {"lines": sum(counts.values()), "distinct": len(counts), "top": top, "samples": samples}

    def stop(self) -> None:
        """SIGINT to the launcher (it stops its children, then itself); anything left of ours is killed."""
        import psutil

        if self.process is not None:
            self.remember_pids()
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGINT)
                try:
                    self.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    say("the launcher did not stop within 60 s after SIGINT; killing it")
                    self.process.kill()
                    self.process.wait()
            for pid in sorted(self.known_pids):
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    leftover = psutil.Process(pid)
                    if leftover.is_running() and leftover.status() != psutil.STATUS_ZOMBIE:
                        say(f"killing leftover process {pid}: {' '.join(leftover.cmdline())[:100]}")
                        leftover.kill()
        if self.log is not None:
            self.log.close()

    def drop_database(self) -> None:
        import psycopg
        from psycopg import sql

        for attempt in range(5):
            try:
                with psycopg.connect(
                    with_database(self.database_url, "postgres"), autocommit=True, connect_timeout=5
                ) as conn:
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.dbname)))
                return
            except psycopg.Error as exc:
                if attempt == 4:
                    say(f"could not drop database {self.dbname}: {exc}")
                time.sleep(1)

    def delete_redis_keys(self) -> int:
        client = self.redis()
        deleted = 0
        try:
            batch = []
            for name in client.scan_iter(match=f"{self.prefix}:*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    deleted += client.delete(*batch)
                    batch = []
            if batch:
                deleted += client.delete(*batch)
        finally:
            client.close()
        return deleted
