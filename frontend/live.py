"""The one place that pushes live events to open dashboards, over the Channels layer.

Events are typed (``LiveEvent``) and carry the lowest role allowed to see them; the consumer re-checks it
for every event. The layer drops messages when a client lags, so pages re-read state from the API after a
reconnect instead of trusting that they saw every event.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from channels.layers import get_channel_layer
from django.utils import timezone

from accounts.roles import Role
from fleet.async_bridge import run_async
from frontend.event_text import live_event, live_link

DASHBOARD_GROUP = "dashboard"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveEvent:
    """``text`` (what happened, in words) and ``url`` (the page it is about) are made from ``kind`` and
    ``data`` when not given (``frontend.event_text``); ``at`` is in UTC, as every time the dashboard shows."""

    kind: str  # e.g. "device.online", "delta.verified", "round.progress"
    data: dict[str, Any]
    min_role: str = Role.VIEWER.value
    at: str = field(default_factory=lambda: timezone.now().isoformat())
    text: str = ""
    url: str = ""


async def apublish(event: LiveEvent) -> None:
    layer = get_channel_layer()
    try:
        message = asdict(event)
        message["text"] = event.text or live_event(event.kind, event.data)
        message["url"] = event.url or live_link(event.kind, event.data)
        await layer.group_send(DASHBOARD_GROUP, {"type": "live.event", **message})
    except Exception:  # live updates are best effort: never fail the work that produced them
        logger.exception("could not publish live event %s", event.kind)


def publish(event: LiveEvent) -> None:
    """From sync code (any thread, also one that runs an event loop): sent on the process's bridge loop,
    which keeps its Redis connections, so a worker does not connect anew for every event."""
    try:
        run_async(apublish, event, timeout=5)
    except Exception:  # best effort, as apublish
        logger.exception("could not publish live event %s", event.kind)
