from __future__ import annotations

from django.db.models import Count, Q
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.roles import Role
from core.api.errors import ErrorBodySerializer
from devices.authentication import DeviceTokenAuthentication, IsDevice
from training.api.rollout_serializers import (
    AssignmentReportSerializer,
    AssignmentSerializer,
    RolloutActionSerializer,
    RolloutDetailSerializer,
    RolloutSerializer,
)
from training.filters import RolloutFilterSet
from training.models import Assignment, Rollout
from training.rollouts.delivery import assignment_message, current_assignment
from training.rollouts.joining import assignment_at_check_in
from training.rollouts.lifecycle import (
    assignment_report,
    rollout_abort,
    rollout_create,
    rollout_pause,
    rollout_resume,
    rollout_rollback,
    rollout_start,
)
from training.rollouts.progress import annotate_device_counts

_COUNTS = {state: Count("assignments", filter=Q(assignments__state=state)) for state in Assignment.State.values}


# An action the rollout's state does not allow (resuming an aborted rollout) is a 409.
_ACTION_RESPONSES = {200: RolloutDetailSerializer, 409: ErrorBodySerializer}


class RolloutViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Rollouts of adapter versions to cohorts. Operators create and steer them; every action is recorded."""

    read_role = Role.VIEWER
    write_role = Role.OPERATOR
    filterset_class = RolloutFilterSet
    search_fields = ["version__adapter__name", "cohort__name"]

    def get_queryset(self):
        counts = {f"n_{state}": count for state, count in _COUNTS.items()}
        rollouts = Rollout.objects.select_related("version__adapter", "cohort").annotate(**counts)
        return annotate_device_counts(rollouts).order_by("-created_at")

    def get_serializer_class(self):
        return RolloutDetailSerializer if self.action == "retrieve" else RolloutSerializer

    def _with_counts(self, rollouts):
        for rollout in rollouts:
            rollout.assignment_counts = {state: getattr(rollout, f"n_{state}", 0) for state in Assignment.State.values}
        return rollouts

    def list(self, request, *args, **kwargs):
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        return self.get_paginated_response(RolloutSerializer(self._with_counts(page), many=True).data)

    def retrieve(self, request, *args, **kwargs):
        (rollout,) = self._with_counts([self.get_object()])
        return Response(RolloutDetailSerializer(rollout).data)

    @extend_schema(request=RolloutSerializer, responses={201: RolloutSerializer, 409: ErrorBodySerializer})
    def create(self, request):
        data = RolloutSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        rollout = rollout_create(
            version=fields["version"],
            cohort=fields["cohort"],
            phases=fields["phases"],
            guards=fields.get("guards", []),
            on_breach=fields.get("on_breach", "pause"),
            max_failure_rate=fields.get("max_failure_rate", 0.2),
            actor=request.user,
            override_gate=fields.get("override_gate", False),
            override_reason=fields.get("override_reason", ""),
        )
        return Response(RolloutSerializer(rollout).data, status=status.HTTP_201_CREATED)

    def _act(self, request, service, **extra):
        data = RolloutActionSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        kwargs = {"reason": data.validated_data["reason"]} if service not in (rollout_start, rollout_resume) else {}
        service(rollout=self.get_object(), actor=request.user, **kwargs)
        (rollout,) = self._with_counts([self.get_queryset().get(pk=self.kwargs["pk"])])
        return Response(RolloutDetailSerializer(rollout).data)

    @extend_schema(request=RolloutActionSerializer, responses=_ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def start(self, request, pk=None):
        return self._act(request, rollout_start)

    @extend_schema(request=RolloutActionSerializer, responses=_ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        return self._act(request, rollout_pause)

    @extend_schema(request=RolloutActionSerializer, responses=_ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        return self._act(request, rollout_resume)

    @extend_schema(request=RolloutActionSerializer, responses=_ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def abort(self, request, pk=None):
        return self._act(request, rollout_abort)

    @extend_schema(request=RolloutActionSerializer, responses=_ACTION_RESPONSES)
    @action(detail=True, methods=["post"])
    def rollback(self, request, pk=None):
        return self._act(request, rollout_rollback)

    @extend_schema(responses=AssignmentSerializer(many=True))
    @action(detail=True, methods=["get"])
    def assignments(self, request, pk=None):
        rows = self.get_object().assignments.select_related("device", "version").order_by("device__name")
        state = request.query_params.get("state")
        if state:
            rows = rows.filter(state=state)
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(AssignmentSerializer(page, many=True).data)


class DeviceAssignmentView(APIView):
    """The calling device's newest assignment not yet installed (the same message the socket pushes). Asking is
    how a REST device checks in: it joins a rollout in progress in its cohort as the socket's hello does."""

    authentication_classes = [DeviceTokenAuthentication]
    permission_classes = [IsDevice]

    @extend_schema(responses={200: OpenApiResponse(description="assignment message"), 204: None})
    def get(self, request):
        assignment_at_check_in(device=request.user.device)  # a rollout it joined since: now its newest
        assignment = current_assignment(request.user.device.pk)
        if assignment is None:
            return Response(status=status.HTTP_204_NO_CONTENT)
        return Response(assignment_message(assignment))


class DeviceAssignmentReportView(APIView):
    """A device reports delivered / installed / failed (with guard metrics or the refusal reason)."""

    authentication_classes = [DeviceTokenAuthentication]
    permission_classes = [IsDevice]

    @extend_schema(request=AssignmentReportSerializer, responses={200: AssignmentSerializer, 409: ErrorBodySerializer})
    def post(self, request, assignment_id: int):
        data = AssignmentReportSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        assignment = assignment_report(device=request.user.device, assignment_id=assignment_id, **data.validated_data)
        return Response(AssignmentSerializer(assignment).data)
