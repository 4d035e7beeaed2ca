"""The personalization setting of an adapter over the API, and the fleet's personal figures for it."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api.serializers import StrictTypesMixin
from training.registry.personalization_settings import (
    PERSONALIZATION_HELP,
    PERSONALIZATION_SCHEMA,
    personalization_settings,
    validate_personalization,
)


@extend_schema_field(PERSONALIZATION_SCHEMA)
class PersonalizationField(serializers.JSONField):
    """An adapter's personalization setting: written as what differs from the defaults (the rest takes them),
    read with every setting resolved, as manifests carry it."""

    def get_attribute(self, instance):
        return personalization_settings(instance)

    def to_internal_value(self, data):
        # Its shape here; whether private_modules are the adapter's own, where the service knows its modules.
        try:
            return validate_personalization(data, modules=None)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None


class PersonalizationPutSerializer(StrictTypesMixin, serializers.Serializer):
    personalization = PersonalizationField(help_text=PERSONALIZATION_HELP)


class PersonalizationSettingSerializer(serializers.Serializer):
    adapter = serializers.CharField()
    personalization = serializers.JSONField(help_text="Every setting, defaults resolved, as manifests carry it.")


class GainBinSerializer(serializers.Serializer):
    low = serializers.IntegerField(help_text="points; the first bin also holds every gain below it")
    high = serializers.IntegerField(help_text="points; the last bin also holds every gain above it")
    devices = serializers.IntegerField()


class ServingSerializer(serializers.Serializer):
    personal = serializers.IntegerField()
    shared = serializers.IntegerField()


class PersonalSummarySerializer(serializers.Serializer):
    devices = serializers.IntegerField(help_text="devices whose latest report is for this adapter")
    held_samples = serializers.IntegerField(help_text="held samples the devices' latest reports were measured on")
    devices_judged = serializers.IntegerField(
        help_text="devices whose report rests on at least 10 held samples; the others' gains are rough"
    )
    weighted_gain_points = serializers.FloatField(
        allow_null=True, help_text="the devices' gains weighted by their held samples, in points"
    )
    weighted_gain_interval_points = serializers.FloatField(
        allow_null=True, help_text="half-width of a 95% interval on weighted_gain_points"
    )
    mean_shared_accuracy = serializers.FloatField(allow_null=True)
    mean_personal_accuracy = serializers.FloatField(allow_null=True)
    mean_gain_points = serializers.FloatField(allow_null=True, help_text="personal minus shared, in points")
    devices_gaining = serializers.IntegerField(help_text="gain above 0")
    share_gaining = serializers.FloatField(allow_null=True)
    devices_not_worse = serializers.IntegerField(help_text="gain of -0.5 points or more")
    share_not_worse = serializers.FloatField(allow_null=True)
    serving = ServingSerializer()
    methods = serializers.DictField(child=serializers.IntegerField(), help_text="devices per method they reported")
    histogram = GainBinSerializer(many=True, help_text="devices per 5-point bin of gain, -20 to +50, clamped")


class CohortSummarySerializer(PersonalSummarySerializer):
    cohort = serializers.CharField()


class AdapterPersonalizationSerializer(PersonalizationSettingSerializer):
    fleet = PersonalSummarySerializer()
    cohorts = CohortSummarySerializer(many=True)
