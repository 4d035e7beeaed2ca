"""The reads of the fleet pages: devices (the detail; the list is ``devices.selectors.device_list``, filtered by
``devices.filters.DeviceFilterSet``), cohorts and enrollment tokens."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count, OuterRef, Subquery

from devices.models import Cohort, Device, DeviceEvent, DeviceStatus, EnrollmentToken
from frontend.selectors.common import VERSION_CHOICES_LIMIT, _count_of
from training.models import AdapterVersion, Assignment, Delta

# --- devices -------------------------------------------------------------------------------------------------


def version_choices(limit: int = VERSION_CHOICES_LIMIT) -> list[AdapterVersion]:
    return list(AdapterVersion.objects.select_related("adapter").order_by("adapter__name", "-number")[:limit])


@dataclass
class DeviceDetail:
    device: Device
    deltas: list[Delta]
    delta_count: int
    events: list[DeviceEvent]
    assignments: list[Assignment]  # the newest ``assignments`` of them
    assignment_count: int = 0  # in all
    rejected_by_code: list[dict] | None = None  # the device's rejected deltas: [{"rejection_code", "n"}], most first

    @property
    def rejected_count(self) -> int:
        return sum(row["n"] for row in self.rejected_by_code or ())


ASSIGNMENTS_SHOWN = 5  # the device page's versions table: the newest few, and a link to the rest
ASSIGNMENTS_LIMIT = 200  # the rest, at most


def device_detail(
    device_id, *, deltas: int = 50, events: int = 50, assignments: int = ASSIGNMENTS_SHOWN
) -> DeviceDetail | None:
    device = (
        Device.objects.select_related("cohort", "running_version__adapter", "desired_version__adapter", "enrolled_with")
        .filter(pk=device_id)
        .first()
    )
    if device is None:
        return None
    return DeviceDetail(
        device=device,
        deltas=list(device.deltas.order_by("-received_at", "-id")[:deltas]),
        delta_count=device.deltas.count(),
        events=list(device.events.all()[:events]),
        assignments=list(device.assignments.select_related("version__adapter", "rollout")[:assignments]),
        assignment_count=device.assignments.count(),
        rejected_by_code=list(
            device.deltas.filter(state=Delta.State.REJECTED)
            .values("rejection_code")
            .annotate(n=Count("id"))
            .order_by("-n", "rejection_code")
        ),
    )


# --- cohorts and enrollment tokens ---------------------------------------------------------------------------


def cohort_list() -> list[Cohort]:
    """Every cohort with its devices by status and its usable tokens (one query, subqueries per count)."""

    def devices_with(**filters):
        return Subquery(
            Device.objects.filter(cohort=OuterRef("pk"), **filters)
            .order_by()
            .values("cohort")
            .annotate(n=Count("id"))
            .values("n")
        )

    usable_tokens = Subquery(
        EnrollmentToken.objects.usable()
        .filter(cohort=OuterRef("pk"))
        .order_by()
        .values("cohort")
        .annotate(n=Count("id"))
        .values("n")
    )
    return list(
        Cohort.objects.annotate(
            n_devices=devices_with(),
            n_active=devices_with(status=DeviceStatus.ACTIVE),
            n_pending=devices_with(status=DeviceStatus.PENDING),
            n_online=devices_with(status=DeviceStatus.ACTIVE, online=True),
            n_tokens=usable_tokens,
        ).order_by("name")
    )


def enrollment_token_list(limit: int = 200) -> list[EnrollmentToken]:
    tokens = EnrollmentToken.objects.select_related("cohort", "created_by")
    return list(tokens.annotate(n_devices=_count_of(Device, "enrolled_with"))[:limit])
