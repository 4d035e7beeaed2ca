"""What the dashboard's reads share: page sizes and limits, the per-row count subquery, pagination."""

from __future__ import annotations

from django.core.paginator import Page, Paginator
from django.db.models import Count, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce

from training.models import Delta, Round
from training.selectors import rejected_meanwhile_count, rejected_while_collecting

__all__ = ["rejected_while_collecting"]  # the round pages' reads import it from here

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
    return _counted(model.objects.filter(**{fk: OuterRef("pk")}, **filters), fk)


def _counted(rows: QuerySet, group: str) -> Coalesce:
    """How many ``rows`` (all with one value of ``group``), as a correlated subquery; 0 if none."""
    # COUNT(*), not COUNT(id): an index-only scan where the filter is an index's columns.
    return Coalesce(Subquery(rows.order_by().values(group).annotate(n=Count("*")).values("n")), 0)


def paginate(queryset: QuerySet, page_number, per_page: int) -> Page:
    """A page of ``queryset`` (two queries: the count and the rows); a bad page number gives the nearest page."""
    return Paginator(queryset, per_page).get_page(page_number)


def _round_rows() -> QuerySet:
    """Rounds with their accepted deltas and the adapter's deltas rejected while they collected
    (``rejected_meanwhile``), newest first (the overview and the rounds pages)."""
    return (
        Round.objects.select_related("adapter", "base_version", "result_version")
        .annotate(
            accepted=_count_of(Delta, "round", state__in=(Delta.State.ACCEPTED, Delta.State.AGGREGATED)),
            rejected_meanwhile=rejected_meanwhile_count(),
        )
        .order_by("-created_at", "-id")
    )
