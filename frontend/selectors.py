"""The dashboard's reads: each returns what one page shows, in a fixed number of queries.

Every function here runs the same number of queries whatever the row counts (tests/frontend pin that), so a
page never slips into one query per device, delta or version. Lists are cut to a page or a stated limit.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.paginator import Page, Paginator
from django.db.models import Count, Max, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce, TruncHour
from django.utils import timezone

from devices.models import Cohort, Device, DeviceEvent, DeviceStatus, EnrollmentToken
from training.models import Adapter, AdapterVersion, Assignment, BaseModel, Delta, Rollout, Round, TrainingEvent

DEVICES_PER_PAGE = 50
ROUNDS_PER_PAGE = 50
ROLLOUTS_PER_PAGE = 50
DELTAS_PER_PAGE = 100
RECENT_ACTIVITY = 20
VERSION_CHOICES_LIMIT = 300
LINEAGE_LIMIT = 500
CHARTED_METRICS = ("eval_accuracy", "eval_loss")


def _count_of(model, fk: str, **filters) -> Coalesce:
    """How many ``model`` rows point at the outer row through ``fk`` (0 if none), as a correlated subquery.

    PostgreSQL runs it only for the rows a page shows (after ORDER BY ... LIMIT), each through the child's
    ``(fk, state)`` index; a ``Count`` over a join would group every child row (all deltas, all assignments)
    before the LIMIT, and make the paginator's count join them too.
    """
    return Coalesce(
        Subquery(
            model.objects.filter(**{fk: OuterRef("pk")}, **filters)
            .order_by()
            .values(fk)
            .annotate(n=Count("*"))  # COUNT(*), not COUNT(id): an index-only scan of the (fk, state) index
            .values("n")
        ),
        0,
    )


def paginate(queryset: QuerySet, page_number, per_page: int) -> Page:
    """A page of ``queryset`` (two queries: the count and the rows); a bad page number gives the nearest page."""
    return Paginator(queryset, per_page).get_page(page_number)


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


def _round_rows() -> QuerySet:
    return (
        Round.objects.select_related("adapter", "base_version", "result_version")
        .annotate(
            accepted=_count_of(Delta, "round", state__in=(Delta.State.ACCEPTED, Delta.State.AGGREGATED)),
            rejected=_count_of(Delta, "round", state=Delta.State.REJECTED),
        )
        .order_by("-created_at", "-id")
    )


def rounds_in_progress(limit: int = 20) -> list[Round]:
    return list(_round_rows().filter(state__in=(Round.State.COLLECTING, Round.State.AGGREGATING))[:limit])


@dataclass
class RejectedDeltas:
    total: int
    by_code: list[dict]  # [{"rejection_code", "n"}]
    recent: list[Delta]


def rejected_deltas(hours: int = 24, limit: int = 10) -> RejectedDeltas:
    """Deltas rejected in the last ``hours``: how many by code and the newest few (two queries)."""
    since = timezone.now() - timedelta(hours=hours)
    rejected = Delta.objects.filter(state=Delta.State.REJECTED, received_at__gte=since)
    by_code = list(rejected.values("rejection_code").annotate(n=Count("id")).order_by("-n", "rejection_code"))
    recent = list(rejected.select_related("device").order_by("-received_at", "-id")[:limit])
    return RejectedDeltas(total=sum(row["n"] for row in by_code), by_code=by_code, recent=recent)


@dataclass
class Activity:
    at: datetime
    source: str  # "device" | "training"
    kind: str
    actor: str
    subject: str
    url: str | None
    detail: dict


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
    enrolled = Subquery(
        Device.objects.filter(enrolled_with=OuterRef("pk"))
        .order_by()
        .values("enrolled_with")
        .annotate(n=Count("id"))
        .values("n")
    )
    return list(EnrollmentToken.objects.select_related("cohort", "created_by").annotate(n_devices=enrolled)[:limit])


# --- models, adapters and versions ---------------------------------------------------------------------------


def base_model_list() -> list[BaseModel]:
    return list(BaseModel.objects.annotate(n_adapters=Count("adapters")).order_by("name"))


def adapter_list() -> list[Adapter]:
    versions = Subquery(
        AdapterVersion.objects.filter(adapter=OuterRef("pk"))
        .order_by()
        .values("adapter")
        .annotate(n=Count("id"))
        .values("n")
    )
    return list(
        Adapter.objects.select_related("base_model")
        .prefetch_related("cohorts")
        .annotate(n_versions=versions, latest_number=Max("versions__number"))
        .order_by("name")
    )


@dataclass
class LineageRow:
    version: AdapterVersion
    depth: int  # 0 on the main line; a branch (a second child of one parent) is one deeper
    branch: bool


def version_lineage(versions: list[AdapterVersion]) -> list[LineageRow]:
    """Versions newest first, indented where the lineage branches.

    A version's first child (lowest number) continues its parent's line; any later child starts a branch one
    level deeper, so a straight chain of rounds stays flat and only real forks stand out.
    """
    by_id = {version.pk: version for version in versions}
    children: dict[int | None, list[AdapterVersion]] = {}
    for version in sorted(versions, key=lambda v: v.number):
        parent = version.parent_id if version.parent_id in by_id else None
        children.setdefault(parent, []).append(version)
    depth: dict[int, int] = {}
    branch: dict[int, bool] = {}
    for version in sorted(versions, key=lambda v: v.number):
        parent = version.parent_id if version.parent_id in by_id else None
        if parent is None:
            first_root = children[None][0].pk == version.pk
            depth[version.pk], branch[version.pk] = (0, False) if first_root else (1, True)
        else:
            first = children[parent][0].pk == version.pk
            depth[version.pk] = depth[parent] + (0 if first else 1)
            branch[version.pk] = not first
    ordered = sorted(versions, key=lambda v: v.number, reverse=True)
    return [LineageRow(v, min(depth[v.pk], 6), branch[v.pk]) for v in ordered]


def metric_series(versions: list[AdapterVersion], metrics=CHARTED_METRICS) -> dict[str, list[tuple[int, float]]]:
    """Per metric, ``[(version number, value)]`` in version order, skipping versions without it."""
    series: dict[str, list[tuple[int, float]]] = {name: [] for name in metrics}
    for version in sorted(versions, key=lambda v: v.number):
        for name in metrics:
            value = (version.metrics or {}).get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
                series[name].append((version.number, float(value)))
    return series


@dataclass
class AdapterDetail:
    adapter: Adapter
    versions: list[AdapterVersion]
    lineage: list[LineageRow]
    series: dict[str, list[tuple[int, float]]]
    rounds: list[Round]
    rollouts: list[Rollout]
    truncated: bool


def adapter_detail(adapter_id: int, *, rounds: int = 10, rollouts: int = 10) -> AdapterDetail | None:
    adapter = Adapter.objects.select_related("base_model").prefetch_related("cohorts").filter(pk=adapter_id).first()
    if adapter is None:
        return None
    versions = list(adapter.versions.select_related("parent").order_by("-number")[: LINEAGE_LIMIT + 1])
    truncated = len(versions) > LINEAGE_LIMIT
    versions = versions[:LINEAGE_LIMIT]
    return AdapterDetail(
        adapter=adapter,
        versions=versions,
        lineage=version_lineage(versions),
        series=metric_series(versions),
        rounds=list(_round_rows().filter(adapter=adapter)[:rounds]),
        rollouts=list(Rollout.objects.filter(version__adapter=adapter).select_related("version", "cohort")[:rollouts]),
        truncated=truncated,
    )


# --- rounds ---------------------------------------------------------------------------------------------------


def round_list(*, state: str = "", adapter: str = "") -> QuerySet:
    rounds = _round_rows()
    if state:
        rounds = rounds.filter(state=state)
    if adapter:
        rounds = rounds.filter(adapter__name=adapter)
    return rounds


def adapters_for_rounds() -> list[Adapter]:
    """Adapters an operator may open a round for, with whether one is collecting already."""
    collecting = Round.objects.filter(adapter=OuterRef("pk"), state=Round.State.COLLECTING).values("pk")[:1]
    return list(Adapter.objects.annotate(collecting_round=Subquery(collecting)).order_by("name"))


@dataclass
class RoundDetail:
    round: Round
    counts: dict[str, int]
    deltas: Page


def round_detail(round_id: int, *, state: str = "", page: Any = 1) -> RoundDetail | None:
    round_ = _round_rows().select_related("opened_by").filter(pk=round_id).first()
    if round_ is None:
        return None
    counts = Delta.objects.filter(round=round_).aggregate(
        total=Count("id"), **{state_: Count("id", filter=Q(state=state_)) for state_ in Delta.State.values}
    )
    deltas = Delta.objects.filter(round=round_).select_related("device").order_by("-received_at", "-id")
    if state:
        deltas = deltas.filter(state=state)
    return RoundDetail(round=round_, counts=counts, deltas=paginate(deltas, page, DELTAS_PER_PAGE))


# --- rollouts -------------------------------------------------------------------------------------------------


def rollout_list(*, state: str = "") -> QuerySet:
    counts = {f"n_{state_}": _count_of(Assignment, "rollout", state=state_) for state_ in Assignment.State.values}
    rollouts = Rollout.objects.select_related("version__adapter", "cohort").annotate(**counts)
    if state:
        rollouts = rollouts.filter(state=state)
    return rollouts.order_by("-created_at", "-id")


def rollout_versions() -> list[AdapterVersion]:
    """Versions that can be rolled out (not revoked), newest first per adapter."""
    return list(
        AdapterVersion.objects.exclude(state=AdapterVersion.State.REVOKED)
        .select_related("adapter")
        .order_by("adapter__name", "-number")[:VERSION_CHOICES_LIMIT]
    )


@dataclass
class RolloutPhase:
    index: int
    percent: float
    min_soak_seconds: int
    status: str  # done | current | upcoming
    counts: dict[str, int]
    total: int


@dataclass
class RolloutDetail:
    rollout: Rollout
    phases: list[RolloutPhase]
    totals: dict[str, int]
    cohort_devices: int
    guards: list[dict]
    assignments: list[Assignment]
    events: list[TrainingEvent]


def rollout_detail(rollout_id: int, *, assignments: int = 50, events: int = 30) -> RolloutDetail | None:
    from training.rollouts import guard_report

    rollout = Rollout.objects.select_related("version__adapter", "cohort", "created_by").filter(pk=rollout_id).first()
    if rollout is None:
        return None
    rows = rollout.assignments.order_by().values("phase", "state").annotate(n=Count("id"))
    per_phase: dict[int, dict[str, int]] = {}
    totals = dict.fromkeys(Assignment.State.values, 0)
    for row in rows:
        per_phase.setdefault(row["phase"], dict.fromkeys(Assignment.State.values, 0))[row["state"]] = row["n"]
        totals[row["state"]] += row["n"]
    phases = []
    for index, phase in enumerate(rollout.phases):
        if rollout.state == Rollout.State.DRAFT or index > rollout.current_phase:
            status = "upcoming"
        elif index < rollout.current_phase or rollout.state == Rollout.State.COMPLETED:
            status = "done"
        else:
            status = "current"
        counts = per_phase.get(index, dict.fromkeys(Assignment.State.values, 0))
        phases.append(
            RolloutPhase(
                index, phase["percent"], phase.get("min_soak_seconds", 0), status, counts, sum(counts.values())
            )
        )
    return RolloutDetail(
        rollout=rollout,
        phases=phases,
        totals=totals,
        cohort_devices=Device.objects.filter(cohort=rollout.cohort_id, status=DeviceStatus.ACTIVE).count(),
        guards=guard_report(rollout),
        assignments=list(rollout.assignments.select_related("device", "version").order_by("-seq")[:assignments]),
        events=list(TrainingEvent.objects.filter(detail__rollout=rollout.pk)[:events]),
    )
