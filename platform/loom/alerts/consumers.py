from channels.generic.websocket import AsyncJsonWebsocketConsumer


def user_alerts_group(user_id: int) -> str:
    return f"user.{user_id}.alerts"


class UserAlertsConsumer(AsyncJsonWebsocketConsumer):
    """Every page a user has open hears of their runs' alerts as they open and resolve (the toasts). Best
    effort: a message lost here leaves the alert where pages read it, the run list and the triage page."""

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()
            return
        self.group = user_alerts_group(user.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def alert_changed(self, message):
        await self.send_json({"type": "alert", "change": message["change"], "alert": message["alert"]})
