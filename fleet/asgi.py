"""ASGI entry point: Django for HTTP, Channels for WebSockets (dashboard live updates, device agents)."""

import gc
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "fleet.settings")
# A connection pool per server process (fleet/settings.py says why ASGI needs one).
os.environ.setdefault("DATABASE_POOL_SIZE", "8")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from fleet import wsmask  # noqa: E402
from fleet.asgi_limits import BodyLimitMiddleware  # noqa: E402
from fleet.routing import websocket_router  # noqa: E402

wsmask.install()  # client frames unmasked by numpy, not byte by byte (fleet/wsmask.py)

# Each open WebSocket keeps ~100 objects tracked by the cyclic GC; with the default thresholds full
# collections over thousands of connections stall the event loop for hundreds of milliseconds
# (bench/agent_connections.py holds such a fleet open; bench/README.md, "agent_connections.py").
# Collect the young generation far less often and freeze start-up objects.
gc.collect()
gc.freeze()
gc.set_threshold(50_000, 20, 100)

application = ProtocolTypeRouter(
    {
        "http": BodyLimitMiddleware(
            django_asgi_app,
            limits=[("/api/v1/device/deltas/", settings.DELTA_MAX_BYTES + 64 * 1024)],
            default=settings.MAX_REQUEST_BYTES,
        ),
        "websocket": websocket_router,
    }
)
