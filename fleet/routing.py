"""WebSocket routes of every app, gathered in one place.

The dashboard socket authenticates with the browser session, so it sits behind the origin check (a page
on another site must not ride the operator's cookies). The agent socket authenticates with device
signatures and no cookies, and agents send no Origin header, so it needs neither.
"""

from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.urls import path

from devices.consumers import AgentConsumer
from edge_agent.protocol import AGENT_WS_PATH
from frontend.consumers import LiveConsumer

websocket_router = URLRouter(
    [
        path(AGENT_WS_PATH.lstrip("/"), AgentConsumer.as_asgi()),
        path("ws/live/", AllowedHostsOriginValidator(AuthMiddlewareStack(LiveConsumer.as_asgi()))),
    ]
)
