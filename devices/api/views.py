from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.db.models import Count
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.throttling import SimpleRateThrottle
from rest_framework.views import APIView

from accounts.roles import Role
from core.api.errors import ApiError, ErrorBodySerializer
from core.api.filters import FilterBackend
from devices import presence
from devices.api.serializers import (
    ChallengeRequestSerializer,
    ChallengeResponseSerializer,
    CohortSerializer,
    DeviceActionSerializer,
    DeviceDetailSerializer,
    DeviceHeartbeatSerializer,
    DeviceSerializer,
    EnrollmentTokenIssuedSerializer,
    EnrollmentTokenSerializer,
    EnrollRequestSerializer,
    EnrollResponseSerializer,
    TokenRequestSerializer,
    TokenResponseSerializer,
)
from devices.authentication import DeviceTokenAuthentication, IsDevice
from devices.feedback import feedback_report_record
from devices.filters import DeviceFilterSet
from devices.identity import NONCE_TTL_SECONDS, rest_challenge_create, rest_token_issue
from devices.models import Cohort, EnrollmentToken
from devices.personalization import personal_report_record
from devices.selectors import device_list
from devices.server_key import server_public_key_b64
from devices.services import (
    device_enroll,
    device_transition,
    device_update,
    enrollment_token_create,
    enrollment_token_revoke,
)
from edge_agent.protocol import AGENT_WS_PATH


@extend_schema_view(destroy=extend_schema(responses={204: None, 409: ErrorBodySerializer}))
class CohortViewSet(viewsets.ModelViewSet):
    """Cohorts: named groups of devices. Admins change them; a cohort with devices cannot be deleted."""

    write_role = Role.ADMIN
    serializer_class = CohortSerializer
    queryset = Cohort.objects.annotate(device_count=Count("devices")).order_by("name")
    search_fields = ["name", "description"]
    ordering_fields = ["name", "created_at", "device_count"]
    http_method_names = ["get", "post", "patch", "delete"]

    def perform_destroy(self, cohort):
        if cohort.devices.exists() or cohort.enrollment_tokens.exists():
            raise ApiError("cohort_in_use", "This cohort still has devices or enrollment tokens.", status_code=409)
        cohort.delete()


class EnrollmentTokenViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Enrollment tokens. The secret is returned once, by create; only its hash is stored."""

    write_role = Role.ADMIN
    serializer_class = EnrollmentTokenSerializer
    queryset = EnrollmentToken.objects.select_related("cohort", "created_by")
    filterset_fields = ["cohort__name", "requires_approval"]
    search_fields = ["name", "prefix"]

    @extend_schema(request=EnrollmentTokenSerializer, responses={201: EnrollmentTokenIssuedSerializer})
    def create(self, request):
        data = EnrollmentTokenSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        issued = enrollment_token_create(
            cohort=data.validated_data["cohort"],
            name=data.validated_data["name"],
            expires_at=data.validated_data.get("expires_at"),  # the service's default when left out
            uses=data.validated_data.get("uses_left"),
            requires_approval=data.validated_data.get("requires_approval", True),
            created_by=request.user,
        )
        body = EnrollmentTokenSerializer(issued.token).data | {"token": issued.raw}
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=EnrollmentTokenSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        return Response(EnrollmentTokenSerializer(enrollment_token_revoke(token=self.get_object())).data)


# A transition the device's status does not allow (approving an active device) is a 409.
_TRANSITION_RESPONSES = {200: DeviceDetailSerializer, 409: ErrorBodySerializer}


class DeviceViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """The fleet. Admins approve, reject, retire and edit devices; operators may also quarantine and
    reactivate them (an incident response). Every change is recorded as a device event with its author."""

    write_role = Role.ADMIN
    queryset = device_list()
    # Search and ordering are the filterset's too (the dashboard's device page uses the same one).
    filter_backends = [FilterBackend]
    filterset_class = DeviceFilterSet

    def get_serializer_class(self):
        return DeviceDetailSerializer if self.action == "retrieve" else DeviceSerializer

    @extend_schema(request=DeviceSerializer, responses=DeviceDetailSerializer)
    def partial_update(self, request, pk=None):
        device = self.get_object()
        data = DeviceSerializer(device, data=request.data, partial=True)
        data.is_valid(raise_exception=True)
        device = device_update(device=device, actor=request.user, **data.validated_data)
        return Response(DeviceDetailSerializer(device).data)

    def _transition(self, request, action_name: str):
        data = DeviceActionSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        device = device_transition(
            device=self.get_object(),
            action=action_name,
            actor=request.user,
            reason=data.validated_data.get("reason", ""),
        )
        return Response(DeviceDetailSerializer(device).data)

    @extend_schema(request=DeviceActionSerializer, responses=_TRANSITION_RESPONSES)
    @action(detail=True, methods=["post"])
    def approve(self, request, pk=None):
        return self._transition(request, "approve")

    @extend_schema(request=DeviceActionSerializer, responses=_TRANSITION_RESPONSES)
    @action(detail=True, methods=["post"])
    def reject(self, request, pk=None):
        return self._transition(request, "reject")

    @extend_schema(request=DeviceActionSerializer, responses=_TRANSITION_RESPONSES)
    @action(detail=True, methods=["post"], write_role=Role.OPERATOR)
    def quarantine(self, request, pk=None):
        return self._transition(request, "quarantine")

    @extend_schema(request=DeviceActionSerializer, responses=_TRANSITION_RESPONSES)
    @action(detail=True, methods=["post"], write_role=Role.OPERATOR)
    def reactivate(self, request, pk=None):
        return self._transition(request, "reactivate")

    @extend_schema(request=DeviceActionSerializer, responses=_TRANSITION_RESPONSES)
    @action(detail=True, methods=["post"])
    def retire(self, request, pk=None):
        return self._transition(request, "retire")


class EnrollmentThrottle(SimpleRateThrottle):
    """Per client address, at ENROLLMENT_RATE (read per request, so it can be changed without a restart)."""

    scope = "enroll"

    def get_rate(self) -> str:
        return settings.ENROLLMENT_RATE

    def get_cache_key(self, request, view) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}

    def wait(self) -> float:
        """Seconds until the oldest request in the window leaves it. DRF's own answer is None when more requests
        are on record than the rate now allows (it was lowered meanwhile), and a 429 without Retry-After leaves
        the client guessing."""
        waited = super().wait()
        if waited is not None:
            return waited
        return max(1.0, self.duration - (self.now - self.history[-1])) if self.history else float(self.duration)


class DeviceAuthThrottle(EnrollmentThrottle):
    """The device sign-in (challenge, token), per client address at DEVICE_AUTH_RATE. A bucket of its own: a
    fleet behind one address signing in for its reports must not use up the enrollments of new devices (the
    demo's 12 did, and the first device a user enrolled beside them was refused)."""

    scope = "device_auth"

    def get_rate(self) -> str:
        return settings.DEVICE_AUTH_RATE


class _PublicDeviceEndpoint(APIView):
    """Called by devices before they hold a token: no operator auth, rate limited per client address."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    throttle_classes = [DeviceAuthThrottle]


class EnrollView(_PublicDeviceEndpoint):
    """A device joins the fleet with an enrollment token and its Ed25519 public key."""

    throttle_classes = [EnrollmentThrottle]

    @extend_schema(
        request=EnrollRequestSerializer,
        responses={201: EnrollResponseSerializer, 401: ErrorBodySerializer, 409: ErrorBodySerializer},
    )
    def post(self, request):
        data = EnrollRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        # The key the device will pin, read (or created) before anything is written: a server that cannot sign
        # must not leave behind a device that never received its enrollment.
        server_public_key = server_public_key_b64()
        with transaction.atomic():  # the device exists only if its whole answer could be made
            device = device_enroll(**data.validated_data)
            body = EnrollResponseSerializer(
                {
                    "device_id": device.pk,
                    "status": device.status,
                    "cohort": device.cohort.name,
                    "server_public_key": server_public_key,
                    "websocket_path": AGENT_WS_PATH,
                    "heartbeat_interval": settings.HEARTBEAT_INTERVAL_SECONDS,
                }
            ).data
        return Response(body, status=status.HTTP_201_CREATED)


class DeviceChallengeView(_PublicDeviceEndpoint):
    """Step 1 of device REST auth: a single-use nonce for this device id, valid for a minute."""

    @extend_schema(request=ChallengeRequestSerializer, responses=ChallengeResponseSerializer)
    def post(self, request):
        data = ChallengeRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        nonce = rest_challenge_create(device_id=data.validated_data["device_id"])
        return Response({"nonce": nonce, "expires_in": NONCE_TTL_SECONDS})


class DeviceTokenView(_PublicDeviceEndpoint):
    """Step 2: the nonce signed with the device key, exchanged for a short-lived `Device` token."""

    @extend_schema(
        request=TokenRequestSerializer,
        responses={200: TokenResponseSerializer, 401: ErrorBodySerializer, 403: ErrorBodySerializer},
    )
    def post(self, request):
        data = TokenRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        issued = rest_token_issue(
            device_id=data.validated_data["device_id"],
            nonce=data.validated_data["nonce"],
            signature=data.validated_data["signature"],
            protocol=data.validated_data.get("protocol"),
        )
        return Response({"token": issued.token, "expires_in": issued.expires_in})


class _DeviceSelfView(APIView):
    authentication_classes = [DeviceTokenAuthentication]
    permission_classes = [IsDevice]


class DeviceSelfView(_DeviceSelfView):
    """The calling device's own record; a device can only ever read itself."""

    @extend_schema(responses=DeviceSerializer)
    def get(self, request):
        return Response(DeviceSerializer(request.user.device).data)


class DeviceHeartbeatView(_DeviceSelfView):
    """A heartbeat over REST, for devices that cannot hold a socket; same fields as the socket's."""

    @extend_schema(request=DeviceHeartbeatSerializer, responses={204: None})
    def post(self, request):
        if not isinstance(request.data, dict):
            raise ValidationError({"non_field_errors": ["expected a JSON object"]})
        try:
            state = presence.parse_heartbeat(dict(request.data))
        except ValueError as exc:
            raise ValidationError({"heartbeat": [str(exc)]}) from None
        device_id = str(request.user.device.pk)
        new = presence.record_heartbeat_sync(device_id, state)
        if "personal" in new:  # a new personal measurement: store it
            personal_report_record(device_id=device_id, personal=state["personal"])
            presence.mark_personal_sync(device_id, state["personal"]["updated_at"])
        if "feedback" in new:  # changed feedback counts
            feedback_report_record(device_id=device_id, feedback=state["feedback"])
            presence.mark_feedback_sync(device_id, state["feedback"])
        return Response(status=status.HTTP_204_NO_CONTENT)
