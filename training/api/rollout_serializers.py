from rest_framework import serializers

from devices.models import Cohort
from training.models import AdapterVersion, Assignment, Rollout


class RolloutSerializer(serializers.ModelSerializer):
    version = serializers.PrimaryKeyRelatedField(queryset=AdapterVersion.objects.all())
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
        extra_kwargs = {"guards": {"required": False}, "max_failure_rate": {"required": False}}

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


class RolloutActionSerializer(serializers.Serializer):
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


class AssignmentReportSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=["delivered", "installed", "failed"])
    reason = serializers.CharField(max_length=300, required=False, default="", allow_blank=True)
    metrics = serializers.DictField(required=False, default=dict)
