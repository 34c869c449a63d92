from datetime import datetime

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.utils import timezone

from .replay import opened_since


def user_alerts_group(user_id: int) -> str:
    return f"user.{user_id}.alerts"


class UserAlertsConsumer(AsyncJsonWebsocketConsumer):
    """Every page a user has open hears of their runs' alerts as they open and resolve (the toasts).

    A group message can be lost (a full channel, a reconnecting page), so pages also ask, on connect and every
    resync_s, for the alerts opened since a moment by the platform's clock, which the hello gives them: a page
    shows each alert once, however it heard of it.
    """

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()
            return
        self.user_id = user.pk
        self.group = user_alerts_group(user.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self.send_json(
            {"type": "hello", "now": timezone.now().isoformat(), "resync_s": settings.LOOM_ALERTS_RESYNC_S}
        )

    async def disconnect(self, code):
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs):
        if content.get("type") != "replay":
            return
        try:
            since = datetime.fromisoformat(content["since"])
        except (KeyError, TypeError, ValueError):
            await self.send_json({"type": "error", "field": "since", "message": "an ISO 8601 time is required"})
            return
        now = timezone.now()
        alerts = await database_sync_to_async(opened_since)(self.user_id, since)
        await self.send_json({"type": "replay", "now": now.isoformat(), "alerts": alerts})

    async def alert_changed(self, message):
        await self.send_json({"type": "alert", "change": message["change"], "alert": message["alert"]})
