from rest_framework import serializers

from core.api.serializers import JsonObjectField, StrictTypesMixin
from training.api.serializers import settings_checked
from training.federation.aggregation_settings import (
    AGGREGATION_DEFAULTS,
    AGGREGATION_HELP,
    DP_DEFAULTS,
    validate_aggregation,
    validate_dp,
)
from training.models import Adapter, Delta, Round


class DeltaSerializer(serializers.ModelSerializer):
    device_name = serializers.CharField(source="device.name", read_only=True)
    base_version = serializers.IntegerField(source="base_version_number", read_only=True)

    class Meta:
        model = Delta
        fields = [
            "id",
            "device",
            "device_name",
            "adapter_name",
            "base_version",
            "round",
            "sha256",
            "size",
            "num_samples",
            "counter",
            "channel",
            "encoding",
            "state",
            "rejection_code",
            "rejection_detail",
            "staleness",
            "norm",
            "metrics",
            "received_at",
            "verified_at",
            "verify_attempts",
        ]
        read_only_fields = fields


class RoundSerializer(serializers.ModelSerializer):
    adapter = serializers.CharField(source="adapter.name", read_only=True)
    base_version = serializers.IntegerField(source="base_version.number", read_only=True)
    result_version = serializers.SerializerMethodField()
    accepted = serializers.IntegerField(
        read_only=True, default=None, help_text="deltas that joined this round, accepted or already aggregated"
    )
    rejected = serializers.IntegerField(
        read_only=True,
        default=None,
        help_text="deltas for the round's adapter received while the round collected (from its opening to its "
        "close, or now while it collects) and rejected; a rejected delta never joins a round. The dashboard "
        "shows this as 'rejected meanwhile'",
    )
    aggregation_seconds = serializers.FloatField(
        read_only=True,
        allow_null=True,
        help_text="seconds from the round's close (or its last re-run, `reran_at`) to its result version stored "
        "(`aggregated_at`); null until then, and for rounds from before this was kept",
    )
    release_seconds = serializers.FloatField(
        read_only=True,
        allow_null=True,
        help_text="seconds from the round's close (or its last re-run) to the start of the first rollout of its "
        "result version (`released_at`), by auto-release or an operator; null until one starts",
    )

    class Meta:
        model = Round
        fields = [
            "id",
            "adapter",
            "base_version",
            "strategy",
            "params",
            "buffer_size",
            "min_deltas",
            "deadline",
            "state",
            "close_reason",
            "failure",
            "attempts",
            "stats",
            "epsilon",
            "accepted",
            "rejected",
            "result_version",
            "created_at",
            "closed_at",
            "completed_at",
            "reran_at",
            "aggregated_at",
            "released_at",
            "aggregation_seconds",
            "release_seconds",
        ]
        read_only_fields = fields

    def get_result_version(self, round_) -> int | None:
        version = getattr(round_, "result_version", None)
        return version.number if version is not None else None


class RoundOpenSerializer(StrictTypesMixin, serializers.Serializer):
    adapter = serializers.SlugRelatedField(slug_field="name", queryset=Adapter.objects.all())
    buffer_size = serializers.IntegerField(min_value=1, max_value=100_000, required=False)
    min_deltas = serializers.IntegerField(min_value=1, max_value=100_000, required=False)
    timeout_seconds = serializers.IntegerField(min_value=1, max_value=30 * 24 * 3600, required=False)


class AggregationConfigSerializer(StrictTypesMixin, serializers.Serializer):
    aggregation = JsonObjectField(required=False, help_text=AGGREGATION_HELP)
    dp = JsonObjectField(required=False, help_text="server-side DP settings and epsilon budget")

    def validate_aggregation(self, value):
        return settings_checked(value, validate_aggregation)

    def validate_dp(self, value):
        return settings_checked(value, validate_dp)

    def validate(self, attrs):
        """Keys other than ``aggregation`` and ``dp`` are refused by name (a setting sent without its wrapper
        would otherwise be a 200 that changes nothing), as is a body with neither."""
        body = self.initial_data if isinstance(self.initial_data, dict) else {}
        unknown = sorted(set(body) - set(self.fields))
        if unknown:
            placed = [key for key in unknown if key in AGGREGATION_DEFAULTS or key in DP_DEFAULTS]
            hint = (
                f"; {', '.join(placed)} belong{'s' if len(placed) == 1 else ''} inside "
                '"aggregation" (or "dp"), for example {"aggregation": {"' + placed[0] + '": ...}}'
                if placed
                else ""
            )
            message = f"unknown key: send aggregation and/or dp{hint}"
            raise serializers.ValidationError({key: [message] for key in unknown})
        if not attrs:
            raise serializers.ValidationError({"aggregation": ["send aggregation and/or dp: nothing to change"]})
        return attrs


class DeviceDeltaStateSerializer(serializers.Serializer):
    sha256 = serializers.CharField()
    size = serializers.IntegerField()
    offset = serializers.IntegerField(help_text="bytes the server holds; continue from here")
    delta_id = serializers.IntegerField(allow_null=True)
    state = serializers.CharField(help_text="uploading, received, accepted, rejected or aggregated")
    rejection_code = serializers.CharField(allow_blank=True)
    rejection_detail = serializers.CharField(allow_blank=True)
