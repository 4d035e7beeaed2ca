"""Rollouts: phases, deterministic device selection, guards, and the assignments that carry them.

Services write (``rollout_*``, ``assignment_*``); ``rollout_tick`` is what the beat task runs. Every change
of state records who did it; deliveries go out after the transaction commits. A rollout assigns the devices of
its current phase when it starts, resumes and advances, and a device that joins its cohort while it runs when
that device checks in (``training.rollouts.joining``). It completes when its phases are done and none of its
devices is still pending (``training.rollouts.progress`` says when a device is gone instead).
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

from django.db import transaction
from django.db.models import Count, F, Q, Value
from django.db.models.functions import Greatest
from django.utils import timezone

from core.errors import Conflict, Invalid, NotFound
from core.live import LiveEvent, publish
from devices.models import Device, DeviceStatus
from devices.push import device_command
from training.models import AdapterVersion, Assignment, Rollout, Round, TrainingEvent
from training.rollouts.feedback import stored_correction_metrics, with_correction_metrics
from training.rollouts.progress import ACTIVE, completion_reason, device_counts, waiting_reason

REPORTABLE_METRICS = 32


def device_bucket(rollout_id: int, device_id) -> float:
    """A stable position in [0, 100) for a device in a rollout: phase n covers buckets below its percent."""
    digest = hashlib.sha256(f"{rollout_id}:{device_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 / 100


def _record(kind: str, rollout: Rollout, actor, **detail) -> None:
    TrainingEvent.objects.create(
        kind=kind,
        actor=actor,
        actor_label=actor.username if actor is not None else "system",
        adapter=rollout.version.adapter,
        version=rollout.version,
        detail={"rollout": rollout.pk, **detail},
    )
    event = LiveEvent(
        kind=kind if kind.startswith("rollout.") else f"rollout.{kind}",
        data={"id": rollout.pk, "state": rollout.state, "phase": rollout.current_phase, "version": rollout.version_id},
    )
    transaction.on_commit(lambda: publish(event))


def validate_phases(phases) -> list[dict]:
    if not isinstance(phases, list) or not 1 <= len(phases) <= 20:
        raise Invalid("invalid_phases", "phases must be a list of 1 to 20 phases")
    cleaned, previous = [], 0.0
    for index, phase in enumerate(phases):
        if not isinstance(phase, dict):
            raise Invalid("invalid_phases", f"phase {index} must be an object")
        percent, soak = phase.get("percent"), phase.get("min_soak_seconds", 0)
        if not isinstance(percent, int | float) or isinstance(percent, bool) or not previous < percent <= 100:
            raise Invalid(
                "invalid_phases",
                f"phase {index}: percent must rise above {previous:g} and be at most 100",
            )
        if not isinstance(soak, int) or isinstance(soak, bool) or soak < 0:
            raise Invalid("invalid_phases", f"phase {index}: min_soak_seconds must be a whole number ≥ 0")
        cleaned.append({"percent": float(percent), "min_soak_seconds": soak})
        previous = float(percent)
    return cleaned


def validate_guards(guards) -> list[dict]:
    if not isinstance(guards, list) or len(guards) > 10:
        raise Invalid("invalid_guards", "guards must be a list of at most 10 guards")
    cleaned = []
    for index, guard in enumerate(guards):
        if not isinstance(guard, dict) or not isinstance(guard.get("metric"), str) or not guard["metric"]:
            raise Invalid("invalid_guards", f"guard {index} needs a metric name")
        bounds = {key: guard[key] for key in ("min", "max") if key in guard}
        if not bounds or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in bounds.values()):
            raise Invalid("invalid_guards", f"guard {index} needs a numeric min or max")
        min_reports = guard.get("min_reports", 1)
        if not isinstance(min_reports, int) or min_reports < 1:
            raise Invalid("invalid_guards", f"guard {index}: min_reports must be ≥ 1")
        cleaned.append({"metric": guard["metric"], **bounds, "min_reports": min_reports})
    return cleaned


@transaction.atomic
def rollout_create(
    *,
    version: AdapterVersion,
    cohort,
    phases,
    guards=(),
    on_breach: str = "pause",
    max_failure_rate: float = 0.2,
    actor,
    override_gate: bool = False,
    override_reason: str = "",
) -> Rollout:
    """A draft rollout of ``version`` to ``cohort``. A candidate goes through the release gate first
    (``training.federation.release_gate``): one judged worse than the best released version is refused
    (``release_gate_failed``) unless ``override_gate`` with ``override_reason``, which is recorded."""
    from training.federation.release_gate import gate_check

    if version.state == AdapterVersion.State.REVOKED:
        raise Conflict("version_revoked", f"{version} is revoked and cannot be rolled out")
    if not version.adapter.cohorts.filter(pk=cohort.pk).exists():
        raise Conflict("cohort_not_served", f"adapter {version.adapter.name} does not serve cohort {cohort.name}")
    if on_breach not in Rollout.OnBreach.values:
        raise Invalid("invalid_on_breach", "on_breach must be pause or rollback")
    if not 0 <= max_failure_rate <= 1:
        raise Invalid("invalid_failure_rate", "max_failure_rate must be between 0 and 1")
    if version.state == AdapterVersion.State.CANDIDATE:
        gate_check(version, override=override_gate, actor=actor, reason=override_reason, doing="roll out")
    rollout = Rollout.objects.create(
        version=version,
        cohort=cohort,
        phases=validate_phases(phases),
        guards=validate_guards(list(guards)),
        on_breach=on_breach,
        max_failure_rate=max_failure_rate,
        created_by=actor,
    )
    _record("rollout.created", rollout, actor, phases=rollout.phases, guards=rollout.guards)
    return rollout


def _lock(rollout: Rollout) -> Rollout:
    # Only the rollout's row: FOR UPDATE on a join would lock its version, adapter and cohort rows too.
    rows = Rollout.objects.select_for_update(no_key=True, of=("self",))
    return rows.select_related("version__adapter", "cohort").get(pk=rollout.pk)


def _set_state(rollout: Rollout, state: str, *, reason: str = "", **fields) -> None:
    rollout.state = state
    rollout.state_reason = reason
    for name, value in fields.items():
        setattr(rollout, name, value)
    rollout.save(update_fields=["state", "state_reason", *fields])


@transaction.atomic
def rollout_start(*, rollout: Rollout, actor) -> Rollout:
    rollout = _lock(rollout)
    if rollout.state != Rollout.State.DRAFT:
        raise Conflict("invalid_transition", f"Cannot start a rollout that is {rollout.state}.")
    busy = Rollout.objects.filter(
        cohort=rollout.cohort,
        version__adapter=rollout.version.adapter,
        state__in=[Rollout.State.RUNNING, Rollout.State.PAUSED],
    ).exclude(pk=rollout.pk)
    if actor is not None:
        # An operator's rollout takes over from automatic ones (auto-release's, which only chase the newest
        # version): they end here, superseded, as a newer automatic release would end them.
        for automatic in busy.filter(created_by__isnull=True).order_by("pk"):
            _supersede(_lock(automatic), f"superseded by rollout {rollout.pk} of {actor.username}")
    earlier = busy.first()
    if earlier is not None:
        waiting = f" ({earlier.state_reason})" if earlier.state_reason else ""
        raise Conflict(
            "rollout_in_progress",
            f"rollout {earlier.pk} of this adapter is still {earlier.state} in {rollout.cohort.name}{waiting}; "
            "wait for it or abort it",
        )
    if rollout.version.state == AdapterVersion.State.REVOKED:
        raise Conflict("version_revoked", f"{rollout.version} was revoked after this rollout was drafted")
    if rollout.version.state == AdapterVersion.State.CANDIDATE:
        # Devices start getting it now: it is released (rounds build on it, staleness counts it). The gate
        # judged it when the rollout was drafted (``rollout_create``).
        from training.registry.services import version_transition

        version_transition(version=rollout.version, action="release", actor=actor, reason=f"rollout {rollout.pk}")
    now = timezone.now()
    _set_state(rollout, Rollout.State.RUNNING, started_at=now, phase_started_at=now, current_phase=0)
    count = _assign_phase(rollout)
    _round_released(rollout.version, now)
    _record("rollout.started", rollout, actor, assigned=count)
    return rollout


def _round_released(version: AdapterVersion, now) -> None:
    """The round that made ``version`` is released now, if this is the first rollout of it to start.

    "Released" is the start of its first rollout (auto-release's, or an operator's): the moment devices are
    assigned the version and it begins to reach them. Not the rollout's creation (a draft assigns nothing), nor the
    version's state turning ``released`` (a label: no device gets anything), nor the rollout's completion (that
    waits on devices coming online, not on the server). Later rollouts of the same version change nothing. Only a
    round whose aggregation time is known gets one (``Round.aggregated_at``), never before it whatever the hosts'
    clocks say."""
    if version.round_id is None:
        return
    Round.objects.filter(pk=version.round_id, aggregated_at__isnull=False, released_at__isnull=True).update(
        released_at=Greatest(Value(now), F("aggregated_at"))
    )


def _phase_devices(rollout: Rollout, phase: int) -> list[Device]:
    percent = rollout.phases[phase]["percent"]
    # In id order: each assignment locks its device, and writers that lock many devices (the presence flush) take
    # them in id order too, so neither waits for the other in a cycle.
    devices = Device.objects.filter(cohort=rollout.cohort, status=DeviceStatus.ACTIVE).only("id", "running_version")
    return [d for d in devices.order_by("pk") if device_bucket(rollout.pk, d.pk) < percent]


def _assign_phase(rollout: Rollout) -> int:
    already = set(rollout.assignments.values_list("device_id", flat=True))
    created = 0
    for device in _phase_devices(rollout, rollout.current_phase):
        if device.pk in already:
            continue
        assignment_create(device=device, version=rollout.version, rollout=rollout, phase=rollout.current_phase)
        created += 1
    return created


def assignment_create(
    *, device: Device, version: AdapterVersion, rollout: Rollout | None = None, phase: int = 0
) -> Assignment:
    """Issue the device's next sequence number for ``version`` and supersede what it had not yet installed."""
    with transaction.atomic():
        locked = Device.objects.select_for_update(no_key=True).get(pk=device.pk)
        seq = locked.assignment_seq + 1
        Device.objects.filter(pk=device.pk).update(assignment_seq=seq, desired_version=version)
        Assignment.objects.filter(device=device, state__in=ACTIVE).update(
            state=Assignment.State.SUPERSEDED, reason=f"superseded by assignment {seq}"
        )
        assignment = Assignment.objects.create(
            device=device,
            rollout=rollout,
            phase=phase,
            version=version,
            previous_version_id=locked.running_version_id,
            seq=seq,
        )
        assignment_id = assignment.pk
        transaction.on_commit(lambda: deliver(assignment_id))
    return assignment


def deliver(assignment_id: int) -> bool:
    """Push an assignment to its device if it is connected; otherwise it is picked up at the next hello. The
    command's id is the stable ``assignment-<id>`` the hello also uses, so the device's ack names the row."""
    from training.rollouts.delivery import assignment_message

    assignment = (
        Assignment.objects.select_related("version__adapter__base_model", "device").filter(pk=assignment_id).first()
    )
    if assignment is None or assignment.state not in ACTIVE:
        return False
    return device_command(
        str(assignment.device_id),
        command_id=f"assignment-{assignment.pk}",
        command="assignment",
        args=assignment_message(assignment),
    )


@transaction.atomic
def rollout_pause(*, rollout: Rollout, actor, reason: str = "") -> Rollout:
    rollout = _lock(rollout)
    if rollout.state != Rollout.State.RUNNING:
        raise Conflict("invalid_transition", f"Cannot pause a rollout that is {rollout.state}.")
    _set_state(rollout, Rollout.State.PAUSED, reason=reason)
    _record("rollout.paused", rollout, actor, reason=reason)
    return rollout


@transaction.atomic
def rollout_resume(*, rollout: Rollout, actor) -> Rollout:
    rollout = _lock(rollout)
    if rollout.state != Rollout.State.PAUSED:
        raise Conflict("invalid_transition", f"Cannot resume a rollout that is {rollout.state}.")
    _set_state(rollout, Rollout.State.RUNNING, phase_started_at=timezone.now())
    count = _assign_phase(rollout)  # devices that enrolled or were approved while it was paused
    _record("rollout.resumed", rollout, actor, assigned=count)
    return rollout


def _supersede_pending(rollout: Rollout, reason: str) -> int:
    active = rollout.assignments.filter(state__in=ACTIVE)
    # The devices first (in pk order), as assignment_create and assignment_report lock a device before its
    # assignments: the other order deadlocked against a device's report when a new version superseded a rollout.
    devices = Device.objects.select_for_update(no_key=True).filter(pk__in=active.values("device_id")).order_by("pk")
    list(devices.values_list("pk", flat=True))
    return active.update(state=Assignment.State.SUPERSEDED, reason=reason)


@transaction.atomic
def rollout_abort(*, rollout: Rollout, actor, reason: str = "") -> Rollout:
    """Stop here: nothing more is assigned; devices keep what they already installed."""
    rollout = _lock(rollout)
    if rollout.state not in (Rollout.State.RUNNING, Rollout.State.PAUSED):
        raise Conflict("invalid_transition", f"Cannot abort a rollout that is {rollout.state}.")
    counts = device_counts(rollout)  # as it stood when stopped: its pending devices are the ones withdrawn
    withdrawn = _supersede_pending(rollout, "rollout aborted")
    _set_state(rollout, Rollout.State.ABORTED, reason=reason, finished_at=timezone.now(), device_counts=counts)
    Device.objects.filter(assignments__rollout=rollout, desired_version=rollout.version).exclude(
        running_version=rollout.version
    ).update(desired_version=None)
    _record("rollout.aborted", rollout, actor, reason=reason, withdrawn=withdrawn)
    return rollout


@transaction.atomic
def rollout_rollback(*, rollout: Rollout, actor, reason: str = "") -> Rollout:
    """Every device this rollout reached gets a new assignment (a newer seq) back to what it ran before."""
    rollout = _lock(rollout)
    if rollout.state not in (Rollout.State.RUNNING, Rollout.State.PAUSED, Rollout.State.COMPLETED):
        raise Conflict("invalid_transition", f"Cannot roll back a rollout that is {rollout.state}.")
    counts = device_counts(rollout)
    _supersede_pending(rollout, "rollout rolled back")
    reached = rollout.assignments.filter(state__in=[Assignment.State.INSTALLED, Assignment.State.DELIVERED])
    reverted = 0
    for assignment in reached.select_related("device", "previous_version").order_by("device_id"):  # devices in id order
        if assignment.previous_version is None:
            continue  # it ran nothing before: there is nothing to go back to
        assignment_create(device=assignment.device, version=assignment.previous_version, rollout=None)
        reverted += 1
    _set_state(rollout, Rollout.State.ROLLED_BACK, reason=reason, finished_at=timezone.now(), device_counts=counts)
    _record("rollout.rolled_back", rollout, actor, reason=reason, reverted=reverted)
    return rollout


def guard_report(rollout: Rollout) -> list[dict]:
    """Each guard with the mean of what installed devices reported, and whether it holds."""
    installed = list(rollout.assignments.filter(state=Assignment.State.INSTALLED).values_list("metrics", flat=True))
    report = []
    for guard in rollout.guards:
        values = [m[guard["metric"]] for m in installed if isinstance(m.get(guard["metric"]), int | float)]
        mean = sum(values) / len(values) if values else None
        enough = len(values) >= guard["min_reports"]
        breached = enough and (("min" in guard and mean < guard["min"]) or ("max" in guard and mean > guard["max"]))
        report.append({**guard, "reports": len(values), "mean": mean, "breached": bool(breached)})
    counts = rollout.assignments.aggregate(
        failed=Count("id", filter=Q(state=Assignment.State.FAILED)),
        done=Count("id", filter=Q(state__in=[Assignment.State.FAILED, Assignment.State.INSTALLED])),
    )
    rate = counts["failed"] / counts["done"] if counts["done"] else 0.0
    report.append(
        {
            "metric": "failure_rate",
            "max": rollout.max_failure_rate,
            "reports": counts["done"],
            "mean": rate,
            "breached": counts["done"] >= 3 and rate > rollout.max_failure_rate,
        }
    )
    return report


def rollout_tick(*, rollout: Rollout) -> str:
    """One step of a running rollout: check guards, then advance when the phase has soaked; after the last
    phase, complete once none of its devices is pending ("waiting" until then). Idempotent."""
    with transaction.atomic():
        rollout = _lock(rollout)
        if rollout.state != Rollout.State.RUNNING:
            return rollout.state
        breached = [g for g in guard_report(rollout) if g["breached"]]
        if breached:
            reason = "guard breached: " + ", ".join(
                f"{g['metric']} {g['mean']:.4g} vs {'min ' + str(g['min']) if 'min' in g else 'max ' + str(g['max'])}"
                for g in breached
            )
            if rollout.on_breach == Rollout.OnBreach.ROLLBACK:
                rollout_rollback(rollout=rollout, actor=None, reason=reason)
                if rollout.created_by_id is None:  # an automatic release: the devices judged it worse
                    _canary_failed(rollout.version, reason)
            else:
                rollout_pause(rollout=rollout, actor=None, reason=reason)
            return "breached"
        phase = rollout.phases[rollout.current_phase]
        if timezone.now() < rollout.phase_started_at + timedelta(seconds=phase["min_soak_seconds"]):
            return "soaking"
        if rollout.current_phase + 1 < len(rollout.phases):
            rollout.current_phase += 1
            rollout.phase_started_at = timezone.now()
            rollout.save(update_fields=["current_phase", "phase_started_at"])
            count = _assign_phase(rollout)
            _record("rollout.phase", rollout, None, phase=rollout.current_phase, assigned=count)
            return "advanced"
        return _complete_when_settled(rollout)


def _supersede(earlier: Rollout, reason: str) -> None:
    """End a locked automatic rollout that a newer one replaces: completed if it only waits for devices (which
    get the newer assignment instead and count as gone, superseded), else aborted."""
    if earlier.state == Rollout.State.RUNNING and _phases_done(earlier):
        _supersede_pending(earlier, reason)
        _complete_when_settled(earlier)
    else:
        rollout_abort(rollout=earlier, actor=None, reason=reason)


def _canary_failed(version: AdapterVersion, reason: str) -> None:
    """Devices' held-slice reports breached an automatic rollout's guard: the version's gate verdict becomes failed
    with that reason, so rounds no longer build on it (``training.federation.rounds.round_base``) and the operator
    sees why."""
    from training.registry.services import _record as record_training

    verdict = {**(version.gate or {}), "verdict": "failed", "reason": f"devices' held-out reports: {reason}"}
    AdapterVersion.objects.filter(pk=version.pk).update(gate=verdict)
    record_training("version.gate_failed", actor=None, adapter=version.adapter, version=version,
                    reason=verdict["reason"])  # fmt: skip


def _phases_done(rollout: Rollout) -> bool:
    soak = timedelta(seconds=rollout.phases[rollout.current_phase]["min_soak_seconds"])
    return rollout.current_phase + 1 == len(rollout.phases) and timezone.now() >= rollout.phase_started_at + soak


def _complete_when_settled(rollout: Rollout) -> str:
    """A locked, running rollout whose phases are done: completed if none of its devices is pending, else
    "waiting", saying which devices it waits for."""
    counts = device_counts(rollout)
    if counts["pending"]:
        reason = waiting_reason(rollout, counts)
        if (reason, counts) != (rollout.state_reason, rollout.device_counts):
            rollout.state_reason, rollout.device_counts = reason, counts
            rollout.save(update_fields=["state_reason", "device_counts"])
        return "waiting"
    reason, now = completion_reason(counts), timezone.now()
    _set_state(rollout, Rollout.State.COMPLETED, reason=reason, finished_at=now, device_counts=counts)
    _record("rollout.completed", rollout, None, **{k: counts[k] for k in ("installed", "failed", "gone")})
    return "completed"


def assignment_report(*, device: Device, assignment_id, status: str, reason: str = "", metrics=None) -> Assignment:
    """A device says what became of one of its assignments. Only its own; only forward in the lifecycle."""
    if status not in ("delivered", "installed", "failed"):
        raise Invalid("invalid_status", "status must be delivered, installed or failed")
    metrics = metrics or {}
    if (
        not isinstance(metrics, dict)
        or len(metrics) > REPORTABLE_METRICS
        or not all(
            isinstance(k, str)
            and len(k) <= 64
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and v == v
            and abs(v) != float("inf")
            for k, v in metrics.items()
        )
    ):
        raise Invalid("invalid_metrics", f"metrics must map up to {REPORTABLE_METRICS} names to finite numbers")
    if not isinstance(reason, str) or len(reason) > 300:
        raise Invalid("invalid_reason", "reason must be a string of at most 300 characters")
    with transaction.atomic():
        # The device row first, as assignment_create locks it before the device's assignments (the other order
        # deadlocked when a report crossed a new version's assignments). Rows are locked FOR NO KEY UPDATE
        # throughout: they serialise writers without blocking the foreign-key checks of rows that refer to them.
        Device.objects.select_for_update(no_key=True).filter(pk=device.pk).values_list("pk", flat=True).first()
        assignment = Assignment.objects.select_for_update(no_key=True).filter(pk=assignment_id, device=device).first()
        if assignment is None:
            raise NotFound("not_found", "No such assignment for this device.")
        allowed = {
            "delivered": {Assignment.State.PENDING},
            "installed": {Assignment.State.PENDING, Assignment.State.DELIVERED},
            "failed": {Assignment.State.PENDING, Assignment.State.DELIVERED},
        }[status]
        if assignment.state == Assignment.State.SUPERSEDED:
            # A newer assignment (or the end of its rollout) withdrew it while the device was working on it: a race
            # the protocol allows, answered with its own code so the device can tell, and not logged as a warning.
            raise Conflict(
                "assignment_superseded",
                f"assignment {assignment.seq} is superseded ({assignment.reason or 'withdrawn'}): the server no "
                "longer wants it installed; nothing to report on it",
                details={"assignment_seq": assignment.seq},
                expected=True,
            )
        if assignment.state not in allowed:
            raise Conflict(
                "invalid_transition",
                f"assignment {assignment.seq} is {assignment.state}; cannot mark it {status}",
            )
        now = timezone.now()
        assignment.state = status
        assignment.reason = reason
        if status == "delivered":
            assignment.delivered_at = now
        else:
            assignment.reported_at = now
            assignment.metrics = metrics
        if status == "installed":
            # feedback counts of this version that came before the install report (``training.rollouts.feedback``)
            stored = Device.objects.get(pk=device.pk)
            correction = stored_correction_metrics(stored, assignment.version.number, assignment.version.adapter.name)
            assignment.metrics = with_correction_metrics(metrics, correction)
        assignment.save(update_fields=["state", "reason", "delivered_at", "reported_at", "metrics"])
        if status == "installed":
            Device.objects.filter(pk=device.pk).update(running_version=assignment.version)
    return assignment
