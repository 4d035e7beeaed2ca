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
            "deltas_chart": hourly_bar_chart("Deltas per hour, last 24 h", selectors.deltas_per_hour()),
            "rounds": selectors.rounds_in_progress(),
            "rejected": selectors.rejected_deltas(),
            "activity": selectors.recent_activity(),
            "personalization": selectors.personalization_headlines(),
            "notices": [state for state in selectors.release_states() if state.notices],
        },
    )
