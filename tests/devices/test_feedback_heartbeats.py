"""Heartbeats that carry what a device's users said of its answers (issue 52, "Operators see it"): each field
checked (a bad one refuses the heartbeat and changes nothing), the counts stored on the device when they change,
read back through the devices API, with a correction rate only from 5 answers on. Through a real agent socket (the
full ASGI app on the Redis channel layer) and the REST heartbeat, on the real PostgreSQL and Redis."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from rest_framework.test import APIClient

from devices import presence
from devices.feedback import correction_rate, parse_feedback
from devices.models import Device
from edge_agent.protocol import encode
from tests.devices.test_agent_socket import hello, open_socket, refused_heartbeat


def counts(**changes) -> dict:
    """A good ``feedback`` object: v3 installed (9 confirmed, 3 corrected), v2 before it, 400 labelled samples and
    150 unlabeled, with ``changes``."""
    return {
        "adapter": "digits-lora",
        "current": {"version": 3, "confirmed": 9, "corrected": 3},
        "previous": {"version": 2, "confirmed": 18, "corrected": 2},
        "feedback_samples": 32,
        "samples": 400,
        "unlabeled_samples": 150,
        **changes,
    }


BAD_FEEDBACK = [
    ("not an object", "feedback: Input should be a valid dictionary"),
    (counts(adapter="a b"), "feedback.adapter"),
    (counts(adapter=None), "feedback.adapter"),
    (counts(current=None), "feedback.current"),
    (counts(current={"version": 3, "confirmed": -1, "corrected": 0}), "feedback.current.confirmed"),
    (counts(current={"version": 3, "confirmed": 1, "corrected": 10**9 + 1}), "feedback.current.corrected"),
    (counts(current={"version": 3, "confirmed": 2.5, "corrected": 0}), "feedback.current.confirmed"),
    (counts(current={"version": 3, "confirmed": "4", "corrected": 0}), "feedback.current.confirmed"),
    (counts(current={"version": 3, "confirmed": True, "corrected": 0}), "feedback.current.confirmed"),
    (counts(current={"version": 0, "confirmed": 1, "corrected": 0}), "feedback.current.version"),
    (counts(current={"version": 3, "confirmed": 1}), "feedback.current.corrected"),
    (counts(previous={"version": 2, "confirmed": 1, "corrected": -3}), "feedback.previous.corrected"),
    (counts(previous={"version": 3, "confirmed": 1, "corrected": 0}), "feedback.previous.version"),
    (counts(previous=[]), "feedback.previous"),
    (counts(feedback_samples=-1), "feedback.feedback_samples"),
    (counts(samples=10**10), "feedback.samples"),
    (counts(samples=None), "feedback.samples"),
    ({k: v for k, v in counts().items() if k != "feedback_samples"}, "feedback.feedback_samples"),
    (counts(unlabeled_samples=-1), "feedback.unlabeled_samples"),
    (counts(unlabeled_samples=10**9 + 1), "feedback.unlabeled_samples"),
    (counts(unlabeled_samples="150"), "feedback.unlabeled_samples"),
    (counts(unlabeled_samples=1.5), "feedback.unlabeled_samples"),
]


def test_a_good_feedback_object_is_read_field_by_field_and_one_without_a_previous_version_too():
    assert parse_feedback(None) is None
    assert parse_feedback({**counts(), "note": "x"}) == counts()  # unknown fields dropped
    first = {k: v for k, v in counts().items() if k != "previous"}  # a device that ran no version before
    assert parse_feedback(first) == {**first, "previous": None}
    state = presence.parse_heartbeat({"seq": 1, "feedback": counts()})
    assert state["feedback"] == counts() and state["personal"] is None
    assert presence.parse_heartbeat({"seq": 1})["feedback"] is None  # older agents send none
    older = {k: v for k, v in counts().items() if k != "unlabeled_samples"}  # agents before unlabeled samples
    assert parse_feedback(older) == {**older, "unlabeled_samples": None}
    assert parse_feedback(counts(unlabeled_samples=None)) == {**older, "unlabeled_samples": None}


@pytest.mark.parametrize(("value", "message"), BAD_FEEDBACK, ids=[message for _, message in BAD_FEEDBACK])
def test_each_bad_feedback_field_is_refused_with_its_name(value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        presence.parse_heartbeat({"seq": 1, "feedback": value})
    for bad in (float("nan"), float("inf")):  # which Python's JSON reads: no counts either
        with pytest.raises(ValueError, match="feedback.current.corrected"):
            parse_feedback(counts(current={"version": 3, "confirmed": 1, "corrected": bad}))


def test_the_correction_rate_needs_five_answers():
    assert correction_rate(3, 1) is None  # 4 answers: too few
    assert correction_rate(None, None) is None
    assert correction_rate(4, 1) == 0.2
    assert correction_rate(0, 7) == 1.0


def _stored(device_id) -> tuple:
    return tuple(
        Device.objects.filter(pk=device_id).values_list(
            "feedback_adapter", "feedback_version", "feedback_confirmed", "feedback_corrected",
            "feedback_previous_version", "feedback_previous_confirmed", "feedback_previous_corrected",
            "feedback_samples", "stored_samples", "unlabeled_samples",
        )[0]
    )  # fmt: skip


NOTHING = ("", None, None, None, None, None, None, None, None, None)


def _beat(seq: int, feedback) -> str:
    return encode("heartbeat", seq=seq, battery=80.0, feedback=feedback)


async def _acked(communicator, seq: int, feedback) -> None:
    await communicator.send_to(text_data=_beat(seq, feedback))
    ack = await communicator.receive_json_from(timeout=5)
    assert ack["type"] == "heartbeat_ack" and ack["seq"] == seq


@pytest.mark.django_db(transaction=True)
def test_the_socket_stores_the_counts_when_they_change_and_redis_stops_the_repeats(enrolled, adapter):
    device = enrolled("active")
    reported_at = []

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        assert (await communicator.receive_json_from(timeout=5))["type"] == "welcome"
        await _acked(communicator, 1, counts())
        await _acked(communicator, 2, None)  # each heartbeat is handled before the next: the first is stored
        reported_at.append(await _reported_at(device.id))
        await _acked(communicator, 3, counts(samples=420, unlabeled_samples=99))  # only samples: not stored again
        await _acked(communicator, 4, counts())
        await _acked(communicator, 5, None)
        assert await _reported_at(device.id) == reported_at[0]
        changed = counts(current={"version": 3, "confirmed": 9, "corrected": 4}, feedback_samples=33, samples=421)
        await _acked(communicator, 6, changed)
        await _acked(communicator, 7, None)
        await communicator.disconnect()

    async_to_sync(scenario)()
    assert _stored(device.id) == ("digits-lora", 3, 9, 4, 2, 18, 2, 33, 421, 150)
    assert Device.objects.get(pk=device.id).feedback_reported_at > reported_at[0]
    state = json.loads(presence.sync_client().hget(presence.key("state"), device.id))
    assert "feedback" not in state and state["battery"] == 80.0


async def _reported_at(device_id):
    from asgiref.sync import sync_to_async

    return await sync_to_async(lambda: Device.objects.get(pk=device_id).feedback_reported_at)()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("value", "message"), BAD_FEEDBACK[:5] + BAD_FEEDBACK[-6:], ids=lambda v: str(v)[:30])
def test_a_heartbeat_with_bad_feedback_closes_the_socket_and_changes_nothing(enrolled, adapter, value, message):
    device = enrolled("active")
    assert message in refused_heartbeat(device, _beat(1, value))["message"]
    assert _stored(device.id) == NOTHING
    assert presence.sync_client().hget(presence.key("state"), device.id) is None
    assert presence.sync_client().hget(presence.key("feedback"), device.id) is None


@pytest.mark.django_db
def test_the_rest_heartbeat_stores_the_counts_refuses_bad_ones_and_the_api_shows_them_read_only(
    enrolled, adapter, device_token, api_client_for
):
    device = enrolled("active")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Device {device_token(device)}")
    url = "/api/v1/device/heartbeat/"
    few = counts(current={"version": 3, "confirmed": 2, "corrected": 1})
    assert client.post(url, {"seq": 1, "feedback": few}, format="json").status_code == 204
    stored = _stored(device.id)
    assert stored == ("digits-lora", 3, 2, 1, 2, 18, 2, 32, 400, 150)
    for value, message in BAD_FEEDBACK[1:]:
        refused = client.post(url, {"seq": 2, "feedback": value}, format="json")
        assert refused.status_code == 400, value
        assert message in refused.json()["error"]["details"]["heartbeat"][0]
    nan = client.generic(
        "POST", url, '{"seq": 3, "feedback": ' + json.dumps(counts())[:-1] + ', "samples": NaN}}',
        content_type="application/json",
    )  # fmt: skip
    assert nan.status_code == 400
    assert _stored(device.id) == stored

    viewer = api_client_for("viewer")
    shown = viewer.get(f"/api/v1/devices/{device.id}/").json()["feedback"]
    assert shown["current"] == {"version": 3, "confirmed": 2, "corrected": 1, "answered": 3,
                                "correction_rate": None, "note": "3 answers, too few for a rate"}  # fmt: skip
    assert shown["previous"] == {"version": 2, "confirmed": 18, "corrected": 2, "answered": 20,
                                 "correction_rate": 0.1, "note": ""}  # fmt: skip
    assert (shown["adapter"], shown["feedback_samples"], shown["samples"]) == ("digits-lora", 32, 400)
    assert shown["unlabeled_samples"] == 150
    listed = [d for d in viewer.get("/api/v1/devices/").json()["results"] if d["id"] == str(device.id)]
    assert listed[0]["feedback"] == shown
    # read only: an admin's write of it is ignored, as of every read-only field
    admin = api_client_for("admin")
    patched = admin.patch(f"/api/v1/devices/{device.id}/", {"feedback": None, "name": "renamed"}, format="json")
    assert patched.status_code == 200 and patched.json()["feedback"] == shown
    assert _stored(device.id) == stored
