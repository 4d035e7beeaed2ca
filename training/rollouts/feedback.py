"""Users' corrections as rollout guard metrics.

A device's heartbeat counts the answers its users confirmed and corrected, for the version installed now and the
one before it (``devices.feedback``). When those counts change, the assignment that installed the current version
through a rollout gets them as metrics beside the ones the device reported at install, which rollout guards read
(``training.rollouts.lifecycle.guard_report``) at the next tick:

- ``correction_rate``: corrected / answered of the installed version, from ``MIN_ANSWERS`` answers on;
- ``previous_correction_rate``: the same of the version the device ran before;
- ``correction_rate_change``: the first minus the second, when both have ``MIN_ANSWERS`` answers.

So ``{"metric": "correction_rate_change", "max": 0.1, "min_reports": 2}`` stops a version whose answers users
correct more than 10 points more often than the one before, once two devices say so. A metric without enough
answers is left out (a device that reports it no longer has is not counted), never guessed.
"""

from __future__ import annotations

from devices.feedback import correction_rate
from devices.models import Device
from training.models import Assignment

CORRECTION_METRICS = ("correction_rate", "previous_correction_rate", "correction_rate_change")


def correction_metrics(current: dict, previous: dict | None) -> dict[str, float]:
    """The guard metrics of a version's counts (``{"confirmed", "corrected"}``) and the previous version's."""
    rate = correction_rate(current["confirmed"], current["corrected"])
    before = correction_rate(previous["confirmed"], previous["corrected"]) if previous else None
    metrics = {}
    if rate is not None:
        metrics["correction_rate"] = rate
    if before is not None:
        metrics["previous_correction_rate"] = before
    if rate is not None and before is not None:
        metrics["correction_rate_change"] = round(rate - before, 4)
    return metrics


def with_correction_metrics(metrics: dict, correction: dict[str, float]) -> dict:
    """``metrics`` whose correction metrics are ``correction``'s alone (a device's own figures by those names are
    not taken: the server computes them)."""
    return {**{k: v for k, v in metrics.items() if k not in CORRECTION_METRICS}, **correction}


def stored_correction_metrics(device: Device, version_number: int, adapter_name: str) -> dict[str, float]:
    """The guard metrics of the feedback counts stored on ``device``, if they are of that version; else none."""
    if device.feedback_adapter != adapter_name or device.feedback_version != version_number:
        return {}
    previous = None
    if device.feedback_previous_version is not None:
        previous = {"confirmed": device.feedback_previous_confirmed, "corrected": device.feedback_previous_corrected}
    current = {"confirmed": device.feedback_confirmed, "corrected": device.feedback_corrected}
    return correction_metrics(current, previous)


def assignment_feedback_record(*, device: Device, feedback: dict) -> Assignment | None:
    """The device's installed rollout assignment of the reported current version, its correction metrics updated
    from ``feedback`` (``devices.feedback.parse_feedback``); None when there is none (the version came another
    way, a rollback's assignment, or its install is not reported yet: ``assignment_report`` takes the counts from
    the device row then). The caller holds the device's row lock."""
    current = feedback["current"]
    newest = (
        Assignment.objects.select_for_update(no_key=True, of=("self",))
        .filter(device=device, state=Assignment.State.INSTALLED)
        .select_related("version__adapter")
        .order_by("-seq")
        .first()
    )
    if (
        newest is None
        or newest.rollout_id is None
        or newest.version.number != current["version"]
        or newest.version.adapter.name != feedback["adapter"]
    ):
        return None
    metrics = with_correction_metrics(newest.metrics, correction_metrics(current, feedback["previous"]))
    if metrics != newest.metrics:
        newest.metrics = metrics
        newest.save(update_fields=["metrics"])
    return newest
