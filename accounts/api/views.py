from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import generics, mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from accounts.api.serializers import (
    ApiTokenCreateSerializer,
    ApiTokenIssuedSerializer,
    ApiTokenSerializer,
    MeSerializer,
    UserCreateSerializer,
    UserSerializer,
)
from accounts.models import ApiToken, User
from accounts.roles import Role, has_role
from accounts.services import api_token_create, api_token_revoke, user_create, user_update


class MeView(generics.RetrieveAPIView):
    """The signed-in user (or the owner of the API token) and their role."""

    serializer_class = MeSerializer

    def get_object(self):
        return self.request.user


class UserViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Operator accounts. Admins only: reading the account list is itself an admin matter."""

    read_role = Role.ADMIN
    write_role = Role.ADMIN
    queryset = User.objects.order_by("username")
    serializer_class = UserSerializer
    filterset_fields = ["role", "is_active"]
    search_fields = ["username", "email"]
    ordering_fields = ["username", "date_joined", "last_login"]

    @extend_schema(request=UserCreateSerializer, responses={201: UserSerializer})
    def create(self, request):
        data = UserCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        user = user_create(**data.validated_data)
        return Response(UserSerializer(user).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=UserSerializer, responses=UserSerializer)
    def partial_update(self, request, pk=None):
        user = self.get_object()
        data = UserSerializer(user, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        if user == request.user and (
            data.validated_data.get("is_active") is False or data.validated_data.get("role", Role.ADMIN) != Role.ADMIN
        ):
            raise PermissionDenied("Admins cannot demote or deactivate themselves; ask another admin.")
        user = user_update(user=user, **data.validated_data)
        return Response(UserSerializer(user).data)


class ApiTokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """API tokens for integrations. Everyone manages their own (a token carries its owner's role, so this
    grants nothing new); admins see and revoke all, and may issue tokens for others."""

    read_role = Role.VIEWER
    write_role = Role.VIEWER
    serializer_class = ApiTokenSerializer
    filterset_fields = ["user__username"]
    search_fields = ["name", "prefix"]

    def get_queryset(self) -> QuerySet[ApiToken]:
        tokens = ApiToken.objects.select_related("user")
        if getattr(self, "swagger_fake_view", False):  # schema generation has no signed-in user
            return tokens.none()
        if has_role(self.request.user, Role.ADMIN):
            return tokens
        return tokens.filter(user=self.request.user)

    @extend_schema(request=ApiTokenCreateSerializer, responses={201: ApiTokenIssuedSerializer})
    def create(self, request):
        data = ApiTokenCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        owner = data.validated_data.get("user") or request.user
        if owner != request.user and not has_role(request.user, Role.ADMIN):
            raise PermissionDenied("Only admins may issue tokens for another user.")
        issued = api_token_create(
            user=owner,
            name=data.validated_data["name"],
            created_by=request.user,
            expires_at=data.validated_data.get("expires_at"),
        )
        body = ApiTokenSerializer(issued.token).data | {"token": issued.raw}
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=ApiTokenSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        token = api_token_revoke(token=self.get_object())
        return Response(ApiTokenSerializer(token).data)
