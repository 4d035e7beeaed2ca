"""Install reports may carry the personal figures (personal_accuracy, shared_accuracy, personal_gain) as ordinary
metrics, and a rollout's guard can name them like any other."""

from __future__ import annotations

import pytest

from training.registry.services import version_create_seeded
from training.rollouts.lifecycle import assignment_report, rollout_create, rollout_start, rollout_tick

pytestmark = pytest.mark.django_db


@pytest.fixture
def running(adapter, cohort, enrolled, make_user):
    adapter.cohorts.add(cohort)
    for index in range(3):
        enrolled("active", name=f"p{index}")
    operator = make_user("operator")
    version = version_create_seeded(adapter=adapter, seed=1)

    def start(guards, on_breach="pause"):
        rollout = rollout_create(
            version=version,
            cohort=cohort,
            phases=[{"percent": 100, "min_soak_seconds": 0}],
            guards=guards,
            on_breach=on_breach,
            actor=operator,
        )
        rollout_start(rollout=rollout, actor=operator)
        return rollout

    return start


def _install_all(rollout, gains: list[float]) -> None:
    for assignment, gain in zip(rollout.assignments.order_by("pk"), gains, strict=True):
        metrics = {"shared_accuracy": 0.8, "personal_accuracy": 0.8 + gain, "personal_gain": gain}
        assignment_report(device=assignment.device, assignment_id=assignment.pk, status="installed", metrics=metrics)


def test_a_guard_on_personal_gain_pauses_a_rollout_whose_devices_lose_by_personalizing(running):
    rollout = running([{"metric": "personal_gain", "min": 0.0, "min_reports": 3}])
    _install_all(rollout, [-0.04, -0.02, 0.01])
    assert rollout_tick(rollout=rollout) == "breached"
    rollout.refresh_from_db()
    assert rollout.state == "paused" and "personal_gain" in rollout.state_reason


def test_a_guard_on_personal_gain_lets_a_rollout_whose_devices_gain_complete(running):
    rollout = running(
        [{"metric": "personal_gain", "min": 0.0, "min_reports": 3}, {"metric": "personal_accuracy", "min": 0.8}]
    )
    _install_all(rollout, [0.05, 0.02, 0.0])
    assert rollout_tick(rollout=rollout) == "completed"
