from django.urls import path
from rest_framework.routers import SimpleRouter

from devices.api import views
from devices.api.personalization_views import DevicePersonalizationView

router = SimpleRouter()
router.register("cohorts", views.CohortViewSet, basename="cohort")
router.register("enrollment-tokens", views.EnrollmentTokenViewSet, basename="enrollment-token")
router.register("devices", views.DeviceViewSet, basename="device")

urlpatterns = [
    path("enroll/", views.EnrollView.as_view(), name="enroll"),
    path("device-auth/challenge/", views.DeviceChallengeView.as_view(), name="device-challenge"),
    path("device-auth/token/", views.DeviceTokenView.as_view(), name="device-token"),
    path("device/", views.DeviceSelfView.as_view(), name="device-self"),
    path("device/heartbeat/", views.DeviceHeartbeatView.as_view(), name="device-heartbeat"),
    path("devices/<uuid:pk>/personalization/", DevicePersonalizationView.as_view(), name="device-personalization"),
    *router.urls,
]
