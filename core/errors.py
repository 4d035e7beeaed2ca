"""Domain errors: what a service raises when it refuses, without HTTP.

Each carries a stable machine-readable ``code`` (the API's ``error.code``, the agent socket's ``code``), a
``message`` for people and optional ``details``. The class says what kind of refusal it is; one exception
handler (``core.api.errors.exception_handler``) maps each kind to an HTTP status, so services and Celery tasks
never speak HTTP. A service refuses before it writes: a caught refusal means nothing changed.

An app's own refusals subclass one of these; one that comes in several kinds lists the kind first, e.g.
``class UploadTooLarge(TooLarge, UploadRefused)``, so the kind decides the status and callers may still catch
the app's family (``except UploadRefused``).
"""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """A refusal: the request does not fit the rules (HTTP 400 unless a subclass says otherwise).

    ``expected``: a refusal that is the normal outcome of a race the protocol allows (a device reporting on an
    assignment a newer one replaced meanwhile), not a caller's mistake: the API answers it as any other, but the
    server does not log it as a warning (``core.api.errors.exception_handler`` logs it at INFO)."""

    def __init__(self, code: str, message: str, *, details: dict[str, Any] | None = None, expected: bool = False):
        super().__init__(message)
        self.code, self.message, self.details = code, message, details or {}
        self.expected = expected


class Invalid(DomainError):
    """The input is malformed or breaks a rule of its own (400)."""


class Unauthenticated(DomainError):
    """The caller could not prove who it is (401)."""


class Forbidden(DomainError):
    """The caller is known but may not do this (403)."""


class NotFound(DomainError):
    """What the request names does not exist, or not for this caller (404)."""


class Conflict(DomainError):
    """The request does not fit the current state: a transition not allowed, a duplicate, a stale step (409)."""


class TooLarge(DomainError):
    """The request is over a size limit (413)."""


class TooMany(DomainError):
    """The caller holds as many of something as it may (unfinished uploads, say) until some end (429)."""
