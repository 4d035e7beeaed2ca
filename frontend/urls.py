from django.urls import path

from frontend import views

app_name = "frontend"

urlpatterns = [
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.logout_view, name="logout"),
    path("", views.overview, name="overview"),
    path("settings/api-tokens/", views.api_tokens, name="api-tokens"),
    path("settings/api-tokens/<int:pk>/revoke/", views.api_token_revoke_view, name="api-token-revoke"),
    path("settings/users/", views.users, name="users"),
    path("settings/users/<int:pk>/role/", views.user_role, name="user-role"),
]
