"""The schema class: what drf-spectacular leaves out of an operation. Every operation documents the errors it can
answer with, not only its successes, and a required string says it cannot be only whitespace.
"""

from __future__ import annotations

from django.core.validators import RegexValidator
from drf_spectacular import openapi
from rest_framework import serializers
from rest_framework.permissions import AllowAny

from core.api.errors import ErrorBodySerializer

# DRF strips a string (str.strip) before it checks that a required one is not blank, so a value made only of
# whitespace is refused: it needs one character that str.strip() would keep. These are the ones it removes.
NOT_ONLY_WHITESPACE = r"[^\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"


class AutoSchema(openapi.AutoSchema):
    """Adds the error responses that come from how a view is set up, all with the one error body: 400 where
    the request carries a body or parameters, 401 and 403 where the caller must authenticate, 404 where the
    path names an object or a list is paged, 429 where a throttle applies.

    Errors particular to one operation (a 409 from a state change, a 413 for an upload) are declared on its
    view with ``extend_schema(responses=...)``, using ``ErrorBodySerializer``.
    """

    def get_operation(self, path, path_regex, path_prefix, method, registry):
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        body = {"application/json": {"schema": self.resolve_serializer(ErrorBodySerializer, "response").ref}}
        responses = operation["responses"]
        for code, description in self._error_statuses(operation):
            responses.setdefault(code, {"content": body, "description": description})
        operation["responses"] = dict(sorted(responses.items()))
        return operation

    def _map_serializer_field(self, field, direction, bypass_extensions=False):
        schema = super()._map_serializer_field(field, direction, bypass_extensions)
        if (
            direction == "request"
            and isinstance(field, serializers.CharField)
            and field.trim_whitespace
            and not field.allow_blank
            and schema.get("type") == "string"
            and "pattern" not in schema
            and not any(isinstance(validator, RegexValidator) for validator in field.validators)  # has its own
        ):
            schema["pattern"] = NOT_ONLY_WHITESPACE
        return schema

    def _error_statuses(self, operation: dict) -> list[tuple[str, str]]:
        parameters = operation.get("parameters", [])
        statuses = []
        if "requestBody" in operation or any(p["in"] in ("query", "header") for p in parameters):
            statuses.append(("400", "Invalid parameters or body"))
        if not all(isinstance(permission, AllowAny) for permission in self.view.get_permissions()):
            statuses.append(("401", "Not authenticated"))
            statuses.append(("403", "Not allowed for this caller"))
        if any(p["in"] == "path" for p in parameters) or (self._is_list_view() and self._get_paginator()):
            statuses.append(("404", "No such object or page"))
        if self.view.get_throttles():
            statuses.append(("429", "Rate limited"))
        return statuses
