from __future__ import annotations

from django.db.models import Max
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response

from accounts.roles import Role
from core import bounded_json
from core.api.errors import ApiError, ErrorBodySerializer
from core.api.parsers import BoundedJSONParser
from training.api.serializers import (
    AdapterSerializer,
    AdapterVersionSerializer,
    BaseModelCreateSerializer,
    BaseModelSerializer,
    CandidateModulesSerializer,
    ImportVersionSerializer,
    SeedVersionSerializer,
    VersionActionSerializer,
)
from training.federation.release_gate import version_release
from training.models import Adapter, AdapterVersion, BaseModel
from training.registry.services import (
    MAX_ARTIFACT_BYTES,
    adapter_create,
    base_model_create,
    build_base,
    candidate_modules,
    version_create_seeded,
    version_export_peft,
    version_import,
    version_transition,
)


def _read_upload(upload, limit: int = MAX_ARTIFACT_BYTES) -> bytes:
    if upload.size > limit:
        raise ApiError(
            "artifact_too_large", f"{upload.name} is {upload.size} bytes; the limit is {limit}", status_code=413
        )
    return upload.read()


class BaseModelViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Base models: the frozen models devices carry. Admins register them."""

    write_role = Role.ADMIN
    queryset = BaseModel.objects.all()
    serializer_class = BaseModelSerializer
    parser_classes = [BoundedJSONParser, MultiPartParser]  # multipart for the weights file
    search_fields = ["name", "family"]

    @extend_schema(request=BaseModelCreateSerializer, responses={201: BaseModelSerializer, 413: ErrorBodySerializer})
    def create(self, request):
        data = BaseModelCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        weights = data.validated_data.get("weights")
        base = base_model_create(
            name=data.validated_data["name"],
            family=data.validated_data["family"],
            family_config=data.validated_data["family_config"],
            weights=_read_upload(weights) if weights else None,
            actor=request.user,
        )
        return Response(BaseModelSerializer(base).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=CandidateModulesSerializer)
    @action(detail=True, methods=["get"])
    def modules(self, request, pk=None):
        """The modules of the base an adapter's ``target_modules`` can name, with their weights' shapes and sizes
        (an exported program's are named as in the team's own code: ``conv1``, ``encoder.fc``)."""
        base = self.get_object()
        return Response({"base_model": base.name, "modules": candidate_modules(build_base(base))})


class AdapterViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Adapters (LoRA configurations) and their versions. Admins create adapters; operators make, import,
    release and revoke versions."""

    write_role = Role.ADMIN
    serializer_class = AdapterSerializer
    queryset = (
        Adapter.objects.select_related("base_model")
        .prefetch_related("cohorts")
        .annotate(latest_number=Max("versions__number"))
        .order_by("name")  # an aggregate drops Meta.ordering
    )
    search_fields = ["name"]
    filterset_fields = ["base_model__name"]

    def create(self, request):
        data = AdapterSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        adapter = adapter_create(
            name=fields["name"],
            base_model=fields["base_model"],
            rank=fields.get("rank"),
            alpha=fields.get("alpha"),
            dropout=fields.get("dropout", 0.0),
            target_modules=fields.get("target_modules"),
            modules_to_save=fields.get("modules_to_save"),
            cohorts=fields.get("cohorts", []),
            aggregation=fields.get("aggregation"),
            personalization=fields.get("personalization"),
            actor=request.user,
        )
        return Response(AdapterSerializer(self.get_queryset().get(pk=adapter.pk)).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=AdapterVersionSerializer(many=True))
    @action(detail=True, methods=["get"])
    def versions(self, request, pk=None):
        versions = self.get_object().versions.select_related("adapter", "parent").order_by("-number")
        page = self.paginate_queryset(versions)
        return self.get_paginated_response(AdapterVersionSerializer(page, many=True).data)

    @extend_schema(request=SeedVersionSerializer, responses={201: AdapterVersionSerializer})
    @action(detail=True, methods=["post"], url_path="versions/seed", write_role=Role.OPERATOR)
    def seed(self, request, pk=None):
        data = SeedVersionSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        version = version_create_seeded(adapter=self.get_object(), actor=request.user, **data.validated_data)
        return Response(AdapterVersionSerializer(version).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        request={"multipart/form-data": ImportVersionSerializer},
        responses={201: AdapterVersionSerializer, 413: ErrorBodySerializer},
    )
    @action(
        detail=True,
        methods=["post"],
        url_path="versions/import",
        write_role=Role.OPERATOR,
        parser_classes=[MultiPartParser],
    )
    def import_version(self, request, pk=None):
        data = ImportVersionSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        config = None
        if data.validated_data.get("adapter_config"):
            try:
                config = bounded_json.loads(_read_upload(data.validated_data["adapter_config"], limit=1024 * 1024))
            except (ValueError, UnicodeDecodeError):
                raise ApiError("invalid_config", "adapter_config.json is not valid JSON", status_code=400) from None
        version = version_import(
            adapter=self.get_object(),
            data=_read_upload(data.validated_data["adapter_model"]),
            config=config,
            actor=request.user,
            note=data.validated_data["note"],
        )
        return Response(AdapterVersionSerializer(version).data, status=status.HTTP_201_CREATED)


class AdapterVersionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Adapter versions: immutable artifacts. Export one as a PEFT directory (zip)."""

    read_role = Role.VIEWER
    write_role = Role.OPERATOR
    serializer_class = AdapterVersionSerializer
    queryset = AdapterVersion.objects.select_related("adapter", "parent")
    filterset_fields = ["adapter__name", "state", "source"]
    search_fields = ["adapter__name", "note", "blob_sha256"]

    def _transition(self, request, action_name):
        data = VersionActionSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        if action_name == "release":  # through the release gate (training.federation.release_gate)
            version = version_release(
                version=self.get_object(), actor=request.user, reason=fields["reason"], override=fields["override"]
            )
        else:
            version = version_transition(
                version=self.get_object(), action=action_name, actor=request.user, reason=fields["reason"]
            )
        return Response(AdapterVersionSerializer(version).data)

    @extend_schema(request=VersionActionSerializer, responses={200: AdapterVersionSerializer, 409: ErrorBodySerializer})
    @action(detail=True, methods=["post"])
    def release(self, request, pk=None):
        return self._transition(request, "release")

    @extend_schema(request=VersionActionSerializer, responses={200: AdapterVersionSerializer, 409: ErrorBodySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        return self._transition(request, "revoke")

    @extend_schema(responses={(200, "application/zip"): OpenApiResponse(description="PEFT adapter directory, zipped")})
    @action(detail=True, methods=["get"], read_role=Role.OPERATOR)
    def export(self, request, pk=None):
        version = self.get_object()
        response = HttpResponse(version_export_peft(version), content_type="application/zip")
        filename = f"{version.adapter.name}-v{version.number}-peft.zip"
        response["Content-Disposition"] = f'attachment; filename="{filename}"'
        return response
