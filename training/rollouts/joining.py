"""Devices that join a cohort after its rollouts began: each check-in (the agent socket's hello, a REST device
asking for its assignment) puts the device where the devices present at the start would be.

- A **running** rollout of its cohort: the device is assigned the rollout's current phase by the rule that chose
  the devices present at its start (``device_bucket(rollout, device) < percent``); a device whose bucket lies
  beyond the current phase waits, and the advance to the phase that includes it assigns it.
- A **paused** rollout assigns nobody, newcomers included, until it resumes; ``rollout_resume`` then assigns
  every active device of the current phase, these among them.
- No rollout in progress: a device that never had an assignment gets the version of its cohort's last
  completed rollout (``assignment_for_newcomer``).
"""

from __future__ import annotations

from django.db import transaction

from devices.models import Device, DeviceStatus
from training.models import AdapterVersion, Assignment, Rollout
from training.rollouts.lifecycle import assignment_create, device_bucket


def assignment_for_running_rollout(*, device: Device) -> Assignment | None:
    """The device's assignment in a running rollout of its cohort it is not yet part of, if the rollout's
    current phase includes it (the newest such rollout); None otherwise."""
    # Narrow first (asked at every check-in): running rollouts of the cohort without this device.
    candidates = (
        Rollout.objects.filter(cohort_id=device.cohort_id, state=Rollout.State.RUNNING)
        .exclude(assignments__device=device)
        .order_by("-started_at", "-id")
        .values_list("pk", "phases")
    )
    for rollout_id, phases in candidates:
        bucket = device_bucket(rollout_id, device.pk)
        if bucket >= phases[-1]["percent"]:
            continue  # no phase of it will ever include this device
        with transaction.atomic():
            # Under the rollout's lock, as its start and phase advances assign: one of them assigns the device,
            # never both, and an advance being committed right now is seen once it has committed.
            rollout = (
                Rollout.objects.select_for_update(no_key=True, of=("self",))
                .select_related("version")
                .get(pk=rollout_id)
            )
            if rollout.state != Rollout.State.RUNNING or bucket >= rollout.phases[rollout.current_phase]["percent"]:
                continue  # paused or finished meanwhile, or the device waits for a later phase
            if rollout.assignments.filter(device=device).exists():
                continue
            member = Device.objects.filter(pk=device.pk, status=DeviceStatus.ACTIVE, cohort_id=rollout.cohort_id)
            if not member.exists():
                return None  # no longer active, or moved away, since it checked in
            phase = rollout.current_phase
            return assignment_create(device=device, version=rollout.version, rollout=rollout, phase=phase)
    return None


def assignment_for_newcomer(*, device: Device) -> Assignment | None:
    """A device that joined its cohort after the cohort's last rollout finished gets that rollout's version,
    so the fleet converges without an operator re-running rollouts for every new device. A device that has
    ever had an assignment is left to the rollouts (and the operator's rollbacks) that made it."""
    if device.assignments.exists():
        return None
    # Narrow first (asked on every hello of a device without assignments), the whole rollout only if any.
    rollout_id = (
        Rollout.objects.filter(cohort_id=device.cohort_id, state=Rollout.State.COMPLETED)
        .exclude(version__state=AdapterVersion.State.REVOKED)
        .order_by("-finished_at", "-id")
        .values_list("pk", flat=True)
        .first()
    )
    if rollout_id is None:
        return None
    rollout = Rollout.objects.select_related("version").get(pk=rollout_id)
    return assignment_create(device=device, version=rollout.version, rollout=rollout, phase=len(rollout.phases) - 1)


def assignment_at_check_in(*, device: Device) -> Assignment | None:
    """What a device that checks in joins now, if anything: a running rollout of its cohort whose current
    phase includes it, else (never assigned before) its cohort's last completed rollout. The assignment is
    pushed to the device's socket once committed (``training.rollouts.lifecycle.deliver``)."""
    return assignment_for_running_rollout(device=device) or assignment_for_newcomer(device=device)
