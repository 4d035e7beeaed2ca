from django.urls import path
from rest_framework.routers import SimpleRouter

from training.api import views
from training.api.cohort_views import AdapterCohortsView
from training.api.delta_views import AdapterAggregationView, DeltaViewSet, DeviceDeltaView, RoundViewSet
from training.api.device_views import DeviceBlobView
from training.api.personalization_views import AdapterPersonalizationView
from training.api.rollout_views import DeviceAssignmentReportView, DeviceAssignmentView, RolloutViewSet

router = SimpleRouter()
router.register("base-models", views.BaseModelViewSet, basename="base-model")
router.register("adapters", views.AdapterViewSet, basename="adapter")
router.register("adapter-versions", views.AdapterVersionViewSet, basename="adapter-version")
router.register("rollouts", RolloutViewSet, basename="rollout")
router.register("rounds", RoundViewSet, basename="round")
router.register("deltas", DeltaViewSet, basename="delta")

urlpatterns = [
    path("device/blobs/<str:sha256>/", DeviceBlobView.as_view(), name="device-blob"),
    path("device/deltas/<str:sha256>/", DeviceDeltaView.as_view(), name="device-delta"),
    path("adapters/<int:pk>/aggregation/", AdapterAggregationView.as_view(), name="adapter-aggregation"),
    path("adapters/<int:pk>/personalization/", AdapterPersonalizationView.as_view(), name="adapter-personalization"),
    path("adapters/<int:pk>/cohorts/", AdapterCohortsView.as_view(), name="adapter-cohorts"),
    path("device/assignment/", DeviceAssignmentView.as_view(), name="device-assignment"),
    path(
        "device/assignments/<int:assignment_id>/report/",
        DeviceAssignmentReportView.as_view(),
        name="device-assignment-report",
    ),
    *router.urls,
]
