"""Send messages to a device's live socket, wherever (whichever server process) it is connected.

Each socket registers its channel name in Redis (``presence:conn``) on hello; a push is a direct
``channel_layer.send`` to it. No Channels group per device, so a mass disconnect costs no group_discard
storm against Redis. A device that is offline simply misses the push and gets its state on reconnect.
"""

from __future__ import annotations

import logging

from channels.layers import get_channel_layer

from core.async_bridge import run_async
from devices import presence

logger = logging.getLogger(__name__)


async def adevice_send(device_id: str, message: dict) -> bool:
    channel = await presence.current_channel(device_id)
    if channel is None:
        return False
    try:
        await get_channel_layer().send(channel, message)
    except Exception:  # the layer may be full for a stuck client; the device re-syncs on reconnect
        logger.warning("push to device %s failed", device_id, exc_info=True)
        return False
    return True


def device_disconnect(device_id: str, *, code: int, reason: str, error: str = "closed_by_server") -> bool:
    """Close the device's live socket with ``code``, after an error message carrying ``error`` (a code of the
    spec's table: ``closed_by_server`` means "retry", ``device_retired`` "stop")."""
    return run_async(adevice_send, device_id, {"type": "device.close", "code": code, "error": error, "reason": reason})


def device_command(device_id: str, *, command_id: str, command: str, args: dict | None = None) -> bool:
    return run_async(
        adevice_send, device_id, {"type": "device.command", "id": command_id, "command": command, "args": args or {}}
    )
