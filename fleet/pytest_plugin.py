"""Loaded with ``-p fleet.pytest_plugin`` before pytest-django reads the settings.

Namespaces this test run's Redis keys, Celery queue and Celery control exchange, so a dev stack (or another
run) on the same Redis never answers the suite's pings or takes its tasks.
"""

import os
import uuid

RUN_ID = os.environ.setdefault("FLEET_TEST_RUN_ID", uuid.uuid4().hex[:8])
os.environ["REDIS_PREFIX"] = f"test-{RUN_ID}"
os.environ["CELERY_QUEUE"] = f"test-{RUN_ID}"
