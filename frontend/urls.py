from django.urls import path

from frontend import views

app_name = "frontend"

urlpatterns = [
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.logout_view, name="logout"),
    path("", views.overview, name="overview"),
    path("devices/", views.devices, name="devices"),
    path("devices/bulk/", views.device_bulk, name="device-bulk"),
    path("devices/<uuid:pk>/", views.device_detail, name="device-detail"),
    path("devices/<uuid:pk>/action/", views.device_action, name="device-action"),
    path("cohorts/", views.cohorts, name="cohorts"),
    path("enrollment-tokens/", views.enrollment_tokens, name="enrollment-tokens"),
    path("enrollment-tokens/<int:pk>/revoke/", views.enrollment_token_revoke_view, name="enrollment-token-revoke"),
    path("models/", views.models, name="models"),
    path("adapters/", views.adapters, name="adapters"),
    path("adapters/<int:pk>/", views.adapter_detail, name="adapter-detail"),
    path("adapters/<int:pk>/cohorts/", views.adapter_cohorts, name="adapter-cohorts"),
    path("adapters/<int:pk>/release/", views.adapter_release_settings, name="adapter-release-settings"),
    path("rounds/", views.rounds, name="rounds"),
    path("rounds/<int:pk>/", views.round_detail, name="round-detail"),
    path("rounds/<int:pk>/<slug:action>/", views.round_action, name="round-action"),
    path("rollouts/", views.rollouts, name="rollouts"),
    path("rollouts/new/", views.rollout_create_view, name="rollout-create"),
    path("rollouts/<int:pk>/", views.rollout_detail, name="rollout-detail"),
    path("rollouts/<int:pk>/<slug:action>/", views.rollout_action, name="rollout-action"),
    path("system/", views.system, name="system"),
    path("settings/api-tokens/", views.api_tokens, name="api-tokens"),
    path("settings/api-tokens/<int:pk>/revoke/", views.api_token_revoke_view, name="api-token-revoke"),
    path("settings/users/", views.users, name="users"),
    path("settings/users/<int:pk>/role/", views.user_role, name="user-role"),
]
