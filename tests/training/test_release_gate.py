"""The release gate (training.federation.release_gate): a round's version evaluated worse than the best released
version stays a candidate with its reason and reaches no device; rounds build on the released version, and
candidates make no delta stale; an operator's override releases it and is recorded."""

from __future__ import annotations

import pytest

from tests.training.test_rounds import make_delta_tensors, receive
from training import dispatch
from training.federation.aggregation import round_aggregate
from training.federation.rounds import round_base
from training.federation.verification import delta_verify
from training.models import AdapterVersion, Assignment, Rollout, Round, TrainingEvent
from training.registry.services import adapter_set_aggregation, version_create_seeded, version_transition
from training.rollouts.automatic import CANARY_PERCENT, CANARY_REPORTS, CANARY_SOAK_SECONDS, round_result_release
from training.rollouts.lifecycle import (
    assignment_report,
    rollout_abort,
    rollout_create,
    rollout_start,
    rollout_tick,
)

AGGREGATION = {"strategy": "fedbuff", "buffer_size": 2, "min_deltas": 1, "auto_release": True}


@pytest.fixture
def fleet(adapter, cohort, enrolled, monkeypatch):
    """Version 1 released and rolled out, judged as good as 0.9 on the server's evaluation set (the test base
    is untrained, so every round's version evaluates near chance: worse); two devices; rounds of two deltas,
    aggregated right here (no task queued)."""
    monkeypatch.setattr("training.federation.verify_queue.queue_verification", lambda delta_id: None)
    monkeypatch.setattr(dispatch, "aggregate_round", lambda round_id: None)
    released = []
    monkeypatch.setattr(dispatch, "release_round_result", released.append)
    adapter.cohorts.add(cohort)
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation=AGGREGATION)
    adapter.refresh_from_db()
    v1 = version_create_seeded(adapter=adapter, seed=3)
    AdapterVersion.objects.filter(pk=v1.pk).update(metrics={**v1.metrics, "eval_accuracy": 0.9})
    rollout_start(rollout=rollout_create(version=v1, cohort=cohort, phases=[{"percent": 100}], actor=None), actor=None)
    v1.refresh_from_db()
    assert v1.state == "released"
    return adapter, v1, [enrolled("active", name=f"d{i}") for i in range(2)], released


def _round_of_two(adapter, devices, *, counter: int, base_version: int = 1, seed: int = 0) -> AdapterVersion:
    for index, device in enumerate(devices):
        tensors = make_delta_tensors(adapter, seed=seed + index)
        delta = delta_verify(delta_id=receive(device, adapter, tensors, counter=counter, base_version=base_version).pk)
        assert delta.state == "accepted", delta.rejection_detail
        assert delta.staleness == 0
    round_ = Round.objects.get(state=Round.State.AGGREGATING)
    return round_aggregate(round_id=round_.pk)


@pytest.mark.django_db
def test_a_worse_version_stays_a_candidate_and_the_next_rounds_build_on_the_released_one(
    fleet, django_capture_on_commit_callbacks
):
    adapter, v1, devices, released = fleet
    made = []
    for counter in range(1, 7):  # six rounds: more candidates than max_staleness (4)
        with django_capture_on_commit_callbacks(execute=True):
            version = _round_of_two(adapter, devices, counter=counter, seed=10 * counter)
        made.append(version)
        assert version.state == "candidate" and version.parent == v1
        assert version.gate["verdict"] == "failed" and version.gate["reference"] == 1
        assert "points below v1's 0.900, the best released version" in version.gate["reason"]
    assert released == []  # auto-release was not asked for any of them
    assert list(Round.objects.order_by("pk").values_list("base_version__number", flat=True)) == [1] * 6
    assert not Rollout.objects.filter(version__in=made).exists()
    assert not Assignment.objects.filter(version__in=made).exists()
    events = TrainingEvent.objects.filter(kind="version.gate_failed", adapter=adapter)
    assert events.count() == 6 and "best released version" in events.first().detail["reason"]
    # and auto-release asked anyway (a task queued before the gate, say) refuses it
    assert round_result_release(version=made[-1]) == []
    made[-1].refresh_from_db()
    assert made[-1].state == "candidate"


@pytest.mark.django_db
def test_a_version_no_worse_than_the_best_released_one_passes_and_is_released_automatically(
    fleet, django_capture_on_commit_callbacks
):
    adapter, v1, devices, released = fleet
    AdapterVersion.objects.filter(pk=v1.pk).update(metrics={"eval_accuracy": 0.0})
    with django_capture_on_commit_callbacks(execute=True):
        version = _round_of_two(adapter, devices, counter=1)
    assert version.gate["verdict"] == "passed" and released == [version.pk]
    (rollout,) = round_result_release(version=version)
    version.refresh_from_db()
    assert version.state == "released" and rollout.state == "running"
    # the next round builds on it, and a delta still on v1 is one released version behind
    assert _round_of_two(adapter, devices, counter=2, base_version=version.number, seed=5).parent == version
    on_v1 = receive(devices[0], adapter, make_delta_tensors(adapter, seed=9), counter=3, base_version=1)
    assert delta_verify(delta_id=on_v1.pk).staleness == 1


@pytest.mark.django_db
def test_staleness_counts_released_versions_only(fleet, cohort):
    adapter, v1, devices, _ = fleet
    adapter_set_aggregation(adapter=adapter, actor=None, aggregation={**AGGREGATION, "max_staleness": 2})
    later = [version_create_seeded(adapter=adapter, seed=20 + i) for i in range(4)]  # candidates
    delta = receive(devices[0], adapter, make_delta_tensors(adapter, seed=1), counter=1)
    assert delta_verify(delta_id=delta.pk).state == "accepted"
    for version in later[:3]:
        version_transition(version=version, action="release", actor=None)
    stale = delta_verify(delta_id=receive(devices[1], adapter, make_delta_tensors(adapter, seed=2), counter=1).pk)
    assert stale.state == "rejected" and stale.rejection_code == "stale_base_version"
    assert stale.rejection_detail.startswith(f"based on v1, 3 released versions behind v{later[2].number}")


@pytest.mark.django_db
def test_releasing_a_version_that_failed_needs_an_override_with_a_reason_which_is_recorded(fleet, api_client_for):
    adapter, _, devices, _ = fleet
    version = _round_of_two(adapter, devices, counter=1)
    operator = api_client_for("operator")
    url = f"/api/v1/adapter-versions/{version.pk}/release/"

    refused = operator.post(url, {}, format="json")
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "release_gate_failed" and "override" in error["message"]
    assert error["details"]["gate"]["verdict"] == "failed"
    no_reason = operator.post(url, {"override": True}, format="json")
    assert no_reason.status_code == 400 and no_reason.json()["error"]["code"] == "override_reason_required"
    version.refresh_from_db()
    assert version.state == "candidate" and not TrainingEvent.objects.filter(kind="version.gate_overridden").exists()

    done = operator.post(url, {"override": True, "reason": "the eval set lags our users"}, format="json")
    assert done.status_code == 200, done.content
    body = done.json()
    assert body["state"] == "released" and body["gate"]["verdict"] == "overridden"
    assert body["gate"]["override_reason"] == "the eval set lags our users"
    event = TrainingEvent.objects.get(kind="version.gate_overridden")
    assert event.actor_label.startswith("operator") and event.detail["reason"] == "the eval set lags our users"


@pytest.mark.django_db
def test_a_rollout_of_a_version_that_failed_is_refused_unless_overridden(fleet, api_client_for, cohort):
    adapter, _, devices, _ = fleet
    version = _round_of_two(adapter, devices, counter=1)
    operator = api_client_for("operator")
    body = {"version": version.pk, "cohort": cohort.name, "phases": [{"percent": 10}, {"percent": 100}]}
    refused = operator.post("/api/v1/rollouts/", body, format="json")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "release_gate_failed"
    assert not Rollout.objects.filter(version=version).exists()
    made = operator.post(
        "/api/v1/rollouts/", {**body, "override_gate": True, "override_reason": "canary on 10%"}, format="json"
    )
    assert made.status_code == 201, made.content
    assert TrainingEvent.objects.filter(kind="version.gate_overridden", detail__doing="roll out").exists()


@pytest.mark.django_db
def test_an_operator_s_rollout_takes_over_from_auto_release_which_then_holds_back_and_says_so(fleet, cohort, make_user):
    adapter, v1, devices, _ = fleet
    AdapterVersion.objects.filter(pk=v1.pk).update(metrics={"eval_accuracy": 0.0})
    staged = _round_of_two(adapter, devices, counter=1)
    operator = make_user("operator")
    phases = [{"percent": 50, "min_soak_seconds": 3600}, {"percent": 100}]
    mine = rollout_start(rollout=rollout_create(version=staged, cohort=cohort, phases=phases, actor=operator),
                         actor=operator)  # fmt: skip
    automatic = Rollout.objects.get(version=v1)  # version 1's, automatic, waiting for its devices: taken over
    assert automatic.state == "completed" and automatic.state_reason.startswith("all phases done")
    newer = _round_of_two(adapter, devices, counter=2, base_version=staged.number, seed=7)
    assert newer.gate["verdict"] == "passed"
    assert round_result_release(version=newer) == []
    mine.refresh_from_db()
    assert mine.state == "running"
    held = TrainingEvent.objects.get(kind="version.release_held")
    assert held.detail == {"rollout": mine.pk, "cohort": cohort.name} and held.version == newer


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"auto_release": False}, "auto_release", 'auto_release belongs inside "aggregation"'),
        ({"bogus": 1}, "bogus", "unknown key"),
        ({}, "aggregation", "nothing to change"),
        ({"aggregation": {"release_margin": 2}}, "aggregation", "release_margin must be a number from 0 to 1"),
    ],
)
def test_the_aggregation_settings_refuse_unknown_and_misplaced_keys(adapter, api_client_for, body, field, words):
    response = api_client_for("operator").put(f"/api/v1/adapters/{adapter.pk}/aggregation/", body, format="json")
    assert response.status_code == 400, response.content
    assert words in str(response.json()["error"]["details"][field])
    adapter.refresh_from_db()
    assert adapter.aggregation == {"strategy": "fedavg"}  # as it was created


@pytest.mark.django_db
def test_a_version_the_server_cannot_evaluate_goes_to_a_canary_share_guarded_by_devices_reports(fleet, cohort):
    """No evaluation set: the gate leaves it unjudged, and its automatic rollout is a canary phase guarded by the
    devices' held-out reports; when they say it is worse, it is rolled back and no later round builds on it."""
    adapter, v1, devices, _ = fleet
    version = _round_of_two(adapter, devices, counter=1)
    AdapterVersion.objects.filter(pk=version.pk).update(metrics={}, gate={})
    (canary,) = round_result_release(version=AdapterVersion.objects.get(pk=version.pk))
    version.refresh_from_db()
    assert version.gate["verdict"] == "unjudged" and version.state == "released"
    assert canary.phases == [{"percent": CANARY_PERCENT, "min_soak_seconds": CANARY_SOAK_SECONDS},
                             {"percent": 100.0, "min_soak_seconds": 0}]  # fmt: skip
    guards = [{"metric": "val_accuracy_change", "min": -0.01, "min_reports": CANARY_REPORTS}]
    assert canary.guards == guards and canary.on_breach == "rollback" and canary.created_by is None
    assert round_base(adapter) == version  # released: rounds build on it
    # the guard at work, on a rollout of every device (the canary share of two devices is too few to report)
    rollout_abort(rollout=canary, actor=None)
    everyone = rollout_start(
        rollout=rollout_create(version=version, cohort=cohort, phases=[{"percent": 100}],
                               guards=[{**guards[0], "min_reports": 2}], on_breach="rollback", actor=None),
        actor=None,
    )  # fmt: skip
    for assignment in Assignment.objects.filter(rollout=everyone):
        assignment_report(device=assignment.device, assignment_id=assignment.pk, status="installed",
                          metrics={"val_accuracy_change": -0.08})  # fmt: skip
    assert rollout_tick(rollout=everyone) == "breached"
    everyone.refresh_from_db()
    version.refresh_from_db()
    assert everyone.state == "rolled_back"
    assert version.gate["verdict"] == "failed" and "devices' held-out reports" in version.gate["reason"]
    assert round_base(adapter) == v1
