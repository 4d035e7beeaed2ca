"""Rollouts end to end on the server: phases, stable selection, guards, rollback, reports, delivery."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from devices.models import Device
from devices.server_key import server_public_key_b64
from edge_agent.manifest import verify_manifest
from edge_agent.protocol import PROTOCOL_VERSION, encode, hello_payload, sign
from fleet.asgi import application
from training.models import Assignment, Rollout, TrainingEvent
from training.registry.services import version_create_seeded
from training.rollouts.joining import assignment_for_newcomer
from training.rollouts.lifecycle import (
    assignment_report,
    device_bucket,
    rollout_create,
    rollout_start,
    rollout_tick,
)


@pytest.fixture
def fleet_of(enrolled):
    def make(count: int):
        return [enrolled("active", name=f"d{index:02d}") for index in range(count)]

    return make


@pytest.fixture
def versions(adapter, cohort):
    adapter.cohorts.add(cohort)
    return version_create_seeded(adapter=adapter, seed=1), version_create_seeded(adapter=adapter, seed=2)


def _rollout(version, cohort, operator, **kwargs):
    kwargs.setdefault("phases", [{"percent": 30, "min_soak_seconds": 60}, {"percent": 100, "min_soak_seconds": 0}])
    return rollout_create(version=version, cohort=cohort, actor=operator, **kwargs)


def _age_phase(rollout, seconds: int) -> None:
    Rollout.objects.filter(pk=rollout.pk).update(phase_started_at=timezone.now() - timedelta(seconds=seconds))


@pytest.mark.django_db
def test_phases_pick_a_stable_growing_set_of_devices_and_advance_after_soak(fleet_of, versions, cohort, make_user):
    devices = fleet_of(20)
    rollout = _rollout(versions[1], cohort, make_user("operator"))
    rollout_start(rollout=rollout, actor=make_user("operator"))
    first = set(Assignment.objects.filter(rollout=rollout).values_list("device_id", flat=True))
    expected = {d.device.pk for d in devices if device_bucket(rollout.pk, d.device.pk) < 30}
    assert first == expected and 0 < len(first) < 20
    # assigned (each assignment locking its device) in id order, as the presence flush locks devices
    made = list(Assignment.objects.filter(rollout=rollout).order_by("pk").values_list("device_id", flat=True))
    assert made == sorted(made)
    assert rollout_tick(rollout=rollout) == "soaking"  # 60 s soak not over
    _age_phase(rollout, 61)
    assert rollout_tick(rollout=rollout) == "advanced"
    second = set(Assignment.objects.filter(rollout=rollout).values_list("device_id", flat=True))
    assert first < second and len(second) == 20  # phase 2 only adds devices
    assert rollout_tick(rollout=rollout) == "waiting"  # every phase done, no device installed yet
    for assignment in rollout.assignments.all():
        assignment_report(device=assignment.device, assignment_id=assignment.pk, status="installed")
    assert rollout_tick(rollout=rollout) == "completed"
    kinds = list(TrainingEvent.objects.filter(detail__rollout=rollout.pk).values_list("kind", flat=True))
    assert {"rollout.created", "rollout.started", "rollout.phase", "rollout.completed"} <= set(kinds)


@pytest.mark.django_db
def test_assignment_sequences_increase_per_device_and_supersede_pending_ones(fleet_of, versions, cohort, make_user):
    (device,) = fleet_of(1)
    operator = make_user("operator")
    one = _rollout(versions[0], cohort, operator, phases=[{"percent": 100, "min_soak_seconds": 0}])
    rollout_start(rollout=one, actor=operator)
    assignment_report(device=device.device, assignment_id=one.assignments.get().pk, status="installed")
    rollout_tick(rollout=one)
    two = _rollout(versions[1], cohort, operator, phases=[{"percent": 100, "min_soak_seconds": 0}])
    rollout_start(rollout=two, actor=operator)
    seqs = list(Assignment.objects.filter(device=device.device).order_by("seq").values_list("seq", "state"))
    assert seqs == [(1, "installed"), (2, "pending")]
    row = Device.objects.get(pk=device.id)
    assert row.running_version == versions[0] and row.desired_version == versions[1] and row.assignment_seq == 2


@pytest.mark.django_db
def test_a_guard_breach_rolls_back_with_newer_sequences_to_the_previous_version(fleet_of, versions, cohort, make_user):
    devices = fleet_of(4)
    operator = make_user("operator")
    base = _rollout(versions[0], cohort, operator, phases=[{"percent": 100, "min_soak_seconds": 0}])
    rollout_start(rollout=base, actor=operator)
    for assignment in base.assignments.all():
        assignment_report(device=assignment.device, assignment_id=assignment.pk, status="installed")
    rollout_tick(rollout=base)

    risky = _rollout(
        versions[1],
        cohort,
        operator,
        phases=[{"percent": 100, "min_soak_seconds": 3600}],
        guards=[{"metric": "val_accuracy", "min": 0.9, "min_reports": 2}],
        on_breach="rollback",
    )
    rollout_start(rollout=risky, actor=operator)
    reports = iter([0.5, 0.6, 0.95, 0.97])
    for assignment in risky.assignments.all():
        metrics = {"val_accuracy": next(reports)}
        assignment_report(device=assignment.device, assignment_id=assignment.pk, status="installed", metrics=metrics)
    assert rollout_tick(rollout=risky) == "breached"
    risky.refresh_from_db()
    assert risky.state == "rolled_back" and "val_accuracy" in risky.state_reason
    for device in devices:
        newest = Assignment.objects.filter(device=device.device).order_by("-seq").first()
        assert newest.version == versions[0] and newest.seq == 3 and newest.rollout is None
    event = TrainingEvent.objects.get(kind="rollout.rolled_back")
    assert event.actor_label == "system"


@pytest.mark.django_db
def test_a_breach_with_on_breach_pause_pauses(fleet_of, versions, cohort, make_user):
    fleet_of(3)
    operator = make_user("operator")
    rollout = _rollout(
        versions[0], cohort, operator, phases=[{"percent": 100, "min_soak_seconds": 0}], max_failure_rate=0.1
    )
    rollout_start(rollout=rollout, actor=operator)
    for assignment in rollout.assignments.all():
        assignment_report(device=assignment.device, assignment_id=assignment.pk, status="failed", reason="disk full")
    assert rollout_tick(rollout=rollout) == "breached"
    rollout.refresh_from_db()
    assert rollout.state == "paused" and "failure_rate" in rollout.state_reason


@pytest.mark.django_db
def test_rollout_api_by_role_and_invalid_requests(api_client_for, fleet_of, versions, cohort):
    fleet_of(3)
    body = {"version": versions[0].pk, "cohort": cohort.name, "phases": [{"percent": 50, "min_soak_seconds": 0}]}
    assert api_client_for("viewer").post("/api/v1/rollouts/", body, format="json").status_code == 403
    operator = api_client_for("operator")
    created = operator.post("/api/v1/rollouts/", body, format="json")
    assert created.status_code == 201, created.content
    rollout_id = created.json()["id"]
    started = operator.post(f"/api/v1/rollouts/{rollout_id}/start/")
    assert started.status_code == 200 and started.json()["state"] == "running"
    assert started.json()["guard_report"][-1]["metric"] == "failure_rate"
    assert operator.post(f"/api/v1/rollouts/{rollout_id}/start/").status_code == 409
    assert operator.post(f"/api/v1/rollouts/{rollout_id}/pause/", {"reason": "lunch"}).json()["state"] == "paused"
    assert operator.post(f"/api/v1/rollouts/{rollout_id}/resume/").json()["state"] == "running"
    listed = api_client_for("viewer").get("/api/v1/rollouts/").json()["results"][0]
    assert sum(listed["progress"].values()) == len(
        api_client_for("viewer").get(f"/api/v1/rollouts/{rollout_id}/assignments/").json()["results"]
    )
    assert operator.post(f"/api/v1/rollouts/{rollout_id}/abort/").json()["state"] == "aborted"
    assert operator.post(f"/api/v1/rollouts/{rollout_id}/resume/").status_code == 409

    bad = [
        ({**body, "phases": [{"percent": 50}, {"percent": 40}]}, "invalid_phases"),
        ({**body, "phases": [{"percent": 150}]}, "invalid_phases"),
        ({**body, "guards": [{"metric": "x"}]}, "invalid_guards"),
        ({**body, "on_breach": "explode"}, "invalid"),
    ]
    for payload, code in bad:
        response = operator.post("/api/v1/rollouts/", payload, format="json")
        assert response.status_code == 400 and response.json()["error"]["code"] == code, payload


@pytest.mark.django_db
def test_device_reports_only_its_own_assignments_and_only_valid_metrics(fleet_of, versions, cohort, make_user):
    from core.errors import Conflict, DomainError, NotFound

    mine, theirs = fleet_of(2)
    operator = make_user("operator")
    rollout = _rollout(versions[0], cohort, operator, phases=[{"percent": 100, "min_soak_seconds": 0}])
    rollout_start(rollout=rollout, actor=operator)
    their_assignment = rollout.assignments.get(device=theirs.device)
    with pytest.raises(DomainError) as caught:
        assignment_report(device=mine.device, assignment_id=their_assignment.pk, status="installed")
    assert isinstance(caught.value, NotFound)
    my_assignment = rollout.assignments.get(device=mine.device)
    for metrics in ({"acc": float("nan")}, {"acc": float("inf")}, {"acc": "high"}, {"x" * 65: 1}):
        with pytest.raises(DomainError) as caught:
            assignment_report(device=mine.device, assignment_id=my_assignment.pk, status="installed", metrics=metrics)
        assert caught.value.code == "invalid_metrics"
    assignment_report(device=mine.device, assignment_id=my_assignment.pk, status="installed", metrics={"acc": 0.9})
    with pytest.raises(DomainError) as caught:
        assignment_report(device=mine.device, assignment_id=my_assignment.pk, status="failed")
    assert isinstance(caught.value, Conflict)
    assert Assignment.objects.get(pk=their_assignment.pk).state == "pending"


@pytest.mark.django_db(transaction=True)
def test_a_device_gets_its_assignment_pushed_when_connected_and_at_hello_when_it_was_offline(
    fleet_of, versions, cohort, make_user
):
    online, offline = fleet_of(2)
    operator = make_user("operator")
    rollout = _rollout(versions[1], cohort, operator, phases=[{"percent": 100, "min_soak_seconds": 0}])

    async def connect(device):
        communicator = WebsocketCommunicator(application, "/ws/agent/")
        await communicator.connect(timeout=5)
        challenge = await communicator.receive_json_from(timeout=5)
        signature = sign(device.key, hello_payload(nonce=challenge["nonce"], device_id=device.id))
        await communicator.send_to(
            text_data=encode("hello", device_id=device.id, signature=signature, protocol=PROTOCOL_VERSION)
        )
        assert (await communicator.receive_json_from(timeout=5))["type"] == "welcome"
        return communicator

    def check(message, device):
        assert message["type"] == "command" and message["command"] == "assignment"
        manifest = verify_manifest(
            message["args"]["envelope"],
            server_public_key=server_public_key_b64(),
            device_id=device.id,
            base_model_sha256=versions[1].adapter.base_model.weights_sha256,
            last_accepted_seq=0,
            now=time.time(),
        )
        assert manifest["version"] == versions[1].number and manifest["assignment_seq"] == 1

    async def scenario():
        from asgiref.sync import sync_to_async

        first = await connect(online)
        await sync_to_async(rollout_start)(rollout=rollout, actor=operator)
        check(await first.receive_json_from(timeout=5), online)  # pushed while connected
        second = await connect(offline)
        check(await second.receive_json_from(timeout=5), offline)  # delivered at hello
        await first.disconnect()
        await second.disconnect()

    async_to_sync(scenario)()


@pytest.mark.django_db
def test_a_rollout_needs_a_live_version_for_a_cohort_the_adapter_serves(versions, make_user):
    from core.errors import DomainError
    from devices.services import cohort_create
    from training.registry.services import version_transition

    operator = make_user("operator")
    with pytest.raises(DomainError) as caught:
        _rollout(versions[0], cohort_create(name="nobody"), operator)
    assert caught.value.code == "cohort_not_served"
    version_transition(version=versions[0], action="revoke", actor=operator)
    with pytest.raises(DomainError) as caught:
        _rollout(versions[0], versions[0].adapter.cohorts.first(), operator)
    assert caught.value.code == "version_revoked"


@pytest.mark.django_db
def test_a_device_that_joins_after_a_rollout_completed_gets_its_version(adapter, cohort, enrolled, make_user):
    adapter.cohorts.add(cohort)
    version = version_create_seeded(adapter=adapter, seed=1)
    operator = make_user("operator")
    rollout = rollout_create(version=version, cohort=cohort, phases=[{"percent": 100}], actor=operator)
    rollout_start(rollout=rollout, actor=operator)
    rollout_tick(rollout=rollout)
    rollout.refresh_from_db()
    assert rollout.state == "completed"
    late = enrolled("active", name="late")
    assignment = assignment_for_newcomer(device=late.device)
    assert assignment is not None and assignment.version == version
    assert assignment_for_newcomer(device=late.device) is None  # only once: later changes come by rollout
