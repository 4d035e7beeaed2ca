"""Users' corrections as rollout guard metrics (issue 52): a device's heartbeat feedback counts become the
``correction_rate``, ``previous_correction_rate`` and ``correction_rate_change`` of the assignment that installed its
version through a rollout, from 5 answers on, and a guard on them pauses or rolls back the rollout at its next tick.
Real REST heartbeats, real services, real PostgreSQL and Redis."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from training.models import Assignment
from training.registry.services import version_create_seeded
from training.rollouts.lifecycle import (
    assignment_report,
    guard_report,
    rollout_create,
    rollout_start,
    rollout_tick,
)

pytestmark = pytest.mark.django_db
CHANGE_GUARD = {"metric": "correction_rate_change", "max": 0.1, "min_reports": 2}


@pytest.fixture
def fleet(adapter, cohort, enrolled, make_user, device_token):
    """Three devices on v1 (installed through a completed rollout), and v2 ready to roll out."""
    adapter.cohorts.add(cohort)
    devices = [enrolled("active", name=f"p{index}") for index in range(3)]
    operator = make_user("operator")
    v1, v2 = version_create_seeded(adapter=adapter, seed=1), version_create_seeded(adapter=adapter, seed=2)

    def roll_out(version, guards, on_breach="pause", soak=3600):
        rollout = rollout_create(
            version=version,
            cohort=cohort,
            phases=[{"percent": 100, "min_soak_seconds": soak}],
            guards=guards,
            on_breach=on_breach,
            actor=operator,
        )
        rollout_start(rollout=rollout, actor=operator)
        return rollout

    first = roll_out(v1, [], soak=0)
    _install(first, {"val_accuracy": 0.9})
    assert rollout_tick(rollout=first) == "completed"
    clients = {}
    for device in devices:
        clients[device.id] = APIClient()
        clients[device.id].credentials(HTTP_AUTHORIZATION=f"Device {device_token(device)}")
    return {"devices": devices, "clients": clients, "roll_out": roll_out, "v2": v2}


def _install(rollout, metrics: dict) -> None:
    for assignment in rollout.assignments.order_by("pk"):
        assignment_report(device=assignment.device, assignment_id=assignment.pk, status="installed", metrics=metrics)


def _heartbeat(client, seq: int, *, current: tuple, previous: tuple | None = (1, 18, 2)) -> None:
    feedback = {
        "adapter": "digits-lora",
        "current": dict(zip(("version", "confirmed", "corrected"), current, strict=True)),
        "previous": dict(zip(("version", "confirmed", "corrected"), previous, strict=True)) if previous else None,
        "feedback_samples": sum(current[1:]) + sum(previous[1:] if previous else ()),
        "samples": 500,
    }
    answer = client.post("/api/v1/device/heartbeat/", {"seq": seq, "feedback": feedback}, format="json")
    assert answer.status_code == 204


def _metrics(rollout, device) -> dict:
    return Assignment.objects.get(rollout=rollout, device_id=device.id).metrics


def test_a_version_users_correct_more_often_is_rolled_back_by_its_correction_rate_change_guard(fleet):
    rollout = fleet["roll_out"](fleet["v2"], [CHANGE_GUARD], on_breach="rollback")
    # a device's own figure by that name is not taken: the server computes it from the counts
    _install(rollout, {"val_accuracy": 0.91, "correction_rate_change": -1.0})
    first, second, third = fleet["devices"]
    assert _metrics(rollout, first) == {"val_accuracy": 0.91}
    assert rollout_tick(rollout=rollout) == "soaking"

    _heartbeat(fleet["clients"][first.id], 1, current=(2, 2, 8))  # 80% corrected against 10% on v1
    assert _metrics(rollout, first) == {
        "val_accuracy": 0.91, "correction_rate": 0.8, "previous_correction_rate": 0.1, "correction_rate_change": 0.7,
    }  # fmt: skip
    assert rollout_tick(rollout=rollout) == "soaking"  # one report of the two the guard waits for

    _heartbeat(fleet["clients"][second.id], 1, current=(2, 1, 3))  # 4 answers: too few for a rate
    assert _metrics(rollout, second) == {"val_accuracy": 0.91, "previous_correction_rate": 0.1}
    _heartbeat(fleet["clients"][third.id], 1, current=(2, 9, 1))  # as good as v1 on this device
    assert _metrics(rollout, third)["correction_rate_change"] == 0.0
    (guard, _) = guard_report(rollout)
    assert (guard["reports"], guard["mean"], guard["breached"]) == (2, 0.35, True)

    assert rollout_tick(rollout=rollout) == "breached"
    rollout.refresh_from_db()
    assert rollout.state == "rolled_back" and "correction_rate_change 0.35 vs max 0.1" in rollout.state_reason
    back = Assignment.objects.filter(rollout=None, version__number=1, state="pending")
    assert back.count() == 3  # every device gets v1 again


def test_a_correction_rate_guard_pauses_and_counts_arriving_before_the_install_report_are_taken_then(fleet):
    rollout = fleet["roll_out"](fleet["v2"], [{"metric": "correction_rate", "max": 0.3, "min_reports": 3}])
    first = fleet["devices"][0]
    # the heartbeat's counts of v2 come before the device's install report: kept on the device, taken at the report
    _heartbeat(fleet["clients"][first.id], 1, current=(2, 3, 3), previous=None)
    assert _metrics(rollout, first) == {}
    _install(rollout, {"val_accuracy": 0.9})
    assert _metrics(rollout, first) == {"val_accuracy": 0.9, "correction_rate": 0.5}
    for index, device in enumerate(fleet["devices"][1:], start=1):
        _heartbeat(fleet["clients"][device.id], 1, current=(2, 5, 5 + index), previous=None)
    assert rollout_tick(rollout=rollout) == "breached"
    rollout.refresh_from_db()
    assert rollout.state == "paused" and rollout.state_reason.startswith("guard breached: correction_rate ")


def test_counts_of_a_version_not_installed_through_the_rollout_change_no_assignment(fleet):
    rollout = fleet["roll_out"](fleet["v2"], [CHANGE_GUARD])
    _install(rollout, {})
    first = fleet["devices"][0]
    _heartbeat(fleet["clients"][first.id], 1, current=(1, 10, 10), previous=None)  # it says it runs v1 still
    assert _metrics(rollout, first) == {}
    other = Assignment.objects.filter(device_id=first.id, version__number=1).get()
    assert "correction_rate" not in other.metrics
