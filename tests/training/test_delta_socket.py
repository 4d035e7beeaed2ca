"""Delta upload over the agent socket (full ASGI app, real Redis channel layer): chunked, resumable after
a dropped connection, acknowledged by sha256 so a repeat is never counted twice."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from edge_agent.delta import encode_delta, sign_delta
from edge_agent.protocol import DELTA_CHUNK_BYTES, b64encode, encode, hello_payload, sign
from fleet.asgi import application
from tests.training.test_rounds import make_delta_tensors
from training.models import Delta
from training.services import version_create_seeded

pytestmark = pytest.mark.django_db(transaction=True)


async def connected(device):
    communicator = WebsocketCommunicator(application, "/ws/agent/")
    assert (await communicator.connect(timeout=5))[0]
    challenge = await communicator.receive_json_from(timeout=5)
    signature = sign(device.key, hello_payload(nonce=challenge["nonce"], device_id=device.id))
    await communicator.send_to(text_data=encode("hello", device_id=device.id, signature=signature))
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
