"""Rotating the server's signing key: a device trusts a new key only through a statement signed by the key it
already trusts, follows a chain of rotations from whatever key it pinned, and refuses the retired key, a forged
or broken chain, and a manifest signed by a key it was never led to. The procedure runs through the real
management command, and real agents install assignments across two rotations against the live server."""

from __future__ import annotations

import json
import stat
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core.management import CommandError, call_command

from devices import server_key
from devices.models import ServerKeyRotation
from devices.server_key import forget_cached_keys, public_key_b64, rotation_sign, server_public_key_b64
from edge_agent.assignments import AdapterStore, AssignmentHandler
from edge_agent.identity import STATE_FILE, AgentState
from edge_agent.manifest import PURPOSE, ManifestRefused, trusted_server_key, verify_manifest
from edge_agent.protocol import sign
from edge_agent.rest import DeviceSession
from training.models import Assignment
from training.registry.services import version_create_seeded
from training.rollouts.lifecycle import assignment_create

DEVICE = "0b7c7a8e-3c1f-4a51-9a35-000000000001"
BASE = "ab" * 32


@pytest.fixture
def isolated_key(settings, tmp_path, monkeypatch):
    """This test's own server key, in its own data folder (never the checkout's); caches reset around it."""
    monkeypatch.delenv("SERVER_SIGNING_KEY", raising=False)
    monkeypatch.delenv("SERVER_SIGNING_KEY_FILE", raising=False)
    settings.DATA_DIR = tmp_path / "data"
    forget_cached_keys()
    yield settings.DATA_DIR / server_key.KEY_FILE_NAME
    forget_cached_keys()


def _manifest(signer: Ed25519PrivateKey, rotations=None, **changes) -> dict:
    now = time.time()
    manifest = {
        "purpose": PURPOSE,
        "device_id": DEVICE,
        "adapter": "digits-lora",
        "version": 2,
        "sha256": "cd" * 32,
        "size": 100,
        "base_model_sha256": BASE,
        "assignment_seq": 3,
        "issued_at": now,
        "expires_at": now + 60,
        **changes,
    }
    envelope = {"manifest": manifest, "signature": sign(signer, manifest)}
    if rotations is not None:
        envelope["key_rotations"] = rotations
    return envelope


def _check(envelope: dict, pinned: str) -> str:
    """What an agent that pinned ``pinned`` does: follow the chain, verify the manifest; the key it would pin."""
    key = trusted_server_key(envelope, pinned)
    verify_manifest(
        envelope, server_public_key=key, device_id=DEVICE, base_model_sha256=BASE, last_accepted_seq=0, now=time.time()
    )
    return key


def _refused(envelope: dict, pinned: str) -> str:
    with pytest.raises(ManifestRefused) as refused:
        _check(envelope, pinned)
    return refused.value.code


@pytest.fixture
def chain():
    keys = [Ed25519PrivateKey.generate() for _ in range(3)]
    links = [rotation_sign(keys[0], keys[1], seq=1), rotation_sign(keys[1], keys[2], seq=2)]
    return keys, [public_key_b64(k) for k in keys], links


def test_a_device_follows_the_chain_from_the_key_it_pinned_to_the_newest(chain):
    keys, public, links = chain
    envelope = _manifest(keys[2], links)
    assert _check(envelope, public[0]) == public[2]  # enrolled before both rotations
    assert _check(envelope, public[1]) == public[2]  # enrolled between them: the first link is skipped
    assert _check(envelope, public[2]) == public[2]  # enrolled after
    assert _check(_manifest(keys[0]), public[0]) == public[0]  # no rotation: the pinned key as before


def _forged(chain_fixture, mutate) -> list:
    _, _, links = chain_fixture
    forged = json.loads(json.dumps(links))
    mutate(forged)
    return forged


def test_forged_broken_or_malformed_chains_are_refused(chain):
    keys, public, links = chain
    attacker = Ed25519PrivateKey.generate()
    by_attacker = rotation_sign(attacker, attacker, seq=1)
    by_attacker["statement"]["old_public_key"] = public[0]  # claims to retire the device's key, signed by another

    def new_key_swapped(links):
        links[1]["statement"]["new_public_key"] = public_key_b64(attacker)

    def new_signature_missing(links):
        del links[0]["new_signature"]

    def seq_backwards(links):
        links[1]["statement"]["seq"] = 1

    def extra_field(links):
        links[0]["statement"]["note"] = "x"

    cases = {
        "signed by a key it does not retire": ([by_attacker], attacker),
        "the new key swapped after signing": (_forged(chain, new_key_swapped), attacker),
        "no signature by the new key": (_forged(chain, new_signature_missing), keys[2]),
        "statements out of order": (_forged(chain, seq_backwards), keys[2]),
        "an unknown statement field": (_forged(chain, extra_field), keys[2]),
        "a gap in the chain": ([links[0], rotation_sign(keys[2], attacker, seq=3)], attacker),
        "rotating back to a retired key": ([*links, rotation_sign(keys[2], keys[0], seq=3)], keys[0]),
        "not a list": ({"statement": {}}, keys[2]),
        "too long": ([links[0]] * 65, keys[2]),
        "a statement of another purpose": (
            _forged(chain, lambda ls: ls[0]["statement"].update(purpose="adapter-manifest")),
            keys[2],
        ),
    }
    for name, (rotations, signer) in cases.items():
        assert _refused(_manifest(signer, rotations), public[0]) == "bad_key_rotation", name


def test_a_retired_key_or_a_key_no_chain_leads_to_is_refused(chain):
    keys, public, links = chain
    # The chain says the device's key was retired: a manifest still signed by it (or by the middle key) is refused.
    assert _refused(_manifest(keys[0], links), public[0]) == "bad_signature"
    assert _refused(_manifest(keys[1], links), public[0]) == "bad_signature"
    # A manifest signed by a newer key without the chain that leads there.
    assert _refused(_manifest(keys[2]), public[0]) == "bad_signature"
    # A chain that does not pass through the device's key at all leads nowhere for it.
    stranger = public_key_b64(Ed25519PrivateKey.generate())
    assert _refused(_manifest(keys[2], links), stranger) == "bad_signature"
    # Anything else in the envelope is refused rather than ignored.
    assert _refused({**_manifest(keys[0]), "rotations": links}, public[0]) == "malformed"


@pytest.mark.django_db
def test_the_command_rotates_the_data_folder_key_and_keeps_the_chain(isolated_key, capsys):
    first = server_public_key_b64()
    call_command("rotate_signing_key")
    second = server_public_key_b64()
    assert second != first and isolated_key.exists()
    assert stat.S_IMODE(isolated_key.stat().st_mode) == 0o600
    assert not isolated_key.with_name(server_key.NEXT_KEY_FILE_NAME).exists()
    call_command("rotate_signing_key")
    third = server_public_key_b64()
    rows = list(ServerKeyRotation.objects.values_list("seq", "old_public_key", "new_public_key"))
    assert rows == [(1, first, second), (2, second, third)]
    assert [link["statement"]["new_public_key"] for link in server_key.key_rotations()] == [second, third]
    assert server_key.key_rotations(second) == server_key.key_rotations()[:1]  # a process still on `second`
    call_command("rotate_signing_key", "--show")
    shown = capsys.readouterr().out
    assert f"current key: {third}" in shown and "#2" in shown and f"{second} -> {third}" in shown


@pytest.mark.django_db
def test_a_key_from_the_environment_is_rotated_to_a_file_the_operator_installs(isolated_key, monkeypatch, tmp_path):
    old = Ed25519PrivateKey.generate()
    seed_file = tmp_path / "old.key"
    seed_file.write_text(server_key.private_key_pem(old).decode())
    monkeypatch.setenv("SERVER_SIGNING_KEY_FILE", str(seed_file))
    forget_cached_keys()
    with pytest.raises(CommandError, match="--new-key-file"):
        call_command("rotate_signing_key")
    assert not ServerKeyRotation.objects.exists()  # nothing recorded by the refusal

    target = tmp_path / "secrets" / "new.pem"
    call_command("rotate_signing_key", "--new-key-file", str(target))
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    rotation = ServerKeyRotation.objects.get()
    assert rotation.old_public_key == public_key_b64(old)
    assert rotation.new_public_key == public_key_b64(server_key.load_private_key(target.read_text()))
    assert server_public_key_b64() == public_key_b64(old)  # this process signs with the old key until restarted
    # Rotating the retired key again (the environment not updated) is refused, and records nothing.
    with pytest.raises(CommandError, match="already rotated"):
        call_command("rotate_signing_key", "--new-key-file", str(tmp_path / "other.pem"))
    assert ServerKeyRotation.objects.count() == 1

    monkeypatch.setenv("SERVER_SIGNING_KEY_FILE", str(target))  # the operator installs it and restarts
    forget_cached_keys()
    assert server_public_key_b64() == rotation.new_public_key
    assert [link["statement"]["seq"] for link in server_key.key_rotations()] == [1]


@pytest.mark.django_db
def test_reusing_an_old_key_or_the_current_one_is_refused(isolated_key, tmp_path):
    first = server_key.server_private_key()
    same = tmp_path / "same.pem"
    same.write_bytes(server_key.private_key_pem(first))
    with pytest.raises(CommandError, match="is the current one"):
        call_command("rotate_signing_key", "--new-key", str(same))
    call_command("rotate_signing_key")
    with pytest.raises(CommandError, match="used before"):
        call_command("rotate_signing_key", "--new-key", str(same))
    assert ServerKeyRotation.objects.count() == 1


@pytest.fixture
def agent(isolated_key, enrolled, live_server, tmp_path, adapter, cohort):
    adapter.cohorts.add(cohort)
    device = enrolled("active")
    home = tmp_path / "agent"
    home.mkdir()
    state = AgentState(
        server=live_server.url,
        device_id=device.id,
        server_public_key=server_public_key_b64(),  # pinned at enrollment
        cohort=cohort.name,
        status="active",
        websocket_path="/ws/agent/",
        heartbeat_interval=30,
    )
    state.save(home)
    session = DeviceSession(server=live_server.url, device_id=device.id, key=device.key)
    handler = AssignmentHandler(home=home, state=state, session=session, evaluate=lambda *a, **k: {})
    handler.device = device
    return handler


@pytest.mark.django_db(transaction=True)
def test_agents_install_across_two_rotations_and_refuse_the_retired_key(agent, adapter):
    pinned = server_public_key_b64()
    retired = server_key.server_private_key()
    call_command("rotate_signing_key")
    call_command("rotate_signing_key")
    newest = server_public_key_b64()

    # The server signs with the newest key and carries the chain; the agent follows it and pins the newest key.
    version = version_create_seeded(adapter=adapter, seed=1)
    assignment_create(device=agent.device.device, version=version)
    message = agent.session.get("/api/v1/device/assignment/")
    assert [link["statement"]["seq"] for link in message["envelope"]["key_rotations"]] == [1, 2]
    assert agent.apply(message) == {"status": "installed", "version": 1}
    assert agent.state.server_public_key == newest != pinned
    assert AgentState.load(agent.home).server_public_key == newest  # persisted in agent.json

    # Someone holding the retired key signs a newer manifest for this device: refused, and nothing moves.
    newer = version_create_seeded(adapter=adapter, seed=2)
    assignment_create(device=agent.device.device, version=newer)
    forged = agent.session.get("/api/v1/device/assignment/")
    forged["envelope"] = {"manifest": forged["envelope"]["manifest"]}
    forged["envelope"]["signature"] = sign(retired, forged["envelope"]["manifest"])
    assert agent.apply(forged) == {"status": "refused", "code": "bad_signature"}
    assert Assignment.objects.get(version=newer).reason.startswith("refused: bad_signature")
    assert AdapterStore(agent.home).state()["current"]["version"] == 1

    # A forged chain from the pinned key is refused as well, and the pinned key stays.
    third = version_create_seeded(adapter=adapter, seed=3)
    assignment_create(device=agent.device.device, version=third)
    attacker = Ed25519PrivateKey.generate()
    message = agent.session.get("/api/v1/device/assignment/")
    link = rotation_sign(attacker, attacker, seq=3)
    link["statement"]["old_public_key"] = newest
    message["envelope"]["key_rotations"].append(link)
    assert agent.apply(message) == {"status": "refused", "code": "bad_key_rotation"}
    assert json.loads((agent.home / STATE_FILE).read_text())["server_public_key"] == newest

    # The genuine message for the same assignment still installs.
    fourth = version_create_seeded(adapter=adapter, seed=4)
    assignment_create(device=agent.device.device, version=fourth)
    assert agent.apply(agent.session.get("/api/v1/device/assignment/"))["status"] == "installed"
    assert AdapterStore(agent.home).state()["current"]["version"] == fourth.number
