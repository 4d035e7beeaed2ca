"""Delta upload over the agent socket (full ASGI app, real Redis channel layer): chunked, resumable after
a dropped connection, acknowledged by sha256 so a repeat is never counted twice."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from edge_agent.delta import encode_delta, sign_delta
from edge_agent.protocol import (
    DELTA_CHUNK_BYTES,
    MAX_BINARY_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    b64encode,
    encode,
    encode_chunk_frame,
    hello_payload,
    sign,
)
from fleet.asgi import application
from tests.training.test_rounds import make_delta_tensors
from training.models import Delta
from training.registry.services import version_create_seeded

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _no_verification(monkeypatch):
    """These tests are about the transfer. A verification task queued by an upload would reach the session's
    Celery worker, if one runs, and could still be reading these tables when the test's flush truncates them
    (a deadlock PostgreSQL resolves by failing the flush); verification has its own tests."""
    monkeypatch.setattr("training.federation.verify_queue.queue_verification", lambda delta_id: None)


async def connected(device):
    communicator = WebsocketCommunicator(application, "/ws/agent/")
    assert (await communicator.connect(timeout=5))[0]
    challenge = await communicator.receive_json_from(timeout=5)
    signature = sign(device.key, hello_payload(nonce=challenge["nonce"], device_id=device.id))
    await communicator.send_to(
        text_data=encode("hello", device_id=device.id, signature=signature, protocol=PROTOCOL_VERSION)
    )
    assert (await communicator.receive_json_from(timeout=5))["type"] == "welcome"
    return communicator


async def answer(communicator) -> dict:
    while True:
        message = await communicator.receive_json_from(timeout=10)
        if message["type"] in ("delta_state", "delta_error"):
            return message


def test_a_delta_uploads_in_chunks_resumes_after_a_drop_and_is_counted_once(adapter, cohort, enrolled):
    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=3)
    device = enrolled("active")
    data = encode_delta(make_delta_tensors(adapter, seed=1))
    assert len(data) > DELTA_CHUNK_BYTES // 10
    signed = sign_delta(
        device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=12, counter=1
    )
    sha = signed["envelope"]["sha256"]

    async def scenario():
        socket = await connected(device)
        await socket.send_to(
            text_data=encode(
                "delta_begin", envelope=signed["envelope"], signature=signed["signature"], metrics={"val_accuracy": 0.9}
            )
        )
        state = await answer(socket)
        assert state["state"] == "uploading" and state["offset"] == 0
        half = len(data) // 2
        await socket.send_to(text_data=encode("delta_chunk", sha256=sha, offset=0, data=b64encode(data[:half])))
        state = await answer(socket)
        assert state["offset"] == half
        await socket.disconnect()  # the connection drops mid-upload

        socket = await connected(device)
        await socket.send_to(
            text_data=encode("delta_begin", envelope=signed["envelope"], signature=signed["signature"])
        )
        state = await answer(socket)
        assert state["state"] == "uploading" and state["offset"] == half  # resumes, not restarts
        await socket.send_to(text_data=encode("delta_chunk", sha256=sha, offset=0, data=b64encode(data[:10])))
        error = await answer(socket)
        assert error["type"] == "delta_error" and error["code"] == "wrong_offset"
        await socket.send_to(text_data=encode("delta_chunk", sha256=sha, offset=half, data=b64encode(data[half:])))
        state = await answer(socket)
        assert state["state"] == "received" and state["delta_id"]
        # A repeat (the agent did not see the answer before a crash) is acknowledged, never a second delta.
        await socket.send_to(
            text_data=encode("delta_begin", envelope=signed["envelope"], signature=signed["signature"])
        )
        again = await answer(socket)
        assert again["delta_id"] == state["delta_id"] and again["offset"] == len(data)
        await socket.disconnect()

    async_to_sync(scenario)()
    delta = Delta.objects.get()
    assert delta.channel == "ws" and delta.metrics == {"val_accuracy": 0.9} and delta.blob_sha256 == sha


def test_a_socket_cannot_upload_for_another_device_and_bad_chunks_are_refused(adapter, cohort, enrolled):
    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=3)
    device, other = enrolled("active"), enrolled("active", name="other")
    data = encode_delta(make_delta_tensors(adapter, seed=2))
    theirs = sign_delta(
        other.key, data, device_id=other.id, adapter=adapter.name, base_version=1, num_samples=3, counter=1
    )

    async def scenario():
        socket = await connected(device)
        await socket.send_to(
            text_data=encode("delta_begin", envelope=theirs["envelope"], signature=theirs["signature"])
        )
        error = await answer(socket)
        assert error["type"] == "delta_error" and error["code"] == "wrong_device"
        await socket.send_to(text_data=encode("delta_chunk", sha256="0" * 64, offset=0, data=b64encode(b"x")))
        error = await answer(socket)
        assert error["code"] == "unknown_upload"
        await socket.send_to(text_data=encode("delta_chunk", sha256="0" * 64, offset=0, data="%%%"))
        closed = await socket.receive_output(timeout=5)
        while closed["type"] != "websocket.close":
            closed = await socket.receive_output(timeout=5)
        assert closed["code"] == 4400

    async_to_sync(scenario)()
    assert not Delta.objects.exists()


async def closed_with(socket) -> int:
    output = await socket.receive_output(timeout=5)
    while output["type"] != "websocket.close":
        output = await socket.receive_output(timeout=5)
    return output["code"]


def test_a_delta_uploads_as_binary_frames_and_resumes_from_the_offset_the_server_holds(adapter, cohort, enrolled):
    adapter.cohorts.add(cohort)
    version_create_seeded(adapter=adapter, seed=3)
    device = enrolled("active")
    data = encode_delta(make_delta_tensors(adapter, seed=4))
    signed = sign_delta(
        device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=5, counter=7
    )
    sha = signed["envelope"]["sha256"]
    third = len(data) // 3

    async def scenario():
        socket = await connected(device)
        await socket.send_to(
            text_data=encode("delta_begin", envelope=signed["envelope"], signature=signed["signature"])
        )
        assert (await answer(socket))["offset"] == 0
        await socket.send_to(bytes_data=encode_chunk_frame(sha256=sha, offset=0, data=data[:third]))
        assert (await answer(socket))["offset"] == third
        await socket.disconnect()

        socket = await connected(device)
        await socket.send_to(
            text_data=encode("delta_begin", envelope=signed["envelope"], signature=signed["signature"])
        )
        assert (await answer(socket))["offset"] == third
        # Binary and text chunks are the same step; a chunk at the wrong offset changes nothing.
        await socket.send_to(bytes_data=encode_chunk_frame(sha256=sha, offset=0, data=data[:third]))
        assert (await answer(socket))["code"] == "wrong_offset"
        await socket.send_to(
            text_data=encode("delta_chunk", sha256=sha, offset=third, data=b64encode(data[third : 2 * third]))
        )
        assert (await answer(socket))["offset"] == 2 * third
        await socket.send_to(bytes_data=encode_chunk_frame(sha256=sha, offset=2 * third, data=data[2 * third :]))
        done = await answer(socket)
        assert done["state"] == "received" and done["offset"] == len(data)
        # A chunk after the end is answered with the finished upload, not appended.
        await socket.send_to(bytes_data=encode_chunk_frame(sha256=sha, offset=len(data), data=b"x"))
        assert (await answer(socket))["delta_id"] == done["delta_id"]
        await socket.disconnect()

    async_to_sync(scenario)()
    delta = Delta.objects.get()
    assert delta.blob_sha256 == sha and delta.size == len(data)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"not a chunk frame at all", 4400),
        (b"FPD1\x00\x05{bad}" + b"x" * 10, 4400),
        (b"FPD1\xff\xff" + b"{}", 4400),
        (b"FPD1\x00\x02[]", 4400),
        (encode_chunk_frame(sha256="ab" * 32, offset=-1, data=b"x"), 4400),
        (encode_chunk_frame(sha256="short", offset=0, data=b"x"), 4400),
        (encode_chunk_frame(sha256="ab" * 32, offset=0, data=b"x" * (MAX_BINARY_MESSAGE_BYTES + 1)), 4413),
    ],
    ids=["no-magic", "bad-json", "header-too-long", "header-not-object", "negative-offset", "bad-sha", "oversized"],
)
def test_a_malformed_or_oversized_binary_frame_closes_the_socket_and_stores_nothing(enrolled, frame, code):
    device = enrolled("active")

    async def scenario():
        socket = await connected(device)
        await socket.send_to(bytes_data=frame)
        assert await closed_with(socket) == code

    async_to_sync(scenario)()
    assert not Delta.objects.exists()


def test_a_binary_frame_before_the_hello_is_refused(enrolled):
    enrolled("active")

    async def scenario():
        socket = WebsocketCommunicator(application, "/ws/agent/")
        assert (await socket.connect(timeout=5))[0]
        await socket.receive_json_from(timeout=5)
        await socket.send_to(bytes_data=encode_chunk_frame(sha256="ab" * 32, offset=0, data=b"x"))
        assert await closed_with(socket) == 4400

    async_to_sync(scenario)()
    assert not Delta.objects.exists()
