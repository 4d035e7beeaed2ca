"""What a device's users say of its answers: the heartbeat's ``feedback`` object, checked and stored.

Users confirm or correct the answers of the model a device serves (``edge_agent.feedback``); the device counts
them per installed version and its heartbeat carries the counts of the version installed now and of the one it
ran before (docs/protocol/README.md, "Heartbeats"). Heartbeats repeat the counts until they change, so only a
change reaches the database: ``devices.presence`` compares them with the last ones stored on the heartbeat's
own round trip. The counts are stored on the device (``Device.feedback_*``) and handed to the training side,
which turns them into a rollout's guard metrics (``training.rollouts.feedback``).

The correction rate, corrected / (confirmed + corrected), is a rate only from ``MIN_ANSWERS`` answers on: below
that, a device or a version says how many answers it has and that they are too few.
"""

from __future__ import annotations

import json

from django.db import transaction
from django.utils import timezone

from devices.models import Device
from devices.socket_hooks import training_side
from edge_agent.wire import validated
from edge_agent.wire_reports import Feedback

MIN_ANSWERS = 5  # answers a correction rate is shown and guarded on from
SAMPLE_COUNTS = ("samples", "unlabeled_samples")  # stored with the counts, never a reason to store them


def parse_feedback(value) -> dict | None:
    """A heartbeat's ``feedback`` object, checked (ValueError naming the bad field); None when the heartbeat has
    none. Fields other than the documented ones are ignored, as in the rest of a heartbeat."""
    if value is None:
        return None
    feedback = validated(Feedback, value, what="feedback").to_dict()
    previous = feedback["previous"]
    if previous is not None and previous["version"] == feedback["current"]["version"]:
        raise ValueError("feedback.previous.version: the version before the current one cannot be the current one")
    return feedback


def fingerprint(feedback: dict) -> str:
    """What decides whether a report is new: everything but ``samples`` and ``unlabeled_samples``, which change
    with every sample the device collects (a database write per heartbeat), where the counts change only with
    feedback."""
    counts = {k: v for k, v in feedback.items() if k not in SAMPLE_COUNTS}
    return json.dumps(counts, sort_keys=True, separators=(",", ":"))


def correction_rate(confirmed: int | None, corrected: int | None) -> float | None:
    """corrected / (confirmed + corrected), or None with fewer than ``MIN_ANSWERS`` answers (or none reported)."""
    answered = (confirmed or 0) + (corrected or 0)
    return round(corrected / answered, 4) if answered >= MIN_ANSWERS and corrected is not None else None


def version_feedback(version: int | None, confirmed: int | None, corrected: int | None) -> dict | None:
    """One version's counts as the API and the pages show them: the rate, or why there is none."""
    if version is None:
        return None
    answered = (confirmed or 0) + (corrected or 0)
    rate = correction_rate(confirmed, corrected)
    return {
        "version": version,
        "confirmed": confirmed or 0,
        "corrected": corrected or 0,
        "answered": answered,
        "correction_rate": rate,
        "note": "" if rate is not None else f"{answered} answer{'' if answered == 1 else 's'}, too few for a rate",
    }


def device_feedback(device: Device) -> dict | None:
    """A device's stored report (no query: the device's own columns), or None before its first."""
    if device.feedback_reported_at is None:
        return None
    return {
        "adapter": device.feedback_adapter,
        "current": version_feedback(device.feedback_version, device.feedback_confirmed, device.feedback_corrected),
        "previous": version_feedback(
            device.feedback_previous_version, device.feedback_previous_confirmed, device.feedback_previous_corrected
        ),
        "feedback_samples": device.feedback_samples,
        "samples": device.stored_samples,
        "unlabeled_samples": device.unlabeled_samples,
        "reported_at": device.feedback_reported_at,
    }


def feedback_report_record(*, device_id, feedback: dict) -> bool:
    """Store a device's report (from ``parse_feedback``) and hand its counts to the training side (the rollout
    guard metrics of the versions it installed). False when the device is gone."""
    current, previous = feedback["current"], feedback["previous"] or {}
    with transaction.atomic():
        # The device row first, as every writer of a device's assignments locks it before them.
        device = Device.objects.select_for_update(no_key=True).filter(pk=device_id).first()
        if device is None:
            return False
        fields = {
            "feedback_adapter": feedback["adapter"],
            "feedback_version": current["version"],
            "feedback_confirmed": current["confirmed"],
            "feedback_corrected": current["corrected"],
            "feedback_previous_version": previous.get("version"),
            "feedback_previous_confirmed": previous.get("confirmed"),
            "feedback_previous_corrected": previous.get("corrected"),
            "feedback_samples": feedback["feedback_samples"],
            "stored_samples": feedback["samples"],
            "unlabeled_samples": feedback.get("unlabeled_samples"),
            "feedback_reported_at": timezone.now(),
        }
        Device.objects.filter(pk=device.pk).update(**fields)
        training_side().feedback_reported(device, feedback)
    return True
