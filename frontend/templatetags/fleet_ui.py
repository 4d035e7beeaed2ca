"""Small display helpers for the dashboard templates."""

from __future__ import annotations

import json

from django import template

register = template.Library()


@register.filter
def summary(detail, limit: int = 140) -> str:
    """A JSON detail dict as ``key=value, ...`` on one line, cut at ``limit`` characters."""
    if not isinstance(detail, dict) or not detail:
        return ""
    text = ", ".join(
        f"{key}={value if isinstance(value, str) else json.dumps(value, separators=(',', ':'))}"
        for key, value in detail.items()
    )
    return text if len(text) <= limit else text[: limit - 1] + "…"


@register.filter
def short(value, length: int = 10) -> str:
    """The first characters of a hash or id."""
    return str(value or "")[:length]


@register.filter
def get(mapping, key):
    return mapping.get(key) if isinstance(mapping, dict) else None


@register.filter
def percent(part, whole) -> int:
    """``part`` of ``whole`` as a whole percent, capped at 100 (0 when ``whole`` is 0)."""
    try:
        return min(100, round(100 * float(part) / float(whole))) if whole else 0
    except (TypeError, ValueError):
        return 0


@register.filter
def version_label(version) -> str:
    if version is None:
        return "—"
    return f"{version.adapter.name} v{version.number}"


@register.inclusion_tag("frontend/_confirm_form.html", takes_context=True)
def action_button(
    context,
    url: str,
    label: str,
    confirm: str = "",
    danger: bool = False,
    reason: bool = False,
    name: str = "",
    value: str = "",
):
    """A POST button (with CSRF), optionally asking for confirmation and an optional reason first."""
    return {
        "csrf_token": context.get("csrf_token"),
        "url": url,
        "label": label,
        "confirm": confirm,
        "danger": danger,
        "reason": reason,
        "name": name,
        "value": value,
        "next": context["request"].get_full_path() if "request" in context else "",
    }
