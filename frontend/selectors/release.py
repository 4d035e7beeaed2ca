"""Where each adapter's shared learning stands for operators: the version devices are served, candidates the release
gate held back or that wait for a rollout, and, when no delta gets through, why and what to do. The adapter page
shows its own; the overview shows every adapter's notices. Five queries whatever the number of adapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from django.db.models import Count, Exists, F, Max, OuterRef, Q, Subquery
from django.utils import timezone

from training.federation.aggregation_settings import aggregation_settings
from training.models import Adapter, AdapterVersion, Delta, Round

QUIET_WINDOW = timedelta(hours=1)  # rejections this recent, with nothing accepted, make an adapter "stalled"
STALLED_AFTER = 3  # ... at least this many of them


@dataclass
class Notice:
    level: str  # "bad" | "warn" | "info"
    text: str
    remedy: str


@dataclass
class ReleaseState:
    adapter: Adapter
    auto_release: bool
    margin: float
    served: AdapterVersion | None  # the newest released version: what devices are given
    newer_candidates: int = 0
    failed_candidates: int = 0
    newest_candidate: AdapterVersion | None = None
    notices: list[Notice] = field(default_factory=list)


def _accuracy(version: AdapterVersion | None) -> str:
    value = (version.metrics or {}).get("eval_accuracy") if version is not None else None
    return f" (eval_accuracy {value:.3f})" if isinstance(value, int | float) else ""


def release_states(adapter_id: int | None = None) -> list[ReleaseState]:
    """Every adapter's (or one's) release state with its notices, by name."""
    released = AdapterVersion.objects.filter(adapter=OuterRef("pk"), state=AdapterVersion.State.RELEASED)
    adapters = Adapter.objects.annotate(
        served_id=Subquery(released.order_by("-number").values("pk")[:1]),
        collecting=Exists(Round.objects.filter(adapter=OuterRef("pk"), state=Round.State.COLLECTING)),
    ).order_by("name")
    if adapter_id is not None:
        adapters = adapters.filter(pk=adapter_id)
    adapters = list(adapters)
    if not adapters:
        return []
    ids = [adapter.pk for adapter in adapters]
    served = {v.pk: v for v in AdapterVersion.objects.filter(pk__in=[a.served_id for a in adapters if a.served_id])}
    newest_released = AdapterVersion.objects.filter(
        adapter=OuterRef("adapter"), state=AdapterVersion.State.RELEASED
    ).order_by("-number")
    candidates = (  # newer than what devices are served (every candidate while none is released)
        AdapterVersion.objects.filter(adapter_id__in=ids, state=AdapterVersion.State.CANDIDATE)
        .annotate(served_number=Subquery(newest_released.values("number")[:1]))
        .filter(Q(served_number__isnull=True) | Q(number__gt=F("served_number")))
    )
    counted = {
        row["adapter_id"]: row
        for row in candidates.values("adapter_id").annotate(
            n=Count("pk"), failed=Count("pk", filter=Q(gate__verdict="failed")), newest=Max("number")
        )
    }
    newest = Q(pk__in=[])
    for adapter_id_, row in counted.items():
        newest |= Q(adapter_id=adapter_id_, number=row["newest"])
    newest_rows = {v.adapter_id: v for v in AdapterVersion.objects.filter(newest)} if counted else {}
    since = timezone.now() - QUIET_WINDOW
    traffic: dict[int, dict[str, int]] = {}
    for row in (
        Delta.objects.filter(adapter_id__in=ids, received_at__gte=since)
        .values("adapter_id", "state", "rejection_code")
        .annotate(n=Count("pk"))
    ):
        key = row["rejection_code"] if row["state"] == Delta.State.REJECTED else "accepted"
        counts = traffic.setdefault(row["adapter_id"], {})
        counts[key] = counts.get(key, 0) + row["n"]
    states = []
    for adapter in adapters:
        settings_ = aggregation_settings(adapter)
        row = counted.get(adapter.pk, {})
        state = ReleaseState(
            adapter=adapter,
            auto_release=settings_["auto_release"],
            margin=float(settings_["release_margin"]),
            served=served.get(adapter.served_id),
            newer_candidates=row.get("n", 0),
            failed_candidates=row.get("failed", 0),
            newest_candidate=newest_rows.get(adapter.pk),
        )
        state.notices = _notices(state, traffic.get(adapter.pk, {}), adapter.collecting)
        states.append(state)
    return states


def _notices(state: ReleaseState, traffic: dict[str, int], collecting: bool) -> list[Notice]:
    notices = []
    served = state.served
    keeps = f"Devices keep v{served.number}{_accuracy(served)}" if served else "No version is released yet"
    newest = state.newest_candidate
    if newest is not None and (newest.gate or {}).get("verdict") == "failed":
        held = (
            f" ({state.failed_candidates} of the {state.newer_candidates} versions made since v{served.number} "
            "failed the gate)"
            if served
            else ""
        )
        notices.append(
            Notice(
                "bad",
                f"v{newest.number} failed the release gate and stays a candidate: {newest.gate.get('reason', '')}. "
                f"{keeps}; rounds go on building on it{held}.",
                "Nothing to do while later rounds may pass. If versions keep failing, look at the deltas of their "
                "rounds; to send one to devices anyway, create a rollout with the gate overridden (recorded).",
            )
        )
    elif newest is not None and not state.auto_release:
        notices.append(
            Notice(
                "info",
                f"Automatic release is off: {state.newer_candidates} candidate"
                f"{'s' if state.newer_candidates != 1 else ''} newer than what devices run wait for a rollout "
                f"(newest v{newest.number}{_accuracy(newest)}). {keeps}.",
                "Roll one out from the Rollouts page (staged, with guards), or turn automatic release on.",
            )
        )
    rejected = {code: n for code, n in traffic.items() if code != "accepted"}
    if not traffic.get("accepted") and sum(rejected.values()) >= STALLED_AFTER:
        code, count = max(rejected.items(), key=lambda item: item[1])
        remedy = {
            "stale_base_version": "Devices train on a version too far behind the newest released one: check that "
            "they install their assignments (a rollout waiting for them says which), or raise max_staleness.",
            "norm_too_large": "Updates are larger than max_norm: check the devices' training settings, or raise "
            "max_norm if such updates are expected.",
            "wrong_cohort": "The devices' cohort does not train this adapter: add the cohort to the adapter.",
        }.get(code, "See the rejected deltas on the overview and on the devices' pages for each one's reason.")
        notices.append(
            Notice(
                "bad",
                f"No delta of {state.adapter.name} was accepted in the last hour: {sum(rejected.values())} were "
                f"refused, {count} as {code}{'' if collecting else ', and no round is collecting'}.",
                remedy,
            )
        )
    return notices
