"""The device list's filters: one FilterSet for the API (``GET /api/v1/devices/``) and the dashboard's device page.

The API reads it through ``DeviceViewSet.filterset_class``; the page binds it with ``from_form=True`` (its form
sends "" for "any" and ``online=yes|no``, which the API refuses), renders its ``.form`` and lists its ``.qs``. Two
names grew up apart and both stay: the API's ``search`` is the page's ``q``. The API's ``status`` may be given
several times; the page's select gives one.
"""

from __future__ import annotations

import operator
import uuid
from functools import reduce

import django_filters
from django import forms
from django.db.models import Q, QuerySet
from drf_spectacular.utils import extend_schema_field
from rest_framework.filters import search_smart_split

from core.api.filters import AnyOrManySelect, FieldOrderingFilter, FilterSet, StrictBooleanFilter, YesNoSelect
from devices.models import Device, DeviceStatus

SEARCH_FIELDS = ("name", "agent_version")
ORDERING_FIELDS = ("name", "enrolled_at", "last_seen_at", "status")
VERSION_PATTERN = r"^(none|\d{1,12})$"


def device_search(queryset: QuerySet, term: str) -> QuerySet:
    """A pasted device id finds exactly that device; otherwise every word (quotes keep a phrase together) must
    appear in the name or the agent version, as DRF's SearchFilter matches."""
    term = term.strip()
    if not term:
        return queryset
    try:
        return queryset.filter(pk=uuid.UUID(term))
    except ValueError:
        pass
    words = search_smart_split(term)
    if not words:
        return queryset
    matches = (reduce(operator.or_, (Q(**{f"{field}__icontains": word}) for field in SEARCH_FIELDS)) for word in words)
    return queryset.filter(reduce(operator.and_, matches))


class RunningVersionFilter(django_filters.Filter):
    """An adapter version id, or ``none``. Not a CharFilter: on the API a blank ``?version=`` is a mistake."""

    field_class = forms.RegexField


class DeviceFilterSet(FilterSet):
    search = django_filters.CharFilter(
        method="filter_search", help_text="A search term: a device id, or words in the name or agent version."
    )
    q = django_filters.CharFilter(method="filter_search", label="Search", help_text="The same as `search`.")
    cohort = django_filters.CharFilter(field_name="cohort__name")
    status = django_filters.MultipleChoiceFilter(
        choices=DeviceStatus.choices, distinct=False, widget=AnyOrManySelect(any_label="any status")
    )
    online = StrictBooleanFilter(widget=YesNoSelect(any_label="online or not", yes_label="online", no_label="offline"))
    agent_version = django_filters.CharFilter()
    version = extend_schema_field(
        {
            "type": "string",
            "pattern": VERSION_PATTERN,
            "description": "The adapter version the device runs: a version id, or `none` for no version yet.",
        }
    )(
        RunningVersionFilter(
            method="filter_version", regex=VERSION_PATTERN, error_messages={"invalid": "Give a version id, or none."}
        )
    )
    label = django_filters.CharFilter(method="filter_label", help_text="`key` (has the label) or `key=value`")
    ordering = FieldOrderingFilter(ordering_fields=ORDERING_FIELDS)

    class Meta:
        model = Device
        fields: list[str] = []  # every filter is declared above

    def filter_search(self, queryset, name, value):
        return device_search(queryset, value)

    def filter_version(self, queryset, name, value):
        if value == "none":
            return queryset.filter(running_version__isnull=True)
        return queryset.filter(running_version_id=int(value))

    def filter_label(self, queryset, name, value):
        label, sep, wanted = value.partition("=")
        if sep:
            return queryset.filter(labels__contains={label: wanted})
        return queryset.filter(labels__has_key=label)
