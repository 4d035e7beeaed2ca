"""The reads of the fleet pages: devices (list and detail), cohorts and enrollment tokens."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.db.models import Count, OuterRef, Q, QuerySet, Subquery

from devices.models import Cohort, Device, DeviceEvent, DeviceStatus, EnrollmentToken
from frontend.selectors.common import VERSION_CHOICES_LIMIT, _count_of
from training.models import AdapterVersion, Assignment, Delta

# --- devices -------------------------------------------------------------------------------------------------


def device_list(
    *,
    cohort: str = "",
    status: str = "",
    online: bool | None = None,
    version: str = "",
    label: str = "",
    search: str = "",
) -> QuerySet:
    """Devices matching the filters, with what the list shows joined in (no per-row queries).

    ``version`` is an adapter version id, or ``none`` for devices that run no version yet; ``label`` is
    ``key`` (has the label) or ``key=value``; ``search`` matches name or agent version, or a pasted device id.
    """
    devices = Device.objects.select_related("cohort", "running_version__adapter", "desired_version__adapter").order_by(
        "name", "id"
    )
    if cohort:
        devices = devices.filter(cohort__name=cohort)
    if status:
        devices = devices.filter(status=status)
    if online is not None:
        devices = devices.filter(online=online)
    if version == "none":
        devices = devices.filter(running_version__isnull=True)
    elif version:
        devices = devices.filter(running_version_id=int(version))
    if label:
        key, sep, wanted = label.partition("=")
        devices = devices.filter(labels__contains={key: wanted}) if sep else devices.filter(labels__has_key=key)
    search = search.strip()
    if search:
        try:
            devices = devices.filter(pk=uuid.UUID(search))
        except ValueError:
            devices = devices.filter(Q(name__icontains=search) | Q(agent_version__icontains=search))
    return devices


def version_choices(limit: int = VERSION_CHOICES_LIMIT) -> list[AdapterVersion]:
    return list(AdapterVersion.objects.select_related("adapter").order_by("adapter__name", "-number")[:limit])


@dataclass
class DeviceDetail:
    device: Device
    deltas: list[Delta]
    delta_count: int
    events: list[DeviceEvent]
    assignments: list[Assignment]


def device_detail(device_id, *, deltas: int = 50, events: int = 50, assignments: int = 20) -> DeviceDetail | None:
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
