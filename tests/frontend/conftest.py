"""Fixtures for the dashboard tests: a signed-in client per role, rows made in bulk, the small fleet the
page tests share (``world``: test_pages.py and test_training_pages.py), and what the browser tests (the modules
marked ``e2e``) share: the ASGI server, headless Chromium, and a plain thread for ORM work beside Playwright.

Pages only read, so the bulk builders write rows directly (``bulk_create``) to reach fleet-sized counts
quickly; the actions under test go through the real services.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from devices.models import Cohort, Device, DeviceStatus, EnrollmentToken
from devices.services import enrollment_token_create
from tests.asgi_server import asgi_server
from training.federation.rounds import round_open
from training.models import AdapterVersion, Delta, Rollout, Round
from training.rollouts.lifecycle import device_bucket, rollout_create


@pytest.fixture(autouse=True)
def _fast_password_hashing(request, settings):
    """These tests make many users; real password hashing would be most of their run time. Not for the
    browser tests: their server process checks passwords with the real hashers."""
    if request.node.get_closest_marker("e2e"):
        return
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def server_url(django_db_setup, django_db_blocker, tmp_path_factory):
    """uvicorn on ``fleet.asgi:application`` against the test database and this run's Redis namespace."""
    with asgi_server("browser", tmp_path_factory.mktemp("browser-server")) as server:
        yield server.url


@pytest.fixture(scope="module")
def browser():
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        message = f"no Chromium at {CHROMIUM}: `make install` (or `make chromium`) installs Debian's"
        if os.environ.get("CI"):
            pytest.fail(message)  # in CI a missing browser is a broken install, never a quiet skip
        pytest.skip(message)
    with playwright_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(autouse=True)
def _orm_beside_playwright(request, monkeypatch):
    # Playwright's sync API keeps an asyncio loop on this thread; the test's own ORM calls are still
    # plain synchronous calls between browser steps, so Django's guard against ORM use in a loop is moot.
    # Only the browser tests: elsewhere the guard stays on.
    if request.node.get_closest_marker("e2e"):
        monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


_side_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="off-loop")


def off_loop(function, *args, **kwargs):
    """Run ``function`` on a plain thread: what publishes live events (``async_to_sync``) cannot run on a
    thread where Playwright's loop is running."""
    return _side_thread.submit(function, *args, **kwargs).result(timeout=60)


@pytest.fixture(scope="module", autouse=True)
def _close_side_thread_connections(request):
    yield
    if request.node.get_closest_marker("e2e"):  # a browser test module
        from django.db import connections

        off_loop(connections.close_all)  # so the test database can be dropped at the end of the run


@pytest.fixture
def client_for(make_user):
    """``client_for("operator")``: a Django test client signed in as a user with that role (one per role)."""
    from django.test import Client

    clients: dict[str | None, Client] = {}

    def make(role: str | None) -> Client:
        if role not in clients:
            clients[role] = Client()
            if role is not None:
                clients[role].force_login(make_user(role))
        return clients[role]

    return make


def make_devices(cohort, count: int, *, status: str = DeviceStatus.ACTIVE, prefix: str = "dev", **fields) -> list:
    now = timezone.now()
    return Device.objects.bulk_create(
        Device(
            name=f"{prefix}-{index:05d}",
            cohort=cohort,
            status=status,
            public_key=secrets.token_urlsafe(32),
            hardware={"ram_mb": 2048, "cpu": "arm64"},
            labels={"site": "lab" if index % 2 else "field"},
            agent_version="0.1.0",
            last_seen_at=now - timedelta(minutes=index % 90),
            online=index % 3 == 0,
            battery_percent=50 + index % 50,
            charging=index % 2 == 0,
            **fields,
        )
        for index in range(count)
    )


def make_versions(adapter, count: int, *, metrics: bool = True) -> list[AdapterVersion]:
    """A chain v1 ← v2 ← ... with eval metrics rising, plus nothing in blob storage (pages never read it)."""
    versions, parent = [], None
    start = (adapter.versions.order_by("-number").values_list("number", flat=True).first() or 0) + 1
    for number in range(start, start + count):
        parent = AdapterVersion.objects.create(
            adapter=adapter,
            number=number,
            parent=parent,
            blob_sha256=hashlib.sha256(f"{adapter.pk}-{number}".encode()).hexdigest(),
            size=1000 + number,
            source=AdapterVersion.Source.ROUND if parent else AdapterVersion.Source.SEED,
            metrics={"eval_accuracy": 0.5 + number / (4 * count), "eval_loss": 2.0 / number} if metrics else {},
            state=AdapterVersion.State.RELEASED,
        )
        versions.append(parent)
    return versions


_COUNTERS = itertools.count(1)  # delta counters are unique per device: never reuse one across calls


def make_deltas(devices, adapter, base_version, count: int, *, round_=None, rejected_every: int = 0) -> list[Delta]:
    """``count`` deltas of ``devices`` in turn, received over the last minutes; every ``rejected_every``-th is
    rejected and, as in the product, joins no round (only accepted deltas join ``round_``)."""
    now = timezone.now()
    rows = []
    for index in range(count):
        device = devices[index % len(devices)]
        rejected = bool(rejected_every) and index % rejected_every == 0
        sha = hashlib.sha256(f"{device.pk}-{index}-{secrets.token_hex(4)}".encode()).hexdigest()
        rows.append(
            Delta(
                device=device,
                adapter=adapter,
                adapter_name=adapter.name,
                base_version_number=base_version.number,
                base_version=base_version,
                round=None if rejected else round_,
                sha256=sha,
                blob_sha256=sha,
                size=4096,
                num_samples=32,
                counter=next(_COUNTERS),
                counter_claimed=not rejected,
                envelope={"sha256": sha},
                signature="sig",
                channel=Delta.Channel.WEBSOCKET,
                state=Delta.State.REJECTED if rejected else Delta.State.ACCEPTED,
                rejection_code="norm_too_large" if rejected else "",
                rejection_detail="update norm 1e6 is above the bound 1000" if rejected else "",
                staleness=0,
                norm=0.5,
                received_at=now - timedelta(minutes=index % (24 * 60)),
                verified_at=now,
            )
        )
    return Delta.objects.bulk_create(rows)


@dataclass
class World:
    cohort: Cohort
    adapter: object
    versions: list
    devices: list
    pending: list
    round: Round
    rollout: Rollout
    token: EnrollmentToken


@pytest.fixture
def pages_world(cohort, adapter, make_user) -> World:
    adapter.cohorts.add(cohort)
    operator = make_user("operator")
    versions = make_versions(adapter, 3)
    devices = make_devices(cohort, 6)
    pending = make_devices(cohort, 2, status=DeviceStatus.PENDING, prefix="new")
    round_ = round_open(adapter=adapter, actor=operator, buffer_size=50)
    make_deltas(devices, adapter, versions[-1], 8, round_=round_, rejected_every=4)
    while True:  # device ids are random: a rollout whose first phase (50%) holds some of the 6 devices, not all
        rollout = rollout_create(
            version=versions[-1],
            cohort=cohort,
            phases=[{"percent": 50, "min_soak_seconds": 60}, {"percent": 100}],
            guards=[{"metric": "eval_accuracy", "min": 0.8}],
            actor=operator,
        )
        if 0 < sum(device_bucket(rollout.pk, device.pk) < 50 for device in devices) < len(devices):
            break
        rollout.delete()  # 1 time in 32
    issued = enrollment_token_create(cohort=cohort, name="line-1", expires_at=timezone.now() + timedelta(days=1))
    return World(cohort, adapter, versions, devices, pending, round_, rollout, issued.token)
