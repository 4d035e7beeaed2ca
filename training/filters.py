"""The round and rollout lists' filters: one FilterSet each for the API (``GET /api/v1/rounds/``,
``GET /api/v1/rollouts/``) and the dashboard's rounds and rollouts pages.

The API reads them through the views' ``filterset_class``; a page binds one with ``from_form=True`` (its form
sends "" for "any") and lists its ``.qs``. The rounds page names the adapter ``adapter``, the API ``adapter__name``:
both are kept.
"""

from __future__ import annotations

import django_filters

from core.api.filters import FilterSet
from training.models import Rollout, Round


class RoundFilterSet(FilterSet):
    adapter = django_filters.CharFilter(field_name="adapter__name", help_text="The same as `adapter__name`.")

    class Meta:
        model = Round
        fields = ["state", "adapter__name", "strategy"]


class RolloutFilterSet(FilterSet):
    class Meta:
        model = Rollout
        fields = ["state", "cohort__name", "version__adapter__name"]
