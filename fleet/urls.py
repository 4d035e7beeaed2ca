from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from core import health
from core.api.errors import json_not_found, json_server_error
from fleet import metrics, protocol_views

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("metrics", metrics.metrics, name="metrics"),
    path("api/v1/", include("fleet.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(permission_classes=[]), name="api-schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema", permission_classes=[]), name="api-docs"),
    path("api/protocol/asyncapi.json", protocol_views.asyncapi_json, name="protocol-asyncapi"),
    path("api/docs/protocol/", protocol_views.protocol_page, name="protocol-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="api-schema", permission_classes=[]), name="api-redoc"),
    path("admin/", admin.site.urls),
    path("", include("frontend.urls")),
]

handler404 = "fleet.urls.not_found"
handler500 = "fleet.urls.server_error"


def not_found(request, exception=None):
    from django.views.defaults import page_not_found

    if request.path.startswith("/api/"):
        return json_not_found(request, exception)
    return page_not_found(request, exception)


def server_error(request):
    from django.views.defaults import server_error as html_server_error

    if request.path.startswith("/api/"):
        return json_server_error(request)
    return html_server_error(request)
