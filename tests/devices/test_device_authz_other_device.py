"""Devices in the authorization matrix, over REST: no device can act as another one (its deltas, unfinished
uploads, artifacts, record, assignment, heartbeat, tokens and key), and a revoked device or a dead token is
refused on every device endpoint. Every refusal has a clear error code and leaves the database as it was.
``alpha`` is the device making the calls, ``bravo`` the device it tries to be; the rest of the matrix and
where its parts come from are described in test_device_authz_matrix.py.
"""

from __future__ import annotations

import json
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core import signing
from rest_framework.test import APIClient

from devices.models import Device, DeviceEvent
from edge_agent.delta import encode_delta, sign_delta
from edge_agent.identity import public_key_b64
from tests.authz_snapshot import db_changes, db_state
from tests.devices.device_authz_support import DEVICE_ROUTE_METHODS, _bravo_finished_upload, error_code, presence_of
from tests.devices.test_device_rest_auth import as_device, challenge, exchange
from tests.training.delta_support import upload
from tests.training.test_rounds import make_delta_tensors


def _take_refusal_count(device_id) -> tuple[int, str]:
    """A device's refused-upload count and last code, set back to none."""
    row = Device.objects.get(pk=device_id)
    Device.objects.filter(pk=device_id).update(uploads_refused=0, upload_refused_at=None, upload_refused_code="")
    return row.uploads_refused, row.upload_refused_code


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.mark.django_db
class TestDeviceCredentialsOverRest:
    @pytest.fixture(autouse=True)
    def _fleet_staging(self, device_fleet, settings):
        settings.DELTA_STAGING_DIR = device_fleet.staging

    @pytest.mark.parametrize("signer", ["bravo, replayed by alpha", "alpha"])
    def test_a_delta_whose_envelope_names_another_device_is_refused(self, device_fleet, signer):
        world = device_fleet.world
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
        before, staged = db_state(), device_fleet.bravo_folder()
        response = upload(as_device(device_fleet.tokens["alpha"]), data, signed)
        assert response.status_code == 403, response.content
        assert error_code(response) == "wrong_device"
        # The one change: alpha's refused begin is counted on alpha (devices.uploads); set back to compare.
        assert _take_refusal_count(world.alpha.id) == (1, "wrong_device")
        assert db_state() == before, db_changes(before, db_state())
        assert device_fleet.bravo_folder() == staged

    def test_another_devices_unfinished_upload_can_be_neither_resumed_nor_queried(self, device_fleet):
        alpha, bravo = as_device(device_fleet.tokens["alpha"]), as_device(device_fleet.tokens["bravo"])
        signed, data, offset = device_fleet.staged["signed"], device_fleet.staged["data"], device_fleet.staged["offset"]
        url = f"/api/v1/device/deltas/{device_fleet.staged_sha}/"
        before, staged = db_state(), device_fleet.bravo_folder()
        queried = alpha.get(url)
        assert queried.status_code == 404 and error_code(queried) == "not_found"
        resumed = upload(alpha, data[offset:], signed, HTTP_CONTENT_RANGE=f"bytes {offset}-{len(data) - 1}/{len(data)}")
        assert resumed.status_code == 403 and error_code(resumed) == "wrong_device"
        assert _take_refusal_count(device_fleet.world.alpha.id) == (1, "wrong_device")
        assert db_state() == before, db_changes(before, db_state())
        assert device_fleet.bravo_folder() == staged
        # bravo still finds its upload where it left it
        assert bravo.get(url).json() == {
            "sha256": device_fleet.staged_sha,
            "size": len(data),
            "offset": offset,
            "delta_id": None,
            "state": "uploading",
            "rejection_code": "",
            "rejection_detail": "",
        }

    def test_another_devices_delta_cannot_be_queried_by_its_sha256(self, device_fleet):
        url = f"/api/v1/device/deltas/{device_fleet.world.bravo_delta.sha256}/"
        response = as_device(device_fleet.tokens["alpha"]).get(url)
        assert response.status_code == 404 and error_code(response) == "not_found"
        assert as_device(device_fleet.tokens["bravo"]).get(url).json()["delta_id"] == device_fleet.world.bravo_delta.pk

    def test_another_devices_artifacts_cannot_be_downloaded(self, device_fleet):
        world, alpha = device_fleet.world, as_device(device_fleet.tokens["alpha"])
        for sha in (world.candidate.blob_sha256, world.bravo_delta.blob_sha256, device_fleet.staged_sha):
            response = alpha.get(f"/api/v1/device/blobs/{sha}/")
            assert response.status_code == 404 and error_code(response) == "not_found", sha
        # what alpha is assigned, and its cohort's base weights, it may fetch; bravo may fetch its own
        assert alpha.get(f"/api/v1/device/blobs/{world.released.blob_sha256}/").status_code == 200
        assert alpha.get(f"/api/v1/device/blobs/{world.base_model.weights_sha256}/").status_code == 200
        bravo = as_device(device_fleet.tokens["bravo"])
        assert bravo.get(f"/api/v1/device/blobs/{world.candidate.blob_sha256}/").status_code == 200

    def test_a_device_reads_only_its_own_record_and_assignment_whatever_it_names(self, device_fleet):
        world, alpha = device_fleet.world, as_device(device_fleet.tokens["alpha"])
        me = alpha.get("/api/v1/device/", {"device_id": world.bravo.id, "id": world.bravo.id})
        assert me.status_code == 200 and me.json()["id"] == world.alpha.id
        assignment = alpha.get("/api/v1/device/assignment/", {"device_id": world.bravo.id}).json()
        assert assignment["assignment_id"] == world.alpha_assignment.pk
        assert assignment["envelope"]["manifest"]["device_id"] == world.alpha.id
        assert world.candidate.blob_sha256 not in json.dumps(assignment)  # nothing of bravo's manifest

    @pytest.mark.parametrize("status", ["delivered", "installed", "failed"])
    def test_another_devices_assignment_cannot_be_reported(self, device_fleet, status):
        world = device_fleet.world
        before = db_state()
        response = as_device(device_fleet.tokens["alpha"]).post(
            f"/api/v1/device/assignments/{world.bravo_assignment.pk}/report/",
            {"status": status, "metrics": {"eval_accuracy": 0.01}, "reason": "as bravo"},
            format="json",
        )
        assert response.status_code == 404 and error_code(response) == "not_found"
        assert db_state() == before, db_changes(before, db_state())

    def test_a_heartbeat_naming_another_device_counts_for_the_sender_only(self, device_fleet):
        world = device_fleet.world
        bravo_before = presence_of(world.bravo.id)
        response = as_device(device_fleet.tokens["alpha"]).post(
            "/api/v1/device/heartbeat/",
            {"seq": 4, "battery": 2.0, "device_id": world.bravo.id, "id": world.bravo.id},
            format="json",
        )
        assert response.status_code == 204
        assert presence_of(world.bravo.id) == bravo_before
        assert json.loads(presence_of(world.alpha.id)[0])["battery"] == 2.0

    def test_no_token_is_issued_and_no_key_enrolled_in_another_devices_name(self, device_fleet):
        from devices.services import enrollment_token_create

        world = device_fleet.world
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
        self, device_fleet, inventory, settings, what
    ):
        from devices.services import device_transition

        world = device_fleet.world
        alpha, token = world.alpha, device_fleet.tokens["alpha"]
        expected = {
            # the codes of the spec's table (docs/protocol/reference.md), which the agent acts on
            "quarantined": (403, "device_quarantined", "quarantined"),
            "retired": (403, "device_retired", "retired"),
            "rekeyed": (401, "auth_failed", "Invalid device token"),
            "token expired": (401, "token_expired", "expired"),
            "token names bravo": (401, "auth_failed", "Invalid device token"),
        }[what]
        if what in ("quarantined", "retired"):
            action = what.removesuffix("d")  # quarantine, retire
            device_transition(device=alpha.device, action=action, actor=world.users["admin"])
        elif what == "rekeyed":  # the device was re-provisioned with a new key: its old tokens die with the key
            Device.objects.filter(pk=alpha.id).update(public_key=public_key_b64(Ed25519PrivateKey.generate()))
        elif what == "token expired":
            settings.DEVICE_TOKEN_TTL_SECONDS = 1
            time.sleep(max(0.0, device_fleet.issued_at + 1.05 - time.time()))
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
