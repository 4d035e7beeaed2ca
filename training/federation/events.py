"""Live events about deltas and rounds for open dashboards (typed payloads, through ``core.live``).

Also tells the device how its delta ended, over its socket when it is connected (``devices.push``); a
device that is offline is told again after its next hello until it acknowledges (``training.socket_entry``),
or reads the outcome over REST (``GET /api/v1/device/deltas/<sha256>/``).
"""

from __future__ import annotations

import logging

from core.live import LiveEvent, publish
from devices.push import device_command
from training.models import Delta

logger = logging.getLogger(__name__)


def delta_payload(delta) -> dict:
    """The delta's live event; the device's name when the row came with it (every caller loads it: never a query
    per event), so the dashboard can say who uploaded."""
    device_name = delta.device.name if Delta.device.is_cached(delta) else None
    return {
        "id": delta.pk,
        "device": str(delta.device_id),
        "device_name": device_name,
        "adapter": delta.adapter_name,
        "base_version": delta.base_version_number,
        "num_samples": delta.num_samples,
        "sha256": delta.sha256,
        "state": delta.state,
        "rejection_code": delta.rejection_code,
        "rejection_detail": delta.rejection_detail,
        "round": delta.round_id,
    }


def announce_delta(delta) -> None:
    """Publish the delta's state once the current transaction commits."""
    from django.db import transaction

    transaction.on_commit(lambda: delta_event(delta))


def delta_event(delta) -> None:
    kind = {"received": "delta.received", "rejected": "delta.rejected"}.get(delta.state, "delta.verified")
    publish(LiveEvent(kind=kind, data=delta_payload(delta)))
    if delta.state in ("accepted", "rejected"):
        _tell_device(delta)


def delta_result_command(delta) -> dict:
    """The ``delta_result`` command telling the device how its delta ended; its id ``delta-<id>`` is stable, so
    the device's acknowledgement names the delta (``training.socket_entry``) and a re-send is the same command."""
    return {
        "id": f"delta-{delta.pk}",
        "command": "delta_result",
        "args": {
            "sha256": delta.sha256,
            "delta_id": delta.pk,
            "state": delta.state,
            "code": delta.rejection_code,
            "detail": delta.rejection_detail,
        },
    }


def _tell_device(delta) -> None:
    command = delta_result_command(delta)
    try:
        device_command(str(delta.device_id), command_id=command["id"], command=command["command"], args=command["args"])
    except Exception:  # the device is told again after its next hello, until it acknowledges
        logger.warning("could not tell device %s about delta %s", delta.device_id, delta.pk, exc_info=True)


def round_event(round_, kind: str = "round.progress", **extra) -> None:
    publish(
        LiveEvent(
            kind=kind,
            data={
                "id": round_.pk,
                "adapter": round_.adapter.name,
                "state": round_.state,
                "deltas": extra.pop("deltas", None),
                "buffer_size": round_.buffer_size,
                "result_version": extra.pop("result_version", None),
                **extra,
            },
        )
    )
