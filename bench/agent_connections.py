"""Agent connections: how many simulated edge agents the real server holds at once, and how it answers them.

    .venv/bin/python bench/agent_connections.py --connections 10000

What it does (DESIGN.md, "Benchmarks", Connections):

1. Starts the whole product with the real launcher (``python -m fleet.launcher run``) in a subprocess, on the
   machine's PostgreSQL (a fresh ``fleet_bench_conn_<random>`` database, created by the launcher) and Redis
   (a unique ``REDIS_PREFIX``), and waits for ``/readyz``.
2. Creates the devices straight in that database (a small Django script in a subprocess): one cohort and N
   active devices, each with a fresh Ed25519 key. The keys go to a temp JSON file for the load generator.
3. Runs two phases: a baseline with few connections (the round-trip floor of this machine and this server,
   measured in the same run), then the target. In each, load-generator processes (asyncio + ``websockets``,
   no Django) open the connections at a fixed rate, speak the real protocol (challenge, signed hello,
   welcome), then heartbeat every ``interval * uniform(0.9, 1.1)`` seconds with the first heartbeat at a
   random offset, so beats are spread out. Round trips (heartbeat seq N sent -> heartbeat_ack seq N
   received) are recorded only in the steady-state window after the ramp.
4. Measures the server's RSS (uvicorn and its workers) idle before the phase and at the end of the steady
   window, the CPU used by the server, the Celery worker and the generators in that window, and whether
   every socket's presence entry in Redis is gone after the generators drop all connections at once.
5. Prints a Markdown table and the command line, writes ``bench/results/agent_connections.json``, keeps the
   launcher's output in ``bench/results/agent_connections_launcher.log``, then stops the launcher with
   SIGINT, drops the database and deletes its own Redis keys, also on failure.

The generators tune their own garbage collector the way ``fleet/asgi.py`` tunes the server's, and measure
their own event-loop lag, so a stall on the client side is reported instead of showing up as server latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import random
import secrets
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from queue import Empty, Queue

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

RESULTS_DIR = BASE_DIR / "bench" / "results"
RESULTS_JSON = RESULTS_DIR / "agent_connections.json"
LAUNCHER_LOG = RESULTS_DIR / "agent_connections_launcher.log"
GENERATOR_LOG = RESULTS_DIR / "agent_connections_generator.log"

AGENT_VERSION = "bench-1"
HARDWARE = {"ram_mb": 4096, "cpu": "bench", "accelerator": "none", "os": "linux"}

# Keep the generator's GC from stalling its event loop (the same reasoning as fleet/asgi.py).
GC_THRESHOLDS = (50_000, 20, 100)


def _say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def _raise_open_file_limit() -> tuple[int, int]:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1_048_576
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _percentile(values: list[float], fraction: float) -> float | None:
    """Nearest-rank percentile of an unsorted list."""
    if not values:
        return None
    ordered = sorted(values)
    index = max(0, min(len(ordered) - 1, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


# ======================================================================================================
# Load generator (a separate process; speaks only the wire protocol, never imports Django)
# ======================================================================================================


class GeneratorState:
    def __init__(self, total: int):
        self.total = total
        self.recording = False
        self.finished_handshakes = 0
        self.ramp_done = asyncio.Event()
        self.connected = 0
        self.handshake_failed = 0
        self.dropped = 0
        self.lost_heartbeats = 0
        self.in_flight = 0
        self.sent_in_window = 0
        self.failure_reasons: Counter[str] = Counter()
        self.close_codes: Counter[str] = Counter()
        self.handshake_ms: list[float] = []  # connect() called -> welcome received
        self.upgrade_ms: list[float] = []  # connect() called -> HTTP upgrade done
        self.hello_ms: list[float] = []  # hello sent -> welcome received (the server's authentication)
        self.rtt_ms: list[float] = []
        self.lag_ms: list[float] = []
        self.gc_pauses_ms: list[float] = []
        self.sockets: set = set()

    def handshake_finished(self) -> None:
        self.finished_handshakes += 1
        if self.finished_handshakes >= self.total:
            self.ramp_done.set()


def _failure_reason(exc: BaseException) -> str:
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    if isinstance(exc, InvalidStatus):
        return f"http {exc.response.status_code}"
    if isinstance(exc, ConnectionClosed):
        code = exc.rcvd.code if exc.rcvd is not None else "no close frame"
        return f"closed {code}"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__} errno {exc.errno}"
    if isinstance(exc, _ProtocolError):
        return str(exc)[:80]
    return type(exc).__name__


class _ProtocolError(Exception):
    pass


async def _client(device: dict, cfg: dict, state: GeneratorState) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from edge_agent.protocol import MAX_MESSAGE_BYTES, MessageType, decode, encode, hello_payload, sign

    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(device["seed"]))
    device_id = device["id"]
    started = time.perf_counter()
    socket_ = None
    stage = "upgrade"  # where a failed handshake stopped: upgrade, challenge or welcome
    try:
        async with asyncio.timeout(cfg["handshake_timeout"]):
            socket_ = await connect(
                cfg["url"],
                ping_interval=None,
                max_size=MAX_MESSAGE_BYTES,
                compression=None if cfg["compression"] == "none" else "deflate",
                open_timeout=None,
                close_timeout=cfg["close_timeout"],
            )
            upgraded = time.perf_counter()
            stage = "challenge"
            challenge = decode(await socket_.recv(), limit=MAX_MESSAGE_BYTES)
            if challenge["type"] != MessageType.CHALLENGE:
                raise _ProtocolError(f"got {challenge['type']} {challenge.get('code')}")
            await socket_.send(
                encode(
                    MessageType.HELLO,
                    device_id=device_id,
                    signature=sign(key, hello_payload(nonce=challenge["nonce"], device_id=device_id)),
                    agent_version=AGENT_VERSION,
                    hardware=HARDWARE,
                )
            )
            hello_sent = time.perf_counter()
            stage = "welcome"
            welcome = decode(await socket_.recv(), limit=MAX_MESSAGE_BYTES)
            if welcome["type"] != MessageType.WELCOME:
                raise _ProtocolError(f"got {welcome['type']} {welcome.get('code')}")
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        state.handshake_failed += 1
        state.failure_reasons[f"handshake at {stage}: {_failure_reason(exc)}"] += 1
        if socket_ is not None:
            with contextlib.suppress(Exception):
                await socket_.close()
        state.handshake_finished()
        return

    welcomed = time.perf_counter()
    state.handshake_ms.append((welcomed - started) * 1000)
    state.upgrade_ms.append((upgraded - started) * 1000)
    state.hello_ms.append((welcomed - hello_sent) * 1000)
    state.connected += 1
    state.sockets.add(socket_)
    state.handshake_finished()

    interval = float(welcome.get("heartbeat_interval") or cfg["interval"])
    rng = random.Random()
    try:
        await asyncio.sleep(rng.uniform(0, interval))
        seq = 0
        while True:
            seq += 1
            in_window = state.recording
            sent = time.perf_counter()
            if in_window:
                state.sent_in_window += 1
                state.in_flight += 1
            try:
                await socket_.send(
                    encode(
                        MessageType.HEARTBEAT,
                        seq=seq,
                        battery=round(rng.uniform(20, 100), 1),
                        charging=rng.random() < 0.3,
                        free_memory_mb=rng.randint(200, 4000),
                        metrics={},
                    )
                )
                async with asyncio.timeout(cfg["ack_timeout"]):
                    while True:
                        message = decode(await socket_.recv(), limit=MAX_MESSAGE_BYTES)
                        if message["type"] == MessageType.HEARTBEAT_ACK and message.get("seq") == seq:
                            break
                        if message["type"] == MessageType.ERROR:
                            raise _ProtocolError(f"error from server: {message.get('code')}")
                        # anything else (a late ack, a command) is not what this round trip waits for
                rtt = (time.perf_counter() - sent) * 1000
                if in_window:
                    state.rtt_ms.append(rtt)
            except TimeoutError:
                if in_window:
                    state.lost_heartbeats += 1
            finally:
                if in_window:
                    state.in_flight -= 1
            delay = sent + interval * rng.uniform(0.9, 1.1) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
    except asyncio.CancelledError:
        raise
    except ConnectionClosed as exc:
        state.dropped += 1
        state.close_codes[str(exc.rcvd.code if exc.rcvd is not None else "no close frame")] += 1
        state.sockets.discard(socket_)
    except Exception as exc:
        state.dropped += 1
        state.failure_reasons[f"after welcome: {_failure_reason(exc)}"] += 1
        state.sockets.discard(socket_)
        with contextlib.suppress(Exception):
            await socket_.close()


async def _lag_monitor(state: GeneratorState) -> None:
    """How late the generator's own loop wakes up: a busy generator would inflate the measured round trips."""
    loop = asyncio.get_running_loop()
    period = 0.1
    while True:
        before = loop.time()
        await asyncio.sleep(period)
        if state.recording:
            state.lag_ms.append(max(0.0, (loop.time() - before - period) * 1000))


def _install_gc_probe(state: GeneratorState) -> None:
    started: list[float] = []

    def probe(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started and state.recording:
            state.gc_pauses_ms.append((time.perf_counter() - started[0]) * 1000)

    gc.callbacks.append(probe)


def _emit(kind: str, payload: dict) -> None:
    sys.stdout.write(f"{kind} {json.dumps(payload)}\n")
    sys.stdout.flush()


def _summary(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "p50": _percentile(values, 0.50),
        "p90": _percentile(values, 0.90),
        "p99": _percentile(values, 0.99),
        "p999": _percentile(values, 0.999),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


async def _generate(cfg: dict) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    nofile = _raise_open_file_limit()
    devices = json.loads(Path(cfg["keys_file"]).read_text())[cfg["first"] : cfg["first"] + cfg["count"]]
    state = GeneratorState(len(devices))
    loop = asyncio.get_running_loop()

    commands: asyncio.Queue[str] = asyncio.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, "EOF")

    threading.Thread(target=read_commands, daemon=True).start()

    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    _install_gc_probe(state)
    monitor = asyncio.create_task(_lag_monitor(state))

    tasks: set[asyncio.Task] = set()
    ramp_started = time.monotonic()
    start = loop.time()
    for index, device in enumerate(devices):
        delay = start + index / cfg["rate"] - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.add(asyncio.create_task(_client(device, cfg, state)))
    if devices:
        await state.ramp_done.wait()
    ramp_seconds = time.monotonic() - ramp_started
    _emit(
        "RAMPED",
        {
            "connected": state.connected,
            "handshake_failed": state.handshake_failed,
            "ramp_seconds": ramp_seconds,
            "nofile": nofile,
            "failure_reasons": dict(state.failure_reasons),
        },
    )

    while (command := await commands.get()) != "STEADY":
        if command == "EOF":
            return
    state.recording = True
    window_started = time.monotonic()

    while (command := await commands.get()) not in ("STOP", "EOF"):
        pass
    state.recording = False
    window_seconds = time.monotonic() - window_started
    held = len(state.sockets)
    # Let heartbeats sent inside the window finish their round trip (they count; nothing new is recorded).
    deadline = time.monotonic() + cfg["ack_timeout"] + 1
    while state.in_flight > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    _emit(
        "RESULT",
        {
            "devices": len(devices),
            "held": held,
            "connected": state.connected,
            "handshake_failed": state.handshake_failed,
            "dropped": state.dropped,
            "lost_heartbeats": state.lost_heartbeats,
            "unfinished_heartbeats": state.in_flight,
            "sent_in_window": state.sent_in_window,
            "window_seconds": window_seconds,
            "ramp_seconds": ramp_seconds,
            "failure_reasons": dict(state.failure_reasons),
            "close_codes": dict(state.close_codes),
            "rtt_ms": state.rtt_ms,
            "handshake_ms": _summary(state.handshake_ms),
            "upgrade_ms": _summary(state.upgrade_ms),
            "hello_ms": _summary(state.hello_ms),
            "loop_lag_ms": _summary(state.lag_ms),
            "gc_pauses_ms": _summary(state.gc_pauses_ms),
        },
    )

    # Drop every connection at once, as a generator crash or a network cut would: a mass disconnect.
    monitor.cancel()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    close_started = time.monotonic()
    sockets = list(state.sockets)
    outcomes = await asyncio.gather(*(s.close() for s in sockets), return_exceptions=True)
    _emit(
        "CLOSED",
        {
            "closed": len(sockets),
            "errors": sum(isinstance(o, BaseException) for o in outcomes),
            "seconds": time.monotonic() - close_started,
        },
    )


def generator_main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    runner(_generate(cfg))
    return 0


# ======================================================================================================
# Orchestrator (starts the product, creates devices, runs the phases, measures the server)
# ======================================================================================================

CREATE_DEVICES = r"""
import json, sys, uuid
import django
django.setup()
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from devices.models import Cohort, Device, DeviceStatus
from edge_agent.protocol import b64encode

count, out, cohort_name, agent_version = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
hardware = json.loads(sys.argv[5])
cohort = Cohort.objects.create(name=cohort_name, description="agent_connections benchmark")
rows, keys = [], []
for index in range(count):
    key = Ed25519PrivateKey.generate()
    device_id = uuid.uuid4()
    rows.append(Device(
        id=device_id, name=f"bench-{index:06d}", cohort=cohort, status=DeviceStatus.ACTIVE,
        public_key=b64encode(key.public_key().public_bytes_raw()),
        # what the simulated agents report in their hello, so a hello writes nothing (a reconnecting fleet)
        agent_version=agent_version, hardware=hardware,
    ))
    keys.append({"id": str(device_id), "seed": key.private_bytes_raw().hex()})
Device.objects.bulk_create(rows, batch_size=2000)
with open(out, "w") as f:
    json.dump(keys, f)
print(Device.objects.filter(cohort=cohort, status=DeviceStatus.ACTIVE).count())
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _with_database(url: str, dbname: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    return urlunsplit(urlsplit(url)._replace(path="/" + dbname))


class GeneratorProcess:
    """One load-generator subprocess and the line protocol it speaks on stdout (RAMPED, RESULT, CLOSED)."""

    def __init__(self, index: int, cfg: dict, workdir: Path, log) -> None:
        self.index = index
        config_path = workdir / f"generator-{cfg['phase']}-{index}.json"
        config_path.write_text(json.dumps(cfg))
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--_generator", str(config_path)],
            cwd=BASE_DIR,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self.lines: Queue = Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            kind, _, payload = line.partition(" ")
            try:
                self.lines.put((kind, json.loads(payload)))
            except ValueError:
                self.lines.put(("TEXT", line))
        self.lines.put(("EXIT", None))

    def expect(self, kind: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"generator {self.index}: no {kind} within {timeout:.0f}s")
            try:
                got, payload = self.lines.get(timeout=remaining)
            except Empty:
                continue
            if got == kind:
                return payload
            if got == "EXIT":
                raise RuntimeError(f"generator {self.index} exited (code {self.process.wait()}) before {kind}")

    def send(self, command: str) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        if self.process.poll() is None:
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Server:
    """The product, started by the real launcher, and the processes it runs."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.run_id = secrets.token_hex(4)
        self.dbname = f"fleet_bench_conn_{self.run_id}"
        self.prefix = f"bench_conn_{self.run_id}"
        self.database_url = _with_database(args.database_url, self.dbname)
        self.redis_url = args.redis_url
        self.port = _free_port()
        self.workdir = workdir
        self.env = {
            **os.environ,
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "REDIS_PREFIX": self.prefix,
            "FLEET_DATA_DIR": str(workdir / "data"),
            "HEARTBEAT_INTERVAL_SECONDS": str(args.interval),
            "SECRET_KEY": secrets.token_urlsafe(50),
            "DJANGO_SETTINGS_MODULE": "fleet.settings",
            "PYTHONUNBUFFERED": "1",
        }
        self.process: subprocess.Popen | None = None
        self.log = None
        self.known_pids: set[int] = set()
        self.command = [
            sys.executable,
            "-m",
            "fleet.launcher",
            "run",
            "--port",
            str(self.port),
            "--web-workers",
            str(args.web_workers),
            "--worker-concurrency",
            "1",
        ]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        self.log = open(LAUNCHER_LOG, "w")  # noqa: SIM115  (closed in stop())
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
                raise RuntimeError(f"the launcher exited with code {self.process.returncode}; see {LAUNCHER_LOG}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.base_url}/readyz", timeout=3) as response,  # noqa: S310
            ):
                if response.status == 200:
                    self.remember_pids()
                    return time.monotonic() - started
            time.sleep(0.5)
        raise RuntimeError(f"/readyz not ready after {timeout:.0f}s; see {LAUNCHER_LOG}")

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

    def web_workers(self) -> list:
        """The uvicorn worker processes (children of the uvicorn supervisor that accept sockets)."""
        tree = self.web_processes()
        return [p for p in tree[1:] if _safe(lambda p=p: "resource_tracker" not in " ".join(p.cmdline()), False)]

    def create_devices(self, count: int, keys_file: Path) -> float:
        started = time.monotonic()
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                CREATE_DEVICES,
                str(count),
                str(keys_file),
                f"bench-conn-{self.run_id}",
                AGENT_VERSION,
                json.dumps(HARDWARE),
            ],
            cwd=BASE_DIR,
            env=self.env,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"creating devices failed:\n{result.stdout}{result.stderr}")
        created = int(result.stdout.strip().splitlines()[-1])
        if created != count:
            raise RuntimeError(f"created {created} devices, expected {count}")
        return time.monotonic() - started

    def redis(self):
        import redis

        return redis.Redis.from_url(self.redis_url, socket_timeout=10)

    def presence_connections(self) -> int:
        client = self.redis()
        try:
            return int(client.hlen(f"{self.prefix}:presence:conn"))
        finally:
            client.close()

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
                    _say("the launcher did not stop within 60 s after SIGINT; killing it")
                    self.process.kill()
                    self.process.wait()
            for pid in sorted(self.known_pids):
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    leftover = psutil.Process(pid)
                    if leftover.is_running() and leftover.status() != psutil.STATUS_ZOMBIE:
                        _say(f"killing leftover process {pid}: {' '.join(leftover.cmdline())[:100]}")
                        leftover.kill()
        if self.log is not None:
            self.log.close()

    def drop_database(self) -> None:
        import psycopg
        from psycopg import sql

        for attempt in range(5):
            try:
                with psycopg.connect(
                    _with_database(self.database_url, "postgres"), autocommit=True, connect_timeout=5
                ) as conn:
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.dbname)))
                return
            except psycopg.Error as exc:
                if attempt == 4:
                    _say(f"could not drop database {self.dbname}: {exc}")
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


def _safe(fn, default):
    try:
        return fn()
    except Exception:
        return default


def _rss(processes: list) -> int:
    return sum(_safe(lambda p=p: p.memory_info().rss, 0) for p in processes)


def _cpu_seconds(processes: list) -> dict[int, float]:
    out = {}
    for p in processes:
        times = _safe(p.cpu_times, None)
        if times is not None:
            out[p.pid] = times.user + times.system
    return out


def _cpu_percent(before: dict[int, float], after: dict[int, float], seconds: float) -> float:
    """Percent of one core over the window (200 = both cores of this machine)."""
    used = sum(after[pid] - before.get(pid, 0.0) for pid in after)
    return 100.0 * used / seconds if seconds > 0 else 0.0


def _machine_cpu(before, after) -> float:
    """Percent of all cores busy between two psutil.cpu_times() samples (every process on the machine)."""

    def busy(t) -> float:
        return t.user + t.nice + t.system + t.irq + t.softirq + t.steal

    total = (busy(after) + after.idle + after.iowait) - (busy(before) + before.idle + before.iowait)
    return 100.0 * (busy(after) - busy(before)) / max(1e-9, total)


def _established(process, port: int) -> int:
    import psutil

    try:
        return sum(
            1
            for c in process.net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return -1


def _log_problems(offset: int) -> dict:
    """Warnings and errors the launcher's children printed since ``offset`` (a byte position in the log)."""
    with open(LAUNCHER_LOG, "rb") as f:
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
    return {"lines": sum(counts.values()), "distinct": len(counts), "top": counts.most_common(8), "samples": samples}


def run_phase(
    *,
    name: str,
    connections: int,
    first_device: int,
    hold: float,
    args: argparse.Namespace,
    server: Server,
    keys_file: Path,
    workdir: Path,
    generator_log,
) -> dict:
    import psutil

    procs = max(1, min(args.generator_procs, connections))
    _say(f"phase {name}: {connections} connections from {procs} generator process(es), ramp {args.ramp_rate}/s")
    time.sleep(args.settle)
    web = server.web_processes()
    idle_rss = _rss(web)
    idle_presence = server.presence_connections()
    log_offset = LAUNCHER_LOG.stat().st_size

    generators: list[GeneratorProcess] = []
    share, extra = divmod(connections, procs)
    ramp_cpu_web0, ramp_system0, ramp_started = _cpu_seconds(web), psutil.cpu_times(), time.monotonic()
    first = first_device
    try:
        for index in range(procs):
            count = share + (1 if index < extra else 0)
            cfg = {
                "phase": name,
                "url": f"ws://127.0.0.1:{server.port}/ws/agent/",
                "keys_file": str(keys_file),
                "first": first,
                "count": count,
                "rate": args.ramp_rate / procs,
                "interval": args.interval,
                "handshake_timeout": args.handshake_timeout,
                "ack_timeout": args.ack_timeout,
                "close_timeout": 10.0,
                "compression": args.compression,
            }
            first += count
            generators.append(GeneratorProcess(index, cfg, workdir, generator_log))

        ramp_timeout = connections / args.ramp_rate + args.handshake_timeout + 60
        ramped = [g.expect("RAMPED", ramp_timeout) for g in generators]
        ramp_seconds = max(r["ramp_seconds"] for r in ramped)
        connected = sum(r["connected"] for r in ramped)
        ramp_wall = time.monotonic() - ramp_started
        ramp_cpu = {
            "wall_seconds": ramp_wall,
            "server_cpu_percent_of_core": _cpu_percent(ramp_cpu_web0, _cpu_seconds(server.web_processes()), ramp_wall),
            "generator_cpu_percent_of_core": _cpu_percent(
                {}, _cpu_seconds([psutil.Process(g.process.pid) for g in generators]), ramp_wall
            ),
            "machine_cpu_percent_of_all_cores": _machine_cpu(ramp_system0, psutil.cpu_times()),
        }
        _say(
            f"phase {name}: ramp done in {ramp_seconds:.1f}s, {connected} connected, "
            f"{sum(r['handshake_failed'] for r in ramped)} handshakes failed"
        )

        # Steady state: every generator starts recording round trips at (about) the same moment.
        web = server.web_processes()
        celery = server.worker_processes()
        gen_ps = [psutil.Process(g.process.pid) for g in generators]
        for g in generators:
            g.send("STEADY")
        window_start = time.monotonic()
        cpu_web0, cpu_celery0, cpu_gen0 = _cpu_seconds(web), _cpu_seconds(celery), _cpu_seconds(gen_ps)
        system0 = psutil.cpu_times()
        rss_samples = []
        while True:
            remaining = hold - (time.monotonic() - window_start)
            if remaining <= 0:
                break
            time.sleep(min(10.0, remaining))
            if not server.alive():
                raise RuntimeError(f"the launcher exited during phase {name}; see {LAUNCHER_LOG}")
            rss_samples.append(_rss(server.web_processes()))
        window = time.monotonic() - window_start
        web = server.web_processes()
        cpu_web = _cpu_percent(cpu_web0, _cpu_seconds(web), window)
        cpu_celery = _cpu_percent(cpu_celery0, _cpu_seconds(server.worker_processes()), window)
        cpu_gen = _cpu_percent(cpu_gen0, _cpu_seconds(gen_ps), window)
        machine_cpu = _machine_cpu(system0, psutil.cpu_times())
        steady_rss = _rss(web)
        per_worker = [
            {
                "pid": p.pid,
                "rss_mb": _safe(lambda p=p: p.memory_info().rss, 0) / 2**20,
                "established": _established(p, server.port),
                "cpu_percent": _cpu_percent({p.pid: cpu_web0.get(p.pid, 0.0)}, _cpu_seconds([p]), window),
            }
            for p in server.web_workers()
        ]
        steady_presence = server.presence_connections()

        for g in generators:
            g.send("STOP")
        results = [g.expect("RESULT", args.ack_timeout + 60) for g in generators]
        closed = [g.expect("CLOSED", 120) for g in generators]
    finally:
        for g in generators:
            g.stop()

    # After the mass disconnect every socket's presence entry should be gone (devices.presence._RELEASE).
    drain_started = time.monotonic()
    leftover = server.presence_connections()
    while leftover > idle_presence and time.monotonic() - drain_started < args.drain_timeout:
        time.sleep(0.5)
        leftover = server.presence_connections()
    drain_seconds = time.monotonic() - drain_started

    rtts = [rtt for r in results for rtt in r["rtt_ms"]]
    held = sum(r["held"] for r in results)
    failure_reasons: Counter[str] = Counter()
    close_codes: Counter[str] = Counter()
    for r in results:
        failure_reasons.update(r["failure_reasons"])
        close_codes.update(r["close_codes"])
    per_connection_kb = (steady_rss - idle_rss) / held / 1024 if held else None
    phase = {
        "phase": name,
        "target": connections,
        "held": held,
        "handshake_failed": sum(r["handshake_failed"] for r in results),
        "dropped": sum(r["dropped"] for r in results),
        "lost_heartbeats": sum(r["lost_heartbeats"] for r in results),
        "unfinished_heartbeats": sum(r["unfinished_heartbeats"] for r in results),
        "heartbeats_in_window": sum(r["sent_in_window"] for r in results),
        "rtt_ms": _summary(rtts),
        "window_seconds": window,
        "ramp_seconds": ramp_seconds,
        "ramp_rate_achieved": connections / ramp_seconds if ramp_seconds else None,
        "ramp_cpu": ramp_cpu,
        "server_rss_idle_mb": idle_rss / 2**20,
        "server_rss_steady_mb": steady_rss / 2**20,
        "server_rss_samples_mb": [s / 2**20 for s in rss_samples],
        "kb_per_connection": per_connection_kb,
        "server_cpu_percent_of_core": cpu_web,
        "celery_worker_cpu_percent_of_core": cpu_celery,
        "generator_cpu_percent_of_core": cpu_gen,
        "machine_cpu_percent_of_all_cores": machine_cpu,
        "web_workers": per_worker,
        "generator_processes": len(generators),
        "generators": [
            {
                k: r[k]
                for k in (
                    "devices",
                    "held",
                    "ramp_seconds",
                    "handshake_ms",
                    "upgrade_ms",
                    "hello_ms",
                    "loop_lag_ms",
                    "gc_pauses_ms",
                )
            }
            for r in results
        ],
        "failure_reasons": dict(failure_reasons),
        "close_codes": dict(close_codes),
        "presence_conn_idle": idle_presence,
        "presence_conn_steady": steady_presence,
        "mass_disconnect": {
            "closed": sum(c["closed"] for c in closed),
            "close_errors": sum(c["errors"] for c in closed),
            "client_close_seconds": max(c["seconds"] for c in closed),
            "presence_conn_left": leftover - idle_presence,
            "waited_seconds": drain_seconds,
        },
    }
    phase["launcher_log_problems"] = _log_problems(log_offset)
    _say(
        f"phase {name}: held {held}/{connections}, p50 {_fmt(phase['rtt_ms'].get('p50'))} ms, "
        f"p99 {_fmt(phase['rtt_ms'].get('p99'))} ms over {phase['rtt_ms']['count']} heartbeats, "
        f"server RSS {phase['server_rss_steady_mb']:.0f} MB, presence entries left after disconnect: "
        f"{phase['mass_disconnect']['presence_conn_left']}"
    )
    return phase


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def render_table(phases: list[dict]) -> str:
    header = (
        "| phase | connections target | held | failed (handshake / closed later / lost beats) | heartbeats | "
        "p50 ms | p99 ms | server RSS MB (idle -> steady) | KB/connection | server CPU % | "
        "celery worker CPU % | generator CPU % | machine CPU % |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for p in phases:
        lines.append(
            "| {phase} | {target:,} | {held:,} | {hf} / {dr} / {lost} | {beats:,} | {p50} | {p99} | {idle} -> {steady} "
            "| {kb} | {cpu} | {celery} | {gen} | {machine} |".format(
                phase=p["phase"],
                target=p["target"],
                held=p["held"],
                hf=p["handshake_failed"],
                dr=p["dropped"],
                lost=p["lost_heartbeats"],
                beats=p["rtt_ms"]["count"],
                p50=_fmt(p["rtt_ms"].get("p50"), 2),
                p99=_fmt(p["rtt_ms"].get("p99"), 2),
                idle=_fmt(p["server_rss_idle_mb"], 0),
                steady=_fmt(p["server_rss_steady_mb"], 0),
                kb=_fmt(p["kb_per_connection"], 1),
                cpu=_fmt(p["server_cpu_percent_of_core"], 1),
                celery=_fmt(p["celery_worker_cpu_percent_of_core"], 1),
                gen=_fmt(p["generator_cpu_percent_of_core"], 1),
                machine=_fmt(p["machine_cpu_percent_of_all_cores"], 1),
            )
        )
    return "\n".join(lines)


def render_details(phases: list[dict]) -> str:
    def each(values, digits=1):
        return ", ".join(_fmt(v, digits) for v in values)

    lines = []
    for p in phases:
        gens = p["generators"]
        rc = p["ramp_cpu"]
        md = p["mass_disconnect"]
        workers = "; ".join(
            f"pid {w['pid']} {w['established']} sockets, {w['rss_mb']:.0f} MB, {w['cpu_percent']:.1f}% CPU"
            for w in p["web_workers"]
        )
        lines += [
            f"- **{p['phase']}**",
            f"  - ramp: {p['ramp_seconds']:.1f} s ({_fmt(p['ramp_rate_achieved'], 0)} connections/s achieved); "
            f"handshake p50 {each(g['handshake_ms'].get('p50') for g in gens)} ms, p99 "
            f"{each(g['handshake_ms'].get('p99') for g in gens)} ms (per generator; of which hello -> welcome p99 "
            f"{each(g['hello_ms'].get('p99') for g in gens)} ms); CPU during the ramp: server "
            f"{rc['server_cpu_percent_of_core']:.0f}%, generators {rc['generator_cpu_percent_of_core']:.0f}%, "
            f"machine {rc['machine_cpu_percent_of_all_cores']:.0f}% of all cores",
            f"  - steady state: {p['window_seconds']:.0f} s, RTT p90 {_fmt(p['rtt_ms'].get('p90'), 2)} ms, p99.9 "
            f"{_fmt(p['rtt_ms'].get('p999'), 2)} ms, max {_fmt(p['rtt_ms'].get('max'), 2)} ms; generator loop lag "
            f"p99 {each((g['loop_lag_ms'].get('p99') for g in gens), 2)} ms, longest generator GC pause "
            f"{each((g['gc_pauses_ms'].get('max') for g in gens), 2)} ms",
            f"  - uvicorn workers: {workers}; presence entries in Redis {p['presence_conn_steady']}",
            f"  - all sockets dropped at once: {md['closed']} closed by the clients in "
            f"{md['client_close_seconds']:.1f} s; presence entries left in Redis after "
            f"{md['waited_seconds']:.0f} s: {md['presence_conn_left']}",
            f"  - launcher log during the phase: {p['launcher_log_problems']['lines']} warning/error lines"
            + (f"; failures {p['failure_reasons']}" if p["failure_reasons"] else "")
            + (f"; close codes {p['close_codes']}" if p["close_codes"] else ""),
        ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=10_000, help="target concurrent agents (big phase)")
    parser.add_argument("--baseline-connections", type=int, default=100, help="agents in the baseline phase (0: none)")
    parser.add_argument("--interval", type=int, default=30, help="heartbeat interval, seconds (sent to the server)")
    parser.add_argument("--hold", type=float, default=120.0, help="steady-state seconds after the ramp")
    parser.add_argument("--baseline-hold", type=float, default=None, help="steady seconds for the baseline (--hold)")
    parser.add_argument("--ramp-rate", type=float, default=400.0, help="new connections per second, all generators")
    parser.add_argument("--web-workers", type=int, default=2, help="uvicorn worker processes")
    parser.add_argument(
        "--generator-procs", type=int, default=2, help="load-generator processes (the machine has two cores)"
    )
    parser.add_argument(
        "--compression",
        choices=("deflate", "none"),
        default="deflate",
        help="permessage-deflate offered by the clients; 'deflate' is what edge_agent does (websockets default)",
    )
    parser.add_argument("--handshake-timeout", type=float, default=30.0)
    parser.add_argument("--ack-timeout", type=float, default=10.0, help="a heartbeat unanswered this long is lost")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of quiet before each phase")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="wait for presence cleanup after a phase")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--output", type=Path, default=RESULTS_JSON)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--_generator":
        return generator_main(sys.argv[2])
    args = parse_args(argv)
    command_line = shlex.join([Path(sys.executable).as_posix(), *sys.argv])
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    nofile = _raise_open_file_limit()
    started = time.monotonic()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)

    workdir = Path(tempfile.mkdtemp(prefix="fleet-bench-conn-"))
    server = Server(args, workdir)
    phases: list[dict] = []
    error: str | None = None
    generator_log = open(GENERATOR_LOG, "w")  # noqa: SIM115
    report: dict = {}
    try:
        _say(f"launcher: {shlex.join(server.command)} (log: {LAUNCHER_LOG.relative_to(BASE_DIR)})")
        _say(f"database {server.dbname}, REDIS_PREFIX {server.prefix}, port {server.port}, RLIMIT_NOFILE {nofile}")
        server.start()
        ready_seconds = server.wait_ready(args.ready_timeout)
        _say(f"server ready in {ready_seconds:.1f}s")

        keys_file = workdir / "devices.json"
        total = args.connections + max(0, args.baseline_connections)
        create_seconds = server.create_devices(total, keys_file)
        _say(f"created {total} active devices with fresh Ed25519 keys in {create_seconds:.1f}s")

        plan = []
        if args.baseline_connections > 0:
            hold = args.baseline_hold if args.baseline_hold is not None else args.hold
            plan.append(("baseline", args.baseline_connections, args.connections, hold))
        plan.append(("target", args.connections, 0, args.hold))
        for name, connections, first_device, hold in plan:
            phases.append(
                run_phase(
                    name=name,
                    connections=connections,
                    first_device=first_device,
                    hold=hold,
                    args=args,
                    server=server,
                    keys_file=keys_file,
                    workdir=workdir,
                    generator_log=generator_log,
                )
            )
    except KeyboardInterrupt:
        error = "interrupted"
        _say("interrupted; cleaning up")
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        _say(f"failed: {error}")
    finally:
        generator_log.close()
        server.stop()
        server.drop_database()
        with contextlib.suppress(Exception):
            deleted = server.delete_redis_keys()
            _say(f"stopped the server, dropped {server.dbname}, deleted {deleted} Redis keys under {server.prefix}:")
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)

    elapsed = time.monotonic() - started
    report = {
        "benchmark": "agent_connections",
        "command": command_line,
        "launcher_command": shlex.join(server.command),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "elapsed_seconds": elapsed,
        "error": error,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "rlimit_nofile": nofile},
        "phases": phases,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))

    print()
    print(f"Command: `{command_line}`")
    print()
    if phases:
        print(render_table(phases))
        print()
        print(render_details(phases))
        print()
    print(
        f"CPU % is of one core (this machine has {os.cpu_count()}; machine CPU % is of all of them, everything "
        f"running). KB/connection = (steady - idle RSS of uvicorn and its workers) / held. Round trips are "
        f"measured by the clients in the steady-state window only. Whole run: {elapsed:.0f} s."
    )
    print(f"JSON: {args.output}  launcher output: {LAUNCHER_LOG}")
    if error:
        print(f"ERROR: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
