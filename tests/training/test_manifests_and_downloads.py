"""Signed manifests and verified, resumable downloads: the agent's half against the real server."""

import hashlib
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from devices.server_key import server_public_key_b64
from edge_agent.download import DownloadError, download
from edge_agent.families import get_family
from edge_agent.manifest import ManifestRefused, verify_manifest
from edge_agent.protocol import sign
from training.registry.blobs import blob_read
from training.registry.services import version_create_seeded, version_transition
from training.rollouts.lifecycle import assignment_create
from training.rollouts.manifests import manifest_sign


@pytest.fixture
def version(adapter, cohort):
    adapter.cohorts.add(cohort)
    return version_create_seeded(adapter=adapter, seed=11)


def _check(envelope, device_id, version, last=0, now=None):
    return verify_manifest(
        envelope,
        server_public_key=server_public_key_b64(),
        device_id=device_id,
        base_model_sha256=version.adapter.base_model.weights_sha256,
        last_accepted_seq=last,
        now=now or time.time(),
    )


@pytest.mark.django_db
def test_a_signed_manifest_is_accepted_and_each_tampering_is_refused_by_code(version):
    device_id = "6a1c1c52-8f1e-4a43-9d7b-3c2f50a1e001"
    envelope = manifest_sign(device_id=device_id, version=version, assignment_seq=5)
    assert _check(envelope, device_id, version, last=4)["sha256"] == version.blob_sha256

    def refused(candidate, **kwargs) -> str:
        with pytest.raises(ManifestRefused) as caught:
            _check(candidate, kwargs.pop("device", device_id), version, **kwargs)
        return caught.value.code

    assert refused({"manifest": envelope["manifest"]}) == "unsigned"
    assert (
        refused({"manifest": {**envelope["manifest"], "version": 99}, "signature": envelope["signature"]})
        == "bad_signature"
    )
    forged = {"manifest": envelope["manifest"], "signature": sign(Ed25519PrivateKey.generate(), envelope["manifest"])}
    assert refused(forged) == "bad_signature"
    assert refused(envelope, now=envelope["manifest"]["expires_at"] + 1) == "expired"
    assert refused(envelope, device="another-device") == "wrong_device"
    assert refused(envelope, last=5) == "stale_sequence"
    assert refused(envelope, last=9) == "stale_sequence"
    other_base = manifest_sign(device_id=device_id, version=version, assignment_seq=6)
    with pytest.raises(ManifestRefused) as caught:
        verify_manifest(
            other_base,
            server_public_key=server_public_key_b64(),
            device_id=device_id,
            base_model_sha256="0" * 64,
            last_accepted_seq=0,
            now=time.time(),
        )
    assert caught.value.code == "wrong_base_model"
    assert refused("not an envelope") == "malformed"
    assert refused({"manifest": {"purpose": "x"}, "signature": "abc"}) == "malformed"


@pytest.mark.django_db(transaction=True)
def test_download_resumes_with_a_range_request_and_verifies_the_hash(
    version, enrolled, device_token, live_server, tmp_path
):
    device = enrolled("active")
    assignment_create(device=device.device, version=version)
    headers = {"Authorization": f"Device {device_token(device)}"}
    url = f"{live_server.url}/api/v1/device/blobs/{version.blob_sha256}/"
    data = blob_read(version.blob_sha256)
    destination = tmp_path / "adapter.safetensors"
    # A previous attempt died after 1,000 bytes.
    (tmp_path / "adapter.safetensors.part").write_bytes(data[:1000])
    seen = []
    download(
        url,
        destination,
        sha256=version.blob_sha256,
        size=version.size,
        headers=headers,
        progress=lambda have, total: seen.append(have),
    )
    assert destination.read_bytes() == data
    assert seen[0] > 1000 and seen[-1] == version.size  # it continued from the partial file
    assert not (tmp_path / "adapter.safetensors.part").exists()


@pytest.mark.django_db(transaction=True)
def test_a_corrupt_partial_or_a_lying_manifest_never_reaches_the_destination(
    version, enrolled, device_token, live_server, tmp_path
):
    device = enrolled("active")
    assignment_create(device=device.device, version=version)
    headers = {"Authorization": f"Device {device_token(device)}"}
    url = f"{live_server.url}/api/v1/device/blobs/{version.blob_sha256}/"
    destination = tmp_path / "adapter.safetensors"
    (tmp_path / "adapter.safetensors.part").write_bytes(b"\x00" * 500)  # garbage from a bad disk
    with pytest.raises(ManifestRefused) as caught:
        download(url, destination, sha256=version.blob_sha256, size=version.size, headers=headers)
    assert caught.value.code == "hash_mismatch"
    assert not destination.exists() and not (tmp_path / "adapter.safetensors.part").exists()
    wrong = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(ManifestRefused):
        download(url, destination, sha256=wrong, size=version.size, headers=headers)
    with pytest.raises(DownloadError, match="more than"):
        download(url, destination, sha256=version.blob_sha256, size=version.size - 10, headers=headers)
    assert not destination.exists()


@pytest.mark.django_db(transaction=True)
def test_downloads_are_authorised_per_device(version, enrolled, device_token, live_server, make_user):
    from rest_framework.test import APIClient

    from devices.services import cohort_create, enrollment_token_create

    device = enrolled("active")
    token = device_token(device)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Device {token}")
    url = f"/api/v1/device/blobs/{version.blob_sha256}/"
    assert client.get(url).status_code == 404  # not assigned to it yet
    assignment_create(device=device.device, version=version)
    full = client.get(url)
    assert full.status_code == 200 and full["Accept-Ranges"] == "bytes"
    part = client.get(url, HTTP_RANGE="bytes=10-19")
    assert part.status_code == 206 and part["Content-Range"] == f"bytes 10-19/{version.size}"
    assert b"".join(part.streaming_content) == blob_read(version.blob_sha256)[10:20]
    assert client.get(url, HTTP_RANGE=f"bytes={version.size}-").status_code == 416
    assert client.get(url, HTTP_RANGE="bytes=oops").status_code == 416
    base_url = f"/api/v1/device/blobs/{version.adapter.base_model.weights_sha256}/"
    assert client.get(base_url).status_code == 200
    assert client.get("/api/v1/device/blobs/" + "a" * 64 + "/").status_code == 404
    assert client.get("/api/v1/device/blobs/../../etc/passwd/").status_code == 404
    assert APIClient().get(url).status_code == 401  # no device token

    # Another device, of another cohort and with no assignment, can fetch neither the version nor the base.
    from datetime import timedelta

    from django.utils import timezone

    from devices.services import device_enroll
    from edge_agent.identity import public_key_b64

    elsewhere = cohort_create(name="elsewhere")
    issued = enrollment_token_create(
        cohort=elsewhere, name="x", expires_at=timezone.now() + timedelta(hours=1), requires_approval=False
    )
    key = Ed25519PrivateKey.generate()
    stranger = device_enroll(token=issued.raw, public_key=public_key_b64(key), name="stranger")

    class Stranger:
        id = str(stranger.pk)

    Stranger.key = key
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Device {device_token(Stranger)}")
    assert other.get(url).status_code == 404
    assert other.get(base_url).status_code == 404

    # A revoked version is no longer served.
    version_transition(version=version, action="revoke", actor=make_user("operator"))
    assert client.get(url).status_code == 404


@pytest.mark.django_db
def test_the_manifest_signs_the_versions_accuracy_per_class_for_devices_to_weigh_by_their_labels(version):
    """The server's evaluation per class (``training.class_accuracy``) is stored on the version and signed into the
    manifest: a device too small to judge versions weighs it by its labels (edge_agent.small_devices)."""
    per_class = version.metrics["eval_class_accuracy"]
    _, test = get_family(version.adapter.base_model.family).dataset(version.adapter.base_model.family_config)
    counts = torch.bincount(test["y"]).tolist()
    assert len(per_class) == len(counts) == 10 and all(0 <= value <= 1 for value in per_class)
    overall = sum(a * n for a, n in zip(per_class, counts, strict=True)) / sum(counts)
    assert overall == pytest.approx(version.metrics["eval_accuracy"], abs=1e-4)
    device_id = "6a1c1c52-8f1e-4a43-9d7b-3c2f50a1e001"
    envelope = manifest_sign(device_id=device_id, version=version, assignment_seq=5)
    assert _check(envelope, device_id, version)["training"]["class_accuracy"] == per_class
    lifted = {**envelope["manifest"], "training": {**envelope["manifest"]["training"], "class_accuracy": [1.0] * 10}}
    with pytest.raises(ManifestRefused) as caught:  # a device is never told a version is better than it was judged
        _check({"manifest": lifted, "signature": envelope["signature"]}, device_id, version)
    assert caught.value.code == "bad_signature"
    version.metrics = {**version.metrics, "eval_class_accuracy": [1.5] * 10}
    bad = manifest_sign(device_id=device_id, version=version, assignment_seq=6)
    with pytest.raises(ManifestRefused) as caught:  # signed, but not a share: refused as malformed
        _check(bad, device_id, version)
    assert caught.value.code == "malformed" and "class_accuracy" in str(caught.value)
