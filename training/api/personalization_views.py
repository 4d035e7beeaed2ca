"""An adapter's personalization over the API: the setting (signed into manifests) and the fleet's figures."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.roles import Role
from core.api.errors import ApiError
from devices.selectors import adapter_personalization
from training.api.personalization_serializers import (
    AdapterPersonalizationSerializer,
    PersonalizationPutSerializer,
    PersonalizationSettingSerializer,
)
from training.models import Adapter
from training.registry.personalization_settings import personalization_settings
from training.registry.services import adapter_set_personalization


def _adapter(pk: int) -> Adapter:
    adapter = Adapter.objects.filter(pk=pk).first()
    if adapter is None:
        raise ApiError("not_found", "No such adapter.", status_code=404)
    return adapter


class AdapterPersonalizationView(APIView):
    """How devices make their own model for this adapter (``PUT``: operators, as the aggregation settings), and
    whether it helps (``GET``): from each device's latest report, the mean shared and personal accuracy, the
    gain in points, the devices that gain and that are not worse, what they serve, a histogram of the gain;
    for the fleet and per cohort."""

    read_role = Role.VIEWER
    write_role = Role.OPERATOR

    @extend_schema(responses=AdapterPersonalizationSerializer)
    def get(self, request, pk: int):
        adapter = _adapter(pk)
        body = {
            "adapter": adapter.name,
            "personalization": personalization_settings(adapter),
            **adapter_personalization(adapter.pk),
        }
        return Response(body)

    @extend_schema(request=PersonalizationPutSerializer, responses=PersonalizationSettingSerializer)
    def put(self, request, pk: int):
        adapter = _adapter(pk)
        data = PersonalizationPutSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        adapter = adapter_set_personalization(
            adapter=adapter, actor=request.user, personalization=data.validated_data["personalization"]
        )
        return Response({"adapter": adapter.name, "personalization": personalization_settings(adapter)})
