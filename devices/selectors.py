"""Reads of devices: the device list (which the API and the dashboard filter with ``devices.filters``), and the
devices' personalization reports: one device's history, and the fleet's figures per adapter.

The fleet's figures come from each device's latest report for the adapter (``PersonalizationReport.latest``,
one indexed read whatever the history holds), of devices that are not retired. Gains are in accuracy points
(personal minus shared, times 100): a device gains above 0 and is not worse at -0.5 points or more. A gain is
measured on the device's held samples, often a handful: each carries a 95% interval, and the fleet's figures add the
mean weighted by held samples with its interval, and how many devices hold enough samples to judge by.

Users' feedback is pooled per version from each device's latest counts (``Device.feedback_*``: the version it runs
and the one before it), of devices that are not retired (``feedback_by_version``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from django.db.models import Avg, Count, F, Q, QuerySet, Sum

from devices.feedback import version_feedback
from devices.models import Device, DeviceStatus, PersonalizationReport, gain_interval_points

NOT_WORSE_POINTS = -0.5  # a device this close to the shared model (or better) lost nothing that matters
GAIN_BIN_POINTS = 5
GAIN_RANGE_POINTS = (-20, 50)  # gains outside fall in the first or last bin


def device_list() -> QuerySet:
    """Every device, by name, with what a list shows joined in (cohort, running and desired versions): no query
    per row. ``devices.filters.DeviceFilterSet`` narrows it."""
    return Device.objects.select_related("cohort", "running_version__adapter", "desired_version__adapter").order_by(
        "name", "id"
    )


def device_history(device_id) -> QuerySet:
    """A device's reports, newest first (at most PERSONALIZATION_HISTORY of them)."""
    return PersonalizationReport.objects.filter(device_id=device_id).order_by("-measured_at", "-id")


JUDGED_SAMPLES = 10  # held samples below which a device's gain is shown as rough, not as a finding


@dataclass(frozen=True)
class Latest:
    """One device's latest report for an adapter, as the fleet's figures read it."""

    cohort: str
    method: str
    serving: str
    shared_accuracy: float
    personal_accuracy: float
    val_samples: int = 0  # the held samples both were measured on

    @property
    def gain_points(self) -> float:
        return round((self.personal_accuracy - self.shared_accuracy) * 100, 9)

    @property
    def interval_points(self) -> float | None:
        return gain_interval_points(self.shared_accuracy, self.personal_accuracy, self.val_samples)


def latest_reports(*, adapter_id: int | None = None) -> list[Latest]:
    """Each non-retired device's latest report (for one adapter, or for every adapter), with its cohort."""
    rows = PersonalizationReport.objects.filter(latest=True).exclude(device__status=DeviceStatus.RETIRED)
    if adapter_id is not None:
        rows = rows.filter(adapter_id=adapter_id)
    fields = ("device__cohort__name", "method", "serving", "shared_accuracy", "personal_accuracy", "val_samples")
    return [Latest(*row) for row in rows.order_by().values_list(*fields)]


def gain_bins() -> list[tuple[int, int]]:
    low, high = GAIN_RANGE_POINTS
    return [(start, start + GAIN_BIN_POINTS) for start in range(low, high, GAIN_BIN_POINTS)]


def _bin_of(points: float, bins: list[tuple[int, int]]) -> int:
    index = int((points - bins[0][0]) // GAIN_BIN_POINTS)
    return min(max(index, 0), len(bins) - 1)


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


def _share(count: int, total: int) -> float | None:
    return round(count / total, 6) if total else None


def summarize(reports: Iterable[Latest]) -> dict:
    """The figures of a set of devices' latest reports (the adapter endpoint's ``fleet`` and each cohort's)."""
    reports = list(reports)
    gains = [report.gain_points for report in reports]
    bins = gain_bins()
    counts = Counter(_bin_of(points, bins) for points in gains)
    serving = Counter(report.serving for report in reports)
    gaining = sum(points > 0 for points in gains)
    not_worse = sum(points >= NOT_WORSE_POINTS for points in gains)
    held = sum(report.val_samples for report in reports)
    weighted = round(sum(report.gain_points * report.val_samples for report in reports) / held, 6) if held else None
    # the weighted mean's own interval: each device's variance, weighted as its gain is
    spread = [(report.val_samples, report.interval_points) for report in reports if report.val_samples]
    interval = round(math.sqrt(sum((w * (h / 1.96)) ** 2 for w, h in spread)) * 1.96 / held, 3) if held else None
    return {
        "devices": len(reports),
        "held_samples": held,
        "devices_judged": sum(report.val_samples >= JUDGED_SAMPLES for report in reports),
        "weighted_gain_points": weighted,
        "weighted_gain_interval_points": interval,
        "mean_shared_accuracy": _mean([report.shared_accuracy for report in reports]),
        "mean_personal_accuracy": _mean([report.personal_accuracy for report in reports]),
        "mean_gain_points": _mean(gains),
        "devices_gaining": gaining,
        "share_gaining": _share(gaining, len(reports)),
        "devices_not_worse": not_worse,
        "share_not_worse": _share(not_worse, len(reports)),
        "serving": {"personal": serving["personal"], "shared": serving["shared"]},
        "methods": dict(sorted(Counter(report.method for report in reports).items())),
        "histogram": [{"low": low, "high": high, "devices": counts[index]} for index, (low, high) in enumerate(bins)],
    }


def personalization_headlines() -> list[dict]:
    """Per adapter, from each non-retired device's latest report: how many devices report, their mean gain in
    points, how many gain and how many serve their own model (one grouped query, whatever the fleet's size)."""
    rows = (
        PersonalizationReport.objects.filter(latest=True)
        .exclude(device__status=DeviceStatus.RETIRED)
        .values("adapter_name", "adapter_id")
        .annotate(
            devices=Count("id"),
            mean_gain=Avg(F("personal_accuracy") - F("shared_accuracy")),
            gaining=Count("id", filter=Q(personal_accuracy__gt=F("shared_accuracy"))),
            serving_personal=Count("id", filter=Q(serving=PersonalizationReport.Serving.PERSONAL)),
        )
        .order_by("adapter_name")
    )
    headlines = []
    for row in rows:
        mean_gain = row.pop("mean_gain")
        headlines.append({**row, "mean_gain_points": round(mean_gain * 100, 6)})
    return headlines


def adapter_personalization(adapter_id: int) -> dict:
    """The fleet's figures for one adapter, and the same per cohort (by name)."""
    reports = latest_reports(adapter_id=adapter_id)
    by_cohort: dict[str, list[Latest]] = {}
    for report in reports:
        by_cohort.setdefault(report.cohort, []).append(report)
    return {
        "fleet": summarize(reports),
        "cohorts": [{"cohort": name, **summarize(rows)} for name, rows in sorted(by_cohort.items())],
    }


def feedback_by_version(adapter_name: str) -> dict[int, dict]:
    """Per version of the adapter, the answers the fleet's devices (not retired) say their users confirmed and
    corrected, pooled, with the correction rate of the pool (``devices.feedback.version_feedback``) and how many
    devices it comes from. Two grouped reads: the devices' current versions, and the versions before them."""
    devices = Device.objects.filter(feedback_adapter=adapter_name).exclude(status=DeviceStatus.RETIRED)
    pooled: dict[int, list[int]] = {}
    for prefix in ("feedback_", "feedback_previous_"):
        rows = (
            devices.filter(**{f"{prefix}version__isnull": False})
            .values(f"{prefix}version")
            .annotate(confirmed=Sum(f"{prefix}confirmed"), corrected=Sum(f"{prefix}corrected"), devices=Count("pk"))
        )
        for row in rows:
            counts = pooled.setdefault(row[f"{prefix}version"], [0, 0, 0])
            counts[0] += row["confirmed"] or 0
            counts[1] += row["corrected"] or 0
            counts[2] += row["devices"]
    return {
        number: {**version_feedback(number, confirmed, corrected), "devices": devices}
        for number, (confirmed, corrected, devices) in pooled.items()
    }
