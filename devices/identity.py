"""How a device proves who it is: an Ed25519 signature over a server nonce, never a shared secret.

The socket uses it directly (challenge on connect). REST callers exchange a signed nonce for a
short-lived device token (``Authorization: Device <token>``); the device's status is re-checked on every
request, so quarantining a device cuts its token too.
"""

from __future__ import annotations

import re
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, time

from django.conf import settings
from django.core import signing
from django.core.cache import cache

from core.queries import only_row
from devices.ed25519_points import public_key_refusal
from devices.errors import DeviceAuthMalformed, DeviceNotAllowed, DeviceNotAuthenticated, DeviceProtocolRefused
from devices.models import Device, DeviceEvent, DeviceStatus
from edge_agent.protocol import (
    PROTOCOL_VERSION,
    SUPPORTED_PROTOCOLS,
    b64decode,
    b64encode,
    public_key_from_b64,
    token_request_payload,
    verify,
)

TOKEN_SALT = "devices.device-token"  # noqa: S105  (a signing namespace, not a secret)
NONCE_TTL_SECONDS = 60
_NONCE = re.compile(r"[A-Za-z0-9_-]{43}")  # what new_nonce makes: 32 bytes, base64url without padding


def new_nonce() -> str:
    return b64encode(secrets.token_bytes(32))


def _parse_device_id(raw) -> uuid.UUID:
    try:
        return uuid.UUID(str(raw))
    except ValueError:
        raise DeviceAuthMalformed("malformed", "device_id must be a UUID.") from None


def accepted_protocols(now: datetime | None = None) -> tuple[int, ...]:
    """The device protocols the server accepts today: 1 until the end of PROTOCOL_1_ACCEPTED_UNTIL (UTC)."""
    sunset = datetime.combine(datetime.fromisoformat(settings.PROTOCOL_1_ACCEPTED_UNTIL).date(), time.max, UTC)
    return tuple(p for p in SUPPORTED_PROTOCOLS if p > 1 or (now or datetime.now(UTC)) <= sunset)


def ensure_protocol(protocol) -> int:
    """The protocol a hello or token request names (absent: 1), if the server accepts it today."""
    protocol = 1 if protocol is None else protocol
    if protocol not in accepted_protocols():
        raise DeviceProtocolRefused(
            "protocol_unsupported",
            f"protocol {protocol!r} is not accepted; this server speaks {list(accepted_protocols())} "
            f"(protocol 1 until {settings.PROTOCOL_1_ACCEPTED_UNTIL}): update the agent",
        )
    return protocol


def device_verify(*, device_id, payload: dict, signature, protocol: int = PROTOCOL_VERSION) -> Device:
    """Load the device and check the signature, over ``payload``'s canonical form of ``protocol``, with its
    enrolled key (never with a weak one: ``_weak_enrolled_key``). Status is checked separately."""
    parsed = _parse_device_id(device_id)
    device = only_row(Device.objects.select_related("cohort").filter(pk=parsed))
    if device is None:
        raise DeviceNotAuthenticated("auth_failed", "Unknown device or bad signature.")
    if (
        not isinstance(signature, str)
        or _weak_enrolled_key(device)
        or not verify(public_key_from_b64(device.public_key), payload, signature, protocols=(protocol,))
    ):
        _record_auth_failure(device)
        raise DeviceNotAuthenticated("auth_failed", "Unknown device or bad signature.")
    return device


def _weak_enrolled_key(device: Device) -> bool:
    """Whether the device was enrolled, before enrollment checked keys, with one a signature made without any
    private key verifies against (``devices.ed25519_points``): such a device cannot prove who it is."""
    try:
        return public_key_refusal(b64decode(device.public_key)) is not None
    except ValueError:
        return True


def note_protocol(device: Device, protocol: int) -> None:
    """The protocol of a device's accepted hello or token request: its manifests are signed in that protocol's
    canonical form from now on. (Not for a refused one: a refusal changes nothing.)"""
    if device.protocol != protocol:
        Device.objects.filter(pk=device.pk).update(protocol=protocol)
        device.protocol = protocol


AUTH_FAILURE_EVENT_EVERY_SECONDS = 300


def _record_auth_failure(device: Device) -> None:
    """Someone tried to act as this device with a wrong key: leave a trace, at most one per few minutes."""
    if cache.add(f"devauth:failed:{device.pk}", 1, timeout=AUTH_FAILURE_EVENT_EVERY_SECONDS):
        DeviceEvent.objects.create(
            device=device,
            kind=DeviceEvent.Kind.AUTH_FAILED,
            actor_label="unknown",
            detail={"reason": "signature did not verify with the enrolled key"},
        )


def ensure_may_sync(device: Device) -> None:
    if device.status == DeviceStatus.ACTIVE:
        return
    messages = {
        DeviceStatus.PENDING: "This device is waiting for an operator to approve it.",
        DeviceStatus.QUARANTINED: "This device is quarantined by an operator.",
        DeviceStatus.RETIRED: "This device is retired and can no longer sync.",
    }
    raise DeviceNotAllowed(f"device_{device.status}", messages[device.status])


def rest_challenge_create(*, device_id) -> str:
    parsed = _parse_device_id(device_id)
    nonce = new_nonce()
    cache.set(f"devauth:nonce:{nonce}", str(parsed), timeout=NONCE_TTL_SECONDS)
    return nonce


@dataclass(frozen=True)
class DeviceToken:
    token: str
    expires_in: int


def rest_token_issue(*, device_id, nonce, signature, protocol: int | None = None) -> DeviceToken:
    """Spend a nonce (once) and, if the device signed it (in ``protocol``'s canonical form: absent, 1), issue a
    short-lived token."""
    protocol = ensure_protocol(protocol)
    if not isinstance(nonce, str) or not nonce:
        raise DeviceAuthMalformed("malformed", "nonce is required.")
    if not _NONCE.fullmatch(nonce):  # not one we issued: no need to look, nor to build a cache key from it
        raise DeviceNotAuthenticated("nonce_invalid", "Unknown, expired or already used nonce.")
    owner = cache.get(f"devauth:nonce:{nonce}")
    if owner is None or not cache.delete(f"devauth:nonce:{nonce}"):
        raise DeviceNotAuthenticated("nonce_invalid", "Unknown, expired or already used nonce.")
    if owner != str(_parse_device_id(device_id)):
        raise DeviceNotAuthenticated("nonce_invalid", "This nonce was issued to another device.")
    device = device_verify(
        device_id=device_id,
        payload=token_request_payload(nonce=nonce, device_id=owner, protocol=protocol),
        signature=signature,
        protocol=protocol,
    )
    ensure_may_sync(device)
    note_protocol(device, protocol)
    token = signing.dumps({"d": str(device.pk), "k": device.public_key[:16]}, salt=TOKEN_SALT)
    return DeviceToken(token=token, expires_in=settings.DEVICE_TOKEN_TTL_SECONDS)


def rest_token_device(token: str) -> Device:
    try:
        data = signing.loads(token, salt=TOKEN_SALT, max_age=settings.DEVICE_TOKEN_TTL_SECONDS)
    except signing.SignatureExpired:
        raise DeviceNotAuthenticated("token_expired", "The device token has expired; request a new one.") from None
    except signing.BadSignature:
        raise DeviceNotAuthenticated("auth_failed", "Invalid device token.") from None
    device = Device.objects.select_related("cohort").filter(pk=data.get("d")).first()
    if device is None or device.public_key[:16] != data.get("k"):
        raise DeviceNotAuthenticated("auth_failed", "Invalid device token.")
    ensure_may_sync(device)
    return device
