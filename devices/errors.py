"""Errors the fleet services raise; each has a stable code the API and the agent socket report."""

from core.api.errors import ApiError


class EnrollmentRefused(ApiError):
    """The enrollment token or the device's key was not accepted."""


class InvalidTransition(ApiError):
    def __init__(self, message: str):
        super().__init__("invalid_transition", message, status_code=409)


class DeviceAuthFailed(ApiError):
    """A device could not prove who it is, or is not allowed to sync."""
