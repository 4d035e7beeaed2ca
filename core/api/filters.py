"""Query filters that refuse a value they cannot read, instead of quietly not filtering.

django-filter reads a boolean it does not recognise (``?online=yes``) or an empty choice (``?state=``) as "no
filter" and returns every row; here both are a 400 like any other invalid filter value.

One FilterSet per resource serves both the API (a view's ``filterset_class``) and the dashboard's list page, which
binds the same class with ``from_form=True``, renders its ``.form`` and lists its ``.qs``. A form sends "" for
"any" and ``yes``/``no`` for a boolean; the API keeps refusing both. The widgets below render the page's selects.
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


class YesNoSelect(forms.Select):
    """A select of "any" (``""``), ``yes`` and ``no`` for a boolean filter (``FilterSet(from_form=True)`` reads
    them); a value spelled the API's way (``true``, ``0``) shows as the option it means."""

    def __init__(self, attrs=None, *, any_label: str, yes_label: str, no_label: str):
        super().__init__(attrs, choices=[("", any_label), ("yes", yes_label), ("no", no_label)])

    def format_value(self, value):
        text = "" if value is None else str(value).lower()
        return [{"true": "yes", "1": "yes", "false": "no", "0": "no"}.get(text, text)]


class AnyOrManySelect(forms.Select):
    """A single select whose first option is "any" (``""``), for a filter that the API may be given several times
    (``?status=a&status=b``): it reads every value of the parameter, as a multiple select would."""

    def __init__(self, attrs=None, *, any_label: str):
        super().__init__(attrs)
        self.any_label = any_label

    def value_from_datadict(self, data, files, name):
        if hasattr(data, "getlist"):
            return data.getlist(name)
        value = data.get(name)
        return value if value is None or isinstance(value, (list, tuple)) else [value]

    def format_value(self, value):
        return super().format_value(value) or [""]

    def optgroups(self, name, value, attrs=None):
        given = self.choices
        self.choices = [("", self.any_label), *given]
        try:
            return super().optgroups(name, value, attrs)
        finally:
            self.choices = given


class FieldOrderingFilter(django_filters.CharFilter):
    """``?ordering=name,-status`` over ``ordering_fields``, read as DRF's OrderingFilter reads it: an unknown field
    is left out, and when none is known the rows keep their order (so a view may move its ordering into a FilterSet)."""

    def __init__(self, *args, ordering_fields: tuple[str, ...] | list[str], **kwargs):
        kwargs.setdefault("help_text", "Which field to use when ordering the results.")
        super().__init__(*args, **kwargs)
        self.ordering_fields = tuple(ordering_fields)

    def filter(self, qs, value):
        terms = [term.strip() for term in (value or "").split(",")]
        ordering = [term for term in terms if (term[1:] if term.startswith("-") else term) in self.ordering_fields]
        return qs.order_by(*ordering) if ordering else qs


_FORM_BOOLEANS = {"yes": "true", "no": "false"}


def _form_query(data, filters: dict):
    """A form's query in the API's spelling: without its "" values (the form's "any", ``?status=`` included), and
    with a boolean filter's ``yes``/``no`` (``YesNoSelect``) as ``true``/``false``."""

    def spelled(name: str, value: str) -> str:
        if isinstance(filters.get(name), django_filters.BooleanFilter):
            return _FORM_BOOLEANS.get(value.lower(), value)
        return value

    if not hasattr(data, "getlist"):
        return {name: spelled(name, value) for name, value in data.items() if value != ""}
    kept = data.copy()
    for name in list(kept):
        values = [spelled(name, value) for value in kept.getlist(name) if value != ""]
        if values:
            kept.setlist(name, values)
        else:
            del kept[name]
    return kept


class FilterSet(RestFilterSet):
    FILTER_DEFAULTS = {
        **RestFilterSet.FILTER_DEFAULTS,
        models.BooleanField: {"filter_class": StrictBooleanFilter},
    }

    def __init__(self, data=None, queryset=None, *, request=None, prefix=None, from_form: bool = False):
        """``from_form``: ``data`` is a dashboard form's query (see ``_form_query``), not an API request's."""
        if from_form and data is not None:
            data = _form_query(data, self.base_filters)
        super().__init__(data, queryset, request=request, prefix=prefix)
        self.from_form = from_form

    def is_valid(self) -> bool:
        valid = super().is_valid()
        if self.from_form:
            return valid
        # A form sends "" for "any"; in an API query, an empty choice, id or boolean is a mistake.
        for name, query_filter in self.filters.items():
            if self.data.get(name) == "" and not isinstance(query_filter, django_filters.CharFilter):
                self.form.add_error(name, "Give a value, or leave the parameter out.")
                valid = False
        return valid


class FilterBackend(DjangoFilterBackend):
    """DjangoFilterBackend building the views' ``filterset_fields`` on the strict FilterSet."""

    filterset_base = FilterSet
