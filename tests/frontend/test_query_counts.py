"""Every page runs a fixed number of queries however many rows it shows (no N+1 at fleet scale).

Each test renders a page with a handful of rows, then again after adding hundreds more (200 devices,
300 deltas, 50 versions...), and requires the same query count both times, under a stated ceiling.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from devices.models import Cohort, Device, DeviceEvent, EnrollmentToken
from tests.frontend.conftest import make_deltas, make_devices, make_versions
from training.models import Adapter, AdapterVersion, Assignment, Rollout, Round, TrainingEvent

pytestmark = pytest.mark.django_db

# Ceilings per page (what they run today, with a little room); the equality check is the real guard.
CEILING = 20


def _count(client, url: str) -> int:
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    assert response.status_code == 200, response.content.decode()[:1000]
    return len(queries)


def _assert_flat(client, url: str, grow, django_assert_max_num_queries) -> None:
    small = _count(client, url)
    grow()
    with django_assert_max_num_queries(CEILING):
        large = _count(client, url)
    assert large == small, f"{url}: {small} queries with few rows, {large} with many"


@pytest.fixture
def trained(adapter, cohort):
    adapter.cohorts.add(cohort)
    return adapter, make_versions(adapter, 2)


def test_overview(client_for, cohort, trained, django_assert_max_num_queries):
    adapter, versions = trained
    devices = make_devices(cohort, 3, running_version=versions[0])
    round_ = Round.objects.create(adapter=adapter, base_version=versions[-1], strategy="fedavg", buffer_size=500)
    make_deltas(devices, adapter, versions[-1], 3, round_=round_, rejected_every=2)
    DeviceEvent.objects.create(device=devices[0], kind="enrolled", actor_label="device")

    def grow():
        more = make_devices(cohort, 200, prefix="more", running_version=versions[1])
        extra = make_versions(adapter, 50)
        Device.objects.filter(pk__in=[d.pk for d in more[:50]]).update(running_version=extra[-1])
        make_deltas(more, adapter, versions[-1], 300, round_=round_, rejected_every=3)
        for other in Cohort.objects.bulk_create(Cohort(name=f"c{i}") for i in range(10)):
            make_devices(other, 5, prefix=other.name)
        DeviceEvent.objects.bulk_create(DeviceEvent(device=d, kind="online", actor_label="system") for d in more)
        TrainingEvent.objects.bulk_create(
            TrainingEvent(kind="version.created", actor_label="x", adapter=adapter, version=v) for v in extra
        )

    _assert_flat(client_for("viewer"), "/", grow, django_assert_max_num_queries)


def test_device_list_with_filters(client_for, cohort, trained, django_assert_max_num_queries):
    adapter, versions = trained
    make_devices(cohort, 3, running_version=versions[0], desired_version=versions[1])

    def grow():
        extra = make_versions(adapter, 50)
        for index, version in enumerate(extra):
            make_devices(cohort, 4, prefix=f"v{index}", running_version=version, desired_version=extra[-1])

    client = client_for("admin")  # admins see every bulk control
    _assert_flat(client, "/devices/", grow, django_assert_max_num_queries)
    _assert_flat(
        client,
        f"/devices/?cohort={cohort.name}&status=active&label=site&page=2",
        lambda: None,
        django_assert_max_num_queries,
    )


def test_device_detail(client_for, cohort, trained, make_user, django_assert_max_num_queries):
    adapter, versions = trained
    (device,) = make_devices(cohort, 1, running_version=versions[0], desired_version=versions[1])
    round_ = Round.objects.create(adapter=adapter, base_version=versions[-1], strategy="fedavg", buffer_size=500)
    make_deltas([device], adapter, versions[-1], 2, round_=round_, rejected_every=2)
    rollout = Rollout.objects.create(version=versions[1], cohort=cohort, phases=[{"percent": 100}])

    def grow():
        make_deltas([device], adapter, versions[-1], 300, round_=round_, rejected_every=5)
        DeviceEvent.objects.bulk_create(
            DeviceEvent(device=device, kind="online", actor_label="system") for _ in range(100)
        )
        extra = make_versions(adapter, 30)
        Assignment.objects.bulk_create(
            Assignment(device=device, rollout=rollout, version=v, seq=i + 10, previous_version=versions[0])
            for i, v in enumerate(extra)
        )

    _assert_flat(client_for("admin"), f"/devices/{device.pk}/", grow, django_assert_max_num_queries)


def test_cohorts(client_for, cohort, django_assert_max_num_queries):
    make_devices(cohort, 2)

    def grow():
        for other in Cohort.objects.bulk_create(Cohort(name=f"c{i}") for i in range(40)):
            make_devices(other, 5, prefix=other.name)

    _assert_flat(client_for("admin"), "/cohorts/", grow, django_assert_max_num_queries)


def test_enrollment_tokens(client_for, cohort, make_user, django_assert_max_num_queries):
    def token(index: int, **fields) -> EnrollmentToken:
        return EnrollmentToken(
            cohort=cohort,
            name=f"t{index}",
            prefix=f"fet_{index}",
            token_hash=f"{index:064d}",
            expires_at=timezone.now() + timedelta(days=1),
            **fields,
        )

    EnrollmentToken.objects.bulk_create([token(0)])
    admin = make_user("admin")

    def grow():
        tokens = EnrollmentToken.objects.bulk_create(token(i, created_by=admin) for i in range(1, 60))
        make_devices(cohort, 100, enrolled_with=tokens[0])

    _assert_flat(client_for("admin"), "/enrollment-tokens/", grow, django_assert_max_num_queries)


def test_models_and_adapter_lineage(client_for, cohort, trained, django_assert_max_num_queries):
    adapter, versions = trained

    def grow():
        make_versions(adapter, 50)
        base = adapter.base_model
        for index in range(20):
            other = Adapter.objects.create(
                name=f"a{index}", base_model=base, rank=4, alpha=8, target_modules=[], tensor_spec={}
            )
            other.cohorts.add(cohort)
            make_versions(other, 2)

    client = client_for("operator")
    small_models = _count(client, "/models/")
    _assert_flat(client, f"/adapters/{adapter.pk}/", grow, django_assert_max_num_queries)
    with django_assert_max_num_queries(CEILING):
        assert _count(client, "/models/") == small_models
    assert AdapterVersion.objects.filter(adapter=adapter).count() == 52


def test_rounds_list_and_round_detail(client_for, cohort, trained, django_assert_max_num_queries):
    adapter, versions = trained
    devices = make_devices(cohort, 3)
    current = Round.objects.create(adapter=adapter, base_version=versions[-1], strategy="fedavg", buffer_size=500)
    make_deltas(devices, adapter, versions[-1], 3, round_=current, rejected_every=2)

    def grow():
        more = make_devices(cohort, 100, prefix="more")
        make_deltas(more, adapter, versions[-1], 300, round_=current, rejected_every=4)
        extra = make_versions(adapter, 60)
        for version in extra:
            done = Round.objects.create(
                adapter=adapter, base_version=versions[0], strategy="fedavg", buffer_size=3, state="completed"
            )
            AdapterVersion.objects.filter(pk=version.pk).update(round=done)

    client = client_for("operator")
    small_list = _count(client, "/rounds/")
    _assert_flat(client, f"/rounds/{current.pk}/", grow, django_assert_max_num_queries)
    with django_assert_max_num_queries(CEILING):
        assert _count(client, "/rounds/") == small_list
    assert _count(client, f"/rounds/{current.pk}/?state=rejected&page=2") <= CEILING


def test_rollouts_list_and_rollout_detail(client_for, cohort, trained, make_user, django_assert_max_num_queries):
    adapter, versions = trained
    devices = make_devices(cohort, 3)
    rollout = Rollout.objects.create(
        version=versions[1],
        cohort=cohort,
        phases=[{"percent": 50}, {"percent": 100}],
        state="running",
        guards=[{"metric": "eval_accuracy", "min": 0.5, "min_reports": 1}],
    )
    Assignment.objects.bulk_create(
        Assignment(
            device=d, rollout=rollout, version=versions[1], seq=1, state="installed", metrics={"eval_accuracy": 0.9}
        )
        for d in devices
    )

    def grow():
        more = make_devices(cohort, 200, prefix="more")
        Assignment.objects.bulk_create(
            Assignment(
                device=d,
                rollout=rollout,
                version=versions[1],
                seq=1,
                phase=i % 2,
                state=("installed", "pending", "failed", "delivered")[i % 4],
                metrics={"eval_accuracy": 0.7},
            )
            for i, d in enumerate(more)
        )
        for _ in range(60):
            Rollout.objects.create(version=versions[0], cohort=cohort, phases=[{"percent": 100}])
        TrainingEvent.objects.bulk_create(
            TrainingEvent(kind="rollout.phase", actor_label="system", adapter=adapter, detail={"rollout": rollout.pk})
            for _ in range(50)
        )

    client = client_for("operator")
    small_list = _count(client, "/rollouts/")
    _assert_flat(client, f"/rollouts/{rollout.pk}/", grow, django_assert_max_num_queries)
    with django_assert_max_num_queries(CEILING):
        assert _count(client, "/rollouts/") == small_list
    with django_assert_max_num_queries(CEILING):
        _count(client, "/rollouts/new/")
