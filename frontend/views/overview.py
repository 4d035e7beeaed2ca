"""The fleet overview: what an operator looks at first."""

from __future__ import annotations

from django.shortcuts import render

from accounts.permissions import role_required
from accounts.roles import Role
from frontend import selectors
from frontend.charts import hourly_bar_chart


@role_required(Role.VIEWER)
def overview(request):
    return render(
        request,
        "frontend/overview.html",
        {
            "counts": selectors.device_counts(),
            "cohort_versions": selectors.versions_in_use(),
            "deltas_chart": _deltas_chart(),
            "shared": selectors.shared_accuracy(),
            "rounds": selectors.rounds_in_progress(),
            "rejected": selectors.rejected_deltas(),
            "activity": selectors.recent_activity(),
            "personalization": selectors.personalization_headlines(),
            "notices": [state for state in selectors.release_states() if state.notices],
        },
    )


def _deltas_chart():
    """Deltas per hour over the span of the last 24 hours that had any (its first to its last busy hour)."""
    buckets = selectors.data_span(selectors.deltas_per_hour())
    if not buckets:
        return hourly_bar_chart("Deltas per hour, last 24 h", buckets)
    first, last = buckets[0]["hour"], buckets[-1]["hour"]
    span = f"{first:%H}:00" if first == last else f"{first:%H}:00 to {last:%H}:59"
    return hourly_bar_chart(f"Deltas per hour, {span}", buckets)
