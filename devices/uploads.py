"""What operators see of a device's refused upload attempts: a counter on the device, the last code and when.

The training side refuses a ``delta_begin`` (``training.federation.intake``) and calls ``upload_refused`` here;
``devices`` never imports ``training`` (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import logging

from django.core.cache import cache
from django.db.models import F
from django.utils import timezone

from devices.models import Device

logger = logging.getLogger(__name__)

# The rate-limit refusal: every begin of a device past DELTA_BEGINS_PER_MINUTE gets one.
RATE_LIMITED = "too_many_begins"
_RATE_LIMITED_TTL = 24 * 3600


def upload_refused(device_id, code: str, *, first_in_window: bool = True) -> None:
    """Count one refused upload begin of this device: one UPDATE with ``F()``, no read.

    The writes stay bounded because every begin passes the per-device rate limit first: a device reaches this
    at most DELTA_BEGINS_PER_MINUTE times a minute with a refusal of its own, plus once per minute for the
    rate-limit refusal itself. ``too_many_begins`` past the first of its window (``first_in_window`` False) is
    counted in Redis only (``upload_refused_rate_limited``), never in the database: a device hammering the door
    costs no writes."""
    if code == RATE_LIMITED and not first_in_window:
        try:
            key = f"uploads-refused:{RATE_LIMITED}:{device_id}"
            cache.add(key, 0, timeout=_RATE_LIMITED_TTL)
            cache.incr(key)
        except Exception:  # Redis away for a moment: a rate-limit refusal goes uncounted
            logger.warning("could not count a rate-limited begin of %s", device_id, exc_info=True)
        return
    Device.objects.filter(pk=device_id).update(
        uploads_refused=F("uploads_refused") + 1, upload_refused_at=timezone.now(), upload_refused_code=code[:32]
    )


def upload_refused_rate_limited(device_id) -> int:
    """The ``too_many_begins`` refusals of the last day not counted on the device row (Redis only)."""
    try:
        return int(cache.get(f"uploads-refused:{RATE_LIMITED}:{device_id}") or 0)
    except Exception:
        return 0
