"""Reads worth naming."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Count, OuterRef, Subquery
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from training.models import Adapter, AdapterVersion, Assignment, BaseModel, Delta


def device_may_download(device, sha256: str) -> bool:
    """A device may fetch the versions it has been assigned (not revoked ones) and the base weights of the
    adapters serving its cohort; nothing else: not another device's assignments, not another cohort's base."""
    assigned = Assignment.objects.filter(device=device, version__blob_sha256=sha256).exclude(
        version__state=AdapterVersion.State.REVOKED
    )
    if assigned.exists():
        return True
    adapters = Adapter.objects.filter(cohorts=device.cohort_id)
    return BaseModel.objects.filter(adapters__in=adapters, weights_sha256=sha256).exists()


def deltas_awaiting_rescue(*, limit: int = 5000) -> list[int]:
    """Ids of deltas still `received` past DELTA_VERIFY_RESCUE_SECONDS: their verification task was lost."""
    older_than = timezone.now() - timedelta(seconds=settings.DELTA_VERIFY_RESCUE_SECONDS)
    return list(
        Delta.objects.filter(state=Delta.State.RECEIVED, received_at__lt=older_than)
        .order_by("received_at")
        .values_list("pk", flat=True)[:limit]
    )


def rejected_while_collecting(adapter, opened, closed):
    """The deltas for a round's adapter that were received while it collected (from ``opened`` to ``closed``)
    and rejected. A rejected delta never joins a round, only accepted ones do: this is what "rejected" means
    for a round, on the dashboard and in the API's ``rejected``. Takes values, or ``OuterRef`` expressions for
    a subquery per round (``rejected_meanwhile_count``)."""
    return Delta.objects.filter(
        adapter=adapter, state=Delta.State.REJECTED, received_at__gte=opened, received_at__lt=closed
    )


def rejected_meanwhile_count():
    """Per round (a correlated subquery to annotate rounds with): how many ``rejected_while_collecting``, 0 if
    none; an open round counts up to now."""
    rows = rejected_while_collecting(
        OuterRef("adapter"), OuterRef("created_at"), Coalesce(OuterRef("closed_at"), Now())
    )
    return Coalesce(Subquery(rows.order_by().values("adapter").annotate(n=Count("*")).values("n")), 0)
