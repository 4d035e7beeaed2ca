"""Devices in the authorization matrix, on the agent socket (real Channels over Redis, committed rows): no hello
can claim another device, after its hello a device cannot name another device on its socket, and revoked or
rekeyed devices and operators' credentials are refused on the sockets. Every refusal has a clear error code
and leaves the database as it was but for a rate-limited ``auth_failed`` event, checked as such; the rest of
the matrix is described in test_device_authz_matrix.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.test import Client

from devices import presence
from devices.models import Device, DeviceEvent
from edge_agent.delta import encode_delta, sign_delta
from edge_agent.identity import public_key_b64
from edge_agent.protocol import CloseCode, b64encode, encode, encode_chunk_frame, hello_payload, sign
from fleet.asgi import application
from tests.authz_snapshot import db_changes, db_state
from tests.devices.device_authz_support import _bravo_finished_upload, build_fleet, presence_of
from tests.devices.test_agent_socket import expect_refusal, hello, open_socket, run
from tests.training.test_delta_socket import answer, connected
from tests.training.test_rounds import make_delta_tensors


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def _no_verification(monkeypatch):
    """As in tests/training/test_delta_socket.py: a verification task queued by an upload in these tests
    would reach the session's Celery worker, if one runs, and change a delta between two snapshots."""
    monkeypatch.setattr("training.federation.verify_queue.queue_verification", lambda delta_id: None)


def _only_new_events(before: dict, after: dict) -> list[tuple[str, str]]:
    """The device events written between two snapshots; the rest of the database must be equal."""
    new = DeviceEvent.objects.exclude(pk__in=[row[0] for row in before["devices.DeviceEvent"]])
    rest_before = {label: rows for label, rows in before.items() if label != "devices.DeviceEvent"}
    rest_after = {label: rows for label, rows in after.items() if label != "devices.DeviceEvent"}
    assert rest_after == rest_before, db_changes(rest_before, rest_after)
    return sorted((str(event.device_id), event.kind) for event in new)


@pytest.mark.django_db(transaction=True)
def test_hellos_claiming_another_device_are_refused(enrolled, device_token):
    alpha, bravo = enrolled("active", name="alpha"), enrolled("active", name="bravo")
    bravo_token = device_token(bravo)
    before = db_state()

    async def scenario():
        # bravo's id, alpha's signature
        socket, challenge_ = await open_socket()
        await hello(socket, challenge_, bravo.id, alpha.key)
        await expect_refusal(socket, CloseCode.AUTH_FAILED, "auth_failed")
        # bravo's REST token in place of a signature: not a signature at all (86 base64url characters)
        socket, _ = await open_socket()
        await socket.send_to(text_data=encode("hello", device_id=bravo.id, signature=bravo_token, protocol=2))
        await expect_refusal(socket, CloseCode.MALFORMED, "malformed")
        # bravo's own answer to another connection's challenge
        other, other_challenge = await open_socket()
        answered = sign(bravo.key, hello_payload(nonce=other_challenge["nonce"], device_id=bravo.id))
        socket, _ = await open_socket()
        await socket.send_to(text_data=encode("hello", device_id=bravo.id, signature=answered, protocol=2))
        await expect_refusal(socket, CloseCode.AUTH_FAILED, "auth_failed")
        await other.disconnect()
        # bravo's token in the handshake's headers does not stand in for a signature
        socket = WebsocketCommunicator(
            application, "/ws/agent/", headers=[(b"authorization", f"Device {bravo_token}".encode())]
        )
        assert (await socket.connect(timeout=5))[0]
        challenge_ = await socket.receive_json_from(timeout=5)
        await hello(socket, challenge_, bravo.id, alpha.key)
        await expect_refusal(socket, CloseCode.AUTH_FAILED, "auth_failed")

    run(scenario)
    assert async_to_sync(presence.current_channel)(bravo.id) is None
    assert presence_of(bravo.id) == (None, None)
    # The only trace: one auth_failed event on bravo (rate-limited, so repeated attempts cannot flood it).
    assert _only_new_events(before, db_state()) == [(bravo.id, "auth_failed")]


def _take_refusal_count(device_id) -> tuple[int, str]:
    """A device's refused-upload count and last code, set back to none."""
    row = Device.objects.get(pk=device_id)
    Device.objects.filter(pk=device_id).update(uploads_refused=0, upload_refused_at=None, upload_refused_code="")
    return row.uploads_refused, row.upload_refused_code


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_no_verification")
def test_after_its_hello_a_device_cannot_name_another_device_on_its_socket(settings):
    fleet = build_fleet(Path(settings.DELTA_STAGING_DIR))
    world, alpha, bravo = fleet.world, fleet.world.alpha, fleet.world.bravo
    staged_envelope, staged_signature = fleet.staged["signed"]["envelope"], fleet.staged["signed"]["signature"]
    offset, sha = fleet.staged["offset"], fleet.staged_sha
    finished_data, finished = _bravo_finished_upload(world)
    data = encode_delta(make_delta_tensors(world.adapter, seed=5))
    forged = sign_delta(
        alpha.key, data, device_id=bravo.id, adapter=world.adapter.name, base_version=1, num_samples=2, counter=12
    )
    chunk = b64encode(fleet.staged["data"][offset : offset + 100])
    into_bravos_folder = f"../{bravo.id}/{sha}"
    frames = [  # (what alpha tries, the frame, the error code it must get)
        ("bravo's envelope, replayed", {"text_data": encode("delta_begin", **finished)}, "wrong_device"),
        (
            "bravo's unfinished upload, begun again",
            {"text_data": encode("delta_begin", envelope=staged_envelope, signature=staged_signature)},
            "wrong_device",
        ),
        ("an envelope naming bravo, signed by alpha", {"text_data": encode("delta_begin", **forged)}, "wrong_device"),
        (
            "a chunk of bravo's unfinished upload",
            {"text_data": encode("delta_chunk", sha256=sha, offset=offset, data=chunk)},
            "unknown_upload",
        ),
        (
            "the same as a binary frame",
            {"bytes_data": encode_chunk_frame(sha256=sha, offset=offset, data=b"\x00" * 100)},
            "unknown_upload",
        ),
        (
            "a chunk for bravo's finished delta",
            {"text_data": encode("delta_chunk", sha256=finished["envelope"]["sha256"], offset=0, data=chunk)},
            "unknown_upload",
        ),
        (
            "a chunk whose name leads into bravo's staging folder",
            {"text_data": encode("delta_chunk", sha256=into_bravos_folder, offset=offset, data=chunk)},
            "unknown_upload",
        ),
        (
            "a binary chunk whose 64-character name leads into bravo's staging folder",
            {"bytes_data": encode_chunk_frame(sha256=f"../{bravo.id}/{'f' * 24}", offset=0, data=b"x")},
            "unknown_upload",
        ),
    ]
    assert len(finished_data) == finished["envelope"]["size"]
    staged_files = fleet.bravo_folder()

    async def scenario():
        socket = await connected(alpha)
        command = await socket.receive_json_from(timeout=5)  # alpha's own pending assignment, and only that
        assert command["command"] == "assignment"
        assert command["args"]["assignment_id"] == world.alpha_assignment.pk
        before = await sync_to_async(db_state)()
        answers = {}
        for label, frame, _ in frames:
            await socket.send_to(**frame)
            answers[label] = await answer(socket)
        # Acknowledging bravo's assignment, and a heartbeat naming bravo: nothing is answered for bravo and
        # nothing changes for it; the heartbeat counts for alpha.
        await socket.send_to(
            text_data=encode("ack", id=f"assignment-{world.bravo_assignment.pk}", ok=True, detail="installed")
        )
        await socket.send_to(text_data=encode("heartbeat", seq=3, battery=1.0, device_id=bravo.id))
        acknowledged = await socket.receive_json_from(timeout=5)
        # The one change: alpha's refused begins are counted on alpha (devices.uploads); set back to compare.
        refused = await sync_to_async(_take_refusal_count)(alpha.id)
        after = await sync_to_async(db_state)()
        await socket.disconnect()
        return answers, acknowledged, before, after, refused

    answers, acknowledged, before, after, refused = run(scenario)
    assert refused == (3, "wrong_device")
    wrong = [
        f"{label}: {answers[label]}"
        for label, _, code in frames
        if answers[label]["type"] != "delta_error" or answers[label]["code"] != code
    ]
    assert not wrong, "\n".join(wrong)
    assert acknowledged["type"] == "heartbeat_ack" and acknowledged["seq"] == 3
    assert after == before, db_changes(before, after)
    assert fleet.bravo_folder() == staged_files
    assert presence_of(bravo.id) == (None, None)
    assert json.loads(presence_of(alpha.id)[0])["battery"] == 1.0


@pytest.mark.django_db(transaction=True)
def test_revoked_and_rekeyed_devices_and_operators_are_refused_on_the_sockets(enrolled, device_token, make_user):
    from accounts.services import api_token_create
    from frontend.consumers import CLOSE_UNAUTHENTICATED

    refused_devices = [
        (enrolled("pending", name="pending"), "device_pending"),
        (enrolled("quarantined", name="quarantined"), "device_quarantined"),
        (enrolled("retired", name="retired"), "device_retired"),
    ]
    rekeyed, active = enrolled("active", name="rekeyed"), enrolled("active", name="active")
    Device.objects.filter(pk=rekeyed.id).update(public_key=public_key_b64(Ed25519PrivateKey.generate()))
    active_token = device_token(active)
    admin = make_user("admin")
    browser = Client()
    browser.force_login(admin)
    operator_headers = [
        (b"cookie", f"sessionid={browser.cookies['sessionid'].value}".encode()),
        (b"authorization", f"Bearer {api_token_create(user=admin, name='socket').raw}".encode()),
    ]
    before = db_state()

    async def scenario():
        for device, error in refused_devices:
            socket, challenge_ = await open_socket()
            await hello(socket, challenge_, device.id, device.key)
            await expect_refusal(socket, CloseCode.NOT_ALLOWED, error)
        socket, challenge_ = await open_socket()
        await hello(socket, challenge_, rekeyed.id, rekeyed.key)  # its old key
        await expect_refusal(socket, CloseCode.AUTH_FAILED, "auth_failed")
        # An admin's session and API token on the agent socket: still a hello as a device first, or nothing.
        socket = WebsocketCommunicator(application, "/ws/agent/", headers=operator_headers)
        assert (await socket.connect(timeout=5))[0]
        await socket.receive_json_from(timeout=5)
        await socket.send_to(text_data=encode("heartbeat", seq=1))
        await expect_refusal(socket, CloseCode.MALFORMED, "malformed")
        # A device's token on the dashboard's live socket: no session, no socket.
        live = WebsocketCommunicator(
            application,
            "/ws/live/",
            headers=[
                (b"origin", b"http://localhost"),
                (b"host", b"localhost"),
                (b"authorization", f"Device {active_token}".encode()),
            ],
        )
        accepted, code = await live.connect(timeout=5)
        assert not accepted and code == CLOSE_UNAUTHENTICATED

    run(scenario)
    for device, _ in refused_devices:
        assert async_to_sync(presence.current_channel)(device.id) is None
    assert _only_new_events(before, db_state()) == [(rekeyed.id, "auth_failed")]
