"""Fixtures the tests under tests/training share: ``setup``, the delta upload tests' adapter, version, device and
client (tests/training/delta_support.py); ``trained``, an adapter with a seeded version and five active devices
(the round tests)."""

import pytest

from tests.training.delta_support import setup  # noqa: F401  (a fixture: registered for this folder)
from training.registry.services import version_create_seeded


@pytest.fixture
def trained(adapter, cohort, enrolled):
    adapter.cohorts.add(cohort)
    version = version_create_seeded(adapter=adapter, seed=3)
    return adapter, version, [enrolled("active", name=f"d{i}") for i in range(5)]
