"""Loaded with ``-p fleet.pytest_plugin`` before pytest-django reads the settings.

Namespaces this test run's Redis keys, Celery queue and Celery control exchange, so a dev stack (or another
run) on the same Redis never answers the suite's pings or takes its tasks. Under pytest-xdist every worker
(``gw0``, ``gw1``, ...) is a run of its own: its own prefix, queue and Celery workers, beside the database of
its own that pytest-django gives it (``test_fleet_gw0``, ...).
"""

import os
import uuid

# One torch thread per process, set before anything imports torch and inherited by every process a test starts:
# the suite's models are small, and torch's intra-op threads cost more than they give on them (a replay test took
# 2.6 s alone with two threads, 0.5 s with one), and far more when xdist's workers and the agents they start
# share two cores (53 s). The celery workers and the demo's agents already train on one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_RUN = os.environ.setdefault("FLEET_TEST_RUN_ID", uuid.uuid4().hex[:8])
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
RUN_ID = f"{_RUN}-{_WORKER}" if _WORKER else _RUN
os.environ["REDIS_PREFIX"] = f"test-{RUN_ID}"
os.environ["CELERY_QUEUE"] = f"test-{RUN_ID}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a test of more than about 20 seconds that starts no product (`make test-fast` skips it)"
    )


def pytest_collection_modifyitems(session, config, items):
    """The longest tests first: those of tests/e2e/ (whole product instances, minutes each), then the other
    ``e2e`` and ``slow`` ones, then the rest in file order. Under pytest-xdist a long test started last would keep
    one worker busy while the others sit idle; started first, the short ones fill the other workers around it.
    Every xdist worker sorts the same way, as xdist requires."""

    def weight(item) -> int:
        if "/e2e/" in item.nodeid:
            return 0
        return 1 if any(item.iter_markers("e2e")) or any(item.iter_markers("slow")) else 2

    items.sort(key=weight)
