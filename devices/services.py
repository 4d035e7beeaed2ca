"""Everything that writes the fleet: cohorts, enrollment tokens, enrollment, device status changes."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from devices.ed25519_points import REASONS, public_key_refusal
from devices.errors import EnrollmentConflict, EnrollmentInvalid, EnrollmentTokenRefused, InvalidTransition
from devices.models import Cohort, Device, DeviceEvent, DeviceStatus, EnrollmentToken
from edge_agent.protocol import CloseCode, b64decode, b64encode

ENROLLMENT_TOKEN_PREFIX = "fet_"  # noqa: S105  (a marker, not a secret)
# How long an enrollment token is usable when its creator names no expiry (the API's expires_at left out).
ENROLLMENT_TOKEN_LIFETIME = timedelta(days=7)


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def _actor_label(actor) -> str:
    return actor.username if actor is not None else "system"


def cohort_create(*, name: str, description: str = "") -> Cohort:
    return Cohort.objects.create(name=name, description=description)


@dataclass(frozen=True)
class IssuedEnrollmentToken:
    token: EnrollmentToken
    raw: str  # shown once


def enrollment_token_create(
    *,
    cohort: Cohort,
    name: str,
    expires_at: datetime | None = None,
    uses: int | None = None,
    requires_approval: bool = True,
    created_by=None,
) -> IssuedEnrollmentToken:
    """A new token for ``cohort``, usable until ``expires_at`` (default: ENROLLMENT_TOKEN_LIFETIME from now)."""
    expires_at = expires_at or timezone.now() + ENROLLMENT_TOKEN_LIFETIME
    raw = ENROLLMENT_TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = EnrollmentToken.objects.create(
        cohort=cohort,
        name=name,
        prefix=raw[: len(ENROLLMENT_TOKEN_PREFIX) + 8],
        token_hash=_hash(raw),
        uses_left=uses,
        expires_at=expires_at,
        requires_approval=requires_approval,
        created_by=created_by,
    )
    return IssuedEnrollmentToken(token=token, raw=raw)


def enrollment_token_revoke(*, token: EnrollmentToken) -> EnrollmentToken:
    EnrollmentToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    token.refresh_from_db()
    return token


@transaction.atomic
def device_enroll(
    *,
    token: str,
    public_key: str,
    name: str,
    hardware: dict | None = None,
    labels: dict | None = None,
    agent_version: str = "",
) -> Device:
    """Spend one use of an enrollment token and register a device under its public key.

    Refusals (each a clear code, nothing written): unknown, revoked, expired or used-up token; a key that
    is not a valid Ed25519 public key (``devices.ed25519_points``: not 32 bytes, not canonical, not on the curve
    or of small order); a key that is already enrolled.
    """
    try:
        raw_key = b64decode(public_key)
        refusal = public_key_refusal(raw_key)
    except ValueError as exc:
        raise EnrollmentInvalid("invalid_public_key", f"public_key: {exc}") from None
    if refusal is not None:
        raise EnrollmentInvalid(
            "invalid_public_key",
            f"public_key {public_key!r} is not an Ed25519 public key to accept: {REASONS[refusal]}",
            details={"reason": refusal},
        )
    # One spelling per key: base64 admits several for the same 32 bytes (padding, the +/ alphabet, set trailing
    # bits), and the unique column compares spellings. Stored canonical, a key enrolled again under another
    # spelling is the duplicate it is.
    public_key = b64encode(raw_key)

    enrollment = EnrollmentToken.objects.select_for_update(no_key=True).filter(token_hash=_hash(token)).first()
    if enrollment is None:
        raise EnrollmentTokenRefused("enrollment_token_invalid", "Unknown enrollment token.")
    if enrollment.revoked_at is not None:
        raise EnrollmentTokenRefused("enrollment_token_revoked", "This enrollment token was revoked.")
    if enrollment.expires_at <= timezone.now():
        raise EnrollmentTokenRefused("enrollment_token_expired", "This enrollment token has expired.")
    if enrollment.uses_left is not None:
        if enrollment.uses_left <= 0:
            raise EnrollmentTokenRefused("enrollment_token_used_up", "This enrollment token has no uses left.")
        EnrollmentToken.objects.filter(pk=enrollment.pk).update(uses_left=F("uses_left") - 1)

    status = DeviceStatus.PENDING if enrollment.requires_approval else DeviceStatus.ACTIVE
    try:
        with transaction.atomic():
            device = Device.objects.create(
                name=name,
                cohort_id=enrollment.cohort_id,
                status=status,
                public_key=public_key,
                hardware=hardware or {},
                labels=labels or {},
                agent_version=agent_version,
                enrolled_with=enrollment,
            )
    except IntegrityError:
        raise EnrollmentConflict("device_key_exists", "A device with this public key is already enrolled.") from None
    DeviceEvent.objects.create(
        device=device,
        kind=DeviceEvent.Kind.ENROLLED,
        actor_label="device",
        detail={"token": enrollment.prefix, "status": status},
    )
    return device


# action -> (states it may start from, state it leads to, event kind)
_TRANSITIONS = {
    "approve": ({DeviceStatus.PENDING}, DeviceStatus.ACTIVE, DeviceEvent.Kind.APPROVED),
    "reject": ({DeviceStatus.PENDING}, DeviceStatus.RETIRED, DeviceEvent.Kind.REJECTED),
    "quarantine": ({DeviceStatus.ACTIVE}, DeviceStatus.QUARANTINED, DeviceEvent.Kind.QUARANTINED),
    "reactivate": ({DeviceStatus.QUARANTINED}, DeviceStatus.ACTIVE, DeviceEvent.Kind.REACTIVATED),
    "retire": (
        {DeviceStatus.PENDING, DeviceStatus.ACTIVE, DeviceStatus.QUARANTINED},
        DeviceStatus.RETIRED,
        DeviceEvent.Kind.RETIRED,
    ),
}
DEVICE_ACTIONS = tuple(_TRANSITIONS)


@transaction.atomic
def device_transition(*, device: Device, action: str, actor, reason: str = "") -> Device:
    """Move a device through its lifecycle, record who did it, and cut its socket if it may no longer sync."""
    if action not in _TRANSITIONS:
        raise InvalidTransition(f"Unknown action {action!r}; use one of: {', '.join(DEVICE_ACTIONS)}.")
    allowed_from, target, kind = _TRANSITIONS[action]
    current = Device.objects.select_for_update(no_key=True).get(pk=device.pk)
    previous = current.status
    if previous not in allowed_from:
        raise InvalidTransition(f"Cannot {action} a device that is {previous}.")
    Device.objects.filter(pk=device.pk).update(status=target)
    device.refresh_from_db()
    DeviceEvent.objects.create(
        device=device,
        kind=kind,
        actor=actor,
        actor_label=_actor_label(actor),
        detail={"from": previous, "to": target, **({"reason": reason} if reason else {})},
    )
    if target != DeviceStatus.ACTIVE:
        from devices.push import device_disconnect

        device_id = str(device.pk)
        # The error names the status (device_quarantined: wait; device_retired: stop), as a hello would be
        # refused, so the agent on the live socket does what the spec's table says (docs/protocol/reference.md).
        error = f"device_{target}"
        transaction.on_commit(
            lambda: device_disconnect(device_id, code=CloseCode.NOT_ALLOWED, error=error, reason=f"device is {target}")
        )
    return device


def device_update(
    *, device: Device, actor, name: str | None = None, labels: dict | None = None, cohort: Cohort | None = None
) -> Device:
    changes = {}
    if name is not None and name != device.name:
        changes["name"] = [device.name, name]
        device.name = name
    if labels is not None and labels != device.labels:
        changes["labels"] = [device.labels, labels]
        device.labels = labels
    if cohort is not None and cohort.pk != device.cohort_id:
        changes["cohort"] = [device.cohort.name, cohort.name]
        device.cohort = cohort
    if changes:
        with transaction.atomic():
            device.save(update_fields=[field for field in ("name", "labels", "cohort") if field in changes])
            DeviceEvent.objects.create(
                device=device,
                kind=DeviceEvent.Kind.UPDATED,
                actor=actor,
                actor_label=_actor_label(actor),
                detail=changes,
            )
    return device
