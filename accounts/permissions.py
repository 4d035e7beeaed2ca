"""Role checks for API views and dashboard pages.

Every view states the role it needs: ``read_role`` for safe methods (default viewer) and ``write_role``
for the rest (default admin, so a view that forgets to say is closed rather than open).
"""

from __future__ import annotations

from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from rest_framework.permissions import SAFE_METHODS, BasePermission

from accounts.roles import Role, has_role


class RolePermission(BasePermission):
    def has_permission(self, request, view) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        if request.method in SAFE_METHODS:
            required = getattr(view, "read_role", Role.VIEWER)
        else:
            required = getattr(view, "write_role", Role.ADMIN)
        return has_role(request.user, required)


def role_required(role: Role):
    """Decorator for dashboard views: sign-in first, then 403 if the role is too low."""

    def decorator(view):
        @wraps(view)
        def wrapped(request, *args, **kwargs):
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            if not has_role(request.user, role):
                raise PermissionDenied(f"This page needs the {role.label.lower()} role.")
            return view(request, *args, **kwargs)

        return wrapped

    return decorator
