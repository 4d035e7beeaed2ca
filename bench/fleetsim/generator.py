"""The load generator of ``agent_connections.py``: a separate process (``python -m bench.fleetsim.generator
CONFIG``) that opens its share of the connections at a fixed rate, heartbeats on each, and answers the parent
on stdout with one line per step (``RAMPED``, ``RESULT``, ``CLOSED``, each a JSON payload); the parent says
``STEADY`` and ``STOP`` on its stdin. ``GeneratorProcess`` is the parent's side of that line protocol.

A client speaks the real protocol (challenge, signed hello, welcome), then heartbeats every
``interval * uniform(0.9, 1.1)`` seconds, the first at a random offset so beats are spread out. Round trips
(heartbeat seq N sent -> heartbeat_ack seq N received) are recorded only in the steady-state window.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from queue import Empty, Queue

from bench.fleetsim import BASE_DIR
from bench.fleetsim.agent import HandshakeFailed, ProtocolError, failure_reason, handshake, heartbeat_message
from bench.fleetsim.loop_health import install_gc_probe, lag_monitor, run_loop, tune_gc
from bench.fleetsim.resources import raise_open_file_limit
from bench.fleetsim.stats import summary


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


async def _client(device: dict, cfg: dict, state: GeneratorState) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from websockets.exceptions import ConnectionClosed

    from edge_agent.protocol import MAX_MESSAGE_BYTES, MessageType, decode

    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(device["seed"]))
    try:
        done = await handshake(
            cfg["url"],
            device["id"],
            key,
            timeout=cfg["handshake_timeout"],
            compression=cfg["compression"],
            close_timeout=cfg["close_timeout"],
        )
    except HandshakeFailed as failed:
        state.handshake_failed += 1
        state.failure_reasons[f"handshake at {failed.stage}: {failure_reason(failed.cause)}"] += 1
        state.handshake_finished()
        return

    socket_ = done.socket
    state.handshake_ms.append(done.handshake_ms)
    state.upgrade_ms.append(done.upgrade_ms)
    state.hello_ms.append(done.hello_ms)
    state.connected += 1
    state.sockets.add(socket_)
    state.handshake_finished()

    interval = float(done.welcome.get("heartbeat_interval") or cfg["interval"])
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
                await socket_.send(heartbeat_message(seq, rng))
                async with asyncio.timeout(cfg["ack_timeout"]):
                    while True:
                        message = decode(await socket_.recv(), limit=MAX_MESSAGE_BYTES)
                        if message["type"] == MessageType.HEARTBEAT_ACK and message.get("seq") == seq:
                            break
                        if message["type"] == MessageType.ERROR:
                            raise ProtocolError(f"error from server: {message.get('code')}")
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
        state.failure_reasons[f"after welcome: {failure_reason(exc)}"] += 1
        state.sockets.discard(socket_)
        with contextlib.suppress(Exception):
            await socket_.close()


def _emit(kind: str, payload: dict) -> None:
    sys.stdout.write(f"{kind} {json.dumps(payload)}\n")
    sys.stdout.flush()


async def _generate(cfg: dict) -> None:
    import logging

    logging.basicConfig(level=logging.ERROR)
    nofile = raise_open_file_limit()
    devices = json.loads(Path(cfg["keys_file"]).read_text())[cfg["first"] : cfg["first"] + cfg["count"]]
    state = GeneratorState(len(devices))
    loop = asyncio.get_running_loop()

    commands: asyncio.Queue[str] = asyncio.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, "EOF")

    threading.Thread(target=read_commands, daemon=True).start()

    tune_gc()
    install_gc_probe(state)
    monitor = asyncio.create_task(lag_monitor(state))

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
            "handshake_ms": summary(state.handshake_ms),
            "upgrade_ms": summary(state.upgrade_ms),
            "hello_ms": summary(state.hello_ms),
            "loop_lag_ms": summary(state.lag_ms),
            "gc_pauses_ms": summary(state.gc_pauses_ms),
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
    run_loop(_generate(json.loads(Path(config_path).read_text())))
    return 0


class GeneratorProcess:
    """One load-generator subprocess and the line protocol it speaks on stdout (RAMPED, RESULT, CLOSED)."""

    def __init__(self, index: int, cfg: dict, workdir: Path, log) -> None:
        self.index = index
        config_path = workdir / f"generator-{cfg['phase']}-{index}.json"
        config_path.write_text(json.dumps(cfg))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.fleetsim.generator", str(config_path)],
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


if __name__ == "__main__":
    sys.exit(generator_main(sys.argv[1]))
