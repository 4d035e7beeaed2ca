"""Query filters that refuse a value they cannot read, instead of quietly not filtering.

django-filter reads a boolean it does not recognise (``?online=yes``) or an empty choice (``?state=``) as "no
filter" and returns every row; here both are a 400 like any other invalid filter value.
"""

from __future__ import annotations

import django_filters
from django import forms
from django.db import models
from django_filters.rest_framework import DjangoFilterBackend
from django_filters.rest_framework import FilterSet as RestFilterSet


class StrictBooleanField(forms.NullBooleanField):
    widget = forms.TextInput

    def to_python(self, value):
        if value in (None, ""):
            return None
        spelled = {"true": True, "1": True, "false": False, "0": False}.get(str(value).lower())
        if spelled is None:
            raise forms.ValidationError("Enter true or false.", code="invalid")
        return spelled


class StrictBooleanFilter(django_filters.BooleanFilter):
    field_class = StrictBooleanField


class FilterSet(RestFilterSet):
    FILTER_DEFAULTS = {
        **RestFilterSet.FILTER_DEFAULTS,
        models.BooleanField: {"filter_class": StrictBooleanFilter},
    }

    def is_valid(self) -> bool:
        valid = super().is_valid()
        # A form sends "" for "any"; in an API query, an empty choice, id or boolean is a mistake.
        for name, query_filter in self.filters.items():
            if self.data.get(name) == "" and not isinstance(query_filter, django_filters.CharFilter):
                self.form.add_error(name, "Give a value, or leave the parameter out.")
                valid = False
        return valid


class FilterBackend(DjangoFilterBackend):
    """DjangoFilterBackend building the views' ``filterset_fields`` on the strict FilterSet."""

    filterset_base = FilterSet
