"""The reads of the training pages: base models, adapters and their version lineage, rounds and rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.core.paginator import Page
from django.db.models import Count, Max, OuterRef, Q, QuerySet, Subquery
from django.utils import timezone

from devices.models import Device, DeviceStatus
from devices.selectors import feedback_by_version
from frontend.selectors.common import (
    CHARTED_METRICS,
    DELTAS_PER_PAGE,
    LINEAGE_LIMIT,
    VERSION_CHOICES_LIMIT,
    _count_of,
    _round_rows,
    paginate,
    rejected_while_collecting,
)
from training.models import Adapter, AdapterVersion, Assignment, BaseModel, Delta, Rollout, Round, TrainingEvent
from training.rollouts.lifecycle import guard_report
from training.rollouts.progress import annotate_device_counts, counts_for, counts_summary

# --- models, adapters and versions ---------------------------------------------------------------------------


def base_model_list() -> list[BaseModel]:
    return list(BaseModel.objects.annotate(n_adapters=Count("adapters")).order_by("name"))


def adapter_list() -> list[Adapter]:
    return list(
        Adapter.objects.select_related("base_model")
        .prefetch_related("cohorts")
        .annotate(n_versions=_count_of(AdapterVersion, "adapter"), latest_number=Max("versions__number"))
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
    feedback: dict[int, dict]  # per version number: users' answers pooled over devices (devices.selectors)


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
        feedback=feedback_by_version(adapter.name),
    )


# --- rounds ---------------------------------------------------------------------------------------------------


def round_list() -> QuerySet:
    """Rounds, newest first, with their counts; the page narrows them with ``training.filters.RoundFilterSet``."""
    return _round_rows()


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
    """The round, its deltas by state, and a page of them; ``state="rejected"`` lists the adapter's deltas
    rejected while the round collected (they never join it: ``rejected_while_collecting``)."""
    round_ = _round_rows().select_related("opened_by").filter(pk=round_id).first()
    if round_ is None:
        return None
    counts = Delta.objects.filter(round=round_).aggregate(
        total=Count("id"), **{state_: Count("id", filter=Q(state=state_)) for state_ in Delta.State.values}
    )
    if state == Delta.State.REJECTED:
        deltas = rejected_while_collecting(round_.adapter_id, round_.created_at, round_.closed_at or timezone.now())
    else:
        deltas = Delta.objects.filter(round=round_, **({"state": state} if state else {}))
    deltas = deltas.select_related("device").order_by("-received_at", "-id")
    return RoundDetail(round=round_, counts=counts, deltas=paginate(deltas, page, DELTAS_PER_PAGE))


# --- rollouts -------------------------------------------------------------------------------------------------


def rollout_list() -> QuerySet:
    """Rollouts, newest first, each with its devices' live counts (``with_device_counts`` picks what to show); the
    page narrows them with ``training.filters.RolloutFilterSet``."""
    return annotate_device_counts(Rollout.objects.select_related("version__adapter", "cohort")).order_by(
        "-created_at", "-id"
    )


def with_device_counts(rollouts) -> list[Rollout]:
    """Each rollout of a page with ``devices``: installed, failed, pending and gone, live while it is in
    progress and as recorded when it finished (so a finished rollout never shows devices pending)."""
    rollouts = list(rollouts)
    for rollout in rollouts:
        rollout.devices = counts_for(rollout)
    return rollouts


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
    devices: dict
    devices_summary: str
    cohort_devices: int
    guards: list[dict]
    assignments: list[Assignment]
    events: list[TrainingEvent]
    held: TrainingEvent | None = None  # the newest version automatic release held back for this rollout


def rollout_detail(rollout_id: int, *, assignments: int = 50, events: int = 30) -> RolloutDetail | None:
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
    devices = counts_for(rollout)
    recent = list(
        TrainingEvent.objects.filter(detail__rollout=rollout.pk).select_related("adapter", "version")[:events]
    )
    return RolloutDetail(
        rollout=rollout,
        phases=phases,
        totals=totals,
        devices=devices,
        devices_summary=counts_summary(devices),
        cohort_devices=Device.objects.filter(cohort=rollout.cohort_id, status=DeviceStatus.ACTIVE).count(),
        guards=guard_report(rollout),
        assignments=list(rollout.assignments.select_related("device", "version").order_by("-seq")[:assignments]),
        events=recent,
        held=next((event for event in recent if event.kind == "version.release_held"), None),
    )
