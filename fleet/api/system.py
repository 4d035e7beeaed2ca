"""System endpoints: the health summary (any role) and a worker diagnostic round trip (operators)."""

from __future__ import annotations

import time

from celery.exceptions import TimeoutError as CeleryTimeout
from django.urls import path
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.roles import Role
from core.api.errors import ErrorBodySerializer, error_body
from core.health import readiness
from fleet.tasks import system_diagnostic


class SystemStatusView(APIView):
    """Readiness of every dependency, as /readyz reports it, for signed-in users and integrations."""

    write_role = Role.ADMIN

    @extend_schema(
        responses=inline_serializer(
            "SystemStatus",
            {"ok": serializers.BooleanField(), "checks": serializers.DictField(child=serializers.DictField())},
        )
    )
    def get(self, request):
        report = readiness()
        return Response(report, status=status.HTTP_200_OK)


class WorkerDiagnosticView(APIView):
    """Send a diagnostic task through the queue and wait for a worker to run it."""

    write_role = Role.OPERATOR

    @extend_schema(
        request=None,
        responses={
            200: inline_serializer(
                "WorkerDiagnostic",
                {
                    "worker": serializers.CharField(),
                    "queue_delay_ms": serializers.FloatField(),
                    "round_trip_ms": serializers.FloatField(),
                    "database": serializers.CharField(),
                    "redis": serializers.CharField(),
                },
            ),
            504: ErrorBodySerializer,
        },
    )
    def post(self, request):
        started = time.time()
        result = system_diagnostic.apply_async(kwargs={"sent_at": started}, expires=15)
        try:
            report = result.get(timeout=15)
        except CeleryTimeout:
            result.forget()
            return Response(
                error_body("worker_timeout", "No worker ran the diagnostic task within 15 seconds."),
                status=status.HTTP_504_GATEWAY_TIMEOUT,
            )
        report["round_trip_ms"] = round((time.time() - started) * 1000, 1)
        return Response(report)


urlpatterns = [
    path("system/status/", SystemStatusView.as_view(), name="system-status"),
    path("system/diagnostic/", WorkerDiagnosticView.as_view(), name="system-diagnostic"),
]
