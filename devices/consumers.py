"""The agent socket (/ws/agent/): challenge, signed hello, heartbeats, pushed commands.

Protocol and close codes: ``docs/protocol/README.md``; every message is a model of ``edge_agent/wire.py``, which
validates what arrives here and builds what is sent. After the hello, heartbeats go to Redis
(``devices.presence``) and pushes arrive on this socket's channel; only upload steps, acknowledgements, new
personal measurements and changed feedback counts reach the database, each on the sockets' own database threads
(``_socket_db``).
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

from core import bounded_json
from core.visible_text import control_character
from devices import presence
from devices.errors import DeviceAuthFailed, DeviceProtocolRefused
from devices.feedback import feedback_report_record
from devices.identity import (
    accepted_protocols,
    device_verify,
    ensure_may_sync,
    ensure_protocol,
    new_nonce,
    note_protocol,
)
from devices.models import Device, DeviceEvent
from devices.personalization import personal_report_record
from devices.socket_hooks import training_side
from edge_agent import wire
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
def _authenticate(hello: wire.Hello, nonce: str) -> Device:
    try:
        protocol = ensure_protocol(hello.protocol)
        device = device_verify(
            device_id=hello.device_id,
            payload=hello_payload(nonce=nonce, device_id=hello.device_id, protocol=protocol),
            signature=hello.signature,
            protocol=protocol,
        )
    except DeviceProtocolRefused as exc:
        raise Refused(CloseCode.UPGRADE_REQUIRED, exc.code, exc.message) from None
    except DeviceAuthFailed as exc:
        code = CloseCode.MALFORMED if exc.code == "malformed" else CloseCode.AUTH_FAILED
        raise Refused(code, exc.code, exc.message) from None
    try:
        ensure_may_sync(device)
    except DeviceAuthFailed as exc:
        raise Refused(CloseCode.NOT_ALLOWED, exc.code, exc.message) from None
    note_protocol(device, protocol)
    return device


def _control_character_in_hello(hello: wire.Hello) -> str | None:
    """Why the hello's agent_version or hardware, which the device record keeps and operators read, may not be
    stored (``core.visible_text``), or None."""
    texts = [("hello.agent_version", hello.agent_version)]
    for name, value in (hello.hardware or {}).items():
        texts += [(f"hello.hardware name {name!r}", name), (f"hello.hardware {name!r}", value)]
    for field, text in texts:
        if isinstance(text, str) and (where := control_character(text)):
            return f"{field} holds {where}: control characters are not accepted"
    return None


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
_feedback_record = _socket_db(feedback_report_record)


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
        self.recorded_beat_at = None  # when the last heartbeat of this socket was recorded (monotonic)
        self.early_beats = 0  # heartbeats in a row that came too soon to be recorded
        await self.accept()
        await self.send(
            wire.Challenge(
                nonce=self.nonce,
                protocol=PROTOCOL_VERSION,
                protocols=list(accepted_protocols()),
                server_time=time.time(),
            ).to_json()
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
            await self.send(wire.Error(code=error, message=message).to_json())
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
            message = decode(text_data if text_data is not None else bytes_data, limit=limit, loads=bounded_json.loads)
        except OverflowError as exc:
            return await self.refuse(CloseCode.TOO_LARGE, "too_large", str(exc))
        except ValueError as exc:
            return await self.refuse(CloseCode.MALFORMED, "malformed", str(exc))

        kind = message["type"]
        try:
            if self.device_id is None and kind != MessageType.HELLO:
                raise Refused(CloseCode.MALFORMED, "malformed", f"expected a hello first, got {kind!r}")
            if self.device_id is not None and kind == MessageType.HELLO:
                raise Refused(CloseCode.MALFORMED, "malformed", "hello: this socket has said hello already")
            if kind == MessageType.DELTA_BEGIN:
                # Its envelope and metrics are the intake's to judge: a bad one is a delta_error, the socket stays.
                return await self.on_delta(kind, message)
            if kind == MessageType.HEARTBEAT and self.device_id is not None:
                # The commonest message: validated once, by presence.parse_heartbeat (the same model).
                return await self.on_heartbeat(message)
            try:
                parsed = wire.agent_message(message)
            except ValueError as exc:
                raise Refused(CloseCode.MALFORMED, "malformed", str(exc)) from None
            if kind == MessageType.HELLO:
                await self.on_hello(parsed)
            elif kind == MessageType.DELTA_CHUNK:
                await self.on_delta(kind, message)
            elif kind == MessageType.DELTA_ABORT:
                await self.on_delta_abort(message)
            elif kind == MessageType.ACK:
                await self.on_ack(parsed)
        except Refused as refused:
            await self.refuse(refused.code, refused.error, refused.message)

    async def on_hello(self, hello: wire.Hello) -> None:
        if refusal := _control_character_in_hello(hello):
            raise Refused(CloseCode.MALFORMED, "malformed", refusal)
        device = await _authenticate(hello, self.nonce)
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
            wire.Welcome(
                device_id=self.device_id,
                status=device.status,
                cohort=device.cohort.name,
                heartbeat_interval=settings.HEARTBEAT_INTERVAL_SECONDS,
                protocol=device.protocol,
                server_time=time.time(),
            ).to_json()
        )
        # A device that was offline when its assignment was made, or when its deltas were verified, gets them now.
        commands = await _after_hello(device, hello.agent_version, hello.hardware or None)
        for command in commands:
            await self.send(encode(MessageType.COMMAND, **command))

    async def on_heartbeat(self, message: dict) -> None:
        try:
            state = presence.parse_heartbeat(message)
        except ValueError as exc:
            raise Refused(CloseCode.MALFORMED, "malformed", str(exc)) from None
        if not self._beat_is_due():
            self.early_beats += 1
            if self.early_beats >= settings.HEARTBEAT_EARLY_LIMIT:
                raise Refused(
                    CloseCode.TOO_CHATTY,
                    "too_chatty",
                    f"{self.early_beats} heartbeats in a row came sooner than half the "
                    f"{settings.HEARTBEAT_INTERVAL_SECONDS}s interval",
                )
            await self.send(wire.HeartbeatAck(seq=message["seq"], server_time=time.time(), recorded=False).to_json())
            return
        self.early_beats = 0
        self.recorded_beat_at = time.monotonic()
        new: set[str] = set()
        try:
            new = await presence.record_heartbeat(self.device_id, state)
        except Exception:  # Redis away for a moment: keep the socket; the next heartbeat records it
            logger.warning("could not record a heartbeat of %s", self.device_id, exc_info=True)
        await self.send(wire.HeartbeatAck(seq=message["seq"], server_time=time.time()).to_json())
        if "personal" in new:
            await self.on_personal(state["personal"])
        if "feedback" in new:
            await self.on_feedback(state["feedback"])

    def _beat_is_due(self) -> bool:
        """Whether a heartbeat now is spaced enough from the last one recorded on this socket to be recorded
        (the first always is): a device that beats far faster than the interval costs Redis writes and tells
        nothing more."""
        if self.recorded_beat_at is None:
            return True
        spacing = settings.HEARTBEAT_INTERVAL_SECONDS * settings.HEARTBEAT_MIN_SPACING_PERCENT / 100
        return time.monotonic() - self.recorded_beat_at >= spacing

    async def on_personal(self, personal: dict) -> None:
        """A new personal measurement: stored on a database thread (only this, not every heartbeat, goes
        there), then noted in Redis; on a failure nothing is noted, and the next heartbeat tries again."""
        try:
            await _personal_record(device_id=self.device_id, personal=personal)
            await presence.mark_personal(self.device_id, personal["updated_at"])
        except Exception:
            logger.warning("could not record a personal measurement of %s", self.device_id, exc_info=True)

    async def on_feedback(self, feedback: dict) -> None:
        """Changed feedback counts: stored (with the rollout guard metrics they make) on a database thread, then
        noted in Redis; on a failure nothing is noted, and the next heartbeat tries again."""
        try:
            await _feedback_record(device_id=self.device_id, feedback=feedback)
            await presence.mark_feedback(self.device_id, feedback)
        except Exception:
            logger.warning("could not record the feedback counts of %s", self.device_id, exc_info=True)

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
        sha256 = message["sha256"]  # a string (edge_agent.wire.DeltaAbort); the intake decides if it names one
        await self._upload_step(sha256, _delta_abort(self.device, sha256))

    async def on_ack(self, ack: wire.Ack) -> None:
        """The device's answer to a command. ``ok`` true of ``delta-<id>`` or ``assignment-<id>`` is recorded (on
        a database thread) so it is not sent again at the next hello; ok false changes nothing (sent again)."""
        command_id, ok = ack.id, ack.ok
        logger.debug("device %s acknowledged %s (ok=%s)", self.device_id, command_id, ok)
        if ok:
            await _command_acknowledged(self.device, command_id)

    async def on_binary(self, frame: bytes) -> None:
        """A binary frame is a delta chunk with its raw bytes (``edge_agent.protocol.encode_chunk_frame``)."""
        try:
            sha256, offset, data = decode_chunk_frame(frame, limit=MAX_BINARY_MESSAGE_BYTES, loads=bounded_json.loads)
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
        await self.refuse(event["code"], event.get("error", "closed_by_server"), event.get("reason", ""))

    async def device_command(self, event):
        if not self.closed:
            await self.send(encode(MessageType.COMMAND, id=event["id"], command=event["command"], args=event["args"]))
