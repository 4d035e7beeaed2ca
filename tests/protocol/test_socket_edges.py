"""The agent socket's edges, each sent by a real WebSocket client to a live server (uvicorn on the test database):
protocol versions and the sunset of protocol 1, limits counted in bytes, heartbeats far faster than the interval,
malformed messages answered with the field's name; and that nothing was stored for what was refused."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from devices import presence
from devices.models import Device, DeviceEvent
from devices.server_key import server_public_key_b64
from edge_agent.manifest import verify_manifest
from edge_agent.protocol import CloseCode, canonical_json, hello_payload, public_key_from_b64, sign, verify
from tests.asgi_server import asgi_server
from training.registry.services import version_create_seeded
from training.rollouts.manifests import manifest_sign

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, tmp_path_factory):
    # Three early heartbeats in a row close the socket (the default is ten).
    with asgi_server("socket-edges", tmp_path_factory.mktemp("socket-edges"), HEARTBEAT_EARLY_LIMIT="3") as s:
        yield s


@pytest.fixture(scope="module")
def sunset_server(django_db_setup, django_db_blocker, tmp_path_factory):
    """A server past protocol 1's sunset."""
    with asgi_server("sunset", tmp_path_factory.mktemp("sunset"), PROTOCOL_1_ACCEPTED_UNTIL="2020-01-01") as s:
        yield s


@pytest.fixture
def version(adapter, cohort):
    adapter.cohorts.add(cohort)
    return version_create_seeded(adapter=adapter, seed=11)


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=30))


async def _closed(socket) -> tuple[int, list[dict]]:
    """Every message until the server closes the socket, and the close code."""
    seen = []
    try:
        while True:
            seen.append(json.loads(await socket.recv()))
    except ConnectionClosed:
        return socket.close_code, seen


async def _hello(url: str, device, *, protocol: int | None = 2, **extra):
    socket = await connect(url + "/ws/agent/", compression=None)
    challenge = json.loads(await socket.recv())
    signed_as = 1 if protocol is None else protocol
    payload = hello_payload(nonce=challenge["nonce"], device_id=device.id, protocol=signed_as)
    hello = {"type": "hello", "device_id": device.id, "signature": sign(device.key, payload, protocol=signed_as)}
    if protocol is not None:
        hello["protocol"] = protocol
    await socket.send(json.dumps({**hello, **extra}))
    return socket, challenge


def test_the_challenge_names_the_protocols_and_a_protocol_1_device_gets_manifests_in_its_form(server, enrolled):
    device = enrolled("active")

    async def scenario():
        socket, challenge = await _hello(server.ws_url, device, protocol=None)  # an agent from before protocol 2
        welcome = json.loads(await socket.recv())
        await socket.close()
        return challenge, welcome

    challenge, welcome = _run(scenario())
    assert challenge["protocol"] == 2 and challenge["protocols"] == [1, 2]
    assert welcome["type"] == "welcome" and welcome["protocol"] == 1
    assert Device.objects.get(pk=device.id).protocol == 1

    async def again():
        socket, _ = await _hello(server.ws_url, device, protocol=2)
        welcome = json.loads(await socket.recv())
        await socket.close()
        return welcome

    assert _run(again())["protocol"] == 2
    assert Device.objects.get(pk=device.id).protocol == 2


def test_manifests_are_signed_in_the_canonical_form_of_the_device_s_protocol(version, enrolled):
    device = enrolled("active")
    key = server_public_key_b64()
    base = version.adapter.base_model.weights_sha256
    for protocol in (1, 2):
        envelope = manifest_sign(device_id=device.id, version=version, assignment_seq=protocol, protocol=protocol)
        manifest = envelope["manifest"]
        assert manifest["training"]["alpha"] == float(manifest["training"]["alpha"])  # a float: the forms differ
        assert canonical_json(manifest, protocol=1) != canonical_json(manifest, protocol=2)
        # Only the device's own form verifies: an agent of that protocol checks exactly those bytes.
        assert verify(public_key_from_b64(key), manifest, envelope["signature"], protocols=(protocol,))
        assert not verify(public_key_from_b64(key), manifest, envelope["signature"], protocols=(3 - protocol,))
        verify_manifest(envelope, server_public_key=key, device_id=device.id, base_model_sha256=base,
                        last_accepted_seq=0, now=manifest["issued_at"])  # fmt: skip


def test_protocol_1_is_refused_after_its_sunset_and_protocol_2_still_welcomed(sunset_server, enrolled):
    device = enrolled("active")
    events = DeviceEvent.objects.filter(device_id=device.id).count()

    async def scenario():
        socket, challenge = await _hello(sunset_server.ws_url, device, protocol=None)
        closed = await _closed(socket)
        socket, _ = await _hello(sunset_server.ws_url, device, protocol=2)
        welcome = json.loads(await socket.recv())
        await socket.close()
        return challenge, closed, welcome

    challenge, (code, messages), welcome = _run(scenario())
    assert challenge["protocols"] == [2]
    assert code == CloseCode.UPGRADE_REQUIRED
    assert messages[-1]["code"] == "protocol_unsupported" and "2020-01-01" in messages[-1]["message"]
    assert welcome["type"] == "welcome"
    device_row = Device.objects.get(pk=device.id)
    assert device_row.protocol == 2
    assert DeviceEvent.objects.filter(device_id=device.id, kind="auth_failed").count() == 0
    assert DeviceEvent.objects.filter(device_id=device.id).count() >= events


def test_the_limit_before_the_hello_counts_bytes_not_characters(server, enrolled):
    device = enrolled("active")

    async def scenario():
        socket = await connect(server.ws_url + "/ws/agent/", compression=None)
        await socket.recv()  # the challenge
        # 1,100 characters of four bytes each: past the 4 KiB limit in bytes with far fewer characters.
        text = json.dumps({"type": "hello", "device_id": device.id, "pad": "\U0001f600" * 1100}, ensure_ascii=False)
        assert len(text) < 4096 < len(text.encode())
        await socket.send(text)
        return len(text.encode()), await _closed(socket)

    size, (code, messages) = _run(scenario())
    assert code == CloseCode.TOO_LARGE
    assert messages[-1]["code"] == "too_large" and f"{size} bytes" in messages[-1]["message"]


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"type": "heartbeat", "seq": 1, "battery": "high"}, "heartbeat.battery"),
        ({"type": "heartbeat", "seq": True}, "heartbeat.seq"),
        ({"type": "heartbeat", "seq": 1, "metrics": {"loss": float("nan")}}, None),  # NaN is not JSON at all
        ({"type": "ack", "id": "x" * 65, "ok": True}, "ack.id"),
        ({"type": "ack", "id": "delta-1", "ok": "yes"}, "ack.ok"),
        ({"type": "delta_chunk", "sha256": "a" * 64, "offset": -1, "data": ""}, "delta_chunk.offset"),
        ({"type": "delta_chunk", "sha256": "a" * 64, "offset": 0, "data": "not base64!"}, "delta_chunk.data"),
        ({"type": "hello", "device_id": "again", "signature": "x"}, "hello"),
        ({"type": "firmware", "url": "http://x"}, "unknown message type"),
    ],
)
def test_a_malformed_message_is_refused_naming_its_field_and_nothing_is_recorded(server, enrolled, message, field):
    device = enrolled("active")

    async def scenario():
        socket, _ = await _hello(server.ws_url, device)
        assert json.loads(await socket.recv())["type"] == "welcome"
        await socket.send(json.dumps(message))  # NaN goes out as the bare word NaN, which JSON does not have
        return await _closed(socket)

    code, messages = _run(scenario())
    assert code == CloseCode.MALFORMED
    error = messages[-1]
    assert error["type"] == "error" and error["code"] == "malformed"
    if field:
        assert field in error["message"], error
    assert presence.sync_client().hget(presence.key("state"), device.id) is None  # no heartbeat recorded


def test_heartbeats_far_faster_than_the_interval_are_not_recorded_and_then_close_the_socket(server, enrolled):
    device = enrolled("active")

    async def scenario():
        socket, _ = await _hello(server.ws_url, device)
        json.loads(await socket.recv())  # welcome
        acks = []
        for seq in range(1, 5):  # the first is recorded; three more right after it are early, the third closes
            await socket.send(json.dumps({"type": "heartbeat", "seq": seq, "battery": 40 + seq}))
            if seq < 4:
                acks.append(json.loads(await socket.recv()))
        return acks, await _closed(socket)

    acks, (code, messages) = _run(scenario())
    assert [(ack["seq"], ack["recorded"]) for ack in acks] == [(1, True), (2, False), (3, False)]
    assert code == CloseCode.TOO_CHATTY and messages[-1]["code"] == "too_chatty"
    recorded = json.loads(presence.sync_client().hget(presence.key("state"), device.id))
    assert recorded["battery"] == 41  # the first heartbeat's; the early ones changed nothing
