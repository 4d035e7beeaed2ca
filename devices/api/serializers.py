from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api.serializers import StrictTypesMixin, VisibleCharField, refuse_control_characters
from devices.feedback import MIN_ANSWERS, device_feedback
from devices.models import Cohort, Device, DeviceEvent, EnrollmentToken, PersonalizationReport
from devices.personalization import EARLIEST_MEASUREMENT, MAX_SAMPLES, SERVING
from devices.presence import MAX_METRICS
from edge_agent.protocol import PERSONALIZATION_METHODS as METHODS
from edge_agent.wire_reports import MAX_COUNT


class CohortSerializer(StrictTypesMixin, serializers.ModelSerializer):
    device_count = serializers.SerializerMethodField()

    class Meta:
        model = Cohort
        fields = ["id", "name", "description", "created_at", "device_count"]
        read_only_fields = ["id", "created_at", "device_count"]

    def get_device_count(self, cohort) -> int:
        count = getattr(cohort, "device_count", None)  # annotated by the view's queryset; not on a new cohort
        return cohort.devices.count() if count is None else count


class EnrollmentTokenSerializer(StrictTypesMixin, serializers.ModelSerializer):
    cohort = serializers.SlugRelatedField(slug_field="name", queryset=Cohort.objects.all())
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    usable = serializers.SerializerMethodField()

    class Meta:
        model = EnrollmentToken
        fields = [
            "id",
            "name",
            "prefix",
            "cohort",
            "uses_left",
            "expires_at",
            "requires_approval",
            "created_by",
            "created_at",
            "revoked_at",
            "usable",
        ]
        read_only_fields = ["id", "prefix", "created_by", "created_at", "revoked_at", "usable"]
        extra_kwargs = {
            "uses_left": {"min_value": 1, "help_text": "Omit or null for unlimited until expiry."},
            "expires_at": {
                "required": False,
                "help_text": "When the token stops being usable; omit for 7 days from now (ENROLLMENT_TOKEN_LIFETIME).",
            },
        }

    def get_usable(self, token) -> bool:
        return (
            token.revoked_at is None
            and token.expires_at > timezone.now()
            and (token.uses_left is None or token.uses_left > 0)
        )

    def validate_expires_at(self, value):
        if value <= timezone.now():
            raise serializers.ValidationError("The expiry must be in the future.")
        return value


class EnrollmentTokenIssuedSerializer(EnrollmentTokenSerializer):
    token = serializers.CharField(read_only=True, help_text="The secret; shown only in this response.")

    class Meta(EnrollmentTokenSerializer.Meta):
        fields = EnrollmentTokenSerializer.Meta.fields + ["token"]


class DeviceEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = DeviceEvent
        fields = ["id", "kind", "actor_label", "detail", "created_at"]


class VersionRefSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    adapter = serializers.CharField(source="adapter.name")
    number = serializers.IntegerField()


@extend_schema_field(
    {
        "type": "object",
        "additionalProperties": {"type": "string", "maxLength": 128},
        "maxProperties": 32,
        "description": "Label names (at most 64 characters) to strings.",
    }
)
class LabelsField(serializers.JSONField):
    """A device's labels; DeviceSerializer.validate_labels holds them to the documented shape."""


class VersionFeedbackSerializer(serializers.Serializer):
    version = serializers.IntegerField()
    confirmed = serializers.IntegerField(help_text="answers its users confirmed")
    corrected = serializers.IntegerField(help_text="answers its users corrected")
    answered = serializers.IntegerField(help_text="confirmed + corrected")
    correction_rate = serializers.FloatField(
        allow_null=True, help_text=f"corrected / answered; null below {MIN_ANSWERS} answers (too few for a rate)"
    )
    note = serializers.CharField(help_text="why there is no rate, when there is none")


class DeviceFeedbackSerializer(serializers.Serializer):
    adapter = serializers.CharField()
    current = VersionFeedbackSerializer(help_text="the version installed at the report")
    previous = VersionFeedbackSerializer(allow_null=True, help_text="the version it ran before, if any")
    feedback_samples = serializers.IntegerField(help_text="labelled samples stored from its users' feedback")
    samples = serializers.IntegerField(help_text="labelled samples it held when the counts last changed")
    unlabeled_samples = serializers.IntegerField(
        allow_null=True, help_text="unlabeled samples it held then; null when its agent does not report them"
    )
    reported_at = serializers.DateTimeField(help_text="when the counts last changed")


class DeviceSerializer(StrictTypesMixin, serializers.ModelSerializer):
    name = VisibleCharField(max_length=100)
    cohort = serializers.SlugRelatedField(slug_field="name", queryset=Cohort.objects.all())
    labels = LabelsField(required=False)
    running_version = VersionRefSerializer(read_only=True, allow_null=True)
    desired_version = VersionRefSerializer(read_only=True, allow_null=True)
    feedback = serializers.SerializerMethodField(
        help_text="what its users said of its answers (their heartbeat's feedback counts); null before a report"
    )

    class Meta:
        model = Device
        fields = [
            "id",
            "name",
            "cohort",
            "status",
            "public_key",
            "hardware",
            "labels",
            "agent_version",
            "protocol",
            "enrolled_at",
            "last_seen_at",
            "online",
            "battery_percent",
            "charging",
            "free_memory_mb",
            "local_metrics",
            "running_version",
            "desired_version",
            "uploads_refused",
            "upload_refused_at",
            "upload_refused_code",
            "feedback",
        ]
        read_only_fields = [f for f in fields if f not in ("name", "cohort", "labels")]

    @extend_schema_field(DeviceFeedbackSerializer(allow_null=True))
    def get_feedback(self, device) -> dict | None:
        report = device_feedback(device)
        return None if report is None else DeviceFeedbackSerializer(report).data

    def validate_labels(self, value):
        if not isinstance(value, dict) or len(value) > 32:
            raise serializers.ValidationError("labels must be an object of at most 32 entries")
        for key, item in value.items():
            if not isinstance(item, str) or len(key) > 64 or len(item) > 128:
                raise serializers.ValidationError("labels map names (≤64 chars) to strings (≤128 chars)")
        refuse_control_characters(value, what="label")
        return value


class DeviceDetailSerializer(DeviceSerializer):
    recent_events = serializers.SerializerMethodField()

    class Meta(DeviceSerializer.Meta):
        fields = DeviceSerializer.Meta.fields + ["recent_events"]

    def get_recent_events(self, device) -> list[dict]:
        return DeviceEventSerializer(device.events.all()[:25], many=True).data


class DeviceActionSerializer(StrictTypesMixin, serializers.Serializer):
    reason = serializers.CharField(required=False, allow_blank=True, max_length=500)


@extend_schema_field({"type": "string", "pattern": "^[A-Za-z0-9_-]{43}=?$"})
class PublicKeyField(serializers.CharField):
    """Documented as the 32 bytes in base64url it must be; device_enroll checks it (invalid_public_key)."""


@extend_schema_field({"type": "object", "maxProperties": 16})
class HardwareField(serializers.DictField):
    pass


@extend_schema_field(
    {"type": "object", "additionalProperties": {"type": "string", "maxLength": 128}, "maxProperties": 32}
)
class EnrollLabelsField(serializers.DictField):
    child = VisibleCharField(max_length=128, allow_blank=True)  # as DeviceSerializer.validate_labels allows


class EnrollRequestSerializer(StrictTypesMixin, serializers.Serializer):
    token = serializers.CharField(max_length=200)
    public_key = PublicKeyField(max_length=64, help_text="Ed25519 public key, base64url (32 bytes)")
    # A device names itself, its labels, version and hardware: operators read each on screens and in logs.
    name = VisibleCharField(max_length=100)
    hardware = HardwareField(required=False, default=dict)
    labels = EnrollLabelsField(required=False, default=dict)
    agent_version = VisibleCharField(max_length=32, required=False, default="", allow_blank=True)

    def validate_hardware(self, value):
        if len(value) > 16:
            raise serializers.ValidationError("at most 16 hardware fields")
        refuse_control_characters(value, what="hardware field")
        return value

    def validate_labels(self, value):
        if len(value) > 32:
            raise serializers.ValidationError("at most 32 labels")
        refuse_control_characters(value, what="label")
        return value


class EnrollResponseSerializer(serializers.Serializer):
    device_id = serializers.UUIDField()
    status = serializers.CharField()
    cohort = serializers.CharField()
    server_public_key = serializers.CharField(help_text="Pin this: the server signs manifests with it.")
    websocket_path = serializers.CharField()
    heartbeat_interval = serializers.IntegerField()


class ChallengeRequestSerializer(StrictTypesMixin, serializers.Serializer):
    device_id = serializers.UUIDField()


class ChallengeResponseSerializer(serializers.Serializer):
    nonce = serializers.CharField()
    expires_in = serializers.IntegerField()


class TokenRequestSerializer(StrictTypesMixin, serializers.Serializer):
    device_id = serializers.UUIDField()
    nonce = serializers.CharField(max_length=128)
    signature = serializers.CharField(max_length=128)
    protocol = serializers.IntegerField(
        min_value=1, max_value=2, required=False, help_text="the protocol the signature was made for (absent: 1)"
    )


class TokenResponseSerializer(serializers.Serializer):
    token = serializers.CharField()
    expires_in = serializers.IntegerField()


@extend_schema_field({"type": "object", "additionalProperties": {"type": "number"}, "maxProperties": MAX_METRICS})
class HeartbeatMetricsField(serializers.DictField):
    child = serializers.FloatField()


# Documents what devices.personalization.parse_personal reads.
class HeartbeatPersonalSerializer(serializers.Serializer):
    adapter = serializers.RegexField(r"^[-a-zA-Z0-9_]{1,64}$", max_length=64)
    version = serializers.IntegerField(min_value=1, max_value=2**31 - 1, help_text="the shared version measured")
    method = serializers.ChoiceField(choices=METHODS)
    serving = serializers.ChoiceField(choices=SERVING, help_text="the model the device serves")
    shared_accuracy = serializers.FloatField(min_value=0, max_value=1)
    personal_accuracy = serializers.FloatField(min_value=0, max_value=1)
    val_samples = serializers.IntegerField(min_value=0, max_value=MAX_SAMPLES)
    trained_samples = serializers.IntegerField(min_value=0, max_value=MAX_SAMPLES)
    shared_only_right = serializers.IntegerField(
        min_value=0, max_value=MAX_SAMPLES, required=False, allow_null=True,
        help_text="distinct held samples the shared version gets right and the personal model wrong",
    )  # fmt: skip
    personal_only_right = serializers.IntegerField(
        min_value=0, max_value=MAX_SAMPLES, required=False, allow_null=True,
        help_text="distinct held samples the personal model gets right and the shared version wrong",
    )  # fmt: skip
    updated_at = serializers.FloatField(
        min_value=EARLIEST_MEASUREMENT, help_text="when it was measured, epoch seconds; at most a day ahead"
    )


class HeartbeatVersionFeedbackSerializer(serializers.Serializer):
    version = serializers.IntegerField(min_value=1, max_value=2**31 - 1)
    confirmed = serializers.IntegerField(min_value=0, max_value=MAX_COUNT)
    corrected = serializers.IntegerField(min_value=0, max_value=MAX_COUNT)


# Documents what devices.feedback.parse_feedback reads.
class HeartbeatFeedbackSerializer(serializers.Serializer):
    adapter = serializers.RegexField(r"^[-a-zA-Z0-9_]{1,64}$", max_length=64)
    current = HeartbeatVersionFeedbackSerializer(help_text="the version installed now")
    previous = HeartbeatVersionFeedbackSerializer(
        required=False, allow_null=True, help_text="the version it ran before the current one, if any"
    )
    feedback_samples = serializers.IntegerField(min_value=0, max_value=MAX_COUNT)
    samples = serializers.IntegerField(min_value=0, max_value=MAX_COUNT)
    unlabeled_samples = serializers.IntegerField(min_value=0, max_value=MAX_COUNT, required=False, allow_null=True)


# Documents the body devices.presence.parse_heartbeat reads (the socket's heartbeat has the same fields).
class DeviceHeartbeatSerializer(serializers.Serializer):
    seq = serializers.IntegerField(min_value=0)
    battery = serializers.FloatField(min_value=0, max_value=100, required=False, allow_null=True)
    charging = serializers.BooleanField(required=False, allow_null=True)
    free_memory_mb = serializers.IntegerField(min_value=0, required=False, allow_null=True)
    metrics = HeartbeatMetricsField(
        required=False, allow_null=True, help_text="Metric names (at most 64 characters) to finite numbers."
    )
    personal = HeartbeatPersonalSerializer(
        required=False,
        allow_null=True,
        help_text="The device's own model against the shared version, on its held-out local data; a new "
        "measurement (a newer updated_at) is stored once.",
    )
    feedback = HeartbeatFeedbackSerializer(
        required=False,
        allow_null=True,
        help_text="Answers its users confirmed and corrected, of the version installed now and the one before; "
        "stored when the counts change.",
    )


class PersonalizationReportSerializer(serializers.ModelSerializer):
    adapter = serializers.CharField(source="adapter_name")
    version = serializers.IntegerField(source="version_number", help_text="the shared version measured")
    gain_points = serializers.FloatField(help_text="personal minus shared accuracy, in points")
    interval_points = serializers.FloatField(
        allow_null=True, read_only=True, help_text="half-width of a 95% interval on gain_points (held samples)"
    )

    class Meta:
        model = PersonalizationReport
        fields = [
            "id",
            "adapter",
            "version",
            "method",
            "serving",
            "shared_accuracy",
            "personal_accuracy",
            "gain_points",
            "interval_points",
            "val_samples",
            "trained_samples",
            "shared_only_right",
            "personal_only_right",
            "measured_at",
            "received_at",
        ]
        read_only_fields = fields
