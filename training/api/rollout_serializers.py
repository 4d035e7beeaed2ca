from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api.serializers import StrictTypesMixin
from devices.models import Cohort
from training.models import AdapterVersion, Assignment, Rollout
from training.rollouts.lifecycle import REPORTABLE_METRICS
from training.rollouts.progress import GONE_RULES, counts_for, counts_summary


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
    """Checked by training.rollouts.lifecycle.validate_phases (which also wants the percents rising)."""


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
    """Checked by training.rollouts.lifecycle.validate_guards (which also wants a min or a max)."""


_COUNT = {"type": "integer", "minimum": 0}


@extend_schema_field(
    {
        "type": "object",
        "properties": {
            "installed": _COUNT,
            "failed": _COUNT,
            "pending": _COUNT,
            "gone": _COUNT,
            "gone_by": {"type": "object", "properties": dict.fromkeys(GONE_RULES, _COUNT)},
            "gone_after_seconds": _COUNT,
        },
        "description": "The rollout's devices: installed, failed, pending (may still install) or gone (superseded, "
        "no longer active, left the cohort, or offline and not seen for gone_after_seconds). Live while it is in "
        "progress; once it finished, as they stood then.",
    }
)
class DeviceCountsField(serializers.DictField):
    """training.rollouts.progress.counts_for"""


class RolloutSerializer(StrictTypesMixin, serializers.ModelSerializer):
    version = serializers.PrimaryKeyRelatedField(queryset=AdapterVersion.objects.all())
    phases = PhasesField(help_text="[{percent, min_soak_seconds}], percents increasing, the last ≤ 100")
    guards = GuardsField(required=False, help_text="[{metric, min | max, min_reports}]")
    cohort = serializers.SlugRelatedField(slug_field="name", queryset=Cohort.objects.all())
    adapter = serializers.CharField(source="version.adapter.name", read_only=True)
    version_number = serializers.IntegerField(source="version.number", read_only=True)
    progress = serializers.SerializerMethodField()
    devices = serializers.SerializerMethodField()
    devices_summary = serializers.SerializerMethodField()
    override_gate = serializers.BooleanField(
        required=False,
        default=False,
        write_only=True,
        help_text="Roll out a candidate that failed the release gate anyway (with override_reason); recorded.",
    )
    override_reason = serializers.CharField(
        required=False, default="", allow_blank=True, max_length=300, write_only=True
    )

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
            "devices",
            "devices_summary",
            "override_gate",
            "override_reason",
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
            "devices",
            "devices_summary",
        ]
        extra_kwargs = {"max_failure_rate": {"required": False}}

    def get_progress(self, rollout) -> dict:
        counts = getattr(rollout, "assignment_counts", None)
        return counts if counts is not None else {}

    def _devices(self, rollout) -> dict:
        if not hasattr(rollout, "_device_counts"):
            rollout._device_counts = counts_for(rollout)
        return rollout._device_counts

    @extend_schema_field(DeviceCountsField)
    def get_devices(self, rollout) -> dict:
        return self._devices(rollout)

    def get_devices_summary(self, rollout) -> str:
        """The counts in words: "10 installed, 1 failed, 1 gone (not seen for 10 min)"."""
        return counts_summary(self._devices(rollout))


class RolloutDetailSerializer(RolloutSerializer):
    guard_report = serializers.SerializerMethodField()

    class Meta(RolloutSerializer.Meta):
        fields = RolloutSerializer.Meta.fields + ["guard_report"]

    def get_guard_report(self, rollout) -> list[dict]:
        from training.rollouts.lifecycle import guard_report

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
    """Checked by training.rollouts.lifecycle.assignment_report (finite numbers, names of at most 64 characters)."""


class AssignmentReportSerializer(StrictTypesMixin, serializers.Serializer):
    status = serializers.ChoiceField(choices=["delivered", "installed", "failed"])
    reason = serializers.CharField(max_length=300, required=False, default="", allow_blank=True)
    metrics = ReportMetricsField(
        required=False, default=dict, help_text="Guard metrics: names (at most 64 characters) to finite numbers."
    )
