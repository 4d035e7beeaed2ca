"""Small display helpers for the dashboard templates."""

from __future__ import annotations

from datetime import UTC

from django import template
from django.utils import timezone
from django.utils.html import escape
from django.utils.safestring import mark_safe

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
def training_event(event) -> str:
    """``{{ event|training_event }}``: a TrainingEvent in words (``frontend.event_text``)."""
    adapter = event.adapter.name if event.adapter_id else ""
    version = event.version.number if event.version_id else None
    return event_text.training_event(event.kind, event.detail, adapter, version)


@register.filter
def event_details(detail, limit: int = 200) -> str:
    """``{{ event.detail|event_details }}``: an event's details as ``name: value; ...`` without the empty ones
    and the ids its sentence already names (``rollout``, ``round``), cut at a word boundary."""
    if not isinstance(detail, dict):
        return ""
    shown = {k: v for k, v in detail.items() if k not in ("rollout", "round") and v not in (None, "", [], {})}
    return wording.detail_text(shown, limit)


@register.filter
def number(value, key: str = "") -> str:
    """``{{ value|number }}``: 4.42, 12,345; ``{{ value|number:"eval_accuracy" }}``: a fraction as 93.2%."""
    return wording.number(value, key)


@register.filter
def delta_norm(delta) -> str:
    """``{{ delta|delta_norm }}``: its update norm for people, from its message when it was rejected before
    verification stored one (``wording.delta_norm``); — when there is none."""
    return wording.number(wording.delta_norm(delta.norm, delta.state, delta.rejection_detail))


@register.filter
def ident(value) -> str:
    """``<code class="ident">{{ code|ident }}</code>``: an identifier (``norm_too_large``) that may wrap after
    its underscores and nowhere else, not ``norm_too_l`` / ``arge`` in a narrow column."""
    return mark_safe(escape(str(value)).replace("_", "_<wbr>"))  # noqa: S308 (escaped first)


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
