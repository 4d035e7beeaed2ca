"""Devices over REST: a signed nonce for a short-lived token, and only ever acting as themselves."""

import pytest
from rest_framework.test import APIClient

from devices import presence
from devices.models import Device
from devices.services import device_transition
from edge_agent.protocol import sign, token_request_payload


def challenge(device_id: str) -> str:
    response = APIClient().post("/api/v1/device-auth/challenge/", {"device_id": device_id}, format="json")
    assert response.status_code == 200, response.content
    return response.json()["nonce"]


def exchange(device_id: str, nonce: str, key):
    signature = sign(key, token_request_payload(nonce=nonce, device_id=device_id))
    body = {"device_id": device_id, "nonce": nonce, "signature": signature, "protocol": 2}
    return APIClient().post("/api/v1/device-auth/token/", body, format="json")


def as_device(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Device {token}")
    return client


@pytest.mark.django_db
def test_signed_challenge_gives_a_token_that_reads_only_the_device_itself(enrolled):
    device = enrolled("active")
    response = exchange(device.id, challenge(device.id), device.key)
    assert response.status_code == 200
    token = response.json()["token"]
    assert response.json()["expires_in"] == 900
    me = as_device(token).get("/api/v1/device/")
    assert me.status_code == 200 and me.json()["id"] == device.id
    assert (
        as_device(token).post("/api/v1/device/heartbeat/", {"seq": 1, "battery": 80}, format="json").status_code == 204
    )
    assert presence.sync_client().zscore(presence.key("seen"), device.id) is not None


@pytest.mark.django_db
def test_nonce_is_single_use_and_bound_to_its_device(enrolled):
    alice, bob = enrolled("active", name="alice"), enrolled("active", name="bob")
    nonce = challenge(alice.id)
    assert exchange(alice.id, nonce, alice.key).status_code == 200
    replay = exchange(alice.id, nonce, alice.key)
    assert replay.status_code == 401 and replay.json()["error"]["code"] == "nonce_invalid"
    stolen = exchange(bob.id, challenge(alice.id), bob.key)
    assert stolen.status_code == 401 and "another device" in stolen.json()["error"]["message"]


@pytest.mark.django_db
def test_a_signature_by_another_key_gets_no_token(enrolled):
    alice, mallory = enrolled("active", name="alice"), enrolled("active", name="mallory")
    response = exchange(alice.id, challenge(alice.id), mallory.key)
    assert response.status_code == 401 and response.json()["error"]["code"] == "auth_failed"


@pytest.mark.django_db
def test_pending_devices_get_no_token_and_a_quarantine_cuts_an_existing_one(enrolled, make_user):
    pending = enrolled("pending")
    response = exchange(pending.id, challenge(pending.id), pending.key)
    assert response.status_code == 403 and response.json()["error"]["code"] == "device_pending"

    device = enrolled("active")
    token = exchange(device.id, challenge(device.id), device.key).json()["token"]
    device_transition(device=device.device, action="quarantine", actor=make_user("operator"))
    response = as_device(token).get("/api/v1/device/")
    assert response.status_code == 403 and "quarantined" in response.json()["error"]["message"]


@pytest.mark.django_db
def test_device_tokens_open_no_operator_endpoint_and_forged_tokens_fail(enrolled):
    device = enrolled("active")
    token = exchange(device.id, challenge(device.id), device.key).json()["token"]
    for path in ("/api/v1/devices/", f"/api/v1/devices/{device.id}/", "/api/v1/me/", "/api/v1/cohorts/"):
        assert as_device(token).get(path).status_code == 401, path
    assert as_device(token).post(f"/api/v1/devices/{device.id}/approve/").status_code == 401
    assert as_device(token[:-2] + "xx").get("/api/v1/device/").status_code == 401
    assert APIClient().get("/api/v1/device/").status_code == 401


@pytest.mark.django_db
def test_bad_rest_heartbeats_are_refused_and_record_nothing(enrolled):
    device = enrolled("active")
    client = as_device(exchange(device.id, challenge(device.id), device.key).json()["token"])
    for body in ({"seq": "one"}, {"seq": 1, "battery": 101}, {"seq": 1, "metrics": {"x": "high"}}):
        response = client.post("/api/v1/device/heartbeat/", body, format="json")
        assert response.status_code == 400, body
        assert response.json()["error"]["code"] == "invalid"
    raw = client.post("/api/v1/device/heartbeat/", '{"seq": 1, "battery": NaN}', content_type="application/json")
    assert raw.status_code == 400
    assert presence.sync_client().hget(presence.key("state"), device.id) is None


@pytest.mark.django_db
def test_challenge_for_a_malformed_device_id_is_refused():
    response = APIClient().post("/api/v1/device-auth/challenge/", {"device_id": "nope"}, format="json")
    assert response.status_code == 400 and "device_id" in response.json()["error"]["details"]


@pytest.mark.django_db
def test_a_protocol_1_token_request_works_until_the_sunset_and_is_refused_after_it(enrolled, settings):
    device = enrolled("active")
    Device.objects.filter(pk=device.id).update(protocol=2)
    # Protocol 1: no "protocol" in the body; the payload names protocol 1 and is signed in its canonical form.
    nonce = challenge(device.id)
    legacy = sign(key := device.key, token_request_payload(nonce=nonce, device_id=device.id, protocol=1), protocol=1)
    body = {"device_id": device.id, "nonce": nonce, "signature": legacy}
    assert APIClient().post("/api/v1/device-auth/token/", body, format="json").status_code == 200
    assert Device.objects.get(pk=device.id).protocol == 1  # its manifests are signed in protocol 1's form now
    # A protocol 2 signature sent as protocol 1 (the body's protocol is what the server checks against) fails.
    nonce = challenge(device.id)
    body = {
        "device_id": device.id,
        "nonce": nonce,
        "signature": sign(key, token_request_payload(nonce=nonce, device_id=device.id)),
    }
    refused = APIClient().post("/api/v1/device-auth/token/", body, format="json")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "auth_failed"
    settings.PROTOCOL_1_ACCEPTED_UNTIL = "2020-01-01"
    nonce = challenge(device.id)
    legacy = sign(key, token_request_payload(nonce=nonce, device_id=device.id, protocol=1), protocol=1)
    late = APIClient().post(
        "/api/v1/device-auth/token/", {"device_id": device.id, "nonce": nonce, "signature": legacy}, format="json"
    )
    assert late.status_code == 403 and late.json()["error"]["code"] == "protocol_unsupported"
    assert "2020-01-01" in late.json()["error"]["message"]
    assert exchange(device.id, challenge(device.id), key).status_code == 200  # protocol 2 still is
    assert Device.objects.get(pk=device.id).protocol == 2
