"""Shared fixtures: users per role, API clients, and a real Celery worker process on the test database.

The suite runs against real PostgreSQL and Redis (DATABASE_URL / REDIS_URL, provided by the launcher when
not set). Every run namespaces its Redis keys, Celery queue and control exchange with a unique prefix, so a
dev stack on the same Redis never steals the suite's tasks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.utils import timezone

from edge_agent.identity import public_key_b64
from fleet.pytest_plugin import RUN_ID

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def shared_blob_root(tmp_path_factory) -> Path:
    """Where the suite's Celery worker reads and writes blobs; tests that use the worker share it."""
    return tmp_path_factory.mktemp("worker-blobs")


@pytest.fixture(autouse=True)
def _blob_storage(settings, tmp_path, shared_blob_root):
    """Every test writes blobs where the suite's Celery worker reads them: a transactional test's committed
    delta may still be verified by the worker after the test, and must find its bytes. Blobs are
    content-addressed, so sharing the folder cannot mix up two tests' data."""
    location = shared_blob_root
    storages = dict(settings.STORAGES)
    storages["blobs"] = storages["default"] = {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(location)},
    }
    settings.STORAGES = storages
    settings.DELTA_STAGING_DIR = tmp_path / "uploads"


@pytest.fixture(scope="session", autouse=True)
def _flush_retried():
    """A transactional test ends by emptying the database (one TRUNCATE of every table). The suite's Celery worker
    may still be verifying a delta that test committed, in a transaction of its own, and PostgreSQL then breaks the
    deadlock by failing one side; when it fails the TRUNCATE, the next test finds this one's rows. The flush is tried
    again a few times, after the worker's transaction has ended."""
    from django.core.management.base import CommandError
    from django.test.testcases import TransactionTestCase

    original = TransactionTestCase._fixture_teardown

    def teardown(self) -> None:
        for pause in (0.5, 1.0, 2.0):
            try:
                return original(self)
            except CommandError as error:
                print(f"flush failed ({error.__cause__!r}); trying again in {pause} s", file=sys.stderr)
                time.sleep(pause)
        return original(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TransactionTestCase, "_fixture_teardown", teardown)
        yield


@pytest.fixture(autouse=True)
def _heartbeats_unspaced(settings):
    """In-process sockets take heartbeats as fast as a test sends them; the spacing rule has its own tests against
    a live server (tests/protocol/test_socket_edges.py)."""
    settings.HEARTBEAT_MIN_SPACING_PERCENT = 0


@pytest.fixture(autouse=True)
def _generous_enrollment_rate(settings):
    """Tests enroll many devices from one address; the rate-limit test sets its own low rate."""
    from django.core.cache import cache

    settings.ENROLLMENT_RATE = settings.DEVICE_AUTH_RATE = "100000/min"
    cache.delete("throttle_device_auth_127.0.0.1")
    cache.delete("throttle_enroll_127.0.0.1")  # never cache.clear(): that flushes the whole Redis database
    cache.delete("login-failures:addr:127.0.0.1")  # every test signs in from this address


@pytest.fixture(autouse=True)
def _generous_upload_limits(settings):
    """Tests upload many deltas from one device in a moment; the per-device limits have their own tests
    (tests/training/test_upload_edges.py, against a server started with small ones)."""
    settings.DELTA_BEGINS_PER_MINUTE = settings.DELTA_REJECTIONS_PER_HOUR = 1_000_000


@pytest.fixture
def make_user(db):
    from accounts.services import user_create

    def make(role: str = "viewer", username: str | None = None, password: str = "correct-horse-battery-9"):
        return user_create(username=username or f"{role}-{uuid.uuid4().hex[:6]}", role=role, password=password)

    return make


@pytest.fixture
def api_client_for(make_user):
    """``api_client_for("operator")`` gives a DRF client authenticated with a real API token of that role."""
    from rest_framework.test import APIClient

    from accounts.services import api_token_create

    def make(role: str | None):
        client = APIClient()
        if role is not None:
            issued = api_token_create(user=make_user(role), name="test")
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.raw}")
        return client

    return make


def _test_database_url() -> str:
    from django.db import connection

    parts = urlsplit(os.environ["DATABASE_URL"])
    return urlunsplit(parts._replace(path="/" + connection.settings_dict["NAME"]))


def worker_log(name: str) -> Path:
    """Where the worker ``start_worker(name=...)`` of this run writes its log."""
    return ROOT / "tests" / "artifacts" / f"celery-{name}-{RUN_ID}.log"


def start_worker(*, name: str, blob_root: Path, **env_overrides: str) -> tuple[subprocess.Popen, Path]:
    """Start a real ``celery worker`` on the test database; returns once it answers a ping."""
    env = dict(os.environ)
    env["DATABASE_URL"] = _test_database_url()
    env["DATABASE_CONN_MAX_AGE"] = "0"
    env["BLOB_ROOT"] = str(blob_root)
    env.update(env_overrides)
    log_path = worker_log(name)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "fleet",
                "worker",
                "--loglevel",
                "INFO",
                "--concurrency",
                env_overrides.get("WORKER_CONCURRENCY", "2"),
                "--pool",
                "prefork",
                "--hostname",
                f"{name}-{RUN_ID}@%h",
                "--without-mingle",
                "--without-gossip",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # so a test can kill the worker with its pool children
        )
    from fleet.celery import app

    deadline = time.monotonic() + 60
    while not app.control.ping(destination=[f"{name}-{RUN_ID}@{socket.gethostname()}"], timeout=0.5):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the Celery worker did not come up; see {log_path}:\n{log_path.read_text()[-3000:]}")
    return process, log_path


def stop_worker(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="session")
def celery_worker_process(django_db_setup, django_db_blocker, shared_blob_root):
    """A real ``celery worker`` subprocess consuming this run's queue, connected to the test database.

    Tests that use it must commit their rows (``transactional_db``) so the worker can see them.
    """
    process, _ = start_worker(name="test", blob_root=shared_blob_root)
    yield process
    stop_worker(process)


# --- the fleet: cohorts, enrollment tokens and enrolled devices with real keys -------------------------------


@dataclass
class EnrolledDevice:
    device: object
    key: Ed25519PrivateKey

    @property
    def id(self) -> str:
        return str(self.device.pk)


@pytest.fixture
def cohort(db):
    from devices.services import cohort_create

    return cohort_create(name="eu-phones")


@pytest.fixture
def enrollment_token(cohort, make_user):
    from devices.services import enrollment_token_create

    def make(*, uses=5, requires_approval=False, expires_in=timedelta(hours=1)):
        return enrollment_token_create(
            cohort=cohort,
            name="t",
            expires_at=timezone.now() + expires_in,
            uses=uses,
            requires_approval=requires_approval,
            created_by=make_user("admin"),
        )

    return make


@pytest.fixture
def enrolled(enrollment_token):
    """``enrolled(status="active")`` enrolls a device with a fresh key through the real service."""
    from devices.models import Device
    from devices.services import device_enroll

    def make(status: str = "active", name: str = "phone") -> EnrolledDevice:
        key = Ed25519PrivateKey.generate()
        issued = enrollment_token(requires_approval=status != "active")
        device = device_enroll(token=issued.raw, public_key=public_key_b64(key), name=name)
        if status not in ("active", "pending"):
            Device.objects.filter(pk=device.pk).update(status=status)
            device.refresh_from_db()
        return EnrolledDevice(device=device, key=key)

    return make


# --- training: a base model and an adapter on it ----------------------------------------------------------


@pytest.fixture
def base_model(db, make_user):
    from training.registry.services import base_model_create

    return base_model_create(
        name="digits-base", family="digits-cnn", family_config={"seed": 1}, actor=make_user("admin")
    )


@pytest.fixture
def adapter(base_model, make_user):
    from training.registry.services import adapter_create

    return adapter_create(name="digits-lora", base_model=base_model, rank=4, alpha=8.0, actor=make_user("admin"))


@pytest.fixture
def device_token(db):
    """``device_token(enrolled_device)``: a short-lived device API token, through the real signed challenge."""
    from rest_framework.test import APIClient

    from edge_agent.protocol import sign, token_request_payload

    def make(device):
        client = APIClient()
        nonce = client.post("/api/v1/device-auth/challenge/", {"device_id": device.id}, format="json").json()["nonce"]
        signature = sign(device.key, token_request_payload(nonce=nonce, device_id=device.id))
        body = {"device_id": device.id, "nonce": nonce, "signature": signature, "protocol": 2}
        return client.post("/api/v1/device-auth/token/", body, format="json").json()["token"]

    return make
