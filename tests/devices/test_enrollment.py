"""Enrollment over the real API: the happy path and every refusal, each changing nothing."""

import base64
import json
from datetime import datetime, timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.utils import timezone
from rest_framework.test import APIClient

from devices.ed25519_points import public_key_refusal
from devices.models import Device, DeviceEvent, DeviceStatus, EnrollmentToken
from devices.server_key import server_public_key_b64
from devices.services import enrollment_token_revoke
from edge_agent.identity import public_key_b64
from edge_agent.protocol import b64encode
from tests.conftest import ROOT

WEAK_KEYS = json.loads((ROOT / "docs" / "protocol" / "vectors" / "weak-keys.json").read_text())
# libsodium's list of the small-order encodings and their y + p forms (crypto_sign_ed25519 blocklist), written
# out apart from the vectors, so the check and the vectors cannot go wrong together.
LIBSODIUM_BLOCKLIST = (
    "00" * 32,
    "01" + "00" * 31,
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "ec" + "ff" * 30 + "7f",
    "ed" + "ff" * 30 + "7f",
    "ee" + "ff" * 30 + "7f",
)


def enroll(token: str, key=None, **extra):
    key = key or Ed25519PrivateKey.generate()
    body = {"token": token, "public_key": public_key_b64(key), "name": "phone-1", **extra}
    return APIClient().post("/api/v1/enroll/", body, format="json")


@pytest.mark.django_db
def test_pre_authorized_token_enrolls_an_active_device_and_returns_the_server_key_to_pin(enrollment_token):
    issued = enrollment_token(uses=2, requires_approval=False)
    response = enroll(issued.raw, hardware={"ram_mb": 2048, "os": "Linux"}, labels={"site": "lab"})
    assert response.status_code == 201, response.content
    body = response.json()
    device = Device.objects.get(pk=body["device_id"])
    assert device.status == "active" and body["status"] == "active"
    assert body["server_public_key"] == server_public_key_b64()
    assert body["websocket_path"] == "/ws/agent/"
    assert device.labels == {"site": "lab"} and device.hardware["ram_mb"] == 2048
    assert EnrollmentToken.objects.get(pk=issued.token.pk).uses_left == 1
    assert list(device.events.values_list("kind", flat=True)) == ["enrolled"]


@pytest.mark.django_db
def test_approval_token_enrolls_a_pending_device(enrollment_token):
    response = enroll(enrollment_token(requires_approval=True).raw)
    assert response.status_code == 201
    assert response.json()["status"] == "pending"


def _refusal(response, code: str, status: int):
    assert response.status_code == status, response.content
    assert response.json()["error"]["code"] == code
    return response.json()["error"]["message"]


@pytest.mark.django_db
def test_unknown_expired_revoked_and_used_up_tokens_are_refused_and_change_nothing(enrollment_token):
    expired = enrollment_token(expires_in=timedelta(seconds=-1))
    revoked = enrollment_token()
    enrollment_token_revoke(token=revoked.token)
    used_up = enrollment_token(uses=1)
    assert enroll(used_up.raw).status_code == 201
    before = (Device.objects.count(), DeviceEvent.objects.count())

    assert "Unknown" in _refusal(enroll("fet_nonsense"), "enrollment_token_invalid", 401)
    assert "expired" in _refusal(enroll(expired.raw), "enrollment_token_expired", 401)
    assert "revoked" in _refusal(enroll(revoked.raw), "enrollment_token_revoked", 401)
    assert "no uses left" in _refusal(enroll(used_up.raw), "enrollment_token_used_up", 401)

    assert (Device.objects.count(), DeviceEvent.objects.count()) == before
    assert EnrollmentToken.objects.get(pk=used_up.token.pk).uses_left == 0


@pytest.mark.django_db
def test_a_bad_or_reused_public_key_is_refused_without_spending_a_use(enrollment_token):
    issued = enrollment_token(uses=3)
    key = Ed25519PrivateKey.generate()
    assert enroll(issued.raw, key=key).status_code == 201
    _refusal(enroll(issued.raw, key=key), "device_key_exists", 409)
    response = APIClient().post(
        "/api/v1/enroll/", {"token": issued.raw, "public_key": "AAAA", "name": "x"}, format="json"
    )
    _refusal(response, "invalid_public_key", 400)
    assert EnrollmentToken.objects.get(pk=issued.token.pk).uses_left == 2
    assert Device.objects.count() == 1


@pytest.mark.django_db
def test_the_same_key_spelled_another_way_in_base64_is_the_same_key(enrollment_token):
    """Padding, the standard alphabet's + and /, or set trailing bits spell the same 32 bytes: each is refused as
    already enrolled, and the key is stored in the one canonical spelling (base64url without padding)."""
    issued = enrollment_token(uses=6)
    key = Ed25519PrivateKey.generate()
    while not set(public_key_b64(key)) & set("-_"):  # a key whose spelling shows the alphabet
        key = Ed25519PrivateKey.generate()
    canonical = public_key_b64(key)
    standard = base64.b64encode(base64.urlsafe_b64decode(canonical + "=")).decode()
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    spare_bits = canonical[:-1] + alphabet[alphabet.index(canonical[-1]) | 1]  # 43 characters hold 2 spare bits
    assert base64.urlsafe_b64decode(spare_bits + "=") == base64.urlsafe_b64decode(canonical + "=")
    first = APIClient().post("/api/v1/enroll/", {"token": issued.raw, "public_key": standard, "name": "a"},
                             format="json")  # fmt: skip
    assert first.status_code == 201, first.content
    assert Device.objects.get().public_key == canonical
    for spelling in (canonical, canonical + "=", standard.rstrip("="), spare_bits):
        again = APIClient().post("/api/v1/enroll/", {"token": issued.raw, "public_key": spelling, "name": "b"},
                                 format="json")  # fmt: skip
        _refusal(again, "device_key_exists", 409)
    assert Device.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("weak", WEAK_KEYS["keys"], ids=lambda weak: weak["is"])
def test_a_weak_ed25519_key_is_refused_with_its_reason_and_changes_nothing(enrollment_token, weak):
    issued = enrollment_token(uses=3)
    body = {"token": issued.raw, "public_key": weak["public_key"], "name": "phone-1"}
    response = APIClient().post("/api/v1/enroll/", body, format="json")
    message = _refusal(response, "invalid_public_key", 400)
    assert weak["public_key"] in message
    assert response.json()["error"]["details"] == {"reason": weak["reason"]}
    assert Device.objects.count() == 0 and DeviceEvent.objects.count() == 0
    assert EnrollmentToken.objects.get(pk=issued.token.pk).uses_left == 3


def test_the_point_check_refuses_libsodium_s_blocklist_and_accepts_generated_keys():
    assert all(public_key_refusal(bytes.fromhex(encoded)) is not None for encoded in LIBSODIUM_BLOCKLIST)
    assert {public_key_refusal(bytes.fromhex(weak["hex"])) for weak in WEAK_KEYS["keys"]} == {
        "small_order", "non_canonical", "not_on_curve",
    }  # fmt: skip
    for _ in range(200):
        assert public_key_refusal(Ed25519PrivateKey.generate().public_key().public_bytes_raw()) is None


@pytest.mark.django_db
def test_a_device_enrolled_with_the_identity_point_cannot_sign_in_with_a_keyless_signature(cohort):
    # Enrolled before the check: with the identity as key, R = identity and S = 0 verify for every message.
    identity = bytes([1]) + bytes(31)
    device = Device.objects.create(
        name="old", cohort=cohort, status=DeviceStatus.ACTIVE, public_key=b64encode(identity)
    )
    client = APIClient()
    nonce = client.post("/api/v1/device-auth/challenge/", {"device_id": str(device.pk)}, format="json").json()
    body = {
        "device_id": str(device.pk),
        "nonce": nonce["nonce"],
        "signature": b64encode(identity + bytes(32)),
        "protocol": 2,
    }
    response = client.post("/api/v1/device-auth/token/", body, format="json")
    _refusal(response, "auth_failed", 401)


# What a name must not hold: each is refused, never rewritten (the character and where it is, in the message).
CONTROL_CHARACTERS = {
    "rtl-override": ("phone\u202egpj.exe", "U+202E (RIGHT-TO-LEFT OVERRIDE) at character 6"),
    "ltr-embedding": ("\u202aphone", "U+202A"),
    "isolate": ("phone\u2067", "U+2067 (RIGHT-TO-LEFT ISOLATE)"),
    "ansi-escape": ("phone\x1b[31m", "U+001B (a control character) at character 6"),
    "newline": ("phone\nenrolled as admin", "U+000A"),
    "carriage-return": ("phone\r", "U+000D"),
    "bell": ("phone\x07", "U+0007"),
    "nul": ("phone\x00", "U+0000"),
    "delete": ("phone\x7f", "U+007F"),
    "c1-next-line": ("phone\x85", "U+0085"),
    "line-separator": ("phone\u2028", "U+2028 (LINE SEPARATOR)"),
}


@pytest.mark.django_db
@pytest.mark.parametrize("case", CONTROL_CHARACTERS, ids=str)
def test_a_device_name_with_a_control_character_is_refused_and_enrolls_nothing(enrollment_token, case):
    name, said = CONTROL_CHARACTERS[case]
    issued = enrollment_token(uses=3)
    error = enroll(issued.raw, name=name).json()["error"]
    assert error["code"] == "invalid" and said in error["details"]["name"][0], error
    assert Device.objects.count() == 0
    assert EnrollmentToken.objects.get(pk=issued.token.pk).uses_left == 3


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"labels": {"site": "lab\u202e"}}, "labels"),
        ({"labels": {"si\x1bte": "lab"}}, "labels"),
        ({"agent_version": "1.0\n"}, "agent_version"),
        ({"hardware": {"os": "Linux\x1b]0;title\x07"}}, "hardware"),
        ({"hardware": {"cpu": ["arm", "x86\u2066"]}}, "hardware"),
    ],
    ids=["label-value", "label-name", "agent-version", "hardware-value", "hardware-nested"],
)
def test_labels_version_and_hardware_with_control_characters_are_refused(enrollment_token, extra, field):
    response = enroll(enrollment_token().raw, **extra)
    assert response.status_code == 400 and "control characters are not accepted" in str(
        response.json()["error"]["details"][field]
    )
    assert Device.objects.count() == 0


@pytest.mark.django_db
def test_names_in_other_scripts_and_with_emoji_are_taken_as_sent(enrollment_token):
    name = "téléphone 電話 هاتف \U0001f4f1 \u200d"  # letters of any script, an emoji, a zero-width joiner
    response = enroll(enrollment_token().raw, name=name, labels={"site": "Zürich"})
    assert response.status_code == 201, response.content
    assert Device.objects.get().name == name


@pytest.mark.django_db
def test_malformed_enrollment_bodies_get_field_errors(enrollment_token):
    issued = enrollment_token()
    response = APIClient().post(
        "/api/v1/enroll/", {"token": issued.raw, "name": "x" * 500, "labels": "nope"}, format="json"
    )
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "invalid"
    assert {"public_key", "name", "labels"} <= set(error["details"])
    assert APIClient().post("/api/v1/enroll/", "not json", content_type="application/json").status_code == 400


@pytest.mark.django_db
def test_enrollment_is_rate_limited_per_client(enrollment_token, settings):
    settings.ENROLLMENT_RATE = "3/min"
    statuses = [enroll("fet_nonsense").status_code for _ in range(4)]
    assert statuses == [401, 401, 401, 429]
    response = enroll(enrollment_token().raw)
    assert response.status_code == 429
    assert response.json()["error"]["details"]["retry_after_seconds"] > 0


@pytest.mark.django_db
def test_device_sign_ins_have_their_own_bucket_and_never_use_up_enrollments(enrollment_token, settings):
    settings.ENROLLMENT_RATE, settings.DEVICE_AUTH_RATE = "2/min", "3/min"
    challenge = [
        APIClient().post("/api/v1/device-auth/challenge/", {"device_id": "nope"}, format="json").status_code
        for _ in range(4)
    ]
    assert challenge[-1] == 429 and 429 not in challenge[:3]
    assert enroll(enrollment_token().raw).status_code == 201  # a fleet signing in leaves room for a new device


@pytest.mark.django_db
def test_admin_creates_a_token_shown_once_and_only_admins_may(api_client_for, cohort):
    expires = (timezone.now() + timedelta(days=1)).isoformat()
    body = {"name": "batch-7", "cohort": cohort.name, "expires_at": expires, "uses_left": 10}
    assert api_client_for("operator").post("/api/v1/enrollment-tokens/", body, format="json").status_code == 403
    admin = api_client_for("admin")
    response = admin.post("/api/v1/enrollment-tokens/", body, format="json")
    assert response.status_code == 201
    raw = response.json()["token"]
    token = EnrollmentToken.objects.get(pk=response.json()["id"])
    assert raw.startswith("fet_") and raw not in token.token_hash
    listed = admin.get("/api/v1/enrollment-tokens/").json()["results"][0]
    assert "token" not in listed and listed["usable"] is True
    assert admin.post(f"/api/v1/enrollment-tokens/{token.pk}/revoke/").json()["usable"] is False
    assert enroll(raw).json()["error"]["code"] == "enrollment_token_revoked"


@pytest.mark.django_db
def test_token_expiry_must_be_in_the_future(api_client_for, cohort):
    body = {"name": "old", "cohort": cohort.name, "expires_at": (timezone.now() - timedelta(days=1)).isoformat()}
    response = api_client_for("admin").post("/api/v1/enrollment-tokens/", body, format="json")
    assert response.status_code == 400 and "expires_at" in response.json()["error"]["details"]


@pytest.mark.django_db
def test_a_token_created_without_an_expiry_is_usable_for_seven_days_as_the_schema_says(api_client_for, cohort):
    admin = api_client_for("admin")
    before = timezone.now()
    response = admin.post("/api/v1/enrollment-tokens/", {"name": "first", "cohort": cohort.name}, format="json")
    assert response.status_code == 201, response.content
    expires = datetime.fromisoformat(response.json()["expires_at"])
    assert before + timedelta(days=7) <= expires <= timezone.now() + timedelta(days=7)
    assert response.json()["usable"] is True and enroll(response.json()["token"]).status_code == 201
    schema = admin.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    request = schema["components"]["schemas"]["EnrollmentTokenRequest"]
    assert "expires_at" not in request["required"] and "7 days" in request["properties"]["expires_at"]["description"]
