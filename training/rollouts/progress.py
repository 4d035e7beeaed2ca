"""Where a rollout's devices stand, and the rule that says when a rollout is done with them.

Every device a rollout assigned is in one of four places: **installed**, **failed**, **pending** (its assignment
is pending or delivered and it may still install) or **gone**. Gone, by the first rule that applies:

- ``superseded``: its assignment was replaced by a newer one (another rollout, a rollback);
- ``inactive``: the device is no longer active (quarantined, retired, back to pending);
- ``left_cohort``: it was moved to another cohort;
- ``unseen``: it is offline and was not seen for ``ROLLOUT_GONE_SECONDS`` (a device never seen counts from its
  enrollment).

A gone device that comes back still gets its assignment; it only no longer holds the rollout open. A rollout
completes when its phases are done and none of its devices is pending
(``training.rollouts.lifecycle.rollout_tick``); the counts are recorded on it then (``Rollout.device_counts``),
so a finished rollout keeps saying what it ended with, whatever happens to its devices (or late joiners)
afterwards. Rollouts in progress are counted live.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Count, OuterRef, Q, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from devices.models import DeviceStatus
from training.models import Assignment, Rollout

ACTIVE = (Assignment.State.PENDING, Assignment.State.DELIVERED)
FINISHED = (Rollout.State.COMPLETED, Rollout.State.ABORTED, Rollout.State.ROLLED_BACK)
GONE_RULES = ("superseded", "inactive", "left_cohort", "unseen")
_PREFIX = "dc_"  # the annotations ``annotate_device_counts`` adds
_RAW = ("installed", "failed", "superseded", "active", "inactive", "left_cohort", "unseen")


def duration_label(seconds: int) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds // 3600} h"
    if seconds >= 120 and seconds % 60 == 0:
        return f"{seconds // 60} min"
    return f"{seconds} s"


def _rule_label(rule: str, gone_after: int) -> str:
    return {
        "superseded": "superseded",
        "inactive": "no longer active",
        "left_cohort": "left the cohort",
        "unseen": f"not seen for {duration_label(gone_after)}",
    }[rule]


def _active_gone(cohort, cutoff) -> dict[str, Q]:
    """For assignments still pending or delivered: the rule that makes their device gone (``cohort``: the
    rollout's cohort id, a value or an expression)."""
    active = Q(device__status=DeviceStatus.ACTIVE)
    in_cohort = active & Q(device__cohort_id=cohort)
    return {
        "inactive": ~active,
        "left_cohort": active & ~Q(device__cohort_id=cohort),
        "unseen": in_cohort
        & Q(device__online=False)
        & (Q(device__last_seen_at__lt=cutoff) | Q(device__last_seen_at__isnull=True, device__enrolled_at__lt=cutoff)),
    }


def _cutoff(now=None):
    return (now or timezone.now()) - timedelta(seconds=settings.ROLLOUT_GONE_SECONDS)


def _counts(raw: dict[str, int]) -> dict:
    """installed / failed / pending / gone (and gone by rule) from the raw per-rule counts."""
    gone_by = {rule: raw[rule] for rule in GONE_RULES}
    return {
        "installed": raw["installed"],
        "failed": raw["failed"],
        "pending": raw["active"] - raw["inactive"] - raw["left_cohort"] - raw["unseen"],
        "gone": sum(gone_by.values()),
        "gone_by": gone_by,
        "gone_after_seconds": settings.ROLLOUT_GONE_SECONDS,
    }


def _filters(cohort, cutoff) -> dict[str, Q]:
    return {
        "installed": Q(state=Assignment.State.INSTALLED),
        "failed": Q(state=Assignment.State.FAILED),
        "superseded": Q(state=Assignment.State.SUPERSEDED),
        "active": Q(state__in=ACTIVE),
        **{rule: Q(state__in=ACTIVE) & q for rule, q in _active_gone(cohort, cutoff).items()},
    }


def device_counts(rollout: Rollout, *, now=None) -> dict:
    """The rollout's devices as they stand now (one query)."""
    filters = _filters(rollout.cohort_id, _cutoff(now))
    raw = Assignment.objects.filter(rollout=rollout).aggregate(
        **{name: Count("pk", filter=q) for name, q in filters.items()}
    )
    return _counts(raw)


def annotate_device_counts(rollouts: QuerySet) -> QuerySet:
    """Each rollout with its live counts, as correlated subqueries (run only for the rows a page shows)."""
    filters = _filters(OuterRef("cohort_id"), _cutoff())
    return rollouts.annotate(
        **{
            _PREFIX + name: Coalesce(
                Subquery(
                    Assignment.objects.filter(q, rollout=OuterRef("pk"))
                    .order_by()
                    .values("rollout")
                    .annotate(n=Count("*"))
                    .values("n")
                ),
                0,
            )
            for name, q in filters.items()
        }
    )


def counts_for(rollout: Rollout) -> dict:
    """What the page and the API show: the counts a finished rollout recorded, else the live ones (from
    ``annotate_device_counts`` when the rollout came through it)."""
    if rollout.state in FINISHED and rollout.device_counts:
        return rollout.device_counts
    if hasattr(rollout, _PREFIX + "active"):
        return _counts({name: getattr(rollout, _PREFIX + name) for name in _RAW})
    return device_counts(rollout)


def counts_summary(counts: dict) -> str:
    """ "10 installed, 1 failed, 1 gone (not seen for 10 min)"; what is zero is left out."""
    if not counts:
        return ""
    parts = [f"{counts[key]} {key}" for key in ("installed", "failed", "pending") if counts.get(key)]
    if counts.get("gone"):
        rules = [(_rule_label(rule, counts["gone_after_seconds"]), n) for rule, n in counts["gone_by"].items() if n]
        detail = rules[0][0] if len(rules) == 1 else ", ".join(f"{n} {label}" for label, n in rules)
        parts.append(f"{counts['gone']} gone ({detail})")
    return ", ".join(parts) or "no device assigned"


def pending_names(rollout: Rollout, *, limit: int = 5) -> list[str]:
    """Some of the devices the rollout waits for, by name."""
    gone = _active_gone(rollout.cohort_id, _cutoff())
    rows = Assignment.objects.filter(rollout=rollout, state__in=ACTIVE)
    for rule in gone.values():
        rows = rows.exclude(rule)
    return list(rows.order_by("device__name").values_list("device__name", flat=True)[:limit])


def waiting_reason(rollout: Rollout, counts: dict) -> str:
    """What a rollout whose phases are done still waits for."""
    names = pending_names(rollout)
    more = counts["pending"] - len(names)
    who = ", ".join(names) + (f" and {more} more" if more > 0 else "")
    reason = (
        f"all phases done; waiting for {counts['pending']} device{'s' if counts['pending'] != 1 else ''} to "
        f"install or fail ({who}); a device offline for {duration_label(counts['gone_after_seconds'])} counts as gone"
    )
    return reason[:300]


def completion_reason(counts: dict) -> str:
    return f"all phases done: {counts_summary(counts)}"[:300]
