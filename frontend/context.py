from accounts.roles import Role, has_role, role_of


def role(request) -> dict:
    """Expose the user's role to templates so controls a role cannot use are not offered."""
    user = getattr(request, "user", None)
    current = role_of(user)
    return {
        "user_role": current.value if current else None,
        "can_operate": has_role(user, Role.OPERATOR),
        "can_administer": has_role(user, Role.ADMIN),
    }
