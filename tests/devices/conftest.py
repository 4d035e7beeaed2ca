"""Fixtures of the device authorization matrix's REST classes (test_device_authz_matrix.py and
test_device_authz_other_device.py): one fleet per class, rolled back after it, and the route inventory."""

from __future__ import annotations

import pytest

from tests.authz_routes import routes_by_name
from tests.authz_support import rolled_back
from tests.devices.device_authz_support import build_fleet


@pytest.fixture(scope="class")
def device_fleet(django_db_setup, django_db_blocker, shared_blob_root, tmp_path_factory):
    staging = tmp_path_factory.mktemp("device-staging")
    rates = {"ENROLLMENT_RATE": "100000/min", "DEVICE_AUTH_RATE": "100000/min"}
    with rolled_back(django_db_blocker, shared_blob_root, DELTA_STAGING_DIR=staging, **rates):
        yield build_fleet(staging)


@pytest.fixture(scope="module")
def inventory():
    return routes_by_name()
