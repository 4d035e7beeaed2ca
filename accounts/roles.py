"""The three operator roles, ordered: each role can do everything the ones below it can."""

from __future__ import annotations

from django.db import models


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"  # reads everything, changes nothing
    OPERATOR = "operator", "Operator"  # runs rollouts and rounds
    ADMIN = "admin", "Admin"  # fleet settings, enrollment tokens, users

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}


def role_of(user) -> Role | None:
    """The effective role of a user, or None for anonymous or deactivated users."""
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return None
    if getattr(user, "is_device", False):  # devices act only as themselves, never with an operator role
        return None
    if user.is_superuser:
        return Role.ADMIN
    return Role(user.role)


def has_role(user, required: Role | str) -> bool:
    role = role_of(user)
    return role is not None and role.rank >= Role(required).rank
