"""Prometheus metrics at /metrics: HTTP traffic of this process plus fleet gauges read at scrape time.

With several server processes, set ``PROMETHEUS_MULTIPROC_DIR`` (the launcher and the compose stack do) so
one scrape sums every process.
"""

from __future__ import annotations

import hmac
import json
import os
import time

from django.conf import settings
from django.http import HttpResponse
from django.views.decorators.cache import never_cache
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client.core import GaugeMetricFamily

from accounts.models import ApiToken, User
from core.api.errors import error_body

HTTP_REQUESTS = Counter("fleet_http_requests_total", "HTTP requests answered", ["method", "status_class"])
HTTP_LATENCY = Histogram(
    "fleet_http_request_seconds",
    "Time to answer an HTTP request",
    ["method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


class RequestMetricsMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        HTTP_LATENCY.labels(request.method).observe(time.perf_counter() - started)
        HTTP_REQUESTS.labels(request.method, f"{response.status_code // 100}xx").inc()
        return response


class FleetCollector:
    """Gauges computed from the database when Prometheus scrapes (cheap aggregate queries)."""

    def collect(self):
        users = GaugeMetricFamily("fleet_operator_accounts", "Active operator accounts by role", labels=["role"])
        for role, count in User.objects.active_counts_by_role().items():
            users.add_metric([role], count)
        yield users
        yield GaugeMetricFamily("fleet_api_tokens_active", "Usable API tokens", value=ApiToken.objects.usable().count())


def _registry() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = CollectorRegistry()
        for collector in list(DEFAULT_REGISTRY._collector_to_names):
            registry.register(collector)
    registry.register(FleetCollector())
    return registry


def _authorized(request) -> bool:
    if request.user.is_authenticated and request.user.is_active:
        return True
    token = settings.METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    return bool(token) and header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip(), token)


@never_cache
def metrics(request):
    if not _authorized(request):
        return HttpResponse(
            json.dumps(error_body("not_authenticated", "Send the METRICS_TOKEN as a Bearer token, or sign in.")),
            status=401,
            content_type="application/json",
            headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
        )
    return HttpResponse(generate_latest(_registry()), content_type=CONTENT_TYPE_LATEST)
