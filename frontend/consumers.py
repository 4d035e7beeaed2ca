"""The dashboard's live-update socket: signed-in users only, each event re-checked against their role."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from accounts.roles import has_role, role_of
from core.live import DASHBOARD_GROUP
from frontend.event_text import live_event, live_link

CLOSE_UNAUTHENTICATED = 4401


class LiveConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        role = await database_sync_to_async(role_of)(user)
        if role is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.user = user
        await self.channel_layer.group_add(DASHBOARD_GROUP, self.channel_name)
        await self.accept()
        await self.send_json({"kind": "hello", "data": {"role": role.value}})

    async def disconnect(self, code):
        if hasattr(self, "user"):
            await self.channel_layer.group_discard(DASHBOARD_GROUP, self.channel_name)

    async def receive_json(self, content, **kwargs):
        if content.get("kind") == "ping":
            await self.send_json({"kind": "pong"})

    async def live_event(self, message):
        if not has_role(self.user, message["min_role"]):
            return
        await self.send_json(
            {
                "kind": message["kind"],
                "data": message["data"],
                "at": message["at"],
                "text": message.get("text") or live_event(message["kind"], message["data"]),
                "url": message.get("url") or live_link(message["kind"], message["data"]),
            }
        )
