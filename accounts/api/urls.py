from django.urls import path
from rest_framework.routers import SimpleRouter

from accounts.api.views import ApiTokenViewSet, MeView, UserViewSet

router = SimpleRouter()
router.register("users", UserViewSet, basename="user")
router.register("api-tokens", ApiTokenViewSet, basename="api-token")

urlpatterns = [path("me/", MeView.as_view(), name="me"), *router.urls]
