"""Small display helpers for the dashboard templates."""

from __future__ import annotations

from datetime import UTC

from django import template
from django.utils import timezone

from frontend import event_text, wording
from frontend.forms import AdapterCohortsForm

register = template.Library()


@register.filter
def summary(detail, limit: int = 140) -> str:
    """A JSON detail dict as ``name value, ...`` on one line, numbers for people (``frontend.wording``), cut
    at ``limit`` characters."""
    return wording.detail_text(detail, limit)


@register.filter
def device_event(event, name: str) -> str:
    """``{{ event|device_event:device.name }}``: a DeviceEvent in words (``frontend.event_text``)."""
    return event_text.device_event(event.kind, event.detail, name)


@register.filter
def number(value, key: str = "") -> str:
    """``{{ value|number }}``: 4.42, 12,345; ``{{ value|number:"eval_accuracy" }}``: a fraction as 93.2%."""
    return wording.number(value, key)


@register.filter
def duration(seconds) -> str:
    """``{{ seconds|duration }}``: 4.2 s, 3 min 5 s, 2 h 5 min; — when it is not known."""
    return wording.duration(seconds)


@register.filter
def round_times(round_) -> str:
    """``{{ round|round_times }}``: aggregated in 4.2 s; released 12 s after close (``wording.round_times``)."""
    return wording.round_times(round_.aggregation_seconds, round_.release_seconds, rerun=round_.reran_at is not None)


@register.filter
def utc_time(value) -> str:
    """A moment in UTC, as the whole dashboard shows time: ``14:03:07 UTC`` today, ``2025-01-31 14:03 UTC``
    before."""
    if value is None:
        return "—"
    moment = value.astimezone(UTC) if timezone.is_aware(value) else value
    today = timezone.now().astimezone(UTC).date()
    return moment.strftime("%H:%M:%S UTC" if moment.date() == today else "%Y-%m-%d %H:%M UTC")


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


@register.inclusion_tag("frontend/_adapter_cohorts_form.html", takes_context=True)
def adapter_cohorts_form(context, adapter):
    """The form that changes which cohorts ``adapter`` serves (admins), its boxes ticked as they are now."""
    served = [cohort.pk for cohort in adapter.cohorts.all()]
    return {
        "csrf_token": context.get("csrf_token"),
        "adapter": adapter,
        "form": AdapterCohortsForm(initial={"cohorts": served}),
    }


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
