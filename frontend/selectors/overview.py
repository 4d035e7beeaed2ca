"""The fleet overview's reads: device counts, versions in use, delta traffic, rounds in progress, rejections
and recent activity."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Count, Max, Q
from django.db.models.functions import TruncHour
from django.utils import timezone

from devices.models import Device, DeviceEvent, DeviceStatus
from frontend import event_text
from frontend.selectors.common import (
    RECENT_ACTIVITY,
    _round_rows,
)
from training.models import AdapterVersion, Delta, Round, TrainingEvent

# --- fleet overview ------------------------------------------------------------------------------------------


def device_counts() -> dict[str, int]:
    """Devices by status, and active ones online and offline, in one query."""
    counts = Device.objects.aggregate(
        n_total=Count("id"),
        n_pending=Count("id", filter=Q(status=DeviceStatus.PENDING)),
        n_active=Count("id", filter=Q(status=DeviceStatus.ACTIVE)),
        n_online=Count("id", filter=Q(status=DeviceStatus.ACTIVE, online=True)),
        n_offline=Count("id", filter=Q(status=DeviceStatus.ACTIVE, online=False)),
        n_quarantined=Count("id", filter=Q(status=DeviceStatus.QUARANTINED)),
        n_retired=Count("id", filter=Q(status=DeviceStatus.RETIRED)),
    )
    return {name.removeprefix("n_"): value for name, value in counts.items()}


@dataclass
class CohortVersions:
    cohort: str
    devices: int
    versions: list[dict]  # [{"label": "digits-lora v3" | "none", "count": n, "version_id": id | None}]


def versions_in_use() -> list[CohortVersions]:
    """Per cohort, how many non-retired devices run which adapter version (one grouped query)."""
    rows = (
        Device.objects.exclude(status=DeviceStatus.RETIRED)
        .values("cohort__name", "running_version_id", "running_version__adapter__name", "running_version__number")
        .annotate(n=Count("id"))
        .order_by("cohort__name", "running_version__adapter__name", "-running_version__number")
    )
    cohorts: dict[str, CohortVersions] = {}
    for row in rows:
        entry = cohorts.setdefault(row["cohort__name"], CohortVersions(row["cohort__name"], 0, []))
        entry.devices += row["n"]
        label = (
            f"{row['running_version__adapter__name']} v{row['running_version__number']}"
            if row["running_version_id"]
            else "none"
        )
        entry.versions.append({"label": label, "count": row["n"], "version_id": row["running_version_id"]})
    return list(cohorts.values())


def deltas_per_hour(hours: int = 24, now: datetime | None = None) -> list[dict]:
    """Deltas received in each of the last ``hours`` hours (oldest first), split into rejected and the rest."""
    now = now or timezone.now()
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    start = end - timedelta(hours=hours)
    rows = (
        Delta.objects.filter(received_at__gte=start)
        .annotate(hour=TruncHour("received_at"))
        .values("hour")
        .annotate(n=Count("id"), rejected=Count("id", filter=Q(state=Delta.State.REJECTED)))
    )
    by_hour = {row["hour"]: row for row in rows}
    buckets = []
    for index in range(hours):
        hour = start + timedelta(hours=index)
        row = by_hour.get(hour, {"n": 0, "rejected": 0})
        buckets.append({"hour": hour, "total": row["n"], "rejected": row["rejected"]})
    return buckets


def data_span(buckets: list[dict]) -> list[dict]:
    """The buckets from the first hour with a delta to the last one (none when no hour has one): the chart
    spends its width on the hours with traffic, not on a day of empty ones."""
    busy = [index for index, bucket in enumerate(buckets) if bucket["total"]]
    return buckets[busy[0] : busy[-1] + 1] if busy else []


def shared_accuracy() -> list[AdapterVersion]:
    """Per adapter, its newest released version (the shared version devices run) with the server's evaluation
    in its ``metrics`` (one query: DISTINCT ON the adapter)."""
    return list(
        AdapterVersion.objects.filter(state=AdapterVersion.State.RELEASED)
        .select_related("adapter")
        .order_by("adapter__name", "adapter_id", "-number")
        .distinct("adapter__name", "adapter_id")
    )


def rounds_in_progress(limit: int = 20) -> list[Round]:
    return list(_round_rows().filter(state__in=(Round.State.COLLECTING, Round.State.AGGREGATING))[:limit])


@dataclass
class RejectedDeltas:
    total: int
    by_code: list[dict]  # [{"rejection_code", "n"}]
    recent: list[dict]  # per device and code, newest first: {device_id, device__name, rejection_code, n, last_at}
    groups: int = 0  # how many device-and-code groups there are in all (``recent`` shows the newest ``limit``)


def rejected_deltas(hours: int = 24, limit: int = 10) -> RejectedDeltas:
    """Deltas rejected in the last ``hours``: how many by code, and per device and code how many and when the
    last (a device that repeats one refusal is one row with its count, not ten rows); four queries."""
    since = timezone.now() - timedelta(hours=hours)
    rejected = Delta.objects.filter(state=Delta.State.REJECTED, received_at__gte=since)
    by_code = list(rejected.values("rejection_code").annotate(n=Count("id")).order_by("-n", "rejection_code"))
    grouped = (
        rejected.values("device_id", "device__name", "rejection_code")
        .annotate(n=Count("id"), last_at=Max("received_at"))
        .order_by("-last_at", "device__name", "rejection_code")
    )
    recent = list(grouped[:limit])
    groups = grouped.count()  # always asked, so the page's query count does not depend on the rows
    return RejectedDeltas(total=sum(row["n"] for row in by_code), by_code=by_code, recent=recent, groups=groups)


@dataclass
class Activity:
    at: datetime
    source: str  # "device" | "training"
    kind: str
    actor: str
    subject: str
    url: str | None
    detail: dict
    text: str = ""  # what happened, in words (frontend.event_text)


def recent_activity(limit: int = RECENT_ACTIVITY) -> list[Activity]:
    """Device events and training events, newest first, merged (two queries)."""
    from django.urls import reverse

    items = [
        Activity(
            at=event.created_at,
            source="device",
            kind=f"device.{event.kind}",
            actor=event.actor_label,
            subject=event.device.name,
            url=reverse("frontend:device-detail", args=[event.device_id]),
            detail=event.detail,
            text=event_text.device_event(event.kind, event.detail, event.device.name),
        )
        for event in DeviceEvent.objects.select_related("device").only(
            "created_at", "kind", "actor_label", "detail", "device__name", "device__id"
        )[:limit]
    ]
    for event in TrainingEvent.objects.select_related("adapter", "version")[:limit]:
        subject = event.adapter.name if event.adapter else ""
        if event.version is not None:
            subject = f"{subject} v{event.version.number}"
        items.append(
            Activity(
                at=event.created_at,
                source="training",
                kind=event.kind,
                actor=event.actor_label,
                subject=subject,
                url=_training_event_url(event),
                detail=event.detail,
                text=event_text.training_event(
                    event.kind,
                    event.detail,
                    event.adapter.name if event.adapter else "",
                    event.version.number if event.version else None,
                ),
            )
        )
    items.sort(key=lambda item: item.at, reverse=True)
    return items[:limit]


def _training_event_url(event: TrainingEvent) -> str | None:
    from django.urls import reverse

    detail = event.detail or {}
    if isinstance(detail.get("rollout"), int):
        return reverse("frontend:rollout-detail", args=[detail["rollout"]])
    if isinstance(detail.get("round"), int):
        return reverse("frontend:round-detail", args=[detail["round"]])
    if event.adapter_id:
        return reverse("frontend:adapter-detail", args=[event.adapter_id])
    return None
