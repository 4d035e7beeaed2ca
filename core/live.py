"""The one place that pushes live events to open dashboards, over the Channels layer.

Events are typed (``LiveEvent``) and carry the lowest role allowed to see them; the dashboard's consumer
(``frontend.consumers``) re-checks it for every event and words the event for the page when the publisher did
not (``frontend.event_text``), so the domain code that publishes knows nothing of the screen. The layer drops
messages when a client lags, so pages re-read state from the API after a reconnect instead of trusting that
they saw every event.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from channels.layers import get_channel_layer
from django.utils import timezone

from core.async_bridge import run_async

DASHBOARD_GROUP = "dashboard"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LiveEvent:
    """``text`` (what happened, in words) and ``url`` (the page it is about) are optional: the dashboard makes
    them from ``kind`` and ``data`` when they are empty; ``at`` is in UTC, as every time the dashboard shows."""

    kind: str  # e.g. "device.online", "delta.verified", "round.progress"
    data: dict[str, Any]
    min_role: str = "viewer"  # accounts.roles.Role values: viewer, operator, admin
    at: str = field(default_factory=lambda: timezone.now().isoformat())
    text: str = ""
    url: str = ""


async def apublish(event: LiveEvent) -> None:
    layer = get_channel_layer()
    try:
        message = asdict(event)
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
