"""Devices that join a cohort while its rollout runs, and when a rollout is done with its devices: a newcomer
whose bucket is in the current phase is assigned at its check-in (socket hello or REST), one beyond it at the
advance that includes it, nobody while paused; a rollout completes only once each of its devices installed,
failed or is gone (superseded, no longer active, left the cohort, not seen for ROLLOUT_GONE_SECONDS), and the
API and pages show the counts and the rule that ended it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from devices.models import Device
from devices.services import cohort_create, device_transition, device_update
from tests.training.test_delta_socket import connected
from training.models import Assignment, Rollout
from training.registry.services import version_create_seeded
from training.rollouts.automatic import round_result_release
from training.rollouts.joining import assignment_at_check_in
from training.rollouts.lifecycle import (
    assignment_create,
    assignment_report,
    device_bucket,
    rollout_create,
    rollout_pause,
    rollout_resume,
    rollout_start,
    rollout_tick,
)

TWO_PHASES = [{"percent": 50, "min_soak_seconds": 60}, {"percent": 100, "min_soak_seconds": 0}]


@pytest.fixture
def versions(adapter, cohort):
    adapter.cohorts.add(cohort)
    return version_create_seeded(adapter=adapter, seed=1), version_create_seeded(adapter=adapter, seed=2)


@pytest.fixture
def started(versions, cohort, make_user):
    """``started(phases, version=1)``: a running rollout, started by an operator (``automatic=True``: by the
    system, as auto-release starts its own)."""

    def make(phases, version: int = 1, automatic: bool = False) -> Rollout:
        operator = None if automatic else make_user("operator")
        rollout = rollout_create(version=versions[version - 1], cohort=cohort, phases=phases, actor=operator)
        return rollout_start(rollout=rollout, actor=operator)

    return make


def _newcomers(enrolled, rollout: Rollout, percent: float):
    """Enroll devices until one falls inside ``percent`` of the rollout and one beyond it."""
    inside = beyond = None
    for index in range(64):
        device = enrolled("active", name=f"late-{index:02d}")
        if device_bucket(rollout.pk, device.device.pk) < percent:
            inside = inside or device
        else:
            beyond = beyond or device
        if inside and beyond:
            return inside, beyond
    pytest.fail("64 random devices all fell on one side of the phase")


def _install(assignment: Assignment) -> None:
    assignment_report(device=assignment.device, assignment_id=assignment.pk, status="installed")


def _tick(rollout: Rollout) -> tuple[str, Rollout]:
    outcome = rollout_tick(rollout=rollout)
    rollout.refresh_from_db()
    return outcome, rollout


@pytest.mark.django_db
def test_a_newcomer_inside_the_current_phase_joins_at_check_in_and_one_beyond_it_at_the_advance(started, enrolled):
    rollout = started(TWO_PHASES)
    assert not rollout.assignments.exists()  # nobody in the cohort at its start
    inside, beyond = _newcomers(enrolled, rollout, 50)

    joined = assignment_at_check_in(device=inside.device)
    assert joined is not None and joined.rollout == rollout and joined.phase == 0
    assert joined.version == rollout.version and joined.seq == 1
    assert assignment_at_check_in(device=inside.device) is None  # once: it is part of the rollout now
    assert assignment_at_check_in(device=beyond.device) is None  # its bucket waits for phase 2
    assert not Assignment.objects.filter(device=beyond.device).exists()

    Rollout.objects.filter(pk=rollout.pk).update(phase_started_at=timezone.now() - timedelta(seconds=61))
    assert rollout_tick(rollout=rollout) == "advanced"
    assert rollout.assignments.get(device=beyond.device).phase == 1


@pytest.mark.django_db
def test_a_paused_rollout_assigns_a_newcomer_only_when_it_resumes(started, enrolled, make_user):
    rollout = started([{"percent": 100}])
    rollout_pause(rollout=rollout, actor=make_user("operator"), reason="look first")
    late = enrolled("active", name="late")
    assert assignment_at_check_in(device=late.device) is None
    assert not Assignment.objects.filter(device=late.device).exists()
    rollout_resume(rollout=rollout, actor=make_user("operator"))
    assert rollout.assignments.get(device=late.device).state == "pending"


@pytest.mark.django_db
def test_a_rest_device_that_enrolls_mid_rollout_gets_its_assignment_when_it_asks(started, enrolled, device_token):
    rollout = started([{"percent": 100}])
    late = enrolled("active", name="late")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Device {device_token(late)}")
    response = client.get("/api/v1/device/assignment/")
    assert response.status_code == 200, response.content
    assert response.json()["assignment_id"] == rollout.assignments.get(device=late.device).pk


@pytest.mark.django_db(transaction=True)
def test_a_device_that_enrolls_mid_rollout_gets_the_assignment_pushed_after_its_hello(started, enrolled):
    rollout = started([{"percent": 100}])
    late = enrolled("active", name="late")

    async def scenario():
        communicator = await connected(late)  # hello answered with welcome
        pushed = await communicator.receive_json_from(timeout=5)
        await communicator.disconnect()
        return pushed

    pushed = async_to_sync(scenario)()
    assignment = Assignment.objects.get(device=late.device)
    assert assignment.rollout_id == rollout.pk
    assert pushed["type"] == "command" and pushed["command"] == "assignment"
    assert pushed["args"]["assignment_id"] == assignment.pk


@pytest.mark.django_db
def test_a_rollout_waits_for_a_pending_device_and_completes_once_it_installs(started, enrolled):
    first, second = enrolled("active", name="alpha"), enrolled("active", name="bravo")
    rollout = started([{"percent": 100}])
    _install(rollout.assignments.get(device=first.device))
    outcome, rollout = _tick(rollout)
    assert outcome == "waiting" and rollout.state == "running"
    assert "waiting for 1 device" in rollout.state_reason and "bravo" in rollout.state_reason
    assert rollout.device_counts["installed"] == 1 and rollout.device_counts["pending"] == 1
    assert _tick(rollout)[0] == "waiting"  # still, at every tick

    _install(rollout.assignments.get(device=second.device))
    outcome, rollout = _tick(rollout)
    assert outcome == "completed" and rollout.state == "completed"
    assert rollout.state_reason == "all phases done: 2 installed"


@pytest.mark.django_db
def test_a_device_not_seen_for_rollout_gone_seconds_is_gone_and_the_rollout_ends_saying_so(started, enrolled, settings):
    settings.ROLLOUT_GONE_SECONDS = 600
    first, quiet = enrolled("active", name="alpha"), enrolled("active", name="quiet")
    rollout = started([{"percent": 100}])
    _install(rollout.assignments.get(device=first.device))
    now = timezone.now()

    Device.objects.filter(pk=quiet.device.pk).update(online=False, last_seen_at=now - timedelta(seconds=590))
    assert _tick(rollout)[0] == "waiting"  # 9 min 50 s: not gone yet
    Device.objects.filter(pk=quiet.device.pk).update(online=True, last_seen_at=now - timedelta(seconds=3600))
    assert _tick(rollout)[0] == "waiting"  # online now, whatever the last flush said
    Device.objects.filter(pk=quiet.device.pk).update(online=False, last_seen_at=None, enrolled_at=now)
    assert _tick(rollout)[0] == "waiting"  # never seen: counted from its enrollment, just now

    Device.objects.filter(pk=quiet.device.pk).update(online=False, last_seen_at=now - timedelta(seconds=610))
    outcome, rollout = _tick(rollout)
    assert outcome == "completed"
    assert rollout.state_reason == "all phases done: 1 installed, 1 gone (not seen for 10 min)"
    assert rollout.device_counts["gone_by"]["unseen"] == 1
    assert rollout.assignments.get(device=quiet.device).state == "pending"  # it still gets it if it returns


@pytest.mark.django_db
def test_superseded_deactivated_and_moved_devices_are_gone_by_their_rules(started, enrolled, versions, make_user):
    fleet = [enrolled("active", name=name) for name in ("alpha", "bravo", "charlie", "delta", "echo")]
    rollout = started([{"percent": 100}])
    admin = make_user("admin")
    _install(rollout.assignments.get(device=fleet[0].device))
    assignment_report(
        device=fleet[1].device,
        assignment_id=rollout.assignments.get(device=fleet[1].device).pk,
        status="failed",
        reason="disk full",
    )
    assignment_create(device=fleet[2].device, version=versions[1])  # superseded by a newer assignment
    device_transition(device=fleet[3].device, action="quarantine", actor=admin)
    device_update(device=fleet[4].device, actor=admin, cohort=cohort_create(name="elsewhere"))

    outcome, rollout = _tick(rollout)
    assert outcome == "completed"
    assert rollout.state_reason == (
        "all phases done: 1 installed, 1 failed, 3 gone (1 superseded, 1 no longer active, 1 left the cohort)"
    )
    assert rollout.device_counts["gone_by"] == {"superseded": 1, "inactive": 1, "left_cohort": 1, "unseen": 0}


@pytest.mark.django_db
def test_the_api_and_pages_show_the_counts_live_then_as_recorded_when_it_completed(
    started, enrolled, api_client_for, make_user
):
    first, second = enrolled("active", name="alpha"), enrolled("active", name="bravo")
    rollout = started([{"percent": 100}])
    _install(rollout.assignments.get(device=first.device))
    viewer = api_client_for("viewer")
    body = viewer.get(f"/api/v1/rollouts/{rollout.pk}/").json()
    assert body["state"] == "running" and body["devices_summary"] == "1 installed, 1 pending"
    assert body["devices"]["pending"] == 1 and body["devices"]["gone_after_seconds"] == 600
    listed = viewer.get("/api/v1/rollouts/").json()["results"][0]
    assert listed["devices"] == body["devices"]

    Device.objects.filter(pk=second.device.pk).update(last_seen_at=timezone.now() - timedelta(hours=1))
    rollout_tick(rollout=rollout)
    body = viewer.get(f"/api/v1/rollouts/{rollout.pk}/").json()
    assert body["state"] == "completed" and body["state_reason"].endswith("1 installed, 1 gone (not seen for 10 min)")

    Device.objects.filter(pk=second.device.pk).update(online=True)  # back: pending again, but the rollout is done
    late = enrolled("active", name="charlie")
    assert assignment_at_check_in(device=late.device).rollout_id == rollout.pk  # joins the completed rollout
    body = viewer.get(f"/api/v1/rollouts/{rollout.pk}/").json()
    assert body["devices"]["pending"] == 0 and body["devices_summary"] == "1 installed, 1 gone (not seen for 10 min)"
    assert viewer.get("/api/v1/rollouts/").json()["results"][0]["devices"]["pending"] == 0

    browser = Client()
    browser.force_login(make_user("viewer"))
    page = browser.get("/rollouts/").content.decode()
    row = page[page.index(f'data-rollout="{rollout.pk}"') :].split("</tr>")[0]
    cells = [cell.split(">", 1)[1].split("<", 1)[0] for cell in row.split("<td")[1:]]
    assert "completed" in row and cells[-5:-1] == ["1", "0", "0", "1"]  # installed, pending, failed, gone
    detail = browser.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "1 installed, 1 gone (not seen for 10 min)" in detail and 'data-testid="rollout-devices"' in detail


@pytest.mark.django_db
def test_auto_release_completes_an_older_rollout_that_only_waits_its_devices_superseded(started, enrolled, versions):
    installed, waiting = enrolled("active", name="alpha"), enrolled("active", name="bravo")
    older = started([{"percent": 100}], automatic=True)
    _install(older.assignments.get(device=installed.device))
    assert _tick(older)[0] == "waiting"
    (newer,) = round_result_release(version=versions[1])
    older.refresh_from_db()
    assert older.state == "completed"
    assert older.state_reason == "all phases done: 1 installed, 1 gone (superseded)"
    superseded = older.assignments.get(device=waiting.device)
    assert superseded.state == "superseded" and superseded.reason == f"superseded by v{versions[1].number}"
    assert newer.state == "running" and newer.version == versions[1]
    for device in (installed, waiting):
        newest = Assignment.objects.filter(device=device.device).order_by("-seq").first()
        assert newest.rollout == newer and newest.state == "pending"


@pytest.mark.django_db
def test_auto_release_aborts_an_older_rollout_still_in_its_phases(started, enrolled, versions):
    device = enrolled("active", name="alpha")
    older = started([{"percent": 100, "min_soak_seconds": 3600}], automatic=True)
    assert _tick(older)[0] == "soaking"
    (newer,) = round_result_release(version=versions[1])
    older.refresh_from_db()
    assert older.state == "aborted" and older.state_reason == f"superseded by v{versions[1].number}"
    assert older.device_counts["pending"] == 1  # what it stood at when it was stopped
    newest = Assignment.objects.filter(device=device.device).order_by("-seq").first()
    assert newest.rollout == newer and newest.state == "pending"
