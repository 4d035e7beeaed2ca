from pathlib import Path

from django.contrib import admin
from django.http import HttpResponse
from django.urls import include, path
from django.views.decorators.http import require_safe
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

import frontend
from core import health
from core.api.errors import json_not_found, json_server_error
from fleet import metrics, protocol_views

# The dashboard's icon as browsers ask for it by default (/favicon.ico: the API docs, a JSON page, a tab before any
# page linked it); the dashboard's pages link it and its SVG beside it (frontend/templates/frontend/base.html).
FAVICON = Path(frontend.__file__).resolve().parent / "static" / "frontend" / "favicon.ico"


@require_safe
def favicon(request):
    response = HttpResponse(FAVICON.read_bytes(), content_type="image/x-icon")
    response["Cache-Control"] = "public, max-age=86400"
    return response


urlpatterns = [
    path("favicon.ico", favicon, name="favicon"),
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
