"""The product's settings with Django's psycopg connection pool instead of persistent connections: an
experiment of the fleet simulator (``--server-env DJANGO_SETTINGS_MODULE=bench.fleetsim.pooled_settings``,
needs ``pip install psycopg-pool``), not a configuration of the product.

Why: under ASGI every HTTP request runs its sync code in a thread of its own, so with ``CONN_MAX_AGE`` > 0
each request leaves a connection behind (Django's documentation: "When using ASGI, persistent connections
should be disabled"), while ``CONN_MAX_AGE = 0`` makes every ``database_sync_to_async`` call of the agent
socket open a new PostgreSQL connection. A pool per process serves both: a connection is checked out for a
request or a call and returned after it, and a process never holds more than ``max_size``.
"""

from fleet.settings import *  # noqa: F403
from fleet.settings import DATABASES

DATABASES["default"]["CONN_MAX_AGE"] = 0
# A health check is one more round trip per checkout, and the agent socket checks out once per message.
DATABASES["default"]["CONN_HEALTH_CHECKS"] = False
DATABASES["default"]["OPTIONS"] = {
    **DATABASES["default"]["OPTIONS"],
    "pool": {"min_size": 2, "max_size": 8, "timeout": 30},
}
