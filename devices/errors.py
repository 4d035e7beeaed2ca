"""Errors the fleet services raise; each has a stable code the API and the agent socket report.

Domain errors (``core.errors``): each family comes in the kinds it needs, the kind first, so the API maps it
to its status and callers may catch the whole family.
"""

from core.errors import Conflict, DomainError, Forbidden, Invalid, Unauthenticated


class EnrollmentRefused(DomainError):
    """The enrollment token or the device's key was not accepted."""


class EnrollmentInvalid(Invalid, EnrollmentRefused):
    """The request itself is wrong (a malformed public key)."""


class EnrollmentTokenRefused(Unauthenticated, EnrollmentRefused):
    """The token is unknown, revoked, expired or used up."""


class EnrollmentConflict(Conflict, EnrollmentRefused):
    """A device with this key is enrolled already."""


class InvalidTransition(Conflict):
    def __init__(self, message: str):
        super().__init__("invalid_transition", message)


class DeviceAuthFailed(DomainError):
    """A device could not prove who it is, or is not allowed to sync."""


class DeviceAuthMalformed(Invalid, DeviceAuthFailed):
    """The proof is malformed (not a UUID, no nonce)."""


class DeviceNotAuthenticated(Unauthenticated, DeviceAuthFailed):
    """Unknown device, bad signature, a nonce or token that is not valid."""


class DeviceProtocolRefused(Forbidden, DeviceAuthFailed):
    """The device speaks a protocol version the server no longer accepts (or never knew)."""


class DeviceNotAllowed(Forbidden, DeviceAuthFailed):
    """The device proved who it is but its status does not allow syncing (pending, suspended, revoked)."""
