from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api.serializers import JsonObjectField, StrictTypesMixin
from devices.models import Cohort
from training.api.personalization_serializers import PersonalizationField
from training.federation.aggregation_settings import AGGREGATION_HELP, validate_aggregation
from training.models import Adapter, AdapterVersion, BaseModel
from training.registry.personalization_settings import PERSONALIZATION_HELP


class BaseModelSerializer(serializers.ModelSerializer):
    class Meta:
        model = BaseModel
        fields = [
            "id",
            "name",
            "family",
            "family_config",
            "weights_sha256",
            "weights_size",
            "parameter_count",
            "created_at",
        ]
        read_only_fields = ["id", "weights_sha256", "weights_size", "parameter_count", "created_at"]


class BaseModelCreateSerializer(StrictTypesMixin, serializers.Serializer):
    name = serializers.SlugField(max_length=64)
    family = serializers.CharField(
        max_length=200,
        help_text="`digits-cnn`, `minilm-text`, `exported-program` (your own model: a `.pt2` saved with "
        "`torch.export.save` as `weights` and its card as `family_config`) or `package.module:attribute`",
    )
    family_config = JsonObjectField(
        required=False, default=dict, help_text="the family's settings; for `exported-program`, the model's card"
    )
    weights = serializers.FileField(
        required=False,
        help_text="safetensors of the family's tensors (omit to store the family's seeded init); for "
        "`exported-program`, the `.pt2` file itself",
    )

    def validate_name(self, value):
        if BaseModel.objects.filter(name=value).exists():
            raise serializers.ValidationError("A base model with this name exists.")
        return value

    def validate_family_config(self, value):
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be a JSON object")
        return value


class CandidateModuleSerializer(serializers.Serializer):
    name = serializers.CharField()
    kind = serializers.ChoiceField(choices=["linear", "conv2d", "weight"])
    shape = serializers.ListField(child=serializers.IntegerField())
    parameters = serializers.IntegerField()


class CandidateModulesSerializer(serializers.Serializer):
    base_model = serializers.CharField()
    modules = CandidateModuleSerializer(many=True)


@extend_schema_field({"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 64})
class ModuleNamesField(serializers.JSONField):
    """Module names, checked by AdapterSerializer._names."""


def settings_checked(value, check):
    """An adapter's aggregation or DP settings, a JSON object checked by ``check`` (ValueError: a 400)."""
    if not isinstance(value, dict):
        raise serializers.ValidationError("must be a JSON object")
    try:
        return check(value)
    except ValueError as exc:
        raise serializers.ValidationError(str(exc)) from None


class AdapterSerializer(StrictTypesMixin, serializers.ModelSerializer):
    base_model = serializers.SlugRelatedField(slug_field="name", queryset=BaseModel.objects.all())
    cohorts = serializers.SlugRelatedField(slug_field="name", queryset=Cohort.objects.all(), many=True, required=False)
    target_modules = ModuleNamesField(required=False, help_text="Omit for the family's default targets.")
    modules_to_save = ModuleNamesField(required=False, help_text="Omit for the family's default.")
    aggregation = JsonObjectField(required=False, help_text=AGGREGATION_HELP)
    personalization = PersonalizationField(required=False, help_text=PERSONALIZATION_HELP)
    latest_version = serializers.SerializerMethodField()

    class Meta:
        model = Adapter
        fields = [
            "id",
            "name",
            "base_model",
            "cohorts",
            "rank",
            "alpha",
            "dropout",
            "target_modules",
            "modules_to_save",
            "tensor_spec",
            "aggregation",
            "personalization",
            "created_at",
            "latest_version",
        ]
        read_only_fields = ["id", "tensor_spec", "created_at", "latest_version"]
        extra_kwargs = {
            "rank": {
                "min_value": 1,
                "max_value": 256,
                "required": False,
                "help_text": "LoRA rank. Omit for the family's default (digits-cnn 16, minilm-text 4).",
            },
            "alpha": {
                "min_value": 0.0,
                "required": False,
                "help_text": "LoRA alpha (the update is scaled by alpha / rank). Omit for the family's default "
                "(digits-cnn 32, minilm-text 8).",
            },
            "dropout": {"min_value": 0.0, "max_value": 0.9},
        }

    def get_latest_version(self, adapter) -> int | None:
        return getattr(adapter, "latest_number", None)

    def validate_name(self, value):
        if Adapter.objects.filter(name=value).exists():
            raise serializers.ValidationError("An adapter with this name exists.")
        return value

    def _names(self, value, field):
        if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value) or len(value) > 64:
            raise serializers.ValidationError(f"{field} must be a list of module names")
        return value

    def validate_aggregation(self, value):
        return settings_checked(value, validate_aggregation)

    def validate_target_modules(self, value):
        return self._names(value, "target_modules")

    def validate_modules_to_save(self, value):
        return self._names(value, "modules_to_save")


class AdapterVersionSerializer(serializers.ModelSerializer):
    adapter = serializers.SlugRelatedField(slug_field="name", read_only=True)
    parent = serializers.SerializerMethodField()

    class Meta:
        model = AdapterVersion
        fields = [
            "id",
            "adapter",
            "number",
            "parent",
            "blob_sha256",
            "size",
            "source",
            "seed",
            "note",
            "metrics",
            "state",
            "gate",
            "server_state",
            "created_at",
        ]
        read_only_fields = fields

    def get_parent(self, version) -> int | None:
        return version.parent.number if version.parent_id else None


class SeedVersionSerializer(StrictTypesMixin, serializers.Serializer):
    seed = serializers.IntegerField(
        min_value=0,
        max_value=2**63 - 1,
        help_text="Seeds the random generator of a fresh adapter: LoRA A initialised as PEFT does (Kaiming "
        "uniform), B zero, modules to save copied from the base, so the adapted model starts equal to the base. "
        "The same seed gives the same bytes (the same sha256) every time.",
    )
    note = serializers.CharField(
        max_length=200, required=False, default="", allow_blank=True, help_text="Shown with the version."
    )


class ImportVersionSerializer(serializers.Serializer):  # multipart only: every value is a string
    adapter_model = serializers.FileField(help_text="adapter_model.safetensors (PEFT key names)")
    adapter_config = serializers.FileField(required=False, help_text="adapter_config.json, checked when given")
    note = serializers.CharField(max_length=200, required=False, default="", allow_blank=True)


class VersionActionSerializer(StrictTypesMixin, serializers.Serializer):
    reason = serializers.CharField(max_length=500, required=False, default="", allow_blank=True)
    override = serializers.BooleanField(
        required=False,
        default=False,
        help_text="release: release a version that failed the release gate anyway (a reason is required); "
        "recorded as version.gate_overridden",
    )
