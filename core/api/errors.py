"""One error body for every API failure: ``{"error": {"code", "message", "details"}}``.

``code`` is stable and machine-readable, ``message`` is for people, ``details`` carries field errors or
context. Clients never have to guess between DRF's several default shapes.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404, JsonResponse
from rest_framework import exceptions, serializers, status
from rest_framework.response import Response
from rest_framework.settings import api_settings

from core.errors import Conflict, DomainError, Forbidden, Invalid, NotFound, TooLarge, TooMany, Unauthenticated

logger = logging.getLogger("core.api")

# Each kind of domain refusal and its HTTP status: the one place where services' errors meet HTTP.
DOMAIN_STATUS: dict[type[DomainError], int] = {
    Invalid: status.HTTP_400_BAD_REQUEST,
    Unauthenticated: status.HTTP_401_UNAUTHORIZED,
    Forbidden: status.HTTP_403_FORBIDDEN,
    NotFound: status.HTTP_404_NOT_FOUND,
    Conflict: status.HTTP_409_CONFLICT,
    TooLarge: status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
    TooMany: status.HTTP_429_TOO_MANY_REQUESTS,
    DomainError: status.HTTP_400_BAD_REQUEST,
}


def domain_status(exc: DomainError) -> int:
    """The HTTP status of a domain refusal: its first kind in method resolution order."""
    return next(DOMAIN_STATUS[klass] for klass in type(exc).__mro__ if klass in DOMAIN_STATUS)


class ApiError(exceptions.APIException):
    """An error raised by an API view about the HTTP request itself (a header, a range), with its own stable
    code and status. Services raise domain errors (``core.errors``) instead."""

    def __init__(self, code: str, message: str, *, status_code: int = 400, details: Any = None):
        super().__init__(detail=message, code=code)
        self.status_code = status_code
        self.error_code = code
        self.message = message
        self.details = details or {}


class ErrorSerializer(serializers.Serializer):
    code = serializers.CharField(help_text="Stable and machine-readable, e.g. `invalid` or `not_found`.")
    message = serializers.CharField()
    details = serializers.DictField(help_text="Field errors or context; empty when there is none.")


class ErrorBodySerializer(serializers.Serializer):
    """The body of every API error (see ``error_body``)."""

    error = ErrorSerializer()


def error_body(code: str, message: str, details: Any = None) -> dict:
    return {"error": {"code": code, "message": message, "details": details or {}}}


_MESSAGES = {
    "not_authenticated": "Authentication required: sign in or send an API token (Authorization: Bearer ...).",
    "authentication_failed": "The credentials were not accepted.",
    "permission_denied": "Your role does not allow this action.",
    "not_found": "No such resource.",
    "method_not_allowed": "This method is not allowed here.",
    "throttled": "Too many requests; slow down.",
}


def exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, DomainError):
        from rest_framework.views import set_rollback  # DRF imports settings late, as below

        set_rollback()  # as DRF does for its own errors: a refusal inside an atomic request keeps nothing
        response = Response(error_body(exc.code, exc.message, exc.details), status=domain_status(exc))
        if isinstance(exc, TooMany) and isinstance(exc.details.get("retry_after"), int):
            response["Retry-After"] = str(exc.details["retry_after"])  # a per-caller limit says when to come back
        if exc.expected:  # a race the protocol allows: not the warning Django logs for every 4xx (django.request)
            response._has_been_logged = True
            request = context.get("request")
            logger.info("%s %s: %s (%s)", getattr(request, "method", "?"), getattr(request, "path", "?"),
                        exc.message, exc.code)  # fmt: skip
        return response
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()

    from rest_framework.views import exception_handler as drf_exception_handler  # DRF imports settings late

    response = drf_exception_handler(exc, context)
    if response is None:
        return None

    if isinstance(exc, ApiError):
        response.data = error_body(exc.error_code, exc.message, exc.details)
        return response
    if isinstance(exc, exceptions.ValidationError):
        # ``details`` is always an object: an error that names no field (a bare list) goes under non_field_errors.
        details = exc.detail if isinstance(exc.detail, dict) else {api_settings.NON_FIELD_ERRORS_KEY: exc.detail}
        response.data = error_body("invalid", "The request has invalid fields.", details)
        return response

    code = exc.get_codes() if isinstance(exc, exceptions.APIException) else "error"
    if not isinstance(code, str):
        code = "error"
    detail = getattr(exc, "detail", "")
    # DRF's stock sentences give way to ours; a specific reason (a CSRF failure, a revoked token) is kept.
    specific = isinstance(detail, str) and detail and str(detail) != str(type(exc).default_detail)
    message = str(detail) if specific else _MESSAGES.get(code, "The request failed.")
    details: dict = {}
    if isinstance(exc, exceptions.Throttled) and exc.wait is not None:
        details["retry_after_seconds"] = int(exc.wait)
    response.data = error_body(code, message, details)
    return response


def json_not_found(request, exception=None) -> JsonResponse:
    return JsonResponse(error_body("not_found", _MESSAGES["not_found"]), status=status.HTTP_404_NOT_FOUND)


class ApiNotFoundMiddleware:
    """Every 404 under ``/api/`` has the error body, whoever made it.

    Django answers a URL that resolves to nothing (``/api/v1/no-such-thing/``) with its own page: the project's
    ``handler404`` only when ``DEBUG`` is off, Django's HTML debug page when it is on (as in development), and an
    ``Http404`` raised outside DRF the same way. This turns any 404 under ``/api/`` that is not already an API
    response into ``json_not_found``. It sits above ``CommonMiddleware``, so a path missing its trailing slash is
    still redirected to the one with it first (``APPEND_SLASH``)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if response.status_code == status.HTTP_404_NOT_FOUND and request.path_info.startswith("/api/"):
            is_api_response = isinstance(response, Response) or response.get("Content-Type", "").startswith(
                "application/json"
            )
            if not is_api_response:
                return json_not_found(request)
        return response


def json_server_error(request) -> JsonResponse:
    return JsonResponse(
        error_body("server_error", "The server failed to handle this request; it has been logged."),
        status=status.HTTP_500_INTERNAL_SERVER_ERROR,
    )
