"""The demo fleet's device homes outlive a run and are bound to the server and database they enrolled with
(``demo.fleet_demo.reset_unbound_homes``): a restart of the same product keeps them and each device's state; a run
against another server URL or port, or another database (or the same one emptied), starts them anew with one line
saying why, instead of agents that retry a port nobody listens on or report versions this database never had.

Real homes on disk (key, ``agent.json``, a file of the device's state) and real devices enrolled in the test
database through the product's service."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from demo.fleet_demo import plan, reset_unbound_homes
from devices.models import Device, DeviceStatus
from devices.services import cohort_create, device_enroll, enrollment_token_create
from edge_agent.identity import AgentState, load_or_create_key, public_key_b64

pytestmark = pytest.mark.django_db
SERVER = "http://127.0.0.1:8000"
DEVICES = 3


def _enrolled_fleet(root, count: int = DEVICES, cohort: str = "demo-homes"):
    """``count`` demo homes enrolled with ``SERVER`` in this database as ``enroll`` leaves them, each with a file of
    state it would keep."""
    fleet = plan(count, root)
    cohort = cohort_create(name=cohort)
    token = enrollment_token_create(
        cohort=cohort, name="t", expires_at=timezone.now() + timedelta(hours=1), uses=count, requires_approval=False
    )
    for device in fleet:
        key = load_or_create_key(device.home)
        row = device_enroll(token=token.raw, public_key=public_key_b64(key), name=device.name)
        AgentState(
            server=SERVER,
            device_id=str(row.id),
            server_public_key="pinned",
            cohort=cohort.name,
            status=row.status,
            websocket_path="/ws/device/",
            heartbeat_interval=30,
        ).save(device.home)
        (device.home / "installed.json").write_text('{"version": 15}')
    return fleet


def _reset_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if "anew" in line]


def test_a_restart_against_the_same_server_and_database_keeps_every_home_and_its_state(tmp_path, capsys):
    fleet = _enrolled_fleet(tmp_path)
    never_enrolled = plan(DEVICES + 1, tmp_path)[-1]  # a key only: its enrollment did not finish
    load_or_create_key(never_enrolled.home)

    assert reset_unbound_homes([*fleet, never_enrolled], SERVER + "/") == []

    for device in fleet:
        assert (device.home / "installed.json").read_text() == '{"version": 15}'
    assert (never_enrolled.home / "device_key.pem").exists()
    assert not _reset_lines(capsys)
    assert set(Device.objects.values_list("status", flat=True)) == {DeviceStatus.ACTIVE}


def test_another_port_starts_the_homes_anew_and_retires_their_old_devices(tmp_path, capsys):
    fleet = _enrolled_fleet(tmp_path)

    reset = reset_unbound_homes(fleet, "http://127.0.0.1:8001")

    assert [d.name for d in reset] == [d.name for d in fleet]
    assert not any(device.home.exists() for device in fleet)
    [line] = _reset_lines(capsys)
    assert f"starting {DEVICES} of {DEVICES} demo devices anew" in line, line
    assert f"enrolled with {SERVER}, not http://127.0.0.1:8001" in line, line
    # same database: the old devices' keys are gone with their homes, so they are retired, not left to look dead
    assert f"their {DEVICES} old devices here are retired" in line, line
    assert set(Device.objects.values_list("status", flat=True)) == {DeviceStatus.RETIRED}


def test_another_database_starts_the_homes_anew(tmp_path, capsys):
    # Enrolled in a database that is not this one: its rows are rolled back, the homes stay on disk.
    with transaction.atomic():
        fleet = _enrolled_fleet(tmp_path)
        transaction.set_rollback(True)
    assert not Device.objects.exists()
    kept = _enrolled_fleet(tmp_path / "here", count=1, cohort="here")  # and one enrolled here, which stays

    reset = reset_unbound_homes([*fleet, *kept], SERVER)

    assert [d.name for d in reset] == [d.name for d in fleet]
    assert not any(device.home.exists() for device in fleet)
    assert (kept[0].home / "agent.json").exists()
    [line] = _reset_lines(capsys)
    assert f"starting {DEVICES} of {DEVICES + 1} demo devices anew" in line, line
    assert "not in this database" in line and "retired" not in line, line
    assert Device.objects.get().status == DeviceStatus.ACTIVE


def test_a_home_whose_key_is_not_the_enrolled_one_starts_anew(tmp_path, capsys):
    """Same device id, another key (a home copied or rebuilt by hand): the database does not know that device."""
    fleet = _enrolled_fleet(tmp_path)
    (fleet[0].home / "device_key.pem").unlink()
    load_or_create_key(fleet[0].home)

    assert [d.name for d in reset_unbound_homes(fleet, SERVER)] == [fleet[0].name]
    assert "not in this database" in _reset_lines(capsys)[0]
