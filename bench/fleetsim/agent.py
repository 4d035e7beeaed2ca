"""The protocol-level agent: what a simulated device says on ``/ws/agent/``, from ``edge_agent.protocol`` only
(no Django, no torch): the handshake (challenge, signed hello, welcome) and heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass

from edge_agent.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, MessageType, decode, encode, hello_payload, sign

AGENT_VERSION = "bench-1"
HARDWARE = {"ram_mb": 4096, "cpu": "bench", "accelerator": "none", "os": "linux"}


class ProtocolError(Exception):
    pass


class HandshakeFailed(Exception):
    """The handshake stopped at ``stage`` (upgrade, challenge or welcome) because of ``cause``."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(f"handshake at {stage}: {cause!r}")
        self.stage, self.cause = stage, cause


def failure_reason(exc: BaseException) -> str:
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
    if isinstance(exc, ProtocolError):
        return str(exc)[:80]
    return type(exc).__name__


@dataclass
class Handshake:
    socket: object
    welcome: dict
    started: float  # perf_counter when connect() was called
    upgraded: float  # HTTP upgrade done
    hello_sent: float
    welcomed: float  # welcome received

    @property
    def handshake_ms(self) -> float:
        return (self.welcomed - self.started) * 1000

    @property
    def upgrade_ms(self) -> float:
        return (self.upgraded - self.started) * 1000

    @property
    def hello_ms(self) -> float:
        """hello sent -> welcome received: the server's authentication."""
        return (self.welcomed - self.hello_sent) * 1000


async def handshake(
    url: str,
    device_id: str,
    key,
    *,
    timeout: float,
    compression: str,
    close_timeout: float,
    agent_version: str = AGENT_VERSION,
    hardware: dict | None = None,
) -> Handshake:
    """Connect and authenticate (challenge, signed hello, welcome) within ``timeout`` seconds; raises
    HandshakeFailed (the socket closed) when any step fails."""
    from websockets.asyncio.client import connect

    started = time.perf_counter()
    socket_ = None
    stage = "upgrade"  # where a failed handshake stopped: upgrade, challenge or welcome
    try:
        async with asyncio.timeout(timeout):
            socket_ = await connect(
                url,
                ping_interval=None,
                max_size=MAX_MESSAGE_BYTES,
                compression=None if compression == "none" else "deflate",
                open_timeout=None,
                close_timeout=close_timeout,
            )
            upgraded = time.perf_counter()
            stage = "challenge"
            challenge = decode(await socket_.recv(), limit=MAX_MESSAGE_BYTES)
            if challenge["type"] != MessageType.CHALLENGE:
                raise ProtocolError(f"got {challenge['type']} {challenge.get('code')}")
            await socket_.send(
                encode(
                    MessageType.HELLO,
                    device_id=device_id,
                    signature=sign(key, hello_payload(nonce=challenge["nonce"], device_id=device_id)),
                    protocol=PROTOCOL_VERSION,
                    agent_version=agent_version,
                    hardware=HARDWARE if hardware is None else hardware,
                )
            )
            hello_sent = time.perf_counter()
            stage = "welcome"
            welcome = decode(await socket_.recv(), limit=MAX_MESSAGE_BYTES)
            if welcome["type"] != MessageType.WELCOME:
                raise ProtocolError(f"got {welcome['type']} {welcome.get('code')}")
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if socket_ is not None:
            with contextlib.suppress(Exception):
                await socket_.close()
        raise HandshakeFailed(stage, exc) from exc
    return Handshake(socket_, welcome, started, upgraded, hello_sent, time.perf_counter())


def heartbeat_message(seq: int, rng: random.Random) -> str:
    """A heartbeat with plausible, varying device state."""
    return encode(
        MessageType.HEARTBEAT,
        seq=seq,
        battery=round(rng.uniform(20, 100), 1),
        charging=rng.random() < 0.3,
        free_memory_mb=rng.randint(200, 4000),
        metrics={},
    )
