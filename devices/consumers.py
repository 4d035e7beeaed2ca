"""The agent socket (/ws/agent/): challenge, signed hello, heartbeats, pushed commands.

Protocol and close codes: ``edge_agent/protocol.py`` and ``edge_agent/PROTOCOL.md``. After the hello the
only database access is none at all: heartbeats go to Redis (``devices.presence``), pushes arrive on this
socket's channel.
"""

from __future__ import annotations

import asyncio
import logging
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from devices import presence
from devices.errors import DeviceAuthFailed
from devices.identity import device_verify, ensure_may_sync, new_nonce
from devices.models import Device, DeviceEvent
from edge_agent.protocol import (
    HELLO_TIMEOUT_SECONDS,
    MAX_MESSAGE_BYTES,
    MAX_MESSAGE_BYTES_BEFORE_AUTH,
    PROTOCOL_VERSION,
    CloseCode,
    MessageType,
    b64decode,
    decode,
    encode,
    hello_payload,
)

logger = logging.getLogger(__name__)


class Refused(Exception):
    def __init__(self, code: int, error: str, message: str):
        super().__init__(message)
        self.code, self.error, self.message = code, error, message


@database_sync_to_async
def _authenticate(device_id, nonce: str, signature) -> Device:
    try:
        device = device_verify(
            device_id=device_id, payload=hello_payload(nonce=nonce, device_id=str(device_id)), signature=signature
        )
    except DeviceAuthFailed as exc:
        code = CloseCode.MALFORMED if exc.error_code == "malformed" else CloseCode.AUTH_FAILED
        raise Refused(code, exc.error_code, exc.message) from None
    try:
        ensure_may_sync(device)
    except DeviceAuthFailed as exc:
        raise Refused(CloseCode.NOT_ALLOWED, exc.error_code, exc.message) from None
    return device


@database_sync_to_async
def _pending_assignment(device_id: str) -> dict | None:
    """The newest assignment the device has not installed yet, as the message it should receive."""
    from training.delivery import assignment_message, current_assignment

    assignment = current_assignment(device_id)
    if assignment is None:
        from training.rollouts import assignment_for_newcomer

        # A newcomer's assignment is pushed to this socket by ``deliver`` once it is committed.
        assignment_for_newcomer(device=Device.objects.get(pk=device_id))
        return None
    return assignment_message(assignment)


@database_sync_to_async
def _note_agent(device: Device, agent_version: str, hardware: dict | None) -> None:
    changes = {}
    if agent_version and agent_version != device.agent_version:
        changes["agent_version"] = agent_version
    if hardware and hardware != device.hardware:
        changes["hardware"] = hardware
    if changes:
        Device.objects.filter(pk=device.pk).update(**changes)
        DeviceEvent.objects.create(device=device, kind=DeviceEvent.Kind.UPDATED, actor_label="device", detail=changes)


@database_sync_to_async
def _delta_begin(device_id: str, message: dict):
    from training.intake import upload_begin

    device = Device.objects.get(pk=device_id)
    return upload_begin(
        device=device,
        envelope=message.get("envelope"),
        signature=message.get("signature"),
        channel="ws",
        metrics=message.get("metrics"),
    )


@database_sync_to_async
def _delta_append(device_id: str, sha256: str, offset: int, data: bytes):
    from training.intake import upload_append

    return upload_append(device=Device.objects.get(pk=device_id), sha256=sha256, offset=offset, data=data, channel="ws")


class AgentConsumer(AsyncWebsocketConsumer):
    device_id: str | None = None

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
        await self.send(encode(MessageType.ERROR, code=error, message=message))
        await self.close(code=code)

    async def receive(self, text_data=None, bytes_data=None):
        if self.closed:
            return
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
            elif kind == MessageType.ACK:
                logger.debug("device %s acknowledged %s", self.device_id, message.get("id"))
            else:
                raise Refused(CloseCode.MALFORMED, "malformed", f"unknown message type {kind!r}")
        except Refused as refused:
            await self.refuse(refused.code, refused.error, refused.message)

    async def on_hello(self, message: dict) -> None:
        device = await _authenticate(message.get("device_id"), self.nonce, message.get("signature"))
        self.hello_deadline.cancel()
        self.device_id = str(device.pk)
        replaced = await presence.record_connected(self.device_id, self.channel_name)
        if replaced:
            await self.channel_layer.send(
                replaced, {"type": "device.close", "code": CloseCode.REPLACED, "reason": "connected again elsewhere"}
            )
        agent_version = message.get("agent_version")
        hardware = message.get("hardware")
        if (isinstance(agent_version, str) and len(agent_version) <= 32) or isinstance(hardware, dict):
            await _note_agent(
                device,
                agent_version if isinstance(agent_version, str) and len(agent_version) <= 32 else "",
                hardware if isinstance(hardware, dict) and len(hardware) <= 16 else None,
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
        # A device that was offline when its assignment was made gets it now.
        pending = await _pending_assignment(self.device_id)
        if pending is not None:
            await self.send(
                encode(
                    MessageType.COMMAND, id=f"assignment-{pending['assignment_id']}", command="assignment", args=pending
                )
            )

    async def on_heartbeat(self, message: dict) -> None:
        try:
            state = presence.parse_heartbeat(message)
        except ValueError as exc:
            raise Refused(CloseCode.MALFORMED, "malformed", f"heartbeat: {exc}") from None
        await presence.record_heartbeat(self.device_id, state)
        await self.send(encode(MessageType.HEARTBEAT_ACK, seq=message["seq"], server_time=time.time()))

    async def on_delta(self, kind: str, message: dict) -> None:
        """Resumable delta upload (``training.intake``): every step answers with where the upload stands."""
        from training.api.delta_views import upload_state_body
        from training.intake import UploadRefused

        sha256 = message.get("sha256") or (message.get("envelope") or {}).get("sha256")
        try:
            if kind == MessageType.DELTA_BEGIN:
                state = await _delta_begin(self.device_id, message)
            else:
                offset, data = message.get("offset"), message.get("data")
                if not isinstance(sha256, str) or not isinstance(offset, int) or isinstance(offset, bool):
                    raise Refused(CloseCode.MALFORMED, "malformed", "delta_chunk needs sha256, offset and data")
                try:
                    raw = b64decode(data, limit=MAX_MESSAGE_BYTES)
                except ValueError:
                    raise Refused(CloseCode.MALFORMED, "malformed", "delta_chunk data is not base64url") from None
                state = await _delta_append(self.device_id, sha256, offset, raw)
        except UploadRefused as exc:
            await self.send(encode(MessageType.DELTA_ERROR, sha256=sha256, code=exc.code, message=exc.message))
            return
        await self.send(encode(MessageType.DELTA_STATE, **upload_state_body(state)))

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
