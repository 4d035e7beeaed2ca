from django.contrib.auth.password_validation import validate_password
from rest_framework import serializers

from accounts.models import ApiToken, User
from accounts.roles import Role, role_of
from core.api.serializers import StrictTypesMixin


def _email_field() -> serializers.CharField:
    # A plain string, not format "email": an account without an address has "".
    return serializers.CharField(read_only=True, help_text="Empty when the account has no address.")


class MeSerializer(serializers.ModelSerializer):
    email = _email_field()
    effective_role = serializers.SerializerMethodField()

    class Meta:
        model = User
        fields = ["id", "username", "email", "role", "effective_role"]

    def get_effective_role(self, user) -> str:
        return role_of(user).value


class UserSerializer(StrictTypesMixin, serializers.ModelSerializer):
    email = _email_field()

    class Meta:
        model = User
        fields = ["id", "username", "email", "role", "is_active", "date_joined", "last_login"]
        read_only_fields = ["id", "username", "email", "date_joined", "last_login"]


class UserCreateSerializer(StrictTypesMixin, serializers.Serializer):
    username = serializers.RegexField(r"^[\w.@+-]{1,150}$")
    email = serializers.EmailField(required=False, default="")
    role = serializers.ChoiceField(choices=Role.choices)
    password = serializers.CharField(
        write_only=True,
        required=False,
        allow_blank=False,
        trim_whitespace=False,  # a password is kept as typed (as Django's own forms do)
        style={"input_type": "password"},
    )

    def validate_username(self, value):
        if User.objects.filter(username=value).exists():
            raise serializers.ValidationError("A user with this username exists.")
        return value

    def validate(self, attrs):
        if attrs.get("password"):
            validate_password(attrs["password"], User(username=attrs["username"], email=attrs.get("email", "")))
        return attrs


class ApiTokenSerializer(serializers.ModelSerializer):
    user = serializers.SlugRelatedField(slug_field="username", read_only=True)
    usable = serializers.BooleanField(source="is_usable", read_only=True)

    class Meta:
        model = ApiToken
        fields = ["id", "name", "prefix", "user", "created_at", "expires_at", "last_used_at", "revoked_at", "usable"]
        read_only_fields = fields


class ApiTokenCreateSerializer(StrictTypesMixin, serializers.Serializer):
    name = serializers.CharField(max_length=100)
    expires_at = serializers.DateTimeField(required=False, allow_null=True)
    user = serializers.SlugRelatedField(
        slug_field="username",
        queryset=User.objects.filter(is_active=True),
        required=False,
        help_text="Admins may issue a token for another user; others always get their own.",
    )

    def validate_expires_at(self, value):
        from django.utils import timezone

        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("The expiry must be in the future.")
        return value


class ApiTokenIssuedSerializer(ApiTokenSerializer):
    token = serializers.CharField(read_only=True, help_text="The secret; shown only in this response.")

    class Meta(ApiTokenSerializer.Meta):
        fields = ApiTokenSerializer.Meta.fields + ["token"]
        read_only_fields = fields
