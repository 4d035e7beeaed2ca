"""Deltas and rounds over REST: devices upload (resumable, size-limited) and read outcomes; operators
watch rounds and deltas, open, close and re-run rounds, and set an adapter's aggregation strategy."""

from __future__ import annotations

import json
import re

from django.conf import settings
from django.db.models import Count, Q
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.roles import Role
from core.api.errors import ApiError, ErrorBodySerializer
from devices.authentication import DeviceTokenAuthentication, IsDevice
from edge_agent.protocol import b64decode
from training.api.round_serializers import (
    AggregationConfigSerializer,
    DeltaSerializer,
    DeviceDeltaStateSerializer,
    RoundOpenSerializer,
    RoundSerializer,
)
from training.federation.intake import (
    UploadConflict,
    UploadRefused,
    UploadTooLarge,
    begin_refused,
    upload_abort,
    upload_append,
    upload_begin,
    upload_state,
)
from training.federation.rounds import round_close, round_open, round_rerun
from training.filters import RoundFilterSet
from training.models import Adapter, Delta, Round
from training.registry.services import adapter_set_aggregation
from training.selectors import rejected_meanwhile_count

CHUNK = 1024 * 1024
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
_SHA = re.compile(r"^[0-9a-f]{64}$")


class DeviceDeltaView(APIView):
    """A device's delta upload, named by the sha256 its signed envelope claims.

    ``PUT`` sends bytes with headers ``X-Delta-Envelope`` (base64url of the envelope's JSON) and
    ``X-Delta-Signature``; ``Content-Range: bytes start-end/total`` resumes from where ``GET`` says the server
    stopped. A repeated upload of a file the server has is acknowledged with its current state. ``DELETE``
    gives up an unfinished upload (the socket's ``delta_abort``), freeing its slot."""

    authentication_classes = [DeviceTokenAuthentication]
    permission_classes = [IsDevice]

    def _device(self, request, sha256: str):
        if not _SHA.match(sha256):
            raise ApiError("not_found", "No such upload.", status_code=404)
        return request.user.device

    @extend_schema(responses={200: DeviceDeltaStateSerializer})
    def get(self, request, sha256: str):
        state = upload_state(device=self._device(request, sha256), sha256=sha256)
        if state is None:
            raise ApiError("not_found", "No upload of this file from this device.", status_code=404)
        return Response(state.body())

    @extend_schema(
        request={"application/octet-stream": OpenApiTypes.BINARY},
        parameters=[
            OpenApiParameter("X-Delta-Envelope", str, OpenApiParameter.HEADER, required=True),
            OpenApiParameter("X-Delta-Signature", str, OpenApiParameter.HEADER, required=True),
            OpenApiParameter("X-Delta-Metrics", str, OpenApiParameter.HEADER, required=False),
            OpenApiParameter("Content-Range", str, OpenApiParameter.HEADER, required=False),
        ],
        responses={200: DeviceDeltaStateSerializer, 201: DeviceDeltaStateSerializer},
    )
    def put(self, request, sha256: str):
        device = self._device(request, sha256)
        # RecursionError: a deeply nested JSON value exhausts the parser's stack before it is found invalid. Each
        # refusal here is a refused begin, counted on the device as upload_begin's own are.
        try:
            envelope = json.loads(b64decode(request.headers.get("X-Delta-Envelope", "")))
        except (ValueError, RecursionError):
            refusal = UploadRefused("malformed_envelope", "X-Delta-Envelope must be base64url of a JSON object")
            raise begin_refused(device, refusal) from None
        try:
            metrics = json.loads(request.headers.get("X-Delta-Metrics") or "{}")
        except (ValueError, RecursionError):
            refusal = UploadRefused("malformed_metrics", "X-Delta-Metrics must be valid JSON")
            raise begin_refused(device, refusal) from None
        if not isinstance(envelope, dict) or envelope.get("sha256") != sha256:
            refusal = UploadRefused("malformed_envelope", "the envelope's sha256 must be the one in the URL")
            raise begin_refused(device, refusal)
        start = 0
        content_range = request.headers.get("Content-Range")
        if content_range:
            match = _CONTENT_RANGE.match(content_range.strip())
            if not match or int(match.group(3)) != envelope.get("size"):
                raise ApiError("bad_range", "Content-Range must be 'bytes start-end/size' for this file")
            start = int(match.group(1))
        # A refusal (training.federation.intake.UploadRefused) answers with its code and status
        # (core.api.errors): nothing of this request is stored.
        state = upload_begin(
            device=device,
            envelope=envelope,
            signature=request.headers.get("X-Delta-Signature"),
            channel=Delta.Channel.REST,
            metrics=metrics,
        )
        if state.delta is None:
            if int(request.headers.get("Content-Length") or 0) > settings.DELTA_MAX_BYTES:
                raise UploadTooLarge("too_large", f"the body is above {settings.DELTA_MAX_BYTES} bytes")
            if start != state.offset:
                raise UploadConflict("wrong_offset", f"the server holds {state.offset} bytes; resume from there")
            stream = request.stream
            offset = start
            while stream is not None and state.delta is None and (chunk := stream.read(CHUNK)):
                state = upload_append(
                    device=device, sha256=sha256, offset=offset, data=chunk, channel=Delta.Channel.REST
                )
                offset += len(chunk)
        code = status.HTTP_201_CREATED if state.delta is not None and state.delta.state != "uploading" else 200
        return Response(state.body(), status=code)

    @extend_schema(request=None, responses={204: None, 404: ErrorBodySerializer})
    def delete(self, request, sha256: str):
        upload_abort(device=self._device(request, sha256), sha256=sha256)
        return Response(status=status.HTTP_204_NO_CONTENT)


def _round_queryset():
    return (
        Round.objects.select_related("adapter", "base_version", "result_version")
        .annotate(
            accepted=Count("deltas", filter=Q(deltas__state__in=("accepted", "aggregated"))),
            rejected=rejected_meanwhile_count(),  # a rejected delta never joins a round: the page's figure
        )
        .order_by("-created_at", "-id")
    )


class RoundViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Aggregation rounds. Operators open, close and re-run them; viewers watch."""

    read_role = Role.VIEWER
    write_role = Role.OPERATOR
    serializer_class = RoundSerializer
    filterset_class = RoundFilterSet
    search_fields = ["adapter__name", "strategy", "close_reason"]

    def get_queryset(self):
        return _round_queryset()

    @extend_schema(request=RoundOpenSerializer, responses={201: RoundSerializer, 409: ErrorBodySerializer})
    def create(self, request):
        data = RoundOpenSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = dict(data.validated_data)
        round_ = round_open(adapter=fields.pop("adapter"), actor=request.user, **fields)
        return Response(RoundSerializer(_round_queryset().get(pk=round_.pk)).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: RoundSerializer, 409: ErrorBodySerializer})
    @action(detail=True, methods=["post"])
    def close(self, request, pk=None):
        round_ = round_close(round_=self.get_object(), actor=request.user)
        return Response(RoundSerializer(_round_queryset().get(pk=round_.pk)).data)

    @extend_schema(request=None, responses={200: RoundSerializer, 409: ErrorBodySerializer})
    @action(detail=True, methods=["post"])
    def rerun(self, request, pk=None):
        round_ = round_rerun(round_=self.get_object(), actor=request.user)
        return Response(RoundSerializer(_round_queryset().get(pk=round_.pk)).data)


class DeltaViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Every upload with its verification result (rejected ones are kept, with the reason)."""

    read_role = Role.VIEWER
    serializer_class = DeltaSerializer
    queryset = Delta.objects.select_related("device").order_by("-received_at", "-id")
    filterset_fields = ["state", "rejection_code", "round", "device", "adapter_name", "channel"]
    search_fields = ["sha256", "device__name"]


class AdapterAggregationView(APIView):
    """An adapter's aggregation strategy and server-side DP settings (only what differs from the defaults)."""

    read_role = Role.VIEWER
    write_role = Role.OPERATOR

    @extend_schema(request=AggregationConfigSerializer, responses=AggregationConfigSerializer)
    def put(self, request, pk: int):
        adapter = Adapter.objects.filter(pk=pk).first()
        if adapter is None:
            raise ApiError("not_found", "No such adapter.", status_code=404)
        data = AggregationConfigSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        adapter = adapter_set_aggregation(adapter=adapter, actor=request.user, **data.validated_data)
        return Response({"aggregation": adapter.aggregation, "dp": adapter.dp})
