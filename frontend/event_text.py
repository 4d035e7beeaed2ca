"""What happened, in a sentence an operator reads: "demo-03 uploaded a delta for digits-lora (v2, 48 samples)",
"round 4 of digits-lora closed with 5 deltas (buffer full)", "version 3 of digits-lora released".

Three sources: device events and training events (the audit trail: the overview's recent activity and the
device page), and live events (``core.live``: the overview's live feed). Each takes the names it needs
from its caller or its payload, never from the database (``live_link`` only builds a URL). A kind without a
sentence of its own still reads as words with its details (``frontend.wording``).
"""

from __future__ import annotations

from typing import Any

from django.urls import NoReverseMatch, reverse

from frontend.wording import detail_text, number, plural, words

CLOSE_REASONS = {"buffer_full": "buffer full", "deadline": "deadline passed", "manual": "closed by an operator"}


def _reason(detail: dict, key: str = "reason") -> str:
    reason = detail.get(key)
    return f": {reason}" if reason else ""


def _fallback(subject: str, kind: str, detail: dict) -> str:
    extra = detail_text(detail)
    return f"{subject + ': ' if subject else ''}{words(kind.replace('.', ' '))}{' (' + extra + ')' if extra else ''}"


# --- device events -------------------------------------------------------------------------------------------

_STATUS_CHANGES = {"approved", "rejected", "quarantined", "reactivated", "retired"}
_PRESENCE = {"online": "came online", "offline": "went offline"}


def device_event(kind: str, detail: dict | None, name: str) -> str:
    """A DeviceEvent (``kind`` without the ``device.`` prefix) of the device called ``name``."""
    detail = detail or {}
    name = name or "a device"
    if kind == "enrolled":
        waits = " and waits for approval" if detail.get("status") == "pending" else ""
        token = f" with token {detail['token']}…" if detail.get("token") else ""
        return f"{name} enrolled{token}{waits}"
    if kind in _STATUS_CHANGES:
        return f"{name} {kind}{_reason(detail)}"
    if kind in _PRESENCE:
        return f"{name} {_PRESENCE[kind]}"
    if kind == "updated":
        changed = ", ".join(words(key) for key in detail) or "nothing"
        return f"{name} updated: {changed}"
    if kind == "auth_failed":
        return f"a request as {name} failed to authenticate{_reason(detail)}"
    return _fallback(name, kind, detail)


# --- training events (the audit trail) ------------------------------------------------------------------------


def _version(number_: Any, adapter: str) -> str:
    return f"version {number_} of {adapter}" if adapter else f"version {number_}"


def _round(detail: dict, adapter: str) -> str:
    return f"round {detail.get('round', '?')} of {adapter}" if adapter else f"round {detail.get('round', '?')}"


def _rollout(detail: dict, adapter: str, version: Any) -> str:
    what = f" of {adapter} v{version}" if adapter and version is not None else ""
    return f"rollout {detail.get('rollout', '?')}{what}"


def training_event(kind: str, detail: dict | None, adapter: str = "", version: Any = None) -> str:
    """A TrainingEvent of ``adapter`` (its name) and ``version`` (its number), both optional."""
    detail = detail or {}
    group, _, action = kind.partition(".")
    if kind == "base_model.created":
        return f"base model {detail.get('base_model', '')} added".replace("  ", " ")
    if kind == "adapter.created":
        return f"adapter {adapter} created (rank {detail.get('rank', '?')})"
    if kind == "adapter.aggregation_changed":
        return f"{adapter}'s aggregation changed: {detail_text(detail) or 'no change'}"
    if kind == "adapter.personalization_changed":
        setting = detail.get("personalization") or {}
        method = setting.get("method", "the default method")
        rest = {k: v for k, v in setting.items() if k != "method"}
        return f"{adapter} now personalizes with {method}" + (f" ({detail_text(rest)})" if rest else "")
    if kind == "adapter.cohorts_changed":
        served = ", ".join(detail.get("cohorts") or []) or "no cohort"
        return f"{adapter} now serves {served}"
    if kind == "version.created":
        source = f"from seed {detail['seed']}" if detail.get("source") == "seed" else "imported"
        return f"{_version(version, adapter)} created, {source}"
    if kind == "version.gate_failed":
        return f"{_version(version, adapter)} failed the release gate and stays a candidate{_reason(detail)}"
    if kind == "version.gate_overridden":
        why = f": {detail['reason']}" if detail.get("reason") else ""
        doing = detail.get("doing", "release")
        return f"{_version(version, adapter)}: the release gate was overridden to {doing} it{why}"
    if kind == "version.release_held":
        return (
            f"{_version(version, adapter)} was not rolled out automatically to {detail.get('cohort', 'a cohort')}: "
            f"an operator's rollout {detail.get('rollout', '?')} is in progress there"
        )
    if group == "version":
        return f"{_version(version, adapter)} {words(action)}{_reason(detail)}"
    if group == "round":
        return _round_event(action, detail, adapter, version)
    if group == "rollout":
        return _rollout_event(action, detail, adapter, version)
    return _fallback(adapter, kind, detail)


def _round_event(action: str, detail: dict, adapter: str, version: Any) -> str:
    this = _round(detail, adapter)
    if action == "opened":
        return f"{this} opened on v{detail.get('base_version', '?')}"
    if action == "closed":
        reason = CLOSE_REASONS.get(detail.get("reason"), words(detail.get("reason") or ""))
        return f"{this} closed with {plural(detail.get('deltas', 0), 'delta')}{f' ({reason})' if reason else ''}"
    if action == "completed":
        made = f"made version {version}" if version is not None else "completed"
        counts = [
            plural(detail[key], noun) for key, noun in (("deltas", "delta"), ("samples", "sample")) if key in detail
        ]
        return f"{this} {made}{' from ' + ' and '.join(counts) if counts else ''}"
    if action == "failed":
        return f"{this} failed{_reason(detail)}"
    if action == "rerun":
        return f"{this} is aggregated again"
    if action == "refused":
        return f"a new round of {adapter} was refused{_reason(detail, 'message')}"
    return _fallback(this, action, detail)


def _rollout_event(action: str, detail: dict, adapter: str, version: Any) -> str:
    this = _rollout(detail, adapter, version)
    if action == "phase":
        phase = detail.get("phase")
        step = f"phase {phase + 1}" if isinstance(phase, int) else "its next phase"
        assigned = f" ({plural(detail['assigned'], 'more device')})" if "assigned" in detail else ""
        return f"{this} moved to {step}{assigned}"
    if action in ("started", "resumed") and "assigned" in detail:
        return f"{this} {action} ({plural(detail['assigned'], 'device')} assigned)"
    if action == "aborted" and "withdrawn" in detail:
        return f"{this} aborted{_reason(detail)} ({plural(detail['withdrawn'], 'assignment')} withdrawn)"
    if action == "rolled_back" and "reverted" in detail:
        return f"{this} rolled back{_reason(detail)} ({plural(detail['reverted'], 'device')} reverted)"
    return f"{this} {words(action)}{_reason(detail)}"


# --- live events --------------------------------------------------------------------------------------------


def _delta_event(kind: str, data: dict) -> str:
    device = data.get("device_name") or "a device"
    about = f"for {data['adapter']} " if data.get("adapter") else ""
    samples = f", {plural(data['num_samples'], 'sample')}" if isinstance(data.get("num_samples"), int) else ""
    base = f"(v{data.get('base_version', '?')}{samples})"
    if kind == "delta.received":
        return f"{device} uploaded a delta {about}{base}"
    if kind == "delta.rejected":
        code = words(data.get("rejection_code") or "unknown reason")
        return f"{device}'s delta {about}{base} was rejected: {code}"
    into = f" into round {data['round']}" if data.get("round") else ""
    return f"{device}'s delta {about}{base} was {data.get('state') or 'verified'}{into}"


def _round_live(kind: str, data: dict) -> str:
    this = f"round {data.get('id', '?')} of {data.get('adapter') or 'an adapter'}"
    deltas = data.get("deltas")
    if kind == "round.completed":
        made = f"made version {data['result_version']}" if data.get("result_version") else "completed"
        held = "; it failed the release gate and stays a candidate" if data.get("gate") == "failed" else ""
        return f"{this} {made}{' from ' + plural(deltas, 'delta') if deltas is not None else ''}{held}"
    if kind == "round.failed":
        return f"{this} failed{_reason(data, 'failure')}"
    if data.get("state") == "aggregating":
        return f"{this} closed with {plural(deltas or 0, 'delta')}; aggregating"
    if deltas is not None and data.get("buffer_size"):
        return f"{this}: {deltas} of {plural(data['buffer_size'], 'delta')} collected"
    return f"{this} is {data.get('state') or 'updated'}"


def live_event(kind: str, data: dict | None) -> str:
    """The live feed's line for one ``LiveEvent``: names from its payload (``training.federation.events``,
    ``devices.tasks``)."""
    data = data or {}
    group, _, action = kind.partition(".")
    if group == "device" and action:
        return device_event(action, data, data.get("name") or "a device")
    if kind == "fleet.presence":
        return (
            f"{plural(data.get('came_online', 0), 'device')} came online, {data.get('went_offline', 0)} went "
            f"offline ({number(data.get('online', 0))} online)"
        )
    if group == "delta":
        return _delta_event(kind, data)
    if group == "round":
        return _round_live(kind, data)
    if group == "rollout":
        phase = data.get("phase")
        step = f"phase {phase + 1}" if isinstance(phase, int) else "its next phase"
        this = f"rollout {data.get('id', '?')}"
        if action == "phase":
            return f"{this} moved to {step}"
        return f"{this} {words(action)}{f' ({step})' if action in ('started', 'resumed') else ''}"
    return _fallback("", kind, data)


def live_link(kind: str, data: dict | None) -> str:
    """The page a live event is about ("" when none): its device, round or rollout."""
    data = data or {}
    group = kind.partition(".")[0]
    try:
        if group in ("device", "delta") and data.get("device"):
            return reverse("frontend:device-detail", args=[data["device"]])
        if group == "round" and isinstance(data.get("id"), int):
            return reverse("frontend:round-detail", args=[data["id"]])
        if group == "rollout" and isinstance(data.get("id"), int):
            return reverse("frontend:rollout-detail", args=[data["id"]])
    except NoReverseMatch:  # not a device id, say
        return ""
    return ""
