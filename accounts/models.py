from __future__ import annotations

from django.contrib.auth.models import AbstractUser, UserManager
from django.db import models
from django.db.models import Count, Q
from django.utils import timezone

from accounts.roles import Role


class OperatorManager(UserManager):
    def active_counts_by_role(self) -> dict[str, int]:
        rows = self.filter(is_active=True).values("role").annotate(n=Count("id"))
        counts = {role.value: 0 for role in Role}
        counts.update({row["role"]: row["n"] for row in rows})
        return counts


class User(AbstractUser):
    """A person who operates the fleet through the dashboard or the API.

    ``role`` decides what they may do (see ``accounts.roles``); superusers count as admins. Devices are
    not users: they authenticate with their own Ed25519 keys.
    """

    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)

    objects = OperatorManager()


class ApiTokenQuerySet(models.QuerySet):
    def usable(self) -> ApiTokenQuerySet:
        now = timezone.now()
        return self.filter(revoked_at__isnull=True, user__is_active=True).filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=now)
        )


class ApiToken(models.Model):
    """A bearer token an integration presents instead of a session; it acts with its user's role.

    Only the sha256 of the token is stored; the token itself is shown once, at creation. ``prefix`` (the
    first characters) lets people tell tokens apart in lists without exposing them.
    """

    user = models.ForeignKey(User, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, db_index=True)
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(User, on_delete=models.SET_NULL, null=True, related_name="+")
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def is_usable(self) -> bool:
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > timezone.now()
