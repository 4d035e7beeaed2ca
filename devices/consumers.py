"""The agent socket (/ws/agent/): challenge, signed hello, heartbeats, pushed commands.

Protocol and close codes: ``edge_agent/protocol.py`` and ``edge_agent/PROTOCOL.md``. After the hello the
only database access is none at all: heartbeats go to Redis (``devices.presence``), pushes arrive on this
socket's channel.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import connection

from devices import presence
from devices.errors import DeviceAuthFailed
from devices.identity import device_verify, ensure_may_sync, new_nonce
from devices.models import Device, DeviceEvent
from devices.personalization import personal_report_record
from devices.socket_hooks import training_side
from edge_agent.protocol import (
    HELLO_TIMEOUT_SECONDS,
    MAX_BINARY_MESSAGE_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_MESSAGE_BYTES_BEFORE_AUTH,
    PROTOCOL_VERSION,
    CloseCode,
    MessageType,
    b64decode,
    decode,
    decode_chunk_frame,
    encode,
    hello_payload,
)

logger = logging.getLogger(__name__)


# The sockets' database work runs on a few threads of its own: Channels' default (thread-sensitive) runs the
# sync code of every socket of the process on one thread, where each hello and each chunk of every upload
# queued behind all the others. None of these calls relies on thread affinity (each is one short
# transaction; upload steps lock their staging file), and each thread takes its connection from the pool.
_SOCKET_DB_THREADS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agent-socket-db")


def _socket_db(func):
    @functools.wraps(func)
    def call(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        finally:
            # Back to the pool (fleet/asgi.py); without one, closed rather than left open in an idle thread.
            connection.close()

    return database_sync_to_async(call, thread_sensitive=False, executor=_SOCKET_DB_THREADS)


class Refused(Exception):
    def __init__(self, code: int, error: str, message: str):
        super().__init__(message)
        self.code, self.error, self.message = code, error, message


@_socket_db
def _authenticate(device_id, nonce: str, signature) -> Device:
    try:
        device = device_verify(
            device_id=device_id, payload=hello_payload(nonce=nonce, device_id=str(device_id)), signature=signature
        )
    except DeviceAuthFailed as exc:
        code = CloseCode.MALFORMED if exc.code == "malformed" else CloseCode.AUTH_FAILED
        raise Refused(code, exc.code, exc.message) from None
    try:
        ensure_may_sync(device)
    except DeviceAuthFailed as exc:
        raise Refused(CloseCode.NOT_ALLOWED, exc.code, exc.message) from None
    return device


@_socket_db
def _after_hello(device: Device, agent_version: str, hardware: dict | None) -> list[dict]:
    """Note the agent's version and hardware when they changed; then the training side's check-in: the
    commands the device should receive now (``{id, command, args}``: the assignment it has not acknowledged, if
    any, and the delta results it has not), in one trip to the database thread per hello."""
    changes = {}
    if agent_version and agent_version != device.agent_version:
        changes["agent_version"] = agent_version
    if hardware and hardware != device.hardware:
        changes["hardware"] = hardware
    if changes:
        Device.objects.filter(pk=device.pk).update(**changes)
        DeviceEvent.objects.create(device=device, kind=DeviceEvent.Kind.UPDATED, actor_label="device", detail=changes)
    return _check_in_commands(device)


def _check_in_commands(device: Device) -> list[dict]:
    side = training_side()
    pending = side.check_in(device)
    commands = [] if pending is None else [_assignment_command(pending)]
    return commands + side.unacknowledged_results(device)


def _assignment_command(pending: dict) -> dict:
    return {"id": f"assignment-{pending['assignment_id']}", "command": "assignment", "args": pending}


_personal_record = _socket_db(personal_report_record)


@_socket_db
def _delta_begin(device: Device, message: dict) -> tuple[str, dict]:
    return training_side().upload_begin(device, message)


@_socket_db
def _delta_abort(device: Device, sha256: str) -> tuple[str, dict]:
    return training_side().upload_abort(device, sha256)


@_socket_db
def _command_acknowledged(device: Device, command_id: str) -> bool:
    return training_side().command_acknowledged(device, command_id)


@_socket_db
def _delta_append(device: Device, sha256: str, offset: int, data: bytes) -> tuple[str, dict]:
    return training_side().upload_append(device, sha256, offset, data)


class AgentConsumer(AsyncWebsocketConsumer):
    device_id: str | None = None

    async def dispatch(self, message):
        """As Channels' own, without its ``close_old_connections`` before every message: that is a hop to the
        thread-sensitive sync thread for each heartbeat, chunk and push, and this consumer holds no connection
        between messages (``_socket_db`` hands its connection back after each call)."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']!r}")
        await handler(message)

    async def connect(self):
        self.nonce = new_nonce()
        self.closed = False
        await self.accept()
        await self.send(
            encode(MessageType.CHALLENGE, nonce=self.nonce, protocol=PROTOCOL_VERSION, server_time=time.time())
        )
        self.hello_deadline = asyncio.get_running_loop().call_later(
            HELLO_TIMEOUT_SECONDS, lambda: asyncio.ensure_future(self._hello_timeout())
        )

    async def _hello_timeout(self):
        if self.device_id is None and not self.closed:
            await self.refuse(CloseCode.HELLO_TIMEOUT, "hello_timeout", "No hello within the time limit.")

    async def refuse(self, code: int, error: str, message: str) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            await self.send(encode(MessageType.ERROR, code=error, message=message))
            await self.close(code=code)
        except Exception:  # the client is already gone (uvicorn's ClientDisconnected): nothing left to tell
            logger.debug("socket of %s gone before it could be refused", self.device_id or "an unknown device")

    async def receive(self, text_data=None, bytes_data=None):
        if self.closed:
            return
        if bytes_data is not None and self.device_id is not None:
            return await self.on_binary(bytes_data)
        limit = MAX_MESSAGE_BYTES if self.device_id else MAX_MESSAGE_BYTES_BEFORE_AUTH
        try:
            message = decode(text_data if text_data is not None else bytes_data, limit=limit)
        except OverflowError as exc:
            return await self.refuse(CloseCode.TOO_LARGE, "too_large", str(exc))
        except ValueError as exc:
            return await self.refuse(CloseCode.MALFORMED, "malformed", str(exc))

        kind = message["type"]
        try:
            if self.device_id is None:
                if kind != MessageType.HELLO:
                    raise Refused(CloseCode.MALFORMED, "malformed", f"expected a hello first, got {kind!r}")
                await self.on_hello(message)
            elif kind == MessageType.HEARTBEAT:
                await self.on_heartbeat(message)
            elif kind in (MessageType.DELTA_BEGIN, MessageType.DELTA_CHUNK):
                await self.on_delta(kind, message)
            elif kind == MessageType.DELTA_ABORT:
                await self.on_delta_abort(message)
            elif kind == MessageType.ACK:
                await self.on_ack(message)
            else:
                raise Refused(CloseCode.MALFORMED, "malformed", f"unknown message type {kind!r}")
        except Refused as refused:
            await self.refuse(refused.code, refused.error, refused.message)

    async def on_hello(self, message: dict) -> None:
        device = await _authenticate(message.get("device_id"), self.nonce, message.get("signature"))
        self.hello_deadline.cancel()
        # Kept for the life of the socket: a change of status that ends syncing closes the socket
        # (devices.services), and verification checks the device again before a delta counts.
        self.device = device
        self.device_id = str(device.pk)
        replaced = await presence.record_connected(self.device_id, self.channel_name)
        if replaced:
            await self.channel_layer.send(
                replaced, {"type": "device.close", "code": CloseCode.REPLACED, "reason": "connected again elsewhere"}
            )
        await self.send(
            encode(
                MessageType.WELCOME,
                device_id=self.device_id,
                status=device.status,
                cohort=device.cohort.name,
                heartbeat_interval=settings.HEARTBEAT_INTERVAL_SECONDS,
                server_time=time.time(),
            )
        )
        # A device that was offline when its assignment was made, or when its deltas were verified, gets them now.
        agent_version, hardware = message.get("agent_version"), message.get("hardware")
        commands = await _after_hello(
            device,
            agent_version if isinstance(agent_version, str) and len(agent_version) <= 32 else "",
            hardware if isinstance(hardware, dict) and len(hardware) <= 16 else None,
        )
        for command in commands:
            await self.send(encode(MessageType.COMMAND, **command))

    async def on_heartbeat(self, message: dict) -> None:
        try:
            state = presence.parse_heartbeat(message)
        except ValueError as exc:
            raise Refused(CloseCode.MALFORMED, "malformed", f"heartbeat: {exc}") from None
        personal_is_new = False
        try:
            personal_is_new = await presence.record_heartbeat(self.device_id, state)
        except Exception:  # Redis away for a moment: keep the socket; the next heartbeat records it
            logger.warning("could not record a heartbeat of %s", self.device_id, exc_info=True)
        await self.send(encode(MessageType.HEARTBEAT_ACK, seq=message["seq"], server_time=time.time()))
        if personal_is_new:
            await self.on_personal(state["personal"])

    async def on_personal(self, personal: dict) -> None:
        """A new personal measurement: stored on a database thread (only this, not every heartbeat, goes
        there), then noted in Redis; on a failure nothing is noted, and the next heartbeat tries again."""
        try:
            await _personal_record(device_id=self.device_id, personal=personal)
            await presence.mark_personal(self.device_id, personal["updated_at"])
        except Exception:
            logger.warning("could not record a personal measurement of %s", self.device_id, exc_info=True)

    async def on_delta(self, kind: str, message: dict) -> None:
        """Resumable delta upload (the training side's intake): every step answers with where the upload stands."""
        envelope = message.get("envelope")
        sha256 = message.get("sha256") or (envelope.get("sha256") if isinstance(envelope, dict) else None)
        if kind == MessageType.DELTA_BEGIN:
            await self._upload_step(sha256, _delta_begin(self.device, message))
            return
        offset, data = message.get("offset"), message.get("data")
        if not isinstance(sha256, str) or not isinstance(offset, int) or isinstance(offset, bool):
            raise Refused(CloseCode.MALFORMED, "malformed", "delta_chunk needs sha256, offset and data")
        try:
            raw = b64decode(data, limit=MAX_MESSAGE_BYTES)
        except ValueError:
            raise Refused(CloseCode.MALFORMED, "malformed", "delta_chunk data is not base64url") from None
        await self._upload_step(sha256, _delta_append(self.device, sha256, offset, raw))

    async def on_delta_abort(self, message: dict) -> None:
        """The device gives up an unfinished upload (``delta_abort``): its slot is free at once."""
        sha256 = message.get("sha256")
        if not isinstance(sha256, str):
            raise Refused(CloseCode.MALFORMED, "malformed", "delta_abort needs sha256")
        await self._upload_step(sha256, _delta_abort(self.device, sha256))

    async def on_ack(self, message: dict) -> None:
        """The device's answer to a command. ``ok`` true of ``delta-<id>`` or ``assignment-<id>`` is recorded (on
        a database thread) so it is not sent again at the next hello; ok false changes nothing (sent again)."""
        command_id, ok, detail = message.get("id"), message.get("ok"), message.get("detail")
        if not isinstance(command_id, str) or len(command_id) > 64:
            raise Refused(CloseCode.MALFORMED, "malformed", "ack: id must be a string of at most 64 characters")
        if not isinstance(ok, bool):
            raise Refused(CloseCode.MALFORMED, "malformed", "ack: ok must be true or false")
        if detail is not None and (not isinstance(detail, str) or len(detail) > 500):
            raise Refused(CloseCode.MALFORMED, "malformed", "ack: detail must be a string of at most 500 or null")
        logger.debug("device %s acknowledged %s (ok=%s)", self.device_id, command_id, ok)
        if ok:
            await _command_acknowledged(self.device, command_id)

    async def on_binary(self, frame: bytes) -> None:
        """A binary frame is a delta chunk with its raw bytes (``edge_agent.protocol.encode_chunk_frame``)."""
        try:
            sha256, offset, data = decode_chunk_frame(frame, limit=MAX_BINARY_MESSAGE_BYTES)
        except OverflowError as exc:
            return await self.refuse(CloseCode.TOO_LARGE, "too_large", str(exc))
        except ValueError as exc:
            return await self.refuse(CloseCode.MALFORMED, "malformed", str(exc))
        await self._upload_step(sha256, _delta_append(self.device, sha256, offset, data))

    async def _upload_step(self, sha256, step) -> None:
        """Run one upload step (``devices.socket_hooks``); send where the upload stands, or why it was refused."""
        kind, fields = await step
        if kind == MessageType.DELTA_ERROR:
            fields = {"sha256": sha256, **fields}
        await self.send(encode(kind, **fields))

    async def disconnect(self, code):
        self.closed = True
        deadline = getattr(self, "hello_deadline", None)
        if deadline is not None:
            deadline.cancel()
        if self.device_id is not None:
            try:
                await presence.record_disconnected(self.device_id, self.channel_name)
            except Exception:  # Redis down: the device still goes offline when its heartbeats stop
                logger.warning("could not record disconnect of %s", self.device_id, exc_info=True)

    # --- messages from the server side (devices.push) ---

    async def device_close(self, event):
        await self.refuse(event["code"], "closed_by_server", event.get("reason", ""))

    async def device_command(self, event):
        if not self.closed:
            await self.send(encode(MessageType.COMMAND, id=event["id"], command=event["command"], args=event["args"]))
