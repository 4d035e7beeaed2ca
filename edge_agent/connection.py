"""The agent's connection loop: authenticate, heartbeat, take commands, and always come back.

Reconnects use exponential backoff with full jitter (a fleet that lost the server together must not
return together: a handshake costs the server about a millisecond of CPU). A device waiting for approval
or quarantined retries at the slowest pace; a retired device stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from edge_agent import __version__, sysinfo, wire
from edge_agent.identity import AgentState, atomic_write
from edge_agent.protocol import (
    DELTA_BINARY_CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    CloseCode,
    MessageType,
    decode,
    encode,
    encode_chunk_frame,
    hello_payload,
    sign,
)

logger = logging.getLogger("edge_agent.connection")
STATUS_FILE = "status.json"


class Retired(Exception):
    """The server says this device is retired: reconnecting can never succeed."""


@dataclass
class Backoff:
    base: float = 1.0
    cap: float = 60.0
    attempt: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def next_delay(self, *, slowest: bool = False) -> float:
        self.attempt += 1
        ceiling = self.cap if slowest else min(self.cap, self.base * 2 ** min(self.attempt, 16))
        return self.rng.uniform(ceiling / 2 if slowest else 0, ceiling)

    def reset(self) -> None:
        self.attempt = 0


def default_heartbeat() -> dict:
    percent, charging = sysinfo.battery()
    return {"battery": percent, "charging": charging, "free_memory_mb": sysinfo.free_memory_mb(), "metrics": {}}


def websocket_url(state: AgentState) -> str:
    scheme = "wss" if state.server.startswith("https://") else "ws"
    return f"{scheme}://{state.server.split('://', 1)[1]}{state.websocket_path}"


CommandHandler = Callable[[str, dict], Awaitable[dict | None]]


class AgentConnection:
    def __init__(
        self,
        *,
        home: Path,
        state: AgentState,
        key: Ed25519PrivateKey,
        heartbeat: Callable[[], dict] = default_heartbeat,
        on_command: CommandHandler | None = None,
        backoff: Backoff | None = None,
        uploads: UploadSource | None = None,
    ):
        self.home, self.state, self.key = home, state, key
        self.heartbeat = heartbeat
        self.on_command = on_command
        self.uploads = uploads
        self.backoff = backoff or Backoff()
        self.connected = asyncio.Event()
        self.sessions = 0
        self.last_rtt_ms: float | None = None

    def _write_status(self, **fields) -> None:
        fields["updated_at"] = time.time()
        fields["pid"] = os.getpid()
        atomic_write(self.home / STATUS_FILE, json.dumps(fields).encode(), mode=0o600)

    async def run(self, stop: asyncio.Event) -> None:
        """Stay connected until ``stop`` is set; raises Retired if the server retired this device."""
        try:
            await self._reconnect_forever(stop)
        finally:
            if stop.is_set():
                self._write_status(connected=False, error="stopped")

    async def _reconnect_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            slowest = False
            try:
                await self._session(stop)
                reason = "closed"
            except Retired:
                self._write_status(connected=False, error="retired")
                raise
            except _Refused as refused:
                reason = f"refused: {refused}"
                slowest = refused.code in CloseCode.WAIT_FOR_OPERATOR
            except (OSError, ConnectionClosed, InvalidHandshake, InvalidURI, TimeoutError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            self.connected.clear()
            if stop.is_set():
                break
            delay = self.backoff.next_delay(slowest=slowest)
            logger.warning("disconnected (%s); reconnecting in %.1fs", reason, delay)
            self._write_status(connected=False, error=reason, retry_in=round(delay, 1))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=delay)

    async def _session(self, stop: asyncio.Event) -> None:
        async with connect(
            websocket_url(self.state),
            max_size=MAX_MESSAGE_BYTES,
            open_timeout=15,
            # No permessage-deflate: the bulk of what goes up is delta bytes, which barely compress, and
            # deflating them costs the device CPU (and the server more to inflate).
            compression=None,
            ping_interval=None,  # liveness is the protocol heartbeat, answered by the application
            close_timeout=5,
        ) as socket:
            challenge = await self._expect(socket, MessageType.CHALLENGE, timeout=15)
            await socket.send(
                wire.Hello(
                    device_id=self.state.device_id,
                    signature=sign(self.key, hello_payload(nonce=challenge["nonce"], device_id=self.state.device_id)),
                    protocol=PROTOCOL_VERSION,
                    agent_version=__version__,
                    hardware=sysinfo.hardware_profile(),
                ).to_json()
            )
            welcome = await self._expect(socket, MessageType.WELCOME, timeout=15)
            interval = float(welcome.get("heartbeat_interval", self.state.heartbeat_interval))
            self.sessions += 1
            self.backoff.reset()
            self.connected.set()
            logger.info("connected as %s (heartbeat every %ss)", self.state.device_id, interval)
            status, cohort = welcome.get("status", self.state.status), welcome.get("cohort", self.state.cohort)
            if (status, cohort) != (self.state.status, self.state.cohort):
                self.state.status, self.state.cohort = status, cohort
                self.state.save(self.home)  # e.g. approved since enrollment, or moved to another cohort
            self.connected_since = time.time()
            self._write_status(connected=True, device_status=self.state.status, since=self.connected_since)
            await self._converse(socket, interval, stop)

    async def _expect(self, socket, message_type: str, *, timeout: float) -> dict:
        message = decode(await asyncio.wait_for(socket.recv(), timeout=timeout), limit=MAX_MESSAGE_BYTES)
        if message["type"] == MessageType.ERROR:
            await self._raise_refusal(socket, message)
        if message["type"] != message_type:
            raise _Refused(CloseCode.MALFORMED, f"expected {message_type}, got {message['type']}")
        return message

    async def _raise_refusal(self, socket, message: dict) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(socket.wait_closed(), timeout=5)
        code = socket.close_code or CloseCode.MALFORMED
        if message.get("code") == "device_retired":
            raise Retired(message.get("message", "retired"))
        raise _Refused(code, f"{message.get('code')}: {message.get('message')}")

    async def _converse(self, socket, interval: float, stop: asyncio.Event) -> None:
        uploading = DeltaUploader(self.uploads, socket) if self.uploads is not None else None
        seq = 0
        sent_at: dict[int, float] = {}
        last_ack = time.monotonic()
        next_beat = time.monotonic()  # the first heartbeat goes out at once, so the server has our state
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                seq += 1
                sent_at[seq] = time.perf_counter()
                await socket.send(encode(MessageType.HEARTBEAT, seq=seq, **self.heartbeat()))
                next_beat = now + interval * random.uniform(0.9, 1.1)  # noqa: S311  (jitter, not crypto)
            if uploading is not None:
                await uploading.start_next()
            if now - last_ack > 2.5 * interval:
                raise TimeoutError(f"no heartbeat acknowledgement for {now - last_ack:.0f}s")
            try:
                raw = await asyncio.wait_for(socket.recv(), timeout=max(0.05, min(next_beat - time.monotonic(), 1.0)))
            except TimeoutError:
                continue
            message = decode(raw, limit=MAX_MESSAGE_BYTES)
            kind = message["type"]
            try:  # what the server sends is checked against the protocol's models before it is acted on
                wire.server_message(message)
            except ValueError as exc:
                logger.warning("ignored a message from the server that does not fit the protocol: %s", exc)
                continue
            if kind == MessageType.HEARTBEAT_ACK:
                started = sent_at.pop(message.get("seq"), None)
                if started is not None:
                    self.last_rtt_ms = (time.perf_counter() - started) * 1000
                last_ack = time.monotonic()
                self._write_status(  # refreshed on every acknowledgement, so a stale file means a dead agent
                    connected=True,
                    device_status=self.state.status,
                    since=self.connected_since,
                    heartbeat_rtt_ms=round(self.last_rtt_ms or 0, 1),
                )
            elif kind in (MessageType.DELTA_STATE, MessageType.DELTA_ERROR) and uploading is not None:
                await uploading.handle(message)
            elif kind == MessageType.COMMAND and message.get("command") == "delta_result" and self.uploads:
                self.uploads.on_result(message.get("args") or {})
                await socket.send(wire.Ack(id=message["id"], ok=True).to_json())
            elif kind == MessageType.COMMAND:
                await self._handle_command(socket, message)
            elif kind == MessageType.ERROR:
                await self._raise_refusal(socket, message)
        await socket.close()

    async def _handle_command(self, socket, message: dict) -> None:
        ok, detail = True, None
        if self.on_command is None:
            ok, detail = False, "this agent takes no commands"
        else:
            try:
                detail = await self.on_command(message.get("command", ""), message.get("args") or {})
            except Exception as exc:  # report the failure to the server instead of dropping the socket
                ok, detail = False, f"{type(exc).__name__}: {exc}"
        detail = None if detail is None else str(detail)[:500]
        await socket.send(wire.Ack(id=message["id"], ok=ok, detail=detail).to_json())


# The server's per-device limits on upload begins: their delta_error carries ``retry_after`` (seconds).
RATE_LIMITED = frozenset({"too_many_begins", "too_many_rejections"})


class UploadSource(Protocol):
    """Where the connection finds deltas to send (the agent's outbox) and reports what became of them."""

    def next_upload(self) -> dict | None:
        """``{"sha256", "path", "envelope", "signature", "metrics"}`` of the oldest delta not yet received."""

    def on_state(self, sha256: str, state: dict) -> None:
        """The server's ``delta_state``: ``state["state"]`` is uploading, received, accepted, rejected, aggregated,
        or aborted (nothing of it is staged on the server any more: it starts again from 0)."""

    def on_error(self, sha256: str, code: str, message: str) -> None: ...

    def on_result(self, result: dict) -> None:
        """The verification outcome pushed later: ``{sha256, delta_id, state, code, detail}``."""


class DeltaUploader:
    """One delta at a time over the socket: begin (the server says from which offset), then chunks, each
    acknowledged with the new offset. After a drop, the next session begins again and the server answers
    with what it holds, so an upload resumes where it stopped and a finished one is never sent twice."""

    def __init__(self, source: UploadSource, socket):
        self.source, self.socket = source, socket
        self.current: dict | None = None
        self.idle_until = 0.0

    async def start_next(self) -> None:
        if self.current is not None or time.monotonic() < self.idle_until:
            return
        upload = self.source.next_upload()
        if upload is None:
            self.idle_until = time.monotonic() + 1.0
            return
        self.current = upload
        await self.socket.send(
            encode(
                MessageType.DELTA_BEGIN,
                envelope=upload["envelope"],
                signature=upload["signature"],
                metrics=upload.get("metrics") or {},
            )
        )

    async def handle(self, message: dict) -> None:
        current = self.current
        sha256 = message.get("sha256")
        if current is None or sha256 != current["envelope"]["sha256"]:
            return
        if message["type"] == MessageType.DELTA_ERROR:
            self.current = None
            self.idle_until = time.monotonic() + self._wait_after(message)
            self.source.on_error(sha256, message.get("code", ""), message.get("message", ""))
            return
        self.source.on_state(sha256, message)
        if message.get("state") != "uploading":
            self.current = None
            return
        offset = int(message.get("offset", 0))
        with open(current["path"], "rb") as handle:
            handle.seek(offset)
            chunk = handle.read(DELTA_BINARY_CHUNK_BYTES)
        await self.socket.send(encode_chunk_frame(sha256=sha256, offset=offset, data=chunk))

    @staticmethod
    def _wait_after(error: dict) -> float:
        """How long to wait before the next begin: what a per-device limit (``too_many_begins``,
        ``too_many_rejections``) says in ``retry_after`` (at most a day), else a short pause."""
        retry_after = error.get("retry_after")
        if error.get("code") in RATE_LIMITED and isinstance(retry_after, int | float) and retry_after > 0:
            return min(float(retry_after), 86_400.0)
        return 5.0


class _Refused(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
