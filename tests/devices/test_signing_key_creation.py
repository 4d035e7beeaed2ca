"""The server's signing key is created once, race-free: many threads and processes asking for it at once on an
empty data folder all get the one complete key that won, leave no temporary file behind, and a process loads it
once; an enrollment the server cannot answer leaves no device behind."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.core.exceptions import ImproperlyConfigured
from rest_framework.test import APIClient

from devices import server_key
from devices.models import Device, DeviceEvent, EnrollmentToken
from devices.server_key import _load_or_create_file, forget_cached_keys, public_key_b64, server_private_key
from edge_agent.identity import public_key_b64 as device_public_key_b64

ROOT = Path(__file__).resolve().parents[2]
THREADS = 16
PROCESSES = 4

# One process of the hammer: THREADS threads wait for the same instant, then all ask for the key file.
_CHILD = """
import json, sys, threading, time
from pathlib import Path
from devices.server_key import _load_or_create_file, public_key_b64

path, go, count = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
keys, errors = [], []

def ask():
    time.sleep(max(0.0, go - time.time()))
    try:
        keys.append(public_key_b64(_load_or_create_file(path)))
    except Exception as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=ask) for _ in range(count)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"keys": keys, "errors": errors}))
"""


def _assert_one_key_file(folder: Path) -> str:
    """The folder holds the key file and nothing else (no temporary left), mode 0600; its public key."""
    assert sorted(p.name for p in folder.iterdir()) == [server_key.KEY_FILE_NAME]
    path = folder / server_key.KEY_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return public_key_b64(server_key.load_private_key(path.read_text()))


def test_threads_creating_the_key_file_at_once_all_get_the_one_key_that_won(tmp_path):
    for attempt in range(5):
        folder = tmp_path / f"data-{attempt}"
        path = folder / server_key.KEY_FILE_NAME
        start = threading.Barrier(THREADS)

        def ask(_, path=path, start=start):
            start.wait()
            return public_key_b64(_load_or_create_file(path))

        with ThreadPoolExecutor(THREADS) as pool:
            keys = list(pool.map(ask, range(THREADS)))
        assert len(set(keys)) == 1, keys
        assert keys[0] == _assert_one_key_file(folder)


def test_processes_of_many_threads_creating_the_key_file_at_once_all_get_the_one_key_that_won(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SERVER_SIGNING_KEY", None)
    for attempt in range(3):
        folder = tmp_path / f"data-{attempt}"
        go = time.time() + 3.0  # every process imported and waiting before the instant comes
        children = [
            subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(folder / server_key.KEY_FILE_NAME), str(go), str(THREADS)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(PROCESSES)
        ]
        keys = []
        for child in children:
            out, err = child.communicate(timeout=60)
            assert child.returncode == 0, err
            result = json.loads(out.strip().splitlines()[-1])
            assert result["errors"] == [], result["errors"]
            keys += result["keys"]
        assert len(keys) == THREADS * PROCESSES
        assert set(keys) == {_assert_one_key_file(folder)}


def test_threads_racing_into_the_process_key_load_it_once(settings, tmp_path, monkeypatch):
    monkeypatch.delenv("SERVER_SIGNING_KEY", raising=False)
    monkeypatch.delenv("SERVER_SIGNING_KEY_FILE", raising=False)
    settings.DATA_DIR = tmp_path / "data"
    forget_cached_keys()
    try:
        start = threading.Barrier(THREADS)

        def ask(_):
            start.wait()
            return server_private_key()

        with ThreadPoolExecutor(THREADS) as pool:
            keys = list(pool.map(ask, range(THREADS)))
        assert len({id(key) for key in keys}) == 1  # one object: one thread loaded it, the others waited
        assert public_key_b64(keys[0]) == _assert_one_key_file(settings.DATA_DIR)
    finally:
        forget_cached_keys()


def test_a_broken_key_file_is_refused_with_its_path_and_never_replaced(tmp_path):
    path = tmp_path / server_key.KEY_FILE_NAME
    path.write_text("-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2Vw")  # cut off half way
    with pytest.raises(ImproperlyConfigured, match=str(path)):
        _load_or_create_file(path)
    assert path.read_text().endswith("MC4CAQAwBQYDK2Vw")


@pytest.mark.django_db
def test_an_enrollment_the_server_cannot_answer_leaves_no_device_and_spends_no_use(enrollment_token, monkeypatch):
    issued = enrollment_token(uses=3, requires_approval=False)
    monkeypatch.setenv("SERVER_SIGNING_KEY", "not a key")
    forget_cached_keys()
    body = {"token": issued.raw, "public_key": device_public_key_b64(Ed25519PrivateKey.generate()), "name": "p"}
    try:
        with pytest.raises(ImproperlyConfigured):
            APIClient().post("/api/v1/enroll/", body, format="json")
    finally:
        monkeypatch.delenv("SERVER_SIGNING_KEY")
        forget_cached_keys()
    assert not Device.objects.exists() and not DeviceEvent.objects.exists()
    assert EnrollmentToken.objects.get(pk=issued.token.pk).uses_left == 3
    response = APIClient().post("/api/v1/enroll/", body, format="json")  # the same device, once the key is back
    assert response.status_code == 201, response.content
    assert str(Device.objects.get().pk) == response.json()["device_id"]
