"""The fleet the dashboard benchmark (``bench/dashboard.py``) renders its pages on: one seeded generator fills a
fresh database at a given size (``Sizes``) with ``bulk_create``, then ``VACUUM ANALYZE``; runs in the
benchmark's child process, after ``django.setup()``. This module holds the fill's order (``populate``) and the
table counts; the parts are ``dashboard_fleet.py`` (users, cohorts, tokens, models, versions, devices),
``dashboard_training.py`` (rounds, deltas, rollouts, assignments) and ``dashboard_events.py`` (device and
training events)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dashboard_events import create_device_events, create_training_events
from dashboard_fleet import create_catalog, create_devices, create_versions
from dashboard_training import create_assignments, create_deltas, create_rollouts, create_rounds

if TYPE_CHECKING:
    from dashboard import Sizes


def populate(sz: Sizes) -> dict:
    """Fill the database with a fleet of the given size (deterministic: one seeded generator, drawn from in
    this order)."""
    import random

    from django.utils import timezone

    rng = random.Random(20240601)
    now = timezone.now()

    admin, cohorts, tokens_of, adapters, adapter_of_cohort = create_catalog(sz, now)
    versions, rounds_per_adapter, released_of = create_versions(sz, rng, now, admin, adapters)

    def released(adapter) -> list:
        return released_of[adapter.pk]

    devices, busy, active, active_of_adapter = create_devices(
        sz, rng, now, cohorts, tokens_of, adapters, adapter_of_cohort, released
    )
    create_device_events(sz, rng, now, admin, devices, busy)
    rounds, collecting = create_rounds(now, admin, adapters, versions, rounds_per_adapter)
    create_deltas(sz, rng, now, rounds, busy, active_of_adapter)
    rollouts = create_rollouts(sz, now, admin, cohorts, adapter_of_cohort, released)
    running = rollouts[-1]
    create_assignments(sz, rng, cohorts, active, rollouts, running)
    create_training_events(admin, adapters, versions, rounds, rollouts)

    return {
        "admin": admin,
        "device": busy.pk,
        "cohort": cohorts[0].name,
        "version": released(adapters[0])[-1].pk,
        "adapter": adapters[0].pk,
        "round": collecting.pk,
        "rollout": running.pk,
    }


def vacuum_analyze() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")


def table_counts() -> dict[str, int]:
    from devices.models import Cohort, Device, DeviceEvent, EnrollmentToken
    from training.models import AdapterVersion, Assignment, Delta, Rollout, Round, TrainingEvent

    models = {
        "cohorts": Cohort,
        "devices": Device,
        "device events": DeviceEvent,
        "tokens": EnrollmentToken,
        "versions": AdapterVersion,
        "rounds": Round,
        "deltas": Delta,
        "rollouts": Rollout,
        "assignments": Assignment,
        "training events": TrainingEvent,
    }
    return {name: model.objects.count() for name, model in models.items()}
