"""Everything that writes operator accounts and API tokens."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from accounts.models import ApiToken, User
from accounts.roles import Role

TOKEN_PREFIX = "fpm_"  # noqa: S105  (a marker, not a secret)
# A token's last_used_at is refreshed at most this often, so busy integrations do not write on every call.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class IssuedToken:
    token: ApiToken
    raw: str  # shown to the caller once; never stored


def api_token_create(
    *, user: User, name: str, created_by: User | None = None, expires_at: datetime | None = None
) -> IssuedToken:
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(
        user=user,
        name=name,
        prefix=raw[: len(TOKEN_PREFIX) + 8],
        token_hash=hash_token(raw),
        created_by=created_by or user,
        expires_at=expires_at,
    )
    return IssuedToken(token=token, raw=raw)


def api_token_revoke(*, token: ApiToken) -> ApiToken:
    ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    token.refresh_from_db()
    return token


def api_token_touch(*, token: ApiToken) -> None:
    now = timezone.now()
    if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)


def api_tokens_purge_expired(*, older_than: timedelta = timedelta(days=30)) -> int:
    """Delete tokens that expired or were revoked more than ``older_than`` ago."""
    cutoff = timezone.now() - older_than
    deleted, _ = ApiToken.objects.filter(expires_at__lt=cutoff).delete()
    revoked, _ = ApiToken.objects.filter(revoked_at__lt=cutoff).delete()
    return deleted + revoked


@transaction.atomic
def user_create(*, username: str, role: Role | str, password: str | None = None, email: str = "") -> User:
    user = User(username=username, email=email, role=Role(role))
    if password:
        user.set_password(password)
    else:
        user.set_unusable_password()
    user.save()
    return user


def user_update(*, user: User, role: Role | str | None = None, is_active: bool | None = None) -> User:
    fields = []
    if role is not None:
        user.role = Role(role)
        fields.append("role")
    if is_active is not None:
        user.is_active = is_active
        fields.append("is_active")
    if fields:
        user.save(update_fields=fields)
    return user
