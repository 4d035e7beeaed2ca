"""Heartbeats that carry a device's personal figures: each field checked (a bad one refuses the heartbeat and
stores nothing), each measurement stored once however often it is repeated, and a bounded history, through a
real agent socket (the full ASGI app on the Redis channel layer) and the REST heartbeat."""

from __future__ import annotations

import json
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from rest_framework.test import APIClient

from devices import presence
from devices.models import PersonalizationReport
from devices.personalization import parse_personal
from edge_agent.protocol import encode
from tests.devices.test_agent_socket import hello, open_socket, refused_heartbeat
from tests.personal_support import NOW
from tests.personal_support import figures as personal

BAD_PERSONAL = [
    ("not an object", "personal: Input should be a valid dictionary"),
    (personal(adapter=""), "personal.adapter"),
    (personal(adapter="a b"), "personal.adapter"),
    (personal(adapter=None), "personal.adapter"),
    (personal(version=0), "personal.version"),
    (personal(version="3"), "personal.version"),
    (personal(version=True), "personal.version"),
    (personal(method="magic"), "personal.method"),
    (personal(serving="both"), "personal.serving"),
    (personal(shared_accuracy=1.2), "personal.shared_accuracy"),
    (personal(shared_accuracy=-0.1), "personal.shared_accuracy"),
    (personal(personal_accuracy=None), "personal.personal_accuracy"),
    (personal(personal_accuracy="0.9"), "personal.personal_accuracy"),
    (personal(val_samples=-1), "personal.val_samples"),
    (personal(val_samples=4.5), "personal.val_samples"),
    (personal(trained_samples=10**10), "personal.trained_samples"),
    (personal(shared_only_right=-1), "personal.shared_only_right"),
    (personal(personal_only_right=2.5), "personal.personal_only_right"),
    (personal(personal_only_right="3"), "personal.personal_only_right"),
    (personal(updated_at="yesterday"), "personal.updated_at"),
    (personal(updated_at=12.0), "personal.updated_at"),
    (personal(updated_at=time.time() + 3 * 86400), "personal.updated_at"),
    ({k: v for k, v in personal().items() if k != "serving"}, "personal.serving"),
]


def test_a_good_personal_object_is_read_field_by_field_and_unknown_fields_are_dropped():
    assert parse_personal(None) is None
    parsed = parse_personal({**personal(shared_accuracy=1, personal_accuracy=0), "note": "x"}, now=NOW)
    assert parsed == {**personal(), "shared_accuracy": 1.0, "personal_accuracy": 0.0}
    assert isinstance(parsed["shared_accuracy"], float)
    counts = {"shared_only_right": 2, "personal_only_right": 7}  # optional: agents before them send none
    assert parse_personal(personal(**counts), now=NOW) == {**personal(), **counts}
    state = presence.parse_heartbeat({"seq": 1, "personal": personal()})
    assert state["personal"] == personal() and state["metrics"] == {}


@pytest.mark.parametrize(("value", "message"), BAD_PERSONAL, ids=[message for _, message in BAD_PERSONAL])
def test_each_bad_personal_field_is_refused_with_its_name(value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        presence.parse_heartbeat({"seq": 1, "personal": value})
    # NaN and infinity, which Python's JSON reads, are no accuracies either.
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="personal.shared_accuracy"):
            parse_personal(personal(shared_accuracy=bad))


def _beat(seq: int, figures: dict | None) -> str:
    return encode("heartbeat", seq=seq, battery=80.0, charging=True, personal=figures)


async def _acked(communicator, seq: int, figures: dict | None) -> None:
    await communicator.send_to(text_data=_beat(seq, figures))
    ack = await communicator.receive_json_from(timeout=5)
    assert ack["type"] == "heartbeat_ack" and ack["seq"] == seq


def _rows(device_id) -> list[tuple]:
    reports = PersonalizationReport.objects.filter(device_id=device_id).order_by("measured_at")
    return list(reports.values_list("version_number", "personal_accuracy", "latest"))


@pytest.mark.django_db(transaction=True)
def test_each_measurement_is_stored_once_and_the_history_keeps_the_newest(enrolled, adapter, settings):
    settings.PERSONALIZATION_HISTORY = 3
    device = enrolled("active")

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        assert (await communicator.receive_json_from(timeout=5))["type"] == "welcome"
        await _acked(communicator, 1, None)  # a heartbeat without figures stores none
        for seq in range(2, 6):  # one measurement, repeated by four heartbeats
            await _acked(communicator, seq, personal())
        # Each heartbeat is handled before the next: after this ack the one before it is fully stored.
        await _acked(communicator, 6, None)
        assert await sync_to_async(_rows)(device.id) == [(3, 0.93, True)]
        cached = presence.sync_client().hget(presence.key("personal"), device.id)
        assert float(cached) == NOW
        # Redis lost its note: the database still knows the measurement, and keeps one row of it.
        presence.sync_client().hdel(presence.key("personal"), device.id)
        await _acked(communicator, 7, personal())
        await _acked(communicator, 8, personal(updated_at=NOW - 60, personal_accuracy=0.5))  # older: ignored
        for step in range(1, 5):  # four newer measurements, versions 4 to 7
            await _acked(communicator, 8 + step, personal(updated_at=NOW + step, version=3 + step))
        await _acked(communicator, 13, None)
        await communicator.disconnect()

    async_to_sync(scenario)()
    # The newest three of five measurements; only the newest is the device's latest for the adapter.
    assert _rows(device.id) == [(5, 0.93, False), (6, 0.93, False), (7, 0.93, True)]
    newest = PersonalizationReport.objects.get(device_id=device.id, latest=True)
    assert newest.adapter_id == adapter.pk and newest.measured_at.timestamp() == NOW + 4
    assert newest.gain_points == pytest.approx(12.0)
    # The presence state flushed to the device row carries no personal figures.
    state = json.loads(presence.sync_client().hget(presence.key("state"), device.id))
    assert "personal" not in state and state["battery"] == 80.0


@pytest.mark.django_db(transaction=True)
def test_figures_for_two_adapters_each_keep_their_latest_and_an_unknown_adapter_is_kept_by_name(enrolled, adapter):
    device = enrolled("active")

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        await communicator.receive_json_from(timeout=5)
        await _acked(communicator, 1, personal())
        await _acked(communicator, 2, personal(adapter="other-lora", updated_at=NOW + 1))
        await _acked(communicator, 3, None)
        await communicator.disconnect()

    async_to_sync(scenario)()
    latest = dict(
        PersonalizationReport.objects.filter(device_id=device.id, latest=True).values_list("adapter_name", "adapter")
    )
    assert latest == {"digits-lora": adapter.pk, "other-lora": None}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("value", "message"), BAD_PERSONAL[:6] + BAD_PERSONAL[-3:], ids=lambda v: str(v)[:30])
def test_a_heartbeat_with_bad_figures_closes_the_socket_and_stores_nothing(enrolled, adapter, value, message):
    device = enrolled("active")
    assert message in refused_heartbeat(device, _beat(1, value))["message"]
    assert not PersonalizationReport.objects.filter(device_id=device.id).exists()
    assert presence.sync_client().hget(presence.key("state"), device.id) is None
    assert presence.sync_client().hget(presence.key("personal"), device.id) is None


@pytest.mark.django_db
def test_the_rest_heartbeat_stores_a_new_measurement_once_and_refuses_bad_figures(enrolled, adapter, device_token):
    device = enrolled("active")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Device {device_token(device)}")
    url = "/api/v1/device/heartbeat/"
    for seq in (1, 2):
        assert client.post(url, {"seq": seq, "personal": personal()}, format="json").status_code == 204
    assert _rows(device.id) == [(3, 0.93, True)]
    for value, message in BAD_PERSONAL[1:4] + [(personal(serving=None), "personal.serving")]:
        refused = client.post(url, {"seq": 3, "personal": {**value, "updated_at": NOW + 9}}, format="json")
        assert refused.status_code == 400
        assert message in refused.json()["error"]["details"]["heartbeat"][0]
    nan = client.generic(
        "POST", url, '{"seq": 4, "personal": ' + json.dumps(personal())[:-1] + ', "val_samples": NaN}}',
        content_type="application/json",
    )  # fmt: skip
    assert nan.status_code == 400
    assert _rows(device.id) == [(3, 0.93, True)]
    paired = personal(updated_at=NOW + 1, shared_only_right=2, personal_only_right=7)
    assert client.post(url, {"seq": 5, "personal": paired}, format="json").status_code == 204
    assert [row[2] for row in _rows(device.id)] == [False, True]
    latest = PersonalizationReport.objects.get(device_id=device.id, latest=True)
    assert (latest.shared_only_right, latest.personal_only_right) == (2, 7)
    listed = client.get(f"/api/v1/devices/{device.id}/personalization/")  # a device token reads no fleet data
    assert listed.status_code in (401, 403)
