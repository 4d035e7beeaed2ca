"""The personalization reads of the dashboard: a device's own model against the shared one over time, an
adapter's fleet figures and the overview's headline per adapter (each a fixed number of queries)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

from devices.models import PersonalizationReport
from devices.selectors import adapter_personalization, device_history, personalization_headlines

__all__ = ["DevicePersonal", "adapter_personalization", "device_personalization", "personalization_headlines"]


@dataclass
class DevicePersonal:
    latest: PersonalizationReport | None  # the device's newest report
    reports: list[PersonalizationReport]  # its reports for the latest one's adapter, oldest first (the chart)


def device_personalization(device_id) -> DevicePersonal:
    """The device's history (one query, at most PERSONALIZATION_HISTORY rows)."""
    reports = list(device_history(device_id)[: settings.PERSONALIZATION_HISTORY])
    if not reports:
        return DevicePersonal(latest=None, reports=[])
    latest = reports[0]
    return DevicePersonal(
        latest=latest, reports=[r for r in reversed(reports) if r.adapter_name == latest.adapter_name]
    )
