"""The cohorts an adapter serves, over the API: read by anyone signed in, replaced by admins (who manage cohorts)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.roles import Role
from core.api.errors import ApiError, ErrorBodySerializer
from core.api.serializers import StrictTypesMixin
from devices.models import Cohort
from training.models import Adapter
from training.registry.services import adapter_set_cohorts

COHORTS_HELP = (
    "Every cohort the adapter serves, by name: the list replaces the one it had ([] for none). Its devices "
    "train it and its rollouts go there. An unknown or repeated name is a 400 and changes nothing; dropping a "
    "cohort that a running or paused rollout of the adapter goes to is a 409."
)


class AdapterCohortsPutSerializer(StrictTypesMixin, serializers.Serializer):
    cohorts = serializers.SlugRelatedField(
        slug_field="name",
        queryset=Cohort.objects.all(),
        many=True,
        help_text=COHORTS_HELP,
        error_messages={"does_not_exist": "There is no cohort named {value}."},
    )

    def validate_cohorts(self, cohorts):
        names = [cohort.name for cohort in cohorts]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise serializers.ValidationError(f"Each cohort once: {', '.join(repeated)} is listed more than once.")
        return cohorts


class AdapterCohortsSerializer(serializers.Serializer):
    adapter = serializers.CharField()
    cohorts = serializers.ListField(child=serializers.CharField(), help_text="The cohorts it serves, by name.")


def adapter_cohorts_body(adapter: Adapter) -> dict:
    return {"adapter": adapter.name, "cohorts": sorted(adapter.cohorts.values_list("name", flat=True))}


class AdapterCohortsView(APIView):
    """Which cohorts an adapter serves (``GET``: viewers) and changing them (``PUT``: admins, as creating the
    adapter), with an ``adapter.cohorts_changed`` event in its audit trail."""

    read_role = Role.VIEWER
    write_role = Role.ADMIN

    @staticmethod
    def _adapter(pk: int) -> Adapter:
        adapter = Adapter.objects.filter(pk=pk).first()
        if adapter is None:
            raise ApiError("not_found", "No such adapter.", status_code=404)
        return adapter

    @extend_schema(responses=AdapterCohortsSerializer)
    def get(self, request, pk: int):
        return Response(adapter_cohorts_body(self._adapter(pk)))

    @extend_schema(
        request=AdapterCohortsPutSerializer, responses={200: AdapterCohortsSerializer, 409: ErrorBodySerializer}
    )
    def put(self, request, pk: int):
        adapter = self._adapter(pk)
        data = AdapterCohortsPutSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        adapter = adapter_set_cohorts(adapter=adapter, actor=request.user, cohorts=data.validated_data["cohorts"])
        return Response(adapter_cohorts_body(adapter))
