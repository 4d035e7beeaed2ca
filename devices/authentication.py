"""``Authorization: Device <token>``: a device acting as itself over REST (see devices.identity)."""

from __future__ import annotations

from dataclasses import dataclass

from rest_framework import authentication, exceptions
from rest_framework.permissions import BasePermission

from core.errors import Forbidden
from devices.errors import DeviceAuthFailed
from devices.identity import rest_token_device
from devices.models import Device


@dataclass(frozen=True)
class DevicePrincipal:
    """What ``request.user`` is for a device: authenticated, but never an operator of any role."""

    device: Device
    is_device: bool = True
    is_authenticated: bool = True
    is_active: bool = True
    is_superuser: bool = False
    is_staff: bool = False

    @property
    def pk(self):
        return self.device.pk


class DeviceTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Device"

    def authenticate(self, request):
        scheme, _, token = authentication.get_authorization_header(request).decode("latin-1").partition(" ")
        if scheme != self.keyword:
            return None
        try:
            device = rest_token_device(token.strip())
        except DeviceAuthFailed as exc:
            # The spec's code travels (device_quarantined, device_retired, token_expired, auth_failed:
            # docs/protocol/reference.md), not DRF's generic permission_denied / authentication_failed.
            if isinstance(exc, Forbidden):
                raise exceptions.PermissionDenied(exc.message, code=exc.code) from None
            raise exceptions.AuthenticationFailed(exc.message, code=exc.code) from None
        return DevicePrincipal(device=device), device

    def authenticate_header(self, request) -> str:
        return f'{self.keyword} realm="devices"'


class IsDevice(BasePermission):
    def has_permission(self, request, view) -> bool:
        return bool(getattr(request.user, "is_device", False))
