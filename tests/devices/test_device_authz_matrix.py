"""Devices in the authorization matrix: a device's credential opens nothing but the device routes, no
operator credential opens a device route, and no device can act as another one, over REST or the agent
socket. Every refusal has a clear error code and leaves the database as it was (``db_state`` before and
after; the one thing a failed signature writes is a rate-limited ``auth_failed`` event, checked as such).

The inventory of routes (from the URL resolver: a new route is a new case here), the world the calls aim
at and ``db_state`` come from tests/fleet/test_role_matrix.py, the operator half; the socket and REST
helpers from the device and delta tests. ``alpha`` is the device making the calls, ``bravo`` the device it
tries to be.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.testing import WebsocketCommunicator
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core import signing
from django.test import Client
from rest_framework.test import APIClient

from devices import presence
from devices.authentication import DeviceTokenAuthentication, IsDevice
from devices.models import Device, DeviceEvent
from edge_agent.delta import encode_delta, sign_delta
from edge_agent.identity import public_key_b64
from edge_agent.protocol import CloseCode, b64encode, encode, encode_chunk_frame, hello_payload, sign
from fleet.asgi import application
from tests.authz_support import (
    DEVICE_ROUTES,
    PUBLIC_ROUTES,
    World,
    build_world,
    db_changes,
    db_state,
    rolled_back,
    routes,
    routes_by_name,
)
from tests.devices.test_agent_socket import expect_refusal, hello, open_socket, run
from tests.devices.test_device_rest_auth import as_device, challenge, exchange
from tests.training.test_delta_socket import answer, connected
from tests.training.test_delta_verification import upload
from tests.training.test_rounds import make_delta_tensors

# Every route that is neither a device route nor public, straight from the resolver (the Django admin is
# one case of its own).
OPERATOR_ROUTES = sorted(
    route.name
    for route in routes()
    if route.name not in DEVICE_ROUTES and route.name not in PUBLIC_ROUTES and not route.is_django_admin
)
DEVICE_ROUTE_METHODS = [(name, method) for name, methods in DEVICE_ROUTES.items() for method in methods]
SIGN_IN_PAGES = ("/login/", "/admin/login/")


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


# --- the fleet: the role matrix's world, plus what devices hold ----------------------------------------------


@dataclass
class Fleet:
    world: World
    tokens: dict  # "alpha" / "bravo" -> their REST device token
    issued_at: float  # when the tokens were issued
    staging: Path  # DELTA_STAGING_DIR
    staged: dict  # bravo's unfinished upload: "signed" (envelope and signature), "data", "offset"

    @property
    def staged_sha(self) -> str:
        return self.staged["signed"]["envelope"]["sha256"]

    def bravo_folder(self) -> dict[str, bytes]:
        """What bravo has staged, file by file (its unfinished upload, with its envelope and lock)."""
        folder = self.staging / self.world.bravo.id
        return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def build_fleet(staging: Path) -> Fleet:
    """The world, the devices' tokens (through the real signed challenge) and half an upload of bravo's."""
    from training.intake import upload_append, upload_begin

    world = build_world()
    issued_at = time.time()
    tokens = {
        name: exchange(device.id, challenge(device.id), device.key).json()["token"]
        for name, device in (("alpha", world.alpha), ("bravo", world.bravo))
    }
    data = encode_delta(make_delta_tensors(world.adapter, seed=2))
    signed = sign_delta(
        world.bravo.key,
        data,
        device_id=world.bravo.id,
        adapter=world.adapter.name,
        base_version=1,
        num_samples=8,
        counter=2,
    )
    bravo = world.bravo.device
    upload_begin(device=bravo, envelope=signed["envelope"], signature=signed["signature"], channel="rest")
    half = len(data) // 2
    sha = signed["envelope"]["sha256"]
    assert upload_append(device=bravo, sha256=sha, offset=0, data=data[:half], channel="rest").offset == half
    return Fleet(world, tokens, issued_at, Path(staging), {"signed": signed, "data": data, "offset": half})


@pytest.fixture(scope="class")
def fleet(django_db_setup, django_db_blocker, shared_blob_root, tmp_path_factory):
    staging = tmp_path_factory.mktemp("device-staging")
    with rolled_back(django_db_blocker, shared_blob_root, DELTA_STAGING_DIR=staging, ENROLLMENT_RATE="100000/min"):
        yield build_fleet(staging)


@pytest.fixture(scope="module")
def inventory():
    return routes_by_name()


def bearer(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def error_code(response) -> str:
    return response.json()["error"]["code"]


def presence_of(device_id: str):
    """What Redis holds for a device's presence: its last heartbeat's state and when it was last seen."""
    client = presence.sync_client()
    return client.hget(presence.key("state"), device_id), client.zscore(presence.key("seen"), device_id)


def unauthenticated(response) -> bool:
    """The API's answer to a caller whose credential it does not take here: 401 with a stable code."""
    return response.status_code == 401 and error_code(response) in ("not_authenticated", "authentication_failed")


def refused(response) -> bool:
    """How a page refuses a caller without the right credential: 401/403/405, or off to a sign-in page."""
    if response.status_code in (401, 403, 405):
        return True
    return response.status_code == 302 and response["Location"].startswith(SIGN_IN_PAGES)


# --- the resolver's device routes are the ones that take a device credential, and only that -----------------


def test_device_routes_are_exactly_the_routes_that_take_a_device_credential():
    problems = []
    for route in routes():
        view = getattr(route.callback, "cls", None) or getattr(route.callback, "view_class", None)
        overrides = getattr(route.callback, "initkwargs", None) or {}
        authentication = list(overrides.get("authentication_classes", getattr(view, "authentication_classes", [])))
        permissions = list(overrides.get("permission_classes", getattr(view, "permission_classes", [])))
        if route.name in DEVICE_ROUTES:
            if authentication != [DeviceTokenAuthentication] or permissions != [IsDevice]:
                problems.append(f"{route.name} must take a device token and nothing else: {authentication}")
        elif DeviceTokenAuthentication in authentication:
            problems.append(f"{route.name} takes a device token but is not in DEVICE_ROUTES")
    assert not problems, "\n".join(problems)


# --- REST, against one world per class ------------------------------------------------------------------------


@pytest.mark.django_db
class TestDeviceCredentialsOverRest:
    @pytest.fixture(autouse=True)
    def _fleet_staging(self, fleet, settings):
        settings.DELTA_STAGING_DIR = fleet.staging

    @pytest.mark.parametrize("name", OPERATOR_ROUTES)
    def test_a_device_token_opens_no_operator_endpoint_or_page(self, fleet, inventory, name):
        """Every method of every non-device route, aimed at real objects (the device itself, and another
        device where the route takes a device id), with the device token as ``Device`` and as ``Bearer``."""
        world, token = fleet.world, fleet.tokens["alpha"]
        route = inventory[name]
        targets = [world.targets(name)]
        if targets[0].get("pk") == world.alpha.id:
            targets.append({"pk": world.bravo.id})
        is_api = route.pattern.startswith("api/")
        before = db_state()
        failures = []
        for url in [route.url(**target) for target in targets]:
            for method in route.methods:
                body = world.bodies().get((name, method))
                if is_api:
                    for scheme in ("Device", "Bearer"):
                        client = APIClient()
                        client.credentials(HTTP_AUTHORIZATION=f"{scheme} {token}")
                        response = getattr(client, method)(url, body, format="json")
                        if not unauthenticated(response):
                            failures.append(f"{scheme}: {method.upper()} {url} {response.status_code}")
                else:
                    call = getattr(Client(), method)
                    response = call(url, body or {}, headers={"Authorization": f"Device {token}"})
                    if not refused(response):
                        failures.append(f"{method.upper()} {url} {response.status_code}")
        assert not failures, "a device token was not refused:\n" + "\n".join(failures)
        assert db_state() == before, db_changes(before, db_state())
        # The token itself is good: where it belongs, it works.
        assert as_device(token).get("/api/v1/device/").status_code == 200

    def test_a_device_token_opens_no_page_of_the_django_admin(self, fleet, inventory):
        token = fleet.tokens["alpha"]
        before = db_state()
        failures = []
        for route in [route for route in inventory.values() if route.is_django_admin]:
            for method in route.methods:
                response = getattr(Client(), method)(route.url(), {}, headers={"Authorization": f"Device {token}"})
                signs_in = route.name in PUBLIC_ROUTES and response.status_code in (200, 302)
                if not (refused(response) or signs_in):
                    failures.append(f"{method.upper()} {route.url()} {response.status_code}")
        assert not failures, "\n".join(failures)
        assert db_state() == before, db_changes(before, db_state())

    @pytest.mark.parametrize(("name", "method"), DEVICE_ROUTE_METHODS)
    def test_operator_credentials_open_no_device_endpoint(self, fleet, inventory, name, method):
        """Sessions and API tokens of every role, an API token under the ``Device`` scheme and a device
        token under ``Bearer``: a device endpoint takes a device's own token and nothing else."""
        world, alpha = fleet.world, fleet.world.alpha
        route = inventory[name]
        url = route.url(
            sha256=world.released.blob_sha256 if name == "device-blob" else world.bravo_delta.sha256,
            assignment_id=world.alpha_assignment.pk,
        )
        credentials = [("anonymous", APIClient())]
        for role in ("viewer", "operator", "admin"):
            credentials += world.api_clients(role)
        admin_token = APIClient()
        admin_token.credentials(HTTP_AUTHORIZATION=f"Device {world.api_tokens['admin']}")
        credentials += [
            ("admin API token as Device", admin_token),
            ("device token as Bearer", bearer(fleet.tokens["alpha"])),
        ]
        data = encode_delta(make_delta_tensors(world.adapter, seed=3))
        signed = sign_delta(
            alpha.key, data, device_id=alpha.id, adapter=world.adapter.name, base_version=1, num_samples=4, counter=7
        )
        bodies = {"device-heartbeat": {"seq": 1, "battery": 5.0}, "device-assignment-report": {"status": "installed"}}
        before, alpha_presence = db_state(), presence_of(alpha.id)
        failures = []
        for label, client in credentials:
            if method == "put":  # a device's signed upload, replayed by someone holding no device token
                response = upload(client, data, signed)
            else:
                response = getattr(client, method)(url, bodies.get(name), format="json")
            if not unauthenticated(response):
                failures.append(f"{label}: {response.status_code} {response.content[:120]!r}")
        assert not failures, f"{method.upper()} {url} was not refused:\n" + "\n".join(failures)
        assert db_state() == before, db_changes(before, db_state())
        assert presence_of(alpha.id) == alpha_presence

    @pytest.mark.parametrize("signer", ["bravo, replayed by alpha", "alpha"])
    def test_a_delta_whose_envelope_names_another_device_is_refused(self, fleet, signer):
        world = fleet.world
        if signer == "alpha":
            data = encode_delta(make_delta_tensors(world.adapter, seed=4))
            signed = sign_delta(
                world.alpha.key,
                data,
                device_id=world.bravo.id,
                adapter=world.adapter.name,
                base_version=1,
                num_samples=4,
                counter=11,
            )
        else:  # bravo's finished upload: alpha has the bytes and the envelope (it sniffed them)
            data, signed = _bravo_finished_upload(world)
        before, staged = db_state(), fleet.bravo_folder()
        response = upload(as_device(fleet.tokens["alpha"]), data, signed)
        assert response.status_code == 403, response.content
        assert error_code(response) == "wrong_device"
        assert db_state() == before, db_changes(before, db_state())
        assert fleet.bravo_folder() == staged

    def test_another_devices_unfinished_upload_can_be_neither_resumed_nor_queried(self, fleet):
        alpha, bravo = as_device(fleet.tokens["alpha"]), as_device(fleet.tokens["bravo"])
        signed, data, offset = fleet.staged["signed"], fleet.staged["data"], fleet.staged["offset"]
        url = f"/api/v1/device/deltas/{fleet.staged_sha}/"
        before, staged = db_state(), fleet.bravo_folder()
        queried = alpha.get(url)
        assert queried.status_code == 404 and error_code(queried) == "not_found"
        resumed = upload(alpha, data[offset:], signed, HTTP_CONTENT_RANGE=f"bytes {offset}-{len(data) - 1}/{len(data)}")
        assert resumed.status_code == 403 and error_code(resumed) == "wrong_device"
        assert db_state() == before, db_changes(before, db_state())
        assert fleet.bravo_folder() == staged
        # bravo still finds its upload where it left it
        assert bravo.get(url).json() == {
            "sha256": fleet.staged_sha,
            "size": len(data),
            "offset": offset,
            "delta_id": None,
            "state": "uploading",
            "rejection_code": "",
            "rejection_detail": "",
        }

    def test_another_devices_delta_cannot_be_queried_by_its_sha256(self, fleet):
        url = f"/api/v1/device/deltas/{fleet.world.bravo_delta.sha256}/"
        response = as_device(fleet.tokens["alpha"]).get(url)
        assert response.status_code == 404 and error_code(response) == "not_found"
        assert as_device(fleet.tokens["bravo"]).get(url).json()["delta_id"] == fleet.world.bravo_delta.pk

    def test_another_devices_artifacts_cannot_be_downloaded(self, fleet):
        world, alpha = fleet.world, as_device(fleet.tokens["alpha"])
        for sha in (world.candidate.blob_sha256, world.bravo_delta.blob_sha256, fleet.staged_sha):
            response = alpha.get(f"/api/v1/device/blobs/{sha}/")
            assert response.status_code == 404 and error_code(response) == "not_found", sha
        # what alpha is assigned, and its cohort's base weights, it may fetch; bravo may fetch its own
        assert alpha.get(f"/api/v1/device/blobs/{world.released.blob_sha256}/").status_code == 200
        assert alpha.get(f"/api/v1/device/blobs/{world.base_model.weights_sha256}/").status_code == 200
        bravo = as_device(fleet.tokens["bravo"])
        assert bravo.get(f"/api/v1/device/blobs/{world.candidate.blob_sha256}/").status_code == 200

    def test_a_device_reads_only_its_own_record_and_assignment_whatever_it_names(self, fleet):
        world, alpha = fleet.world, as_device(fleet.tokens["alpha"])
        me = alpha.get("/api/v1/device/", {"device_id": world.bravo.id, "id": world.bravo.id})
        assert me.status_code == 200 and me.json()["id"] == world.alpha.id
        assignment = alpha.get("/api/v1/device/assignment/", {"device_id": world.bravo.id}).json()
        assert assignment["assignment_id"] == world.alpha_assignment.pk
        assert assignment["envelope"]["manifest"]["device_id"] == world.alpha.id
        assert world.candidate.blob_sha256 not in json.dumps(assignment)  # nothing of bravo's manifest

    @pytest.mark.parametrize("status", ["delivered", "installed", "failed"])
    def test_another_devices_assignment_cannot_be_reported(self, fleet, status):
        world = fleet.world
        before = db_state()
        response = as_device(fleet.tokens["alpha"]).post(
            f"/api/v1/device/assignments/{world.bravo_assignment.pk}/report/",
            {"status": status, "metrics": {"eval_accuracy": 0.01}, "reason": "as bravo"},
            format="json",
        )
        assert response.status_code == 404 and error_code(response) == "not_found"
        assert db_state() == before, db_changes(before, db_state())

    def test_a_heartbeat_naming_another_device_counts_for_the_sender_only(self, fleet):
        world = fleet.world
        bravo_before = presence_of(world.bravo.id)
        response = as_device(fleet.tokens["alpha"]).post(
            "/api/v1/device/heartbeat/",
            {"seq": 4, "battery": 2.0, "device_id": world.bravo.id, "id": world.bravo.id},
            format="json",
        )
        assert response.status_code == 204
        assert presence_of(world.bravo.id) == bravo_before
        assert json.loads(presence_of(world.alpha.id)[0])["battery"] == 2.0

    def test_no_token_is_issued_and_no_key_enrolled_in_another_devices_name(self, fleet):
        from devices.services import enrollment_token_create

        world = fleet.world
        alpha, bravo = world.alpha, world.bravo
        spare = enrollment_token_create(
            cohort=world.cohort,
            name="spare",
            expires_at=world.enrollment_token.expires_at,
            uses=1,
            requires_approval=False,
            created_by=world.users["admin"],
        )
        before = db_state()
        signed_by_alpha = exchange(bravo.id, challenge(bravo.id), alpha.key)
        assert signed_by_alpha.status_code == 401 and error_code(signed_by_alpha) == "auth_failed"
        nonce_of_alpha = exchange(bravo.id, challenge(alpha.id), bravo.key)  # even with bravo's key
        assert nonce_of_alpha.status_code == 401 and error_code(nonce_of_alpha) == "nonce_invalid"
        body = {"token": spare.raw, "public_key": bravo.device.public_key, "name": "bravo-2"}
        enrollment = APIClient().post("/api/v1/enroll/", body, format="json")
        assert enrollment.status_code == 409 and error_code(enrollment) == "device_key_exists"
        after = db_state()
        events = DeviceEvent.objects.exclude(pk__in=[row[0] for row in before["devices.DeviceEvent"]])
        assert [(str(e.device_id), e.kind) for e in events] == [(bravo.id, "auth_failed")]
        del before["devices.DeviceEvent"], after["devices.DeviceEvent"]
        assert after == before, db_changes(before, after)

    @pytest.mark.parametrize("what", ["quarantined", "retired", "rekeyed", "token expired", "token names bravo"])
    def test_a_revoked_device_or_a_dead_token_is_refused_on_every_device_endpoint(
        self, fleet, inventory, settings, what
    ):
        from devices.services import device_transition

        world = fleet.world
        alpha, token = world.alpha, fleet.tokens["alpha"]
        expected = {
            "quarantined": (403, "permission_denied", "quarantined"),
            "retired": (403, "permission_denied", "retired"),
            "rekeyed": (401, "authentication_failed", "Invalid device token"),
            "token expired": (401, "authentication_failed", "expired"),
            "token names bravo": (401, "authentication_failed", "Invalid device token"),
        }[what]
        if what in ("quarantined", "retired"):
            action = what.removesuffix("d")  # quarantine, retire
            device_transition(device=alpha.device, action=action, actor=world.users["admin"])
        elif what == "rekeyed":  # the device was re-provisioned with a new key: its old tokens die with the key
            Device.objects.filter(pk=alpha.id).update(public_key=public_key_b64(Ed25519PrivateKey.generate()))
        elif what == "token expired":
            settings.DEVICE_TOKEN_TTL_SECONDS = 1
            time.sleep(max(0.0, fleet.issued_at + 1.05 - time.time()))
        else:  # alpha rewrites its token's payload to name bravo, keeping its own signature
            payload = json.dumps({"d": world.bravo.id, "k": world.bravo.device.public_key[:16]}, separators=(",", ":"))
            token = signing.b64_encode(payload.encode()).decode() + token[token.index(":") :]
        client = as_device(token)
        before, alpha_presence = db_state(), presence_of(alpha.id)
        failures = []
        for name, method in DEVICE_ROUTE_METHODS:
            url = inventory[name].url(sha256=world.released.blob_sha256, assignment_id=world.alpha_assignment.pk)
            body = {"device-heartbeat": {"seq": 9}, "device-assignment-report": {"status": "installed"}}.get(name)
            response = getattr(client, method)(url, body, format="json")
            status, code, words = expected
            if (response.status_code, error_code(response)) != (status, code) or words not in response.json()["error"][
                "message"
            ]:
                failures.append(f"{method.upper()} {url}: {response.status_code} {response.content[:150]!r}")
        assert not failures, "\n".join(failures)
        assert db_state() == before, db_changes(before, db_state())
        assert presence_of(alpha.id) == alpha_presence
        if what in ("quarantined", "retired"):  # and no new token either
            again = exchange(alpha.id, challenge(alpha.id), alpha.key)
            assert again.status_code == 403 and error_code(again) == f"device_{what}"
        if what == "rekeyed":
            again = exchange(alpha.id, challenge(alpha.id), alpha.key)
            assert again.status_code == 401 and error_code(again) == "auth_failed"


def _bravo_finished_upload(world: World) -> tuple[bytes, dict]:
    """The bytes and signed envelope of bravo's received delta, as bravo sent them."""
    from training.blobs import blob_read

    delta = world.bravo_delta
    return blob_read(delta.blob_sha256), {"envelope": delta.envelope, "signature": delta.signature}


# --- the agent socket: real Channels over Redis, committed rows -----------------------------------------------


@pytest.fixture
def _no_verification(monkeypatch):
    """As in tests/training/test_delta_socket.py: a verification task queued by an upload in these tests
    would reach the session's Celery worker, if one runs, and change a delta between two snapshots."""
    monkeypatch.setattr("training.verify_queue.queue_verification", lambda delta_id: None)


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
        # bravo's REST token in place of a signature
        socket, _ = await open_socket()
        await socket.send_to(text_data=encode("hello", device_id=bravo.id, signature=bravo_token))
        await expect_refusal(socket, CloseCode.AUTH_FAILED, "auth_failed")
        # bravo's own answer to another connection's challenge
        other, other_challenge = await open_socket()
        answered = sign(bravo.key, hello_payload(nonce=other_challenge["nonce"], device_id=bravo.id))
        socket, _ = await open_socket()
        await socket.send_to(text_data=encode("hello", device_id=bravo.id, signature=answered))
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
        after = await sync_to_async(db_state)()
        await socket.disconnect()
        return answers, acknowledged, before, after

    answers, acknowledged, before, after = run(scenario)
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
