"""The versioned API: every app mounts its routes under /api/v1/."""

from django.urls import include, path

urlpatterns = [
    path("", include("accounts.api.urls")),
    path("", include("devices.api.urls")),
    path("", include("training.api.urls")),
    path("", include("fleet.api.system")),
]
