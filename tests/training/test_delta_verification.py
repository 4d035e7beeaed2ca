"""Every way a delta can be wrong apart from its file, through the real REST upload and the verification
service (a hash, a signature, a device, a counter, a version, a cohort, a size, an upload's state): each
gets its stored rejection code and a readable detail, and nothing of it is ever aggregated. What is wrong
inside the safetensors file is in test_delta_file_checks.py."""

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from rest_framework.test import APIClient

from edge_agent.delta import encode_delta, sign_delta
from tests.training.delta_support import rejected, send, small_delta, upload
from training.federation.verification import delta_verify
from training.models import Delta
from training.registry.services import version_create_seeded, version_transition


@pytest.mark.django_db
def test_a_good_delta_is_accepted_into_a_round_and_a_repeat_upload_is_the_same_delta(setup):
    adapter, version, device, client = setup
    data = encode_delta(small_delta(adapter))
    delta = send(setup, data)
    assert delta.state == Delta.State.ACCEPTED and delta.round is not None
    assert delta.round.base_version == version and delta.staleness == 0 and delta.norm > 0
    again = send(setup, data)
    assert again.pk == delta.pk and Delta.objects.count() == 1


@pytest.mark.django_db
def test_a_repeat_upload_after_the_staging_sweep_sends_its_bytes_again_and_is_still_the_same_delta(setup, settings):
    """The begin step looks for a stored delta only when the file's lock file says it was begun here lately;
    once beat's sweep removed that file, a repeat sends its bytes again and the unique insert answers."""
    from pathlib import Path

    from training.federation.intake import upload_append, upload_begin

    adapter, _, device, _ = setup
    data = encode_delta(small_delta(adapter, seed=5))
    delta = send(setup, data)
    signed = sign_delta(
        device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=32, counter=1
    )
    begin = {"device": device.device, "envelope": signed["envelope"], "signature": signed["signature"]}
    assert upload_begin(**begin, channel="rest").delta.pk == delta.pk  # begun here lately: answered at once

    for lock in Path(settings.DELTA_STAGING_DIR).glob("*/*.lock"):
        lock.unlink()
    assert upload_begin(**begin, channel="rest").offset == 0  # no look-up: the bytes are asked for again
    again = send(setup, data)
    assert again.pk == delta.pk and again.state == Delta.State.ACCEPTED and Delta.objects.count() == 1

    # Sent again torn, the stored delta stands (no `hash_mismatch` row, no "rejected" for an accepted file).
    for lock in Path(settings.DELTA_STAGING_DIR).glob("*/*.lock"):
        lock.unlink()
    upload_begin(**begin, channel="rest")
    torn = bytes(len(data) - 1) + b"x"
    sha256 = signed["envelope"]["sha256"]
    state = upload_append(device=device.device, sha256=sha256, offset=0, data=torn, channel="rest")
    assert state.delta.pk == delta.pk and Delta.objects.count() == 1

    # With its four upload slots full, the repeat is answered with the stored delta, not refused.
    for seed in range(4):
        other = sign_delta(
            device.key,
            encode_delta(small_delta(adapter, seed=10 + seed)),
            device_id=device.id,
            adapter=adapter.name,
            base_version=1,
            num_samples=32,
            counter=10 + seed,
        )
        upload_begin(device=device.device, envelope=other["envelope"], signature=other["signature"], channel="rest")
    for lock in Path(settings.DELTA_STAGING_DIR).glob(f"*/{signed['envelope']['sha256']}.lock"):
        lock.unlink()
    assert upload_begin(**begin, channel="rest").delta.pk == delta.pk


@pytest.mark.django_db
def test_wrong_hash_bad_signature_and_another_devices_key_are_rejected(setup, enrolled):
    adapter, _, device, client = setup
    data = encode_delta(small_delta(adapter))
    signed = sign_delta(
        device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=8, counter=1
    )
    tampered = bytearray(data)
    tampered[-1] ^= 0xFF
    response = upload(client, bytes(tampered), signed)
    assert response.json()["state"] == "rejected" and response.json()["rejection_code"] == "hash_mismatch"

    forged = sign_delta(
        Ed25519PrivateKey.generate(),
        data,
        device_id=device.id,
        adapter=adapter.name,
        base_version=1,
        num_samples=8,
        counter=2,
    )
    # A signature that does not verify is refused at the door (before a byte is taken): no row.
    response = upload(client, data, {**signed, "signature": forged["signature"]})
    assert response.status_code == 403 and response.json()["error"]["code"] == "bad_signature"
    other = enrolled("active", name="other")
    signed_by_other = sign_delta(
        other.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=8, counter=3
    )
    response = upload(client, data, signed_by_other)
    assert response.status_code == 403 and response.json()["error"]["code"] == "bad_signature"
    assert Delta.objects.count() == 1  # the hash_mismatch row only

    # The worker checks the signature again: a stored row whose signature no longer verifies is rejected.
    good = send(setup, encode_delta(small_delta(adapter, seed=5)), counter=4, verify=False)
    Delta.objects.filter(pk=good.pk).update(signature=forged["signature"])
    rejected(delta_verify(delta_id=good.pk), "bad_signature")


@pytest.mark.django_db
def test_an_envelope_naming_another_device_is_refused_at_the_door(setup, enrolled):
    adapter, _, _, client = setup
    other = enrolled("active", name="other")
    data = encode_delta(small_delta(adapter))
    signed = sign_delta(
        other.key, data, device_id=other.id, adapter=adapter.name, base_version=1, num_samples=8, counter=1
    )
    response = upload(client, data, signed)
    assert response.status_code == 403 and response.json()["error"]["code"] == "wrong_device"
    assert not Delta.objects.exists()


@pytest.mark.django_db
def test_a_replayed_counter_is_rejected_but_a_forgery_cannot_burn_a_counter(setup):
    adapter, _, device, client = setup
    # A forged upload claiming counter 7 fails its signature and leaves counter 7 free for the device.
    data = encode_delta(small_delta(adapter, seed=1))
    signed = sign_delta(
        Ed25519PrivateKey.generate(),
        data,
        device_id=device.id,
        adapter=adapter.name,
        base_version=1,
        num_samples=8,
        counter=7,
    )
    refused = upload(client, data, signed)  # refused at the door: no row, so it claims nothing
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "bad_signature"
    # Nor does a forged row that reached the worker (the worker checks the signature again).
    forged = send(setup, encode_delta(small_delta(adapter, seed=4)), counter=7, verify=False)
    Delta.objects.filter(pk=forged.pk).update(signature=signed["signature"])
    rejected(delta_verify(delta_id=forged.pk), "bad_signature")
    assert send(setup, encode_delta(small_delta(adapter, seed=2)), counter=7).state == Delta.State.ACCEPTED
    replay = send(setup, encode_delta(small_delta(adapter, seed=3)), counter=7)
    rejected(replay, "replayed_counter")


@pytest.mark.django_db
def test_unknown_revoked_and_too_stale_base_versions_are_rejected(setup, make_user):
    adapter, version, _, _ = setup
    rejected(send(setup, encode_delta(small_delta(adapter)), base_version=9, counter=1), "unknown_base_version")
    later = [version_create_seeded(adapter=adapter, seed=seed) for seed in range(4, 9)]  # v2..v6, candidates
    # candidates never reached a device: a delta on v1 is not stale for them (staleness counts released versions)
    accepted = send(setup, encode_delta(small_delta(adapter, seed=2)), base_version=1, counter=2)
    assert accepted.state == "accepted" and accepted.staleness == 0
    for released in later:  # v1 is now 5 released versions behind, past the default bound of 4
        version_transition(version=released, action="release", actor=None)
    stale = rejected(
        send(setup, encode_delta(small_delta(adapter, seed=1)), base_version=1, counter=3), "stale_base_version"
    )
    assert "5 released versions behind v6" in stale.rejection_detail


@pytest.mark.django_db
def test_unknown_adapter_and_a_cohort_that_does_not_train_it_are_rejected(setup, enrolled, cohort):
    adapter, _, _, _ = setup
    rejected(send(setup, encode_delta(small_delta(adapter)), adapter_name="nope", counter=1), "unknown_adapter")
    adapter.cohorts.remove(cohort)
    rejected(send(setup, encode_delta(small_delta(adapter, seed=1)), counter=2), "wrong_cohort")


@pytest.mark.django_db
def test_a_quarantined_device_is_rejected(setup):
    adapter, _, device, _ = setup
    from devices.models import Device

    delta = send(setup, encode_delta(small_delta(adapter)), verify=False)
    Device.objects.filter(pk=device.device.pk).update(status="quarantined")  # after upload, before verification
    rejected(delta_verify(delta_id=delta.pk), "device_not_active")


@pytest.mark.django_db
def test_an_oversized_upload_is_refused_by_its_envelope_and_by_its_bytes(setup, settings):
    adapter, _, device, client = setup
    settings.DELTA_MAX_BYTES = 4096
    data = encode_delta(small_delta(adapter))
    assert len(data) > 4096
    signed = sign_delta(
        device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=8, counter=1
    )
    response = upload(client, data, signed)  # refused by its declared size: no row, nothing stored
    assert response.status_code == 413 and response.json()["error"]["code"] == "too_large"
    assert not Delta.objects.exists()
    # A device that declares a small size and sends more is cut off at the declared size.
    small = encode_delta({k: v[:1] for k, v in small_delta(adapter).items()})
    signed = sign_delta(
        device.key, small, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=8, counter=9
    )
    response = upload(client, small + b"x" * 100, signed)
    assert response.json()["rejection_code"] == "too_large"  # a row, for forensics; its bytes are not kept
    assert Delta.objects.get().blob_sha256 == ""


@pytest.mark.django_db
def test_resuming_an_upload_continues_from_the_servers_offset(setup):
    adapter, _, device, client = setup
    data = encode_delta(small_delta(adapter))
    signed = sign_delta(
        device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=8, counter=1
    )
    size = len(data)
    first = upload(client, data[:1000], signed, HTTP_CONTENT_RANGE=f"bytes 0-999/{size}")
    assert first.status_code == 200 and first.json()["offset"] == 1000 and first.json()["state"] == "uploading"
    state = client.get(f"/api/v1/device/deltas/{signed['envelope']['sha256']}/").json()
    assert state["offset"] == 1000
    wrong = upload(client, data[500:], signed, HTTP_CONTENT_RANGE=f"bytes 500-{size - 1}/{size}")
    assert wrong.status_code == 409 and wrong.json()["error"]["code"] == "wrong_offset"
    rest = upload(client, data[1000:], signed, HTTP_CONTENT_RANGE=f"bytes 1000-{size - 1}/{size}")
    assert rest.status_code == 201 and rest.json()["state"] == "received"
    assert Delta.objects.get().blob_sha256 == signed["envelope"]["sha256"]


@pytest.mark.django_db
def test_malformed_envelopes_are_refused_and_store_nothing(setup):
    adapter, _, device, client = setup
    data = encode_delta(small_delta(adapter))
    signed = sign_delta(
        device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=8, counter=1
    )
    for broken in (
        {**signed["envelope"], "num_samples": -1},
        {**signed["envelope"], "counter": "1"},
        {**signed["envelope"], "extra": 1},
        {k: v for k, v in signed["envelope"].items() if k != "base_version"},
    ):
        response = upload(client, data, {"envelope": broken, "signature": signed["signature"]})
        assert response.status_code == 400 and response.json()["error"]["code"] == "malformed_envelope"
    garbage = client.put(
        f"/api/v1/device/deltas/{signed['envelope']['sha256']}/",
        data=data,
        content_type="application/octet-stream",
        HTTP_X_DELTA_ENVELOPE="!!!",
    )
    assert garbage.status_code == 400
    assert (
        APIClient()
        .put(
            f"/api/v1/device/deltas/{signed['envelope']['sha256']}/", data=data, content_type="application/octet-stream"
        )
        .status_code
        == 401
    )
    assert not Delta.objects.exists()


@pytest.mark.django_db
def test_a_delta_rejected_after_the_counter_check_still_uses_up_its_counter(setup):
    adapter, _, _, _ = setup
    bad = small_delta(adapter, seed=4)
    name = next(iter(bad))
    bad[name] = bad[name].clone()
    bad[name][0, 0] = float("nan")
    rejected(send(setup, encode_delta(bad), counter=9), "not_finite")
    # The same counter on a good delta is a replay, even though the first one never counted.
    rejected(send(setup, encode_delta(small_delta(adapter, seed=5)), counter=9), "replayed_counter")


@pytest.mark.django_db
def test_a_replay_that_also_fails_a_later_check_is_reported_as_a_replay(setup, make_user):
    adapter, _, _, _ = setup
    assert send(setup, encode_delta(small_delta(adapter, seed=6)), counter=11).state == Delta.State.ACCEPTED
    # Counter reused and an unknown base version: the counter check comes first in the documented order
    # (README.md, "Deltas, verification and rounds").
    rejected(send(setup, encode_delta(small_delta(adapter, seed=7)), counter=11, base_version=42), "replayed_counter")


@pytest.mark.django_db
def test_verifying_an_accepted_delta_takes_a_bounded_number_of_queries(setup, django_assert_max_num_queries):
    adapter, _, _, _ = setup
    send(setup, encode_delta(small_delta(adapter, seed=8)), counter=1)  # opens the round
    delta = send(setup, encode_delta(small_delta(adapter, seed=9)), counter=2, verify=False)
    # Delta with device and cohort; adapter with cohort check; base and newest version; savepoint + outcome
    # update; collecting round locked, delta into it, count. A slip into per-tensor or per-check queries
    # shows here.
    with django_assert_max_num_queries(12):
        verified = delta_verify(delta_id=delta.pk)
    assert verified.state == Delta.State.ACCEPTED


@pytest.mark.django_db
def test_abandoned_uploads_hold_a_devices_slots_only_until_they_expire(setup, settings):
    import os
    import time
    from pathlib import Path

    from training.federation.intake import MAX_STAGED_PER_DEVICE
    from training.tasks import expire_staged_uploads

    adapter, _, device, client = setup
    staging = Path(settings.DELTA_STAGING_DIR) / str(device.id)

    def begin(seed):
        data = encode_delta(small_delta(adapter, seed=seed))
        signed = sign_delta(
            device.key, data, device_id=device.id, adapter=adapter.name, base_version=1, num_samples=8, counter=seed
        )
        return upload(client, data[:100], signed, HTTP_CONTENT_RANGE=f"bytes 0-99/{len(data)}"), signed

    def age(paths, seconds):
        for path in paths:
            then = time.time() - seconds
            os.utime(path, (then, then))

    finished = send(setup, encode_delta(small_delta(adapter, seed=20)), counter=20, verify=False)
    leftover_lock = staging / f"{finished.sha256}.lock"  # what a finished upload leaves behind
    assert leftover_lock.exists()
    for seed in range(1, MAX_STAGED_PER_DEVICE + 1):
        assert begin(seed)[0].json()["state"] == "uploading"
    refused, _ = begin(10)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_uploads"
    assert len(list(staging.glob("*.part"))) == MAX_STAGED_PER_DEVICE

    # One abandoned upload goes stale: the next upload takes its slot, the fresh ones are kept.
    stale = sorted(staging.glob("*.part"))[0]
    age([stale], settings.DELTA_STAGED_EXPIRY_SECONDS + 1)
    taken, signed = begin(11)
    assert taken.status_code == 200 and taken.json()["offset"] == 100
    assert not stale.exists() and not stale.with_suffix(".json").exists()
    assert len(list(staging.glob("*.part"))) == MAX_STAGED_PER_DEVICE
    resumed = client.get(f"/api/v1/device/deltas/{stale.stem}/")
    assert resumed.status_code == 404  # the device starts that file over

    # Beat's sweep: stale uploads go, with the lock and envelope files that finished uploads leave behind.
    assert expire_staged_uploads() == 0  # nothing is old yet
    age(staging.glob("*"), settings.DELTA_STAGED_EXPIRY_SECONDS + 1)
    keep = staging / f"{signed['envelope']['sha256']}.part"
    age([keep], 0)
    assert expire_staged_uploads() == MAX_STAGED_PER_DEVICE - 1
    kept = sorted(path.name for path in staging.iterdir())
    assert kept == sorted(f"{signed['envelope']['sha256']}{suffix}" for suffix in (".json", ".lock", ".part"))
    assert not leftover_lock.exists()
    assert Delta.objects.filter(sha256=finished.sha256).exists()  # a stored delta is not the sweep's business
