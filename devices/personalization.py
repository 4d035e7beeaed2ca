"""What devices say about their own models: the heartbeat's ``personal`` object, checked and stored.

A device trains a personal model beside the shared version (how: the adapter's personalization setting,
signed into its manifest) and measures both on a held-out slice of its own data. Its heartbeat carries the
latest measurement (docs/protocol/README.md, "Heartbeats"); heartbeats repeat it until the next one, so
only a measurement newer than the device's last stored one is written (``devices.presence`` answers that from
Redis on the heartbeat's own round trip; this module checks again in the database). Each device keeps at most
``PERSONALIZATION_HISTORY`` reports.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from django.conf import settings
from django.db import transaction

from core.live import LiveEvent, publish
from devices.models import Device, PersonalizationReport
from edge_agent.wire import validated
from edge_agent.wire_reports import Personal
from edge_agent.wire_types import EARLIEST_TIME

SERVING = ("personal", "shared")
MAX_SAMPLES = 10**9
EARLIEST_MEASUREMENT = EARLIEST_TIME
# A measurement further ahead of the server's clock than this is refused: a device with its clock far ahead
# would otherwise hide every later measurement behind that one. (The other bounds are the model's,
# ``edge_agent.wire_reports.Personal``.)
MAX_CLOCK_AHEAD_SECONDS = 86400


def parse_personal(value, *, now: float | None = None) -> dict | None:
    """A heartbeat's ``personal`` object, checked (ValueError naming the bad field); None when the heartbeat has
    none. Fields other than the documented ones are ignored, as in the rest of a heartbeat."""
    if value is None:
        return None
    # the optional paired counts (agents before them send none) are left out rather than kept as nulls
    personal = {k: v for k, v in validated(Personal, value, what="personal").to_dict().items() if v is not None}
    if personal["updated_at"] > (time.time() if now is None else now) + MAX_CLOCK_AHEAD_SECONDS:
        raise ValueError("personal.updated_at: the measurement's time is more than a day ahead of the server's clock")
    return personal


def _adapters():
    """The adapters, through the report's own relation: the training side sits above ``devices``, which does not
    import it (docs/architecture.md)."""
    return PersonalizationReport._meta.get_field("adapter").related_model.objects


def personal_report_record(*, device_id, personal: dict) -> PersonalizationReport | None:
    """Store a device's measurement (from ``parse_personal``) unless it is not newer than the last one stored;
    keep the device's newest ``PERSONALIZATION_HISTORY`` reports. Returns the new report, or None."""
    measured_at = datetime.fromtimestamp(personal["updated_at"], tz=UTC)
    with transaction.atomic():
        # One writer per device at a time (a REST heartbeat beside the socket's), so ``latest`` stays unique.
        names = Device.objects.select_for_update(no_key=True).filter(pk=device_id).values_list("name", flat=True)
        name = next(iter(names), None)
        if name is None:
            return None
        reports = PersonalizationReport.objects.filter(device_id=device_id)
        if reports.filter(measured_at__gte=measured_at).exists():
            return None
        reports.filter(adapter_name=personal["adapter"], latest=True).update(latest=False)
        report = PersonalizationReport.objects.create(
            device_id=device_id,
            adapter_id=_adapters().filter(name=personal["adapter"]).values_list("pk", flat=True).first(),
            adapter_name=personal["adapter"],
            version_number=personal["version"],
            method=personal["method"],
            serving=personal["serving"],
            shared_accuracy=personal["shared_accuracy"],
            personal_accuracy=personal["personal_accuracy"],
            val_samples=personal["val_samples"],
            trained_samples=personal["trained_samples"],
            shared_only_right=personal.get("shared_only_right"),
            personal_only_right=personal.get("personal_only_right"),
            measured_at=measured_at,
            latest=True,
        )
        keep = settings.PERSONALIZATION_HISTORY
        oldest_kept = reports.order_by("-measured_at", "-id").values_list("measured_at", flat=True)[keep - 1 : keep]
        reports.filter(measured_at__lt=oldest_kept).delete()
        transaction.on_commit(lambda: publish(_event(report, name)))
    return report


def _event(report: PersonalizationReport, name: str) -> LiveEvent:
    data = {
        "device": str(report.device_id),
        "name": name,
        "adapter": report.adapter_name,
        "version": report.version_number,
        "serving": report.serving,
        "gain_points": report.gain_points,
    }
    text = (
        f"{name}'s own model: {report.gain_points:+.1f} points against {report.adapter_name} "
        f"v{report.version_number}, serves {report.serving}"
    )
    return LiveEvent(kind="device.personalization", data=data, text=text)
