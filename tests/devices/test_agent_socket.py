"""The agent socket through the full ASGI app and the real Redis channel layer."""

from __future__ import annotations

import json
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from devices import presence
from devices.models import Device
from edge_agent.protocol import CloseCode, encode, hello_payload, sign
from fleet.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)


async def open_socket() -> tuple[WebsocketCommunicator, dict]:
    communicator = WebsocketCommunicator(application, "/ws/agent/")
    connected, _ = await communicator.connect(timeout=5)
    assert connected
    challenge = await communicator.receive_json_from(timeout=5)
    assert challenge["type"] == "challenge" and challenge["protocol"] == 2
    return communicator, challenge


async def hello(communicator, challenge, device_id: str, key: Ed25519PrivateKey, nonce: str | None = None):
    signature = sign(key, hello_payload(nonce=nonce or challenge["nonce"], device_id=device_id))
    await communicator.send_to(
        text_data=encode("hello", device_id=device_id, signature=signature, agent_version="9.9", protocol=2)
    )


async def expect_refusal(communicator, close_code: int, error_code: str | None = None) -> dict:
    error = await communicator.receive_json_from(timeout=5)
    assert error["type"] == "error", error
    if error_code:
        assert error["code"] == error_code, error
    closed = await communicator.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": close_code}
    return error


def run(coroutine_function):
    return async_to_sync(coroutine_function)()


def refused_heartbeat(device, text: str) -> dict:
    """Say hello as ``device`` (an enrolled one), send ``text`` as its first heartbeat, and return the error of the
    socket's refusal (closed as malformed)."""

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        await communicator.receive_json_from(timeout=5)
        await communicator.send_to(text_data=text)
        return await expect_refusal(communicator, CloseCode.MALFORMED, "malformed")

    return run(scenario)


def test_active_device_authenticates_heartbeats_and_is_marked_online_by_the_batch_flush(enrolled):
    device = enrolled("active")

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        welcome = await communicator.receive_json_from(timeout=5)
        assert welcome["type"] == "welcome" and welcome["device_id"] == device.id
        await communicator.send_to(
            text_data=encode(
                "heartbeat", seq=1, battery=41.5, charging=False, free_memory_mb=900, metrics={"val_loss": 0.3}
            )
        )
        ack = await communicator.receive_json_from(timeout=5)
        assert ack == {"type": "heartbeat_ack", "seq": 1, "server_time": ack["server_time"], "recorded": True}
        # Nothing reached the database per heartbeat: presence is still only in Redis.
        row = await sync_to_async(Device.objects.get)(pk=device.id)
        assert row.online is False and row.last_seen_at is None and row.battery_percent is None
        result = await sync_to_async(presence.flush_presence)()
        assert device.id in result.came_online
        row = await sync_to_async(Device.objects.get)(pk=device.id)
        assert row.online and row.battery_percent == 41.5 and row.charging is False
        assert row.free_memory_mb == 900 and row.local_metrics == {"val_loss": 0.3} and row.agent_version == "9.9"
        await communicator.disconnect()
        result = await sync_to_async(presence.flush_presence)()
        assert result.went_offline == [device.id]

    run(scenario)
    kinds = list(Device.objects.get(pk=device.id).events.values_list("kind", flat=True))
    assert kinds[:3] == ["offline", "online", "updated"]


def test_a_signature_by_another_devices_key_is_refused(enrolled):
    victim, attacker = enrolled("active", name="victim"), enrolled("active", name="attacker")

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, victim.id, attacker.key)
        await expect_refusal(communicator, CloseCode.AUTH_FAILED, "auth_failed")

    run(scenario)
    assert not Device.objects.get(pk=victim.id).online


def test_a_replayed_challenge_answer_is_refused(enrolled):
    device = enrolled("active")

    async def scenario():
        first, challenge = await open_socket()
        old_nonce = challenge["nonce"]
        await hello(first, challenge, device.id, device.key)
        assert (await first.receive_json_from(timeout=5))["type"] == "welcome"
        await first.disconnect()
        # An eavesdropper replays the old answer on a new connection: the new nonce differs.
        second, new_challenge = await open_socket()
        assert new_challenge["nonce"] != old_nonce
        await hello(second, new_challenge, device.id, device.key, nonce=old_nonce)
        await expect_refusal(second, CloseCode.AUTH_FAILED, "auth_failed")

    run(scenario)


@pytest.mark.parametrize(
    ("status", "error_code"),
    [("pending", "device_pending"), ("quarantined", "device_quarantined"), ("retired", "device_retired")],
)
def test_devices_that_may_not_sync_are_refused_with_a_clear_reason(enrolled, status, error_code):
    device = enrolled(status)

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        error = await expect_refusal(communicator, CloseCode.NOT_ALLOWED, error_code)
        assert status in error["message"] or "approve" in error["message"]

    run(scenario)
    assert async_to_sync(presence.current_channel)(device.id) is None


def test_unknown_device_is_refused(enrolled):
    key = Ed25519PrivateKey.generate()

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, "6a1c1c52-8f1e-4a43-9d7b-3c2f50a1e001", key)
        await expect_refusal(communicator, CloseCode.AUTH_FAILED, "auth_failed")

    run(scenario)


@pytest.mark.parametrize(
    ("frame", "close_code"),
    [
        ({"text_data": "not json"}, CloseCode.MALFORMED),
        ({"text_data": "[1, 2]"}, CloseCode.MALFORMED),
        ({"text_data": json.dumps({"type": "heartbeat", "seq": 1})}, CloseCode.MALFORMED),
        (
            {"text_data": json.dumps({"type": "hello", "device_id": "not-a-uuid", "signature": "x"})},
            CloseCode.MALFORMED,
        ),
        ({"text_data": json.dumps({"type": "hello", "device_id": None})}, CloseCode.MALFORMED),
        ({"bytes_data": b"\x00\x01"}, CloseCode.MALFORMED),
        ({"text_data": json.dumps({"type": "hello", "pad": "x" * 5000})}, CloseCode.TOO_LARGE),
        ({"text_data": '{"type": "hello", "pad": ' + "[" * 2000 + "]" * 2000 + "}"}, CloseCode.MALFORMED),
    ],
    ids=["not-json", "not-object", "heartbeat-before-hello", "bad-uuid", "null-id", "binary", "oversized", "deep"],
)
def test_malformed_and_oversized_messages_before_hello_close_the_socket(frame, close_code):
    async def scenario():
        communicator, _ = await open_socket()
        await communicator.send_to(**frame)
        await expect_refusal(communicator, close_code)

    run(scenario)


def test_a_chunk_frame_with_an_unlisted_header_field_or_more_than_512_kib_of_file_closes_the_socket(enrolled):
    """What the spec says of a binary chunk frame (docs/protocol/README.md, "Uploads"): a header field besides
    offset and sha256 is malformed; more than 512 KiB of the file is too large, however short the header."""
    device = enrolled("active")

    def frame(header: dict, data: bytes) -> bytes:
        raw = json.dumps(header, separators=(",", ":")).encode()
        return b"FPD1" + len(raw).to_bytes(2, "big") + raw + data

    sha = "0" * 64
    cases = [
        (frame({"offset": 0, "sha256": sha, "note": "x"}, b"data"), CloseCode.MALFORMED, "malformed", "['note']"),
        (frame({"offset": 0, "sha256": sha}, b"\0" * (512 * 1024 + 1)), CloseCode.TOO_LARGE, "too_large", "524288"),
    ]

    async def scenario(data: bytes, code: int, error: str):
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        assert (await communicator.receive_json_from(timeout=5))["type"] == "welcome"
        await communicator.send_to(bytes_data=data)
        return await expect_refusal(communicator, code, error)

    for data, code, error, said in cases:
        assert said in async_to_sync(scenario)(data, code, error)["message"]


@pytest.mark.parametrize(
    "heartbeat",
    [
        '{"type":"heartbeat","seq":1,"battery":NaN}',
        '{"type":"heartbeat","seq":1,"battery":250}',
        '{"type":"heartbeat","seq":-1}',
        '{"type":"heartbeat","seq":1,"metrics":{"loss":Infinity}}',
        '{"type":"heartbeat","seq":1,"charging":"yes"}',
        '{"type":"launch_missiles"}',
    ],
)
def test_bad_heartbeats_close_the_socket_and_record_nothing(enrolled, heartbeat):
    device = enrolled("active")
    refused_heartbeat(device, heartbeat)
    assert presence.sync_client().hget(presence.key("state"), device.id) is None


def test_json_nested_too_deep_is_malformed_before_and_after_the_hello_and_in_a_chunk_header(enrolled):
    device = enrolled("active")
    deep_header = b"[" * 128 + b"]" * 128  # the longest header a chunk frame may have
    frames = [
        {"text_data": '{"type": "hello", "pad": ' + "[" * 2000 + "]" * 2000 + "}"},  # 4 KB, before the hello
        {"text_data": '{"type": "heartbeat", "seq": 1, "metrics": ' + "[" * 30_000 + "]" * 30_000 + "}"},
        {"bytes_data": b"FPD1" + len(deep_header).to_bytes(2, "big") + deep_header + b"data"},
    ]

    async def scenario(frame, after_hello: bool):
        communicator, challenge = await open_socket()
        if after_hello:
            await hello(communicator, challenge, device.id, device.key)
            assert (await communicator.receive_json_from(timeout=5))["type"] == "welcome"
        await communicator.send_to(**frame)
        return await expect_refusal(communicator, CloseCode.MALFORMED, "malformed")

    for frame, after_hello in zip(frames, (False, True, True), strict=True):
        error = async_to_sync(scenario)(frame, after_hello)
        assert "levels deep; at most 64" in error["message"], error
    assert presence.sync_client().hget(presence.key("state"), device.id) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("agent_version", "9.9\x1b[2J"), ("agent_version", "9.9\u202e"), ("hardware", {"os": "Linux\nroot"}),
     ("hardware", {"cpu\x07": "arm"})],
    ids=["ansi-escape", "rtl-override", "newline-in-value", "bell-in-name"],
)  # fmt: skip
def test_a_hello_with_control_characters_in_what_the_device_record_keeps_is_malformed(enrolled, field, value):
    device = enrolled("active")

    async def scenario():
        communicator, challenge = await open_socket()
        signature = sign(device.key, hello_payload(nonce=challenge["nonce"], device_id=device.id))
        message = {"device_id": device.id, "signature": signature, "protocol": 2, field: value}
        await communicator.send_to(text_data=encode("hello", **message))
        return await expect_refusal(communicator, CloseCode.MALFORMED, "malformed")

    error = run(scenario)
    assert f"hello.{field}" in error["message"] and "control characters are not accepted" in error["message"]
    stored = Device.objects.get(pk=device.id)
    assert stored.agent_version == "" and stored.hardware == {}


def test_an_oversized_message_after_hello_is_refused(enrolled):
    device = enrolled("active")

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        await communicator.receive_json_from(timeout=5)
        await communicator.send_to(text_data=encode("heartbeat", seq=1, pad="x" * 70_000))
        await expect_refusal(communicator, CloseCode.TOO_LARGE, "too_large")

    run(scenario)


def test_no_hello_in_time_closes_the_socket(monkeypatch):
    import devices.consumers

    monkeypatch.setattr(devices.consumers, "HELLO_TIMEOUT_SECONDS", 0.3)

    async def scenario():
        communicator, _ = await open_socket()
        await expect_refusal(communicator, CloseCode.HELLO_TIMEOUT, "hello_timeout")

    run(scenario)


@pytest.mark.parametrize(("action", "code", "kind"), [("quarantine", "device_quarantined", "quarantined"),
                                                       ("retire", "device_retired", "retired")])  # fmt: skip
def test_quarantining_or_retiring_a_connected_device_closes_its_socket_with_the_status_code_and_records_who(
    enrolled, make_user, action, code, kind
):
    """The error names the status, as the spec's table has it (device_retired: stop; device_quarantined: wait),
    never closed_by_server, which tells an agent to reconnect at once."""
    from devices.services import device_transition

    device = enrolled("active")
    operator = make_user("operator")

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        await communicator.receive_json_from(timeout=5)
        await sync_to_async(device_transition)(device=device.device, action=action, actor=operator)
        error = await expect_refusal(communicator, CloseCode.NOT_ALLOWED, code)
        assert kind in error["message"]

    run(scenario)
    event = Device.objects.get(pk=device.id).events.get(kind=kind)
    assert event.actor == operator and event.actor_label == operator.username


def test_a_second_connection_of_the_same_device_replaces_the_first(enrolled):
    device = enrolled("active")

    async def scenario():
        first, challenge = await open_socket()
        await hello(first, challenge, device.id, device.key)
        await first.receive_json_from(timeout=5)
        second, challenge2 = await open_socket()
        await hello(second, challenge2, device.id, device.key)
        assert (await second.receive_json_from(timeout=5))["type"] == "welcome"
        await expect_refusal(first, CloseCode.REPLACED, "closed_by_server")
        await second.send_to(text_data=encode("heartbeat", seq=7))
        assert (await second.receive_json_from(timeout=5))["seq"] == 7
        await second.disconnect()

    run(scenario)


def test_a_device_silent_past_the_timeout_goes_offline_without_a_clean_disconnect(enrolled, settings):
    device = enrolled("active")
    presence.sync_client().zadd(presence.key("seen"), {device.id: time.time()})
    assert device.id in presence.flush_presence().came_online
    settings.DEVICE_OFFLINE_AFTER_SECONDS = 5
    # The server process holding the socket died: nothing refreshes the device any more.
    result = presence.flush_presence(now=time.time() + 6)
    assert result.went_offline == [device.id]
    assert presence.flush_presence(now=time.time() + 7).went_offline == []  # idempotent
    assert Device.objects.get(pk=device.id).online is False


def test_a_command_pushed_from_server_code_reaches_the_device_and_offline_devices_miss_it(enrolled):
    from devices.push import adevice_send

    device, offline = enrolled("active"), enrolled("active", name="offline")

    async def scenario():
        communicator, challenge = await open_socket()
        await hello(communicator, challenge, device.id, device.key)
        await communicator.receive_json_from(timeout=5)
        message = {"type": "device.command", "id": "c-1", "command": "sync_now", "args": {"why": "test"}}
        assert await adevice_send(device.id, message) is True
        command = await communicator.receive_json_from(timeout=5)
        assert command == {"type": "command", "id": "c-1", "command": "sync_now", "args": {"why": "test"}}
        await communicator.send_to(text_data=encode("ack", id="c-1", ok=True, detail=None))
        assert await adevice_send(offline.id, message) is False
        await communicator.send_to(text_data=encode("heartbeat", seq=2))
        assert (await communicator.receive_json_from(timeout=5))["seq"] == 2  # the ack did not upset the socket
        await communicator.disconnect()

    run(scenario)


def test_a_wrong_key_for_a_known_device_leaves_one_auth_failed_event(enrolled):
    victim, attacker = enrolled("active", name="victim"), enrolled("active", name="attacker")

    async def scenario():
        for _ in range(3):
            communicator, challenge = await open_socket()
            await hello(communicator, challenge, victim.id, attacker.key)
            await expect_refusal(communicator, CloseCode.AUTH_FAILED, "auth_failed")

    from django.core.cache import cache

    cache.delete(f"devauth:failed:{victim.id}")
    run(scenario)
    events = Device.objects.get(pk=victim.id).events.filter(kind="auth_failed")
    assert events.count() == 1  # rate-limited, so an attacker cannot flood the event log
