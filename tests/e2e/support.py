"""What the end-to-end tests share: starting and stopping the real product, a fresh database and Redis
namespace per test, waiting for conditions."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psutil
import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]


def stack_env(tmp_path: Path, **overrides: str) -> dict:
    """The environment for one product instance on the machine's PostgreSQL and Redis: its own database
    (the launcher creates it), its own Redis prefix and data folder. Undo with ``drop_stack``."""
    name = f"fleet_e2e_{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "DATABASE_URL": urlunsplit(urlsplit(os.environ["DATABASE_URL"])._replace(path="/" + name)),
        "FLEET_DATA_DIR": str(tmp_path / "data"),
        "REDIS_PREFIX": name,
        "PYTHONUNBUFFERED": "1",
        **overrides,
    }
    env.pop("CELERY_QUEUE", None)
    return env


def drop_stack(env: dict) -> None:
    database = urlsplit(env["DATABASE_URL"]).path.lstrip("/")
    admin = urlunsplit(urlsplit(env["DATABASE_URL"])._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    forget_redis_keys(env["REDIS_PREFIX"])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Output:
    """Collects a child's merged stdout/stderr on a thread, for assertions and failure messages."""

    def __init__(self, process: subprocess.Popen):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.lines.append(line.rstrip("\n"))

    def tail(self, count: int = 60) -> str:
        return "\n".join(self.lines[-count:])


def spawn(argv: list[str], env: dict) -> tuple[subprocess.Popen, Output]:
    process = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    return process, Output(process)


def launcher_argv(port: int, demo_devices: int | None = None, web_workers: int = 1, *extra: str) -> list[str]:
    """The launcher's command line as `make run` gives it; without ``demo_devices``, no demo (``--no-demo``; 0:
    the demo setup without a fleet); ``extra`` arguments last."""
    return [
        sys.executable,
        "-m",
        "fleet.launcher",
        "run",
        "--port",
        str(port),
        "--web-workers",
        str(web_workers),
        "--worker-concurrency",
        "1",
        *(["--devices", str(demo_devices)] if demo_devices is not None else ["--no-demo"]),
        *extra,
    ]


def await_ready(process: subprocess.Popen, output: Output, timeout: float = 120) -> None:
    """Waits until ``process`` (the launcher, or a parent whose output it shares) says the product is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            time.sleep(0.3)
            pytest.fail("launcher exited early:\n" + output.tail())
        if any("press Ctrl-C to stop" in line for line in output.lines):
            return
        time.sleep(0.3)
    stop_launcher(process)
    pytest.fail("launcher not ready in time:\n" + output.tail())


def start_launcher(
    env: dict, port: int, timeout: float = 240, demo_devices: int | None = None, web_workers: int = 1
) -> tuple[subprocess.Popen, Output]:
    """The product as `make run` starts it; without ``demo_devices``, no demo fleet (``--no-demo``);
    ``web_workers`` server processes."""
    process, output = spawn(launcher_argv(port, demo_devices, web_workers), env)
    await_ready(process, output, timeout)
    return process, output


def stop_launcher(process: subprocess.Popen, timeout: float = 60) -> list[psutil.Process]:
    """SIGINT the launcher as Ctrl-C would, wait for it and its children; returns children still alive
    (after killing them, so nothing outlives the test)."""
    if process.poll() is not None:
        return []  # already stopped and reaped: its pid may belong to someone else by now
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    _, alive = psutil.wait_procs(children, timeout=20)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for leftover in alive:
        leftover.kill()
    psutil.wait_procs(alive, timeout=10)
    return alive


def kill(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def wait_for(check, timeout: float, interval: float = 0.25):
    """Polls ``check()`` until it returns something truthy; returns (value, seconds waited) or (None, timeout)."""
    started = time.monotonic()
    while True:
        value = check()
        if value:
            return value, time.monotonic() - started
        if time.monotonic() - started > timeout:
            return None, timeout
        time.sleep(interval)


def forget_redis_keys(prefix: str) -> None:
    """Delete this test's own keys (all under its unique prefix); never anything else on the shared Redis."""
    import redis

    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def multipart_post(
    url: str, token: str, fields: dict[str, str], files: dict[str, tuple[str, bytes]]
) -> tuple[int, dict]:
    """POST a multipart form (``fields`` as text, ``files`` as ``(filename, bytes)``) with a bearer token:
    ``(status, JSON body)``, an error's status and body included."""
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()
    ]
    for name, (filename, data) in files.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
        parts.append(head.encode() + b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n")
    request = urllib.request.Request(  # noqa: S310  (our own http URL)
        url,
        data=b"".join(parts) + f"--{boundary}--\r\n".encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


@dataclass
class Stack:
    """One running product (``product_stack``): its environment, port and output, and the agent processes a
    test starts (``(process, output)`` pairs, killed when the stack stops)."""

    env: dict
    port: int
    output: Output
    agents: list = field(default_factory=list)


@contextlib.contextmanager
def product_stack(tmp_path: Path, **overrides: str) -> Iterator[Stack]:
    """The product as `make run` starts it, without the demo, on its own database and Redis prefix, with quick
    heartbeats, rollout ticks and presence flushes; afterwards the agents killed, the launcher stopped and the
    database and keys dropped, whatever happened."""
    quick = {"HEARTBEAT_INTERVAL_SECONDS": "2", "ROLLOUT_TICK_SECONDS": "1", "PRESENCE_FLUSH_SECONDS": "1"}
    env = stack_env(tmp_path, **{**quick, **overrides})
    port, launcher, stack = free_port(), None, None
    try:
        launcher, output = start_launcher(env, port)
        stack = Stack(env, port, output)
        yield stack
    finally:
        for process, _ in stack.agents if stack else []:
            kill(process)
        if launcher is not None:
            stop_launcher(launcher)
        drop_stack(env)
