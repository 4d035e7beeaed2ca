from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from devices.models import Cohort
from fleet.api.serializers import StrictTypesMixin
from training.models import AdapterVersion, Assignment, Rollout
from training.rollouts import REPORTABLE_METRICS


@extend_schema_field(
    {
        "type": "array",
        "minItems": 1,
        "maxItems": 20,
        "items": {
            "type": "object",
            "properties": {
                "percent": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 100},
                "min_soak_seconds": {"type": "integer", "minimum": 0},
            },
            "required": ["percent"],
        },
    }
)
class PhasesField(serializers.JSONField):
    """Checked by training.rollouts.validate_phases (which also wants the percents rising)."""


@extend_schema_field(
    {
        "type": "array",
        "maxItems": 10,
        "items": {
            "type": "object",
            "properties": {
                "metric": {"type": "string", "minLength": 1},
                "min": {"type": "number"},
                "max": {"type": "number"},
                "min_reports": {"type": "integer", "minimum": 1},
            },
            "required": ["metric"],
        },
    }
)
class GuardsField(serializers.JSONField):
    """Checked by training.rollouts.validate_guards (which also wants a min or a max)."""


class RolloutSerializer(StrictTypesMixin, serializers.ModelSerializer):
    version = serializers.PrimaryKeyRelatedField(queryset=AdapterVersion.objects.all())
    phases = PhasesField(help_text="[{percent, min_soak_seconds}], percents increasing, the last ≤ 100")
    guards = GuardsField(required=False, help_text="[{metric, min | max, min_reports}]")
    cohort = serializers.SlugRelatedField(slug_field="name", queryset=Cohort.objects.all())
    adapter = serializers.CharField(source="version.adapter.name", read_only=True)
    version_number = serializers.IntegerField(source="version.number", read_only=True)
    progress = serializers.SerializerMethodField()

    class Meta:
        model = Rollout
        fields = [
            "id",
            "version",
            "adapter",
            "version_number",
            "cohort",
            "phases",
            "guards",
            "max_failure_rate",
            "on_breach",
            "state",
            "state_reason",
            "current_phase",
            "phase_started_at",
            "created_at",
            "started_at",
            "finished_at",
            "progress",
        ]
        read_only_fields = [
            "id",
            "adapter",
            "version_number",
            "state",
            "state_reason",
            "current_phase",
            "phase_started_at",
            "created_at",
            "started_at",
            "finished_at",
            "progress",
        ]
        extra_kwargs = {"max_failure_rate": {"required": False}}

    def get_progress(self, rollout) -> dict:
        counts = getattr(rollout, "assignment_counts", None)
        return counts if counts is not None else {}


class RolloutDetailSerializer(RolloutSerializer):
    guard_report = serializers.SerializerMethodField()

    class Meta(RolloutSerializer.Meta):
        fields = RolloutSerializer.Meta.fields + ["guard_report"]

    def get_guard_report(self, rollout) -> list[dict]:
        from training.rollouts import guard_report

        return guard_report(rollout)


class RolloutActionSerializer(StrictTypesMixin, serializers.Serializer):
    reason = serializers.CharField(max_length=300, required=False, default="", allow_blank=True)


class AssignmentSerializer(serializers.ModelSerializer):
    device_name = serializers.CharField(source="device.name", read_only=True)
    version_number = serializers.IntegerField(source="version.number", read_only=True)

    class Meta:
        model = Assignment
        fields = [
            "id",
            "device",
            "device_name",
            "rollout",
            "phase",
            "version",
            "version_number",
            "previous_version",
            "seq",
            "state",
            "reason",
            "metrics",
            "created_at",
            "delivered_at",
            "reported_at",
        ]
        read_only_fields = fields


@extend_schema_field(
    {"type": "object", "additionalProperties": {"type": "number"}, "maxProperties": REPORTABLE_METRICS}
)
class ReportMetricsField(serializers.DictField):
    """Checked by training.rollouts.assignment_report (finite numbers, names of at most 64 characters)."""


class AssignmentReportSerializer(StrictTypesMixin, serializers.Serializer):
    status = serializers.ChoiceField(choices=["delivered", "installed", "failed"])
    reason = serializers.CharField(max_length=300, required=False, default="", allow_blank=True)
    metrics = ReportMetricsField(
        required=False, default=dict, help_text="Guard metrics: names (at most 64 characters) to finite numbers."
    )
