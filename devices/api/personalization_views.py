"""A device's personalization history over the API: its own model against the shared one, newest first."""

from __future__ import annotations

from rest_framework.generics import ListAPIView

from accounts.roles import Role
from core.api.errors import ApiError
from devices.api.serializers import PersonalizationReportSerializer
from devices.models import Device
from devices.selectors import device_history


class DevicePersonalizationView(ListAPIView):
    """The personal and shared accuracy a device measured on its held-out local data, newest first (at most
    ``PERSONALIZATION_HISTORY`` reports a device; a heartbeat repeating a measurement stores nothing)."""

    read_role = Role.VIEWER
    serializer_class = PersonalizationReportSerializer
    filter_backends: list = []

    def get_queryset(self):
        if not Device.objects.filter(pk=self.kwargs["pk"]).exists():
            raise ApiError("not_found", "No such device.", status_code=404)
        return device_history(self.kwargs["pk"])
