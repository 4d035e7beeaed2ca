"""Request bodies are held to the JSON types the schema documents.

DRF coerces whatever it can: ``5`` becomes ``"5"`` for a string field, ``"5"`` becomes ``5`` for an integer,
``0`` becomes ``False`` and ``false`` becomes the nil UUID. ``StrictTypesMixin`` refuses those before the fields
run, so a client that sends the wrong type learns it from a 400 instead of having its value reinterpreted.
Form and multipart bodies are left alone: every value there is a string.
"""

from __future__ import annotations

from collections.abc import Mapping

from django.db import models
from drf_spectacular.utils import extend_schema_field
from rest_framework import relations, serializers
from rest_framework.utils import html

from core.visible_text import control_character

_STRING_FIELDS = (
    serializers.CharField,
    serializers.ChoiceField,
    serializers.UUIDField,
    serializers.DateTimeField,
    serializers.DateField,
    relations.SlugRelatedField,
)


def _expected_type(field: serializers.Field) -> tuple[tuple[type, ...], str] | None:
    """The JSON types ``field`` accepts and how to name them, or None where the field checks on its own."""
    if isinstance(field, serializers.MultipleChoiceField | serializers.ListField | relations.ManyRelatedField):
        return (list,), "a list"
    if isinstance(field, serializers.BooleanField):
        return (bool,), "a boolean"
    if isinstance(field, serializers.IntegerField):
        return (int,), "an integer"
    if isinstance(field, serializers.FloatField | serializers.DecimalField):
        return (int, float), "a number"
    if isinstance(field, _STRING_FIELDS):
        return (str,), "a string"
    if isinstance(field, relations.PrimaryKeyRelatedField):
        pk = field.get_queryset().model._meta.pk
        return ((int,), "an integer") if isinstance(pk, models.IntegerField) else ((str,), "a string")
    if isinstance(field, serializers.DictField):
        return (dict,), "an object"
    return None  # JSON fields, nested serializers


def _type_error(field: serializers.Field, value) -> str | None:
    expected = _expected_type(field)
    if value is None or expected is None:
        return None
    types, name = expected
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        return f"Expected {name}."
    child = getattr(field, "child", None) or getattr(field, "child_relation", None)
    if child is not None:
        items = value.values() if isinstance(value, dict) else value
        return next((error for item in items if (error := _type_error(child, item))), None)
    return None


# For serializers that read request bodies: a value of the wrong JSON type is a validation error. (A comment,
# not a docstring: drf-spectacular would show a docstring as the description of every serializer using it.)
class StrictTypesMixin:
    def to_internal_value(self, data):
        type_errors = {}
        if isinstance(data, Mapping) and not html.is_html_input(data):
            for field in self._writable_fields:
                if field.field_name in data and (error := _type_error(field, data[field.field_name])):
                    type_errors[field.field_name] = [error]
        try:
            value = super().to_internal_value(data)
        except serializers.ValidationError as exc:
            if not type_errors:
                raise
            # Every field's problem at once, the type error standing in for whatever DRF made of that field.
            raise serializers.ValidationError({**exc.detail, **type_errors}) from None
        if type_errors:
            raise serializers.ValidationError(type_errors)
        return value


@extend_schema_field({"type": "object"})
class JsonObjectField(serializers.JSONField):
    """A JSON object whose keys the reader checks (settings, configurations); documented as an object."""


def refuse_control_characters(value, *, what: str) -> None:
    """Refuse text that operators read when it holds a character screens and logs act on (``core.visible_text``):
    a string, or the keys and strings of an object or list, however nested. ``what`` names it in the message
    (``name``, ``label``)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            refuse_control_characters(str(key), what=f"{what} name {str(key)!r}")
            refuse_control_characters(item, what=f"{what} {str(key)!r}")
    elif isinstance(value, list):
        for item in value:
            refuse_control_characters(item, what=what)
    elif isinstance(value, str) and (where := control_character(value)):
        raise serializers.ValidationError(f"{what} holds {where}: control characters are not accepted here.")


class VisibleCharField(serializers.CharField):
    """A CharField for text operators read: it refuses control characters in the text as sent, before DRF trims
    whitespace (a trailing newline would otherwise be dropped without a word) or refuses NUL on its own."""

    def to_internal_value(self, data):
        refuse_control_characters(data, what=self.field_name or "This value")
        return super().to_internal_value(data)
